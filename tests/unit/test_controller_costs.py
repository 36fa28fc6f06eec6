"""The shared cost model: catch-up apart from draft steps, rebuilds and outliers kept out,
calibration priors, and the k it leads to (specdec.decoding.costs, specdec.decoding.k_policy)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from specdec.config import SpeculationConfig
from specdec.decoding.acceptance import CONFIDENCE_WINDOW, ConfidenceCalibration
from specdec.decoding.costs import CATCHUP_STEADY_TOKENS, CostModel, CostPrior, RoundTiming
from specdec.decoding.k_policy import PROBE_EVERY, KController
from specdec.decoding.traffic import EXPLORE_S, LOAD_HOLD_S
from specdec.decoding.windows import MAX_AGE_S, WINDOW

STEP_S = 0.02  # a draft step
CATCHUP_S = 0.03  # a steady catch-up over 1-2 tokens
OVERHEAD_S = 0.001


def _config(k_max: int = 8, dynamic: bool = False) -> SpeculationConfig:
    return SpeculationConfig(max_speculative_tokens=k_max, dynamic_draft_length=dynamic)


def _verify(k: int) -> float:
    """A verify cost growing 10 ms per draft token (float32 on a CPU)."""
    return 0.2 + 0.01 * k


def _round(
    k: int,
    *,
    catchup_s: float = CATCHUP_S,
    catchup_tokens: int = 1,
    verify_s: float | None = None,
    overhead_s: float = OVERHEAD_S,
    draft_rebuilt: bool = False,
    target_rebuilt: bool = False,
) -> RoundTiming:
    """A round drafting k tokens: a catch-up, then k - 1 draft steps of STEP_S each."""
    draft_s = catchup_s + (k - 1) * STEP_S if k else 0.0
    return RoundTiming(
        verify_s=_verify(k) if verify_s is None else verify_s,
        draft_s=draft_s,
        catchup_s=catchup_s if k else 0.0,
        catchup_tokens=catchup_tokens if k else 0,
        overhead_s=overhead_s,
        draft_rebuilt=draft_rebuilt,
        target_rebuilt=target_rebuilt,
    )


def _scaled_round(k: int, scale: float) -> RoundTiming:
    """A round drafting k tokens whose catch-up and draft steps cost ``scale`` x _round's (a
    draft under load)."""
    timing = _round(k)
    scaled = {"catchup_s": scale * timing.catchup_s, "draft_s": scale * timing.draft_s}
    return RoundTiming(**{**timing.__dict__, **scaled})


def _measured(k_max: int = 8, rounds: int = 3) -> CostModel:
    """Costs measured in steady rounds at every k."""
    costs = CostModel(_config(k_max))
    for _ in range(rounds):
        for k in range(k_max + 1):
            costs.observe(k, _round(k))
    return costs


def _measured_once() -> CostModel:
    """One steady round at k = 0 and one at k = 4: a single sample per estimate, so any sample
    taken in would move it."""
    costs = CostModel(_config())
    costs.observe(0, _round(0))
    costs.observe(4, _round(4))
    return costs


def _snapshot(costs: CostModel, k_max: int = 8) -> list[float]:
    return [
        costs.draft_step_seconds,
        costs.catchup_seconds,
        *(costs.verify_seconds(k) for k in range(k_max + 1)),
        *(costs.round_seconds(k) for k in range(k_max + 1)),
    ]


class _FixedRate:
    def __init__(self, rate: float) -> None:
        self.rate = rate

    def observe(self, k, num_accepted):
        pass


# --- catch-up apart from the draft steps ------------------------------------------------------


def test_draft_step_is_measured_without_the_catchup():
    costs = CostModel(_config())
    costs.observe(5, _round(5, catchup_s=0.5, catchup_tokens=2))
    # (0.5 + 4 x 0.02 - 0.5) / 4 draft steps: the catch-up is not a draft step.
    assert costs.draft_step_seconds == pytest.approx(STEP_S)
    assert costs.catchup_seconds == pytest.approx(0.5)
    assert costs.draft_seconds(5) == pytest.approx(0.5 + 4 * STEP_S)


def test_a_large_catchup_leaves_the_per_token_cost_alone():
    costs = _measured_once()
    before = _snapshot(costs)
    # A prompt (concurrent prefill off), a return from plain decoding, a rebuilt draft: each
    # catch-up carries many tokens and takes seconds.
    costs.observe(4, _round(4, catchup_s=6.0, catchup_tokens=300))
    costs.observe(1, _round(1, catchup_s=2.0, catchup_tokens=CATCHUP_STEADY_TOKENS + 1))
    costs.observe(4, _round(4, catchup_s=9.0, catchup_tokens=900, draft_rebuilt=True))
    assert _snapshot(costs) == pytest.approx(before)


def test_a_single_token_round_measures_no_draft_step():
    costs = CostModel(_config())
    costs.observe(1, _round(1))
    assert costs.draft_step_seconds is None  # its draft time is all catch-up
    assert costs.catchup_seconds == pytest.approx(CATCHUP_S)


def test_catchup_falls_back_to_a_draft_step_before_it_is_measured():
    costs = CostModel(_config())
    costs.observe(4, _round(4, catchup_s=3.0, catchup_tokens=120))  # the first round's prefill
    assert costs.catchup_seconds == pytest.approx(STEP_S)


# --- rebuilds and outliers --------------------------------------------------------------------


def test_rounds_that_rebuilt_a_cache_do_not_inflate_the_costs():
    costs = _measured_once()
    before = _snapshot(costs)
    for k in (0, 4):
        # The target recomputed the whole prefix, and the resent call added a round trip.
        costs.observe(k, _round(k, verify_s=30.0, overhead_s=5.0, target_rebuilt=True))
    # The draft rebuilt in its catch-up; the catch-up it reports fed only the tokens its old
    # entry lacked, so only the flag tells.
    rebuilt = _round(4, catchup_s=20.0, catchup_tokens=1, overhead_s=5.0, draft_rebuilt=True)
    costs.observe(4, rebuilt)
    assert _snapshot(costs) == pytest.approx(before)


def test_isolated_outliers_do_not_move_an_estimate_and_a_new_level_does():
    costs = _measured(rounds=WINDOW)
    before = _snapshot(costs)
    outliers = WINDOW // 2  # a minority of the window, each 100x the steady cost
    for _ in range(outliers):
        costs.observe(2, _round(2, catchup_s=100 * CATCHUP_S, verify_s=100 * _verify(2)))
    assert _snapshot(costs) == pytest.approx(before)
    # A real change (e.g. a busier device) becomes the estimate once it is the majority.
    costs.observe(2, _round(2, catchup_s=100 * CATCHUP_S, verify_s=100 * _verify(2)))
    assert costs.verify_seconds(2) == pytest.approx(100 * _verify(2))
    assert costs.catchup_seconds == pytest.approx(100 * CATCHUP_S)


def _run_low_acceptance_request(controller: KController, costs: CostModel, rounds: int) -> list:
    """Drives a request whose draft is never accepted; a catch-up after plain rounds carries
    every token committed meanwhile (the first one the prompt, 400 tokens). Returns its ks."""
    ks, pending = [], 400
    for _ in range(rounds):
        k = controller.choose(limit=1000).k
        ks.append(k)
        catchup_tokens = pending if k else 0
        catchup_s = CATCHUP_S if catchup_tokens <= CATCHUP_STEADY_TOKENS else 0.01 * pending
        controller.observe(k, 0, _round(k, catchup_s=catchup_s, catchup_tokens=catchup_tokens))
        pending = 1 if k else pending + 1
    return ks


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-length", "dynamic-length"])
def test_a_low_acceptance_request_goes_plain_and_leaves_another_request_speculating(dynamic):
    costs = _measured()
    good = KController(costs, _config(dynamic=dynamic))
    for _ in range(50):
        good.observe(8, 8, _round(8))  # high acceptance: every draft token accepted
    plan = good.choose(limit=1000)
    assert plan.k >= 2
    before = _snapshot(costs)

    poisoned = KController(costs, _config(dynamic=dynamic))
    ks = _run_low_acceptance_request(poisoned, costs, rounds=3 * PROBE_EVERY)

    # It starts from its neighbours' acceptance (PooledAcceptance: every draft accepted), so its
    # own rejections take some rounds to outweigh that prior (11 here); then it decodes plain.
    first_plain = ks.index(0)
    assert first_plain <= 12 and ks.count(0) >= 2 * PROBE_EVERY
    assert ks[first_plain : first_plain + PROBE_EVERY] == [0] * PROBE_EVERY
    # It probes k = 1 after each PROBE_EVERY plain rounds, then returns to plain decoding.
    probe = first_plain + PROBE_EVERY
    assert ks[probe] == 1 and ks[probe + 1] == 0
    assert _snapshot(costs) == pytest.approx(before)
    assert good.choose(limit=1000)[:2] == (plan.k, pytest.approx(plan.min_draft_confidence))


# --- priors from the device calibration -------------------------------------------------------


def test_prior_prices_rounds_before_any_measurement():
    prior = CostPrior(verify_s=[_verify(k) for k in range(9)], draft_step_s=0.05, catchup_s=0.06)
    costs = CostModel(_config(), prior=prior)
    assert costs.ready
    assert costs.round_seconds(0) == pytest.approx(_verify(0))
    assert costs.round_seconds(3) == pytest.approx(0.06 + 2 * 0.05 + _verify(3))


def test_measurements_replace_the_prior():
    prior = CostPrior(verify_s=[1.0] * 9, draft_step_s=1.0, catchup_s=1.0)
    costs = CostModel(_config(), prior=prior)
    measured = _snapshot(_measured())
    for k in range(9):
        costs.observe(k, _round(k))
    assert _snapshot(costs) == pytest.approx(measured)


def test_a_partly_measured_verify_keeps_the_priors_shape_at_the_measured_level():
    prior = CostPrior(verify_s=[0.1 * (k + 1) for k in range(9)], draft_step_s=STEP_S)
    costs = CostModel(_config(), prior=prior)
    costs.observe(0, _round(0, verify_s=0.2))  # twice the prior at k = 0
    assert costs.verify_seconds(0) == pytest.approx(0.2)
    assert costs.verify_seconds(5) == pytest.approx(2 * 0.6)
    costs.observe(8, _round(8, verify_s=0.9))  # the prior at k = 8: ratio 1
    # Ratio interpolated between 2 (k = 0) and 1 (k = 8): 1.5 at k = 4.
    assert costs.verify_seconds(4) == pytest.approx(1.5 * 0.5)


def test_prior_catchup_defaults_to_a_draft_step_and_its_table_fits_k_max():
    prior = CostPrior(verify_s=[0.3, 0.4], draft_step_s=STEP_S)
    costs = CostModel(_config(k_max=4), prior=prior)
    assert costs.catchup_seconds == pytest.approx(STEP_S)
    assert [costs.verify_seconds(k) for k in range(5)] == pytest.approx([0.3, 0.4, 0.4, 0.4, 0.4])
    assert prior.verify_table(0) == [0.3]


@pytest.mark.parametrize(
    "verify_s, step_s",
    [([], 0.1), ([0.1, -0.1], 0.1), ([0.1], 0.0), ([float("nan")], 0.1)],
)
def test_prior_rejects_missing_or_non_positive_seconds(verify_s, step_s):
    with pytest.raises(ValueError):
        CostPrior(verify_s=verify_s, draft_step_s=step_s)


def test_without_prior_the_first_rounds_draft_initial_k_with_one_k_is_chosen():
    blind = KController(CostModel(_config()), _config(), acceptance=_FixedRate(0.6))
    assert blind.choose(limit=1000).k == blind.initial_k
    # A prior saying speculation cannot pay here (a verify 10x a plain step at k_max) switches
    # it off from the first round instead.
    prior = CostPrior(verify_s=[0.2 + 0.15 * k for k in range(9)], draft_step_s=0.06)
    informed = KController(CostModel(_config(), prior), _config(), acceptance=_FixedRate(0.6))
    assert informed.choose(limit=1000).k == 0


# --- hand-computed choices --------------------------------------------------------------------


@pytest.mark.parametrize(
    "k_max, verify_s, step_s, catchup_s, rate, expected",
    [
        # bfloat16 on an AMX CPU, fixed width: verify 0.25 s at every k; draft step and catch-up
        # 0.03 s; a = 0.7. tokens/s = E(k) / (0.25 + 0.03 k): k=3 2.533/0.34 = 7.450,
        # k=4 2.7731/0.37 = 7.495, k=5 2.94117/0.40 = 7.353; k=0 4.0.
        (8, [0.25] * 9, 0.03, 0.03, 0.7, 4),
        # float32 on a CPU: verify 0.45 + 0.07 k; draft step 0.06, catch-up 0.07; a = 0.7.
        # Round 0.45 + 0.07 + 0.06 (k - 1) + 0.07 k: k=1 1.7/0.59 = 2.881, k=2 2.19/0.72 = 3.042,
        # k=3 2.533/0.85 = 2.980; k=0 1/0.45 = 2.222.
        (8, [0.45 + 0.07 * k for k in range(9)], 0.06, 0.07, 0.7, 2),
        # bfloat16 without AMX: verify 0.2 s at width 1, +0.15 s per row (2.0 s at 13 rows);
        # a = 0.6. k=0 1/0.2 = 5.0 beats k=1 1.6/0.42 = 3.81 and every larger k.
        (12, [0.2 + 0.15 * k for k in range(13)], 0.06, 0.07, 0.6, 0),
    ],
    ids=["flat-bf16-amx", "growing-float32", "steep-bf16-avx2"],
)
def test_k_follows_the_cost_curve(k_max, verify_s, step_s, catchup_s, rate, expected):
    prior = CostPrior(verify_s=verify_s, draft_step_s=step_s, catchup_s=catchup_s)
    controller = KController(
        CostModel(_config(k_max), prior), _config(k_max), acceptance=_FixedRate(rate)
    )
    assert controller.choose(limit=1000).k == expected
    # The same curve measured instead of given: the same choice.
    costs = CostModel(_config(k_max))
    for k in range(k_max + 1):
        draft_s = catchup_s + (k - 1) * step_s if k else 0.0
        timing = RoundTiming(verify_s[k], draft_s, catchup_s if k else 0.0, 1 if k else 0)
        costs.observe(k, timing)
    measured = KController(costs, _config(k_max), acceptance=_FixedRate(rate))
    assert measured.choose(limit=1000).k == expected


def test_dynamic_length_floor_uses_the_draft_step_not_the_catchup():
    # Flat verify 0.25 s, draft step 0.03 s, catch-up 0.3 s (ten steps), a = 0.7. Round
    # 0.25 + 0.3 + 0.03 (k - 1): best fixed k = 5 (E 2.94117 in 0.67 s, 4.3898 tokens/s; k=4
    # 4.3330, k=6 4.3697, k=0 4.0); one more token costs one draft step, not a catch-up, so the
    # floor is 0.03 x 4.3898.
    prior = CostPrior(verify_s=[0.25] * 9, draft_step_s=0.03, catchup_s=0.3)
    controller = KController(
        CostModel(_config(), prior), _config(dynamic=True), acceptance=_FixedRate(0.7)
    )
    assert controller.choose(limit=1000)[:2] == (8, pytest.approx(0.03 * 2.94117 / 0.67, rel=1e-4))


def _with_in_flight(costs: CostModel, requests: int) -> None:
    """Sets the requests in flight on ``costs``: the load its draft costs are kept at."""
    while costs.traffic.in_flight < requests:
        costs.traffic.request_started()
    while costs.traffic.in_flight > requests:
        costs.traffic.request_ended()


def _batch_prior(k_max: int = 8, sessions: int = 8, flat_rows: int = 16) -> CostPrior:
    """A device where a forward costs 0.2 s up to ``flat_rows`` rows and grows 0.2 s per
    ``flat_rows`` rows after (weights read once per forward until the rows dominate)."""
    rows = range(1, sessions * (k_max + 1) + 1)
    return CostPrior(
        verify_s=[0.2] * (k_max + 1),
        draft_step_s=STEP_S,
        catchup_s=CATCHUP_S,
        batch_verify_s=[0.2 * -(-r // flat_rows) for r in rows],
    )


def _batched_round(k: int, sessions: int, verify_s: float) -> RoundTiming:
    timing = _round(k, verify_s=verify_s)
    return RoundTiming(**{**timing.__dict__, "batch_sessions": sessions, "batch_rows": sessions})


def test_under_load_k_falls_to_what_the_batch_can_absorb():
    # Alone, rows up to 16 cost the same, so a request drafts deep. With 8 sessions sharing
    # every verify, each token of k adds 8 rows to the batch: k = 1 (16 rows) still rides on
    # the same forward, beyond it the forward grows, and at acceptance 0.5 k = 1 is best.
    costs = CostModel(_config(), _batch_prior())
    controller = KController(costs, _config())
    for _ in range(3):
        controller.acceptance.observe(4, 2)  # acceptance about 0.5
    alone = controller.choose(limit=100).k
    for _ in range(WINDOW):
        costs.observe(0, _batched_round(0, 8, verify_s=0.2))
    assert costs.traffic.batch_sessions == 8
    loaded = controller.choose(limit=100).k
    assert alone >= 4
    assert loaded == 1
    # Each batched verify measured twice the prior: the level scales every batch price.
    for _ in range(WINDOW):
        costs.observe(0, _batched_round(0, 8, verify_s=0.4))
    assert costs.verify_seconds(3) == pytest.approx(2 * 0.2 * 2)  # 32 rows: two forwards


def test_lone_verifies_keep_the_per_k_costs_and_batched_ones_do_not_touch_them():
    costs = CostModel(_config(), _batch_prior())
    for _ in range(WINDOW):
        costs.observe(3, _round(3, verify_s=0.3))  # alone: batch_sessions not reported
    assert costs.traffic.batch_sessions == 1 and costs.verify_seconds(3) == pytest.approx(0.3)
    costs.observe(3, _batched_round(3, 2, verify_s=5.0))
    assert costs.traffic.batch_sessions == 1  # the median of mostly lone verifies
    assert costs.verify_seconds(3) == pytest.approx(0.3)  # not the batch's 5 s


# --- probes under load ------------------------------------------------------------------------


def _plain_rounds_until_probe(controller: KController, sessions: int, limit: int) -> int | None:
    """Plain rounds a request decodes (each verified in a batch of ``sessions``) before the
    controller drafts again; None if it has not within ``limit`` rounds."""
    for rounds in range(limit):
        if controller.choose(limit=1000).k > 0:
            return rounds
        controller.observe(0, 0, _batched_round(0, sessions, verify_s=0.2))
    return None


@pytest.mark.parametrize("sessions", [1, 2, 8])
def test_a_plain_request_probes_as_often_per_batch_as_alone(sessions):
    # Acceptance 0: plain decoding is best, and only a probe drafts. A batch of B sessions
    # probes about as often as one lone request: each request every PROBE_EVERY x B rounds.
    costs = CostModel(_config(), _batch_prior())
    for _ in range(WINDOW):
        costs.observe(0, _batched_round(0, sessions, verify_s=0.2))
    controller = KController(costs, _config(), acceptance=_FixedRate(0.0))
    assert _plain_rounds_until_probe(controller, sessions, 100 * PROBE_EVERY) == (
        PROBE_EVERY * sessions
    )


def test_a_draft_starts_priced_at_the_requests_in_flight_under_a_burst():
    # Rows up to 8 cost one forward. Alone, at acceptance 0.5, drafting pays; a batch of 8
    # sessions would turn k = 1 into two forwards, so plain decoding is best there. The verify
    # batches measured so far were lone (a burst of 8 requests has just arrived).
    now = [0.0]
    costs = CostModel(_config(), _batch_prior(flat_rows=8), clock=lambda: now[0])
    controller = KController(costs, _config(), acceptance=_FixedRate(0.5))
    assert costs.traffic.batch_sessions == 1
    costs.traffic.request_started()
    assert controller.choose(limit=1000, draft_lag=100).k > 0  # alone: start the draft
    for _ in range(7):
        costs.traffic.request_started()
    assert costs.traffic.in_flight == 8
    assert controller.choose(limit=1000, draft_lag=100).k == 0  # no prefill for nothing
    # A draft already caught up has nothing to buy, but its round is priced in the same batch
    # of the 8 requests in flight (the next test), where k = 1 takes two forwards.
    assert controller.choose(limit=1000, draft_lag=CATCHUP_STEADY_TOKENS).k == 0
    for _ in range(8):
        costs.traffic.request_ended()
    costs.traffic.request_ended()  # an extra end never counts below zero
    assert costs.traffic.in_flight == 0
    now[0] += LOAD_HOLD_S
    assert controller.choose(limit=1000, draft_lag=100).k > 0


def test_a_round_is_priced_in_a_batch_of_every_request_in_flight():
    # Rows up to 8 cost one forward. 8 requests are in flight, but the verifies lately ran in
    # batches of 3 sessions (requests that draft fall out of step). Priced at 3 sessions, k = 1
    # (6 rows) rides on one forward and drafting pays; but the other 5 sessions' verifies are
    # forwards on the same target, and priced at the 8 it serves, k = 1 takes two forwards.
    now = [0.0]
    costs = CostModel(_config(), _batch_prior(flat_rows=8), clock=lambda: now[0])
    controller = KController(costs, _config(), acceptance=_FixedRate(0.5))
    for _ in range(8):
        costs.traffic.request_started()
    for _ in range(5):
        costs.observe(0, _batched_round(0, sessions=3, verify_s=0.2))
    assert costs.traffic.batch_sessions == 3
    assert costs.round_seconds(1, 3) == costs.round_seconds(0, 3) + costs.draft_seconds(1)
    assert controller.choose(limit=1000, draft_lag=CATCHUP_STEADY_TOKENS).k == 0
    for _ in range(5):
        costs.traffic.request_ended()
    assert costs.traffic.in_flight == 3  # now the batches of 3 are the load
    now[0] += LOAD_HOLD_S
    assert controller.choose(limit=1000, draft_lag=CATCHUP_STEADY_TOKENS).k > 0


def test_the_batch_load_follows_the_requests_in_flight_at_once():
    # A burst of 8 drains: the verify batches of 8 are still the median, but the last request
    # alone is priced alone (its verify of up to 9 rows costs one forward, so it drafts deep),
    # not in a batch of 8 where 8 rows fill a forward and k = 1 takes a second; only for
    # LOAD_HOLD_S after the others ended does it still count them.
    now = [0.0]
    costs = CostModel(_config(), _batch_prior(flat_rows=8), clock=lambda: now[0])
    _with_in_flight(costs, 8)
    for _ in range(WINDOW):
        costs.observe(0, _batched_round(0, sessions=8, verify_s=0.2))
    controller = KController(costs, _config(), acceptance=_FixedRate(0.9))
    assert costs.traffic.batch_load == 8
    assert controller.choose(limit=1000).k == 0
    _with_in_flight(costs, 1)
    assert costs.traffic.batch_load == 8  # held: another request would take their places at once
    now[0] += LOAD_HOLD_S
    assert costs.traffic.batch_sessions == 8  # the median lags
    assert costs.traffic.batch_load == 1
    assert controller.choose(limit=1000).k >= 6


def test_a_request_that_ends_counts_in_the_batch_load_for_the_hold():
    # 2 streams: one request ends and its client's next call arrives 20 ms later. Rows up to 8
    # cost one forward. The request left alone in that gap must not choose a lone round's k
    # (up to 8, 9 rows): its draft phase would hold the new request's prefill. Held at 2
    # sessions it chooses k = 3 (8 rows); the load grows at once and falls LOAD_HOLD_S later.
    now = [0.0]
    costs = CostModel(_config(), _batch_prior(flat_rows=8), clock=lambda: now[0])
    controller = KController(costs, _config(), acceptance=_FixedRate(0.9))
    _with_in_flight(costs, 2)
    assert costs.traffic.batch_load == 2
    now[0] += 10.0
    costs.traffic.request_ended()
    now[0] += LOAD_HOLD_S / 2
    assert costs.traffic.batch_load == 2
    assert controller.choose(limit=1000).k == 3
    costs.traffic.request_started()  # the next request arrives
    now[0] += LOAD_HOLD_S
    assert costs.traffic.batch_load == 2
    costs.traffic.request_ended()
    assert costs.traffic.batch_load == 2
    now[0] += LOAD_HOLD_S * 1.01
    assert costs.traffic.batch_load == 1
    assert controller.choose(limit=1000).k == 8
    for _ in range(4):
        costs.traffic.request_started()
    assert costs.traffic.batch_load == 5  # a burst counts at once


def test_sessions_from_other_routers_scale_the_batch_load():
    # 4 requests in flight here, verified in batches of 8: another router's 4 share them.
    now = [0.0]
    costs = CostModel(_config(), _batch_prior(), clock=lambda: now[0])
    _with_in_flight(costs, 4)
    for _ in range(WINDOW):
        costs.observe(0, _batched_round(0, sessions=8, verify_s=0.2))
    assert costs.traffic.batch_load == 8
    _with_in_flight(costs, 2)
    now[0] += LOAD_HOLD_S
    assert costs.traffic.batch_load == 4


def test_in_a_batch_every_request_prices_the_mean_acceptance():
    # Rows up to 16 cost one forward; 4 sessions at k = 3 fill it. A request that accepts
    # everything would draft deep on its own rate; among neighbours who accept 0.3 it prices
    # the batch's mean, as they do, and they all choose the same k.
    costs = CostModel(_config(), _batch_prior(flat_rows=16))
    sure = KController(costs, _config(), acceptance=_FixedRate(1.0))
    unsure = [KController(costs, _config(), acceptance=_FixedRate(0.3)) for _ in range(3)]
    costs.traffic.request_started(sure)
    alone = sure.choose(limit=1000).k
    assert costs.traffic.batch_expected_tokens(3) is None  # one request: its own rate
    for controller in unsure:
        costs.traffic.request_started(controller)
    assert costs.traffic.batch_expected_tokens(3) == pytest.approx(
        (4 + 3 * (1 + 0.3 + 0.09 + 0.027)) / 4
    )
    costs.observe(4, _batched_round(4, sessions=4, verify_s=0.2))  # the load's draft measured
    choices = {controller.choose(limit=1000).k for controller in [sure, *unsure]}
    assert len(choices) == 1
    assert choices.pop() < alone
    for controller in unsure:
        costs.traffic.request_ended(controller)
    costs.traffic.request_ended(sure)
    assert costs.traffic.in_flight == 0 and costs.traffic.batch_expected_tokens(3) is None


def test_a_draft_prefill_is_charged_to_the_batch_it_delays():
    # Rows up to 16 cost one forward: at 8 sessions k = 1 rides on the same forward, and
    # drafting pays round by round. But this draft lacks 100 tokens, measured at 20 ms each:
    # a 2 s prefill that delays all 8 sessions' verifies, over the 100 tokens left (limit 99).
    now = [0.0]
    costs = CostModel(_config(), _batch_prior(flat_rows=16), clock=lambda: now[0])
    controller = KController(costs, _config(), acceptance=_FixedRate(0.5))
    for _ in range(8):
        costs.traffic.request_started()
    assert controller.choose(limit=99, draft_lag=100).k > 0  # no catch-up measured yet
    costs.observe(1, _round(1, catchup_s=2.0, catchup_tokens=100))
    assert costs.catchup_token_seconds == pytest.approx(0.02)
    assert controller.choose(limit=99, draft_lag=100).k == 0
    # Alone, the same prefill pays for itself over the request.
    for _ in range(7):
        costs.traffic.request_ended()
    now[0] += LOAD_HOLD_S
    assert controller.choose(limit=99, draft_lag=100).k > 0


def test_waiting_in_a_batch_is_not_priced_as_orchestration():
    costs = _measured()
    lone = costs.round_seconds(4)
    for _ in range(WINDOW):  # loaded rounds that waited 3 s in the batch queue
        batched = _batched_round(4, 8, verify_s=_verify(4))
        costs.observe(4, RoundTiming(**{**batched.__dict__, "overhead_s": 3.0}))
    for _ in range(WINDOW):  # then alone again, plain decoding
        costs.observe(0, _round(0))
    assert costs.traffic.batch_sessions == 1
    assert costs.round_seconds(4) == pytest.approx(lone)


def test_a_lone_verify_beside_other_requests_in_flight_is_not_priced_as_orchestration():
    # Two streams out of step: each verify runs alone, after waiting in the batch queue for
    # the other request's call (and its draft for the other's draft).
    costs = _measured()
    alone = costs.round_seconds(4)
    costs.traffic.request_started()
    costs.traffic.request_started()
    for _ in range(WINDOW):
        costs.observe(4, _round(4, overhead_s=0.9))
    assert costs.round_seconds(4) == pytest.approx(alone)
    costs.traffic.request_ended()
    for _ in range(WINDOW):  # alone on the router: its orchestration is measured
        costs.observe(4, _round(4, overhead_s=0.9))
    assert costs.round_seconds(4) == pytest.approx(alone - OVERHEAD_S + 0.9)


def test_costs_measured_under_load_expire_and_the_prior_takes_over():
    # A busy spell measured draft steps 20x the calibration's; the request after it decodes
    # alone and plain, so nothing measures the draft again. The old samples must not keep it
    # plain for good.
    now = [0.0]
    prior = CostPrior(verify_s=[_verify(k) for k in range(9)], draft_step_s=STEP_S)
    costs = CostModel(_config(), prior, clock=lambda: now[0])
    for _ in range(WINDOW):
        costs.observe(4, _round(4, catchup_s=20 * CATCHUP_S))
    controller = KController(costs, _config(), acceptance=_FixedRate(0.8))
    assert costs.draft_step_seconds == pytest.approx(STEP_S)  # steps as the prior (see below)
    assert costs.catchup_seconds == pytest.approx(20 * CATCHUP_S)
    assert controller.choose(limit=1000).k == 0
    now[0] = MAX_AGE_S - 1
    assert controller.choose(limit=1000).k == 0
    now[0] = MAX_AGE_S + 1
    assert costs.catchup_seconds == pytest.approx(STEP_S)  # the prior's (no catchup_s: a step)
    assert controller.choose(limit=1000).k > 0


def test_draft_costs_are_kept_per_load():
    # Under load a draft batch carries other sessions' catch-ups, and shares the host with the
    # target: steps measured at 8 sessions per batch are 20x the lone ones. Each load prices
    # with its own.
    costs = CostModel(_config(), _batch_prior())
    for _ in range(WINDOW):
        costs.observe(4, _round(4))
    slow = _scaled_round(4, 20)
    _with_in_flight(costs, 8)
    for _ in range(WINDOW):
        costs.observe(4, RoundTiming(**{**slow.__dict__, "batch_sessions": 8, "batch_rows": 40}))
    assert costs.draft_step_seconds == pytest.approx(20 * STEP_S)
    assert costs.catchup_seconds == pytest.approx(20 * CATCHUP_S)
    assert costs.draft_seconds(4) == pytest.approx(20 * (CATCHUP_S + 3 * STEP_S))
    _with_in_flight(costs, 1)  # alone again
    assert costs.draft_step_seconds == pytest.approx(STEP_S)
    assert costs.draft_seconds(4) == pytest.approx(CATCHUP_S + 3 * STEP_S)
    _with_in_flight(costs, 8)
    assert costs.draft_seconds(4) == pytest.approx(20 * (CATCHUP_S + 3 * STEP_S))


def test_without_a_prior_a_load_not_yet_measured_prices_with_the_nearest_load():
    # A router whose replicas reported no calibration has measured lone rounds only; a request
    # whose draft must catch up is priced at the requests in flight (8), a load with no
    # samples. That failed the request (int * None) instead of pricing with the lone step.
    costs = _measured()
    for _ in range(8):
        costs.traffic.request_started()
    assert costs.draft_step_at(8) == pytest.approx(STEP_S)
    assert costs.catchup_at(8) == pytest.approx(CATCHUP_S)
    assert costs.draft_seconds(4) == pytest.approx(CATCHUP_S + 3 * STEP_S)
    controller = KController(costs, _config(), acceptance=_FixedRate(0.8))
    # No long catch-up measured yet, so no start charge: priced as the lone load it chose from.
    alone = KController(_measured(), _config(), acceptance=_FixedRate(0.8))
    assert controller.choose(limit=100, draft_lag=120)[:2] == alone.choose(limit=100)[:2]
    # Measured only at 2 requests in flight: a lighter load takes the nearest measured one.
    loaded = _scaled_round(4, 2)
    heavy = CostModel(_config())
    _with_in_flight(heavy, 2)
    heavy.observe(4, loaded)
    assert heavy.draft_step_at(1) == pytest.approx(2 * STEP_S)
    assert heavy.catchup_at(1) == pytest.approx(2 * CATCHUP_S)
    assert heavy.draft_step_at(8) == pytest.approx(2 * STEP_S)


def test_draft_costs_are_kept_by_the_requests_in_flight_not_only_the_verify_batch():
    # Two streams out of step verify one at a time (batch 1) while the other drafts: their
    # slow draft steps are loaded ones, and the last request of the burst, alone, keeps the
    # lone price.
    costs = CostModel(_config(), _batch_prior())
    for _ in range(WINDOW):
        costs.observe(4, _round(4))
    costs.traffic.request_started()
    costs.traffic.request_started()
    slow = _scaled_round(4, 10)
    for _ in range(WINDOW):
        costs.observe(4, slow)
    assert costs.traffic.batch_sessions == 1
    assert costs.draft_step_seconds == pytest.approx(10 * STEP_S)
    assert costs.draft_seconds(4) == pytest.approx(10 * (CATCHUP_S + 3 * STEP_S))
    costs.traffic.request_ended()
    assert costs.draft_step_seconds == pytest.approx(STEP_S)
    assert costs.catchup_seconds == pytest.approx(CATCHUP_S)


def test_a_load_not_yet_measured_is_priced_from_the_measured_loads_around_it():
    # The prior is a lone cost: 8 requests in flight, with steps measured 10x it at 2, are
    # priced at 10x, not at the prior; a load below every measured one keeps the prior.
    costs = CostModel(_config(), _batch_prior())
    assert costs.draft_step_at(8) == pytest.approx(STEP_S)  # nothing measured: the prior
    loaded = _scaled_round(4, 10)
    _with_in_flight(costs, 2)
    costs.observe(4, loaded)
    assert costs.draft_step_at(2) == pytest.approx(10 * STEP_S)
    assert costs.draft_step_at(8) == pytest.approx(10 * STEP_S)
    assert costs.catchup_at(8) == pytest.approx(10 * CATCHUP_S)
    assert costs.draft_step_at(1) == pytest.approx(STEP_S)
    # Measured cheaper than the prior at 2: a heavier load keeps the prior as its floor.
    cheap = _scaled_round(4, 0.1)
    for _ in range(WINDOW):
        costs.observe(4, cheap)
    assert costs.draft_step_at(2) == pytest.approx(0.1 * STEP_S)
    assert costs.draft_step_at(8) == pytest.approx(STEP_S)
    # At 8, steps measured, and a catch-up only as a prefill: a catch-up costs a step there.
    prefill = RoundTiming(**{**loaded.__dict__, "catchup_tokens": 100})
    prefill = RoundTiming(**{**prefill.__dict__, "draft_s": prefill.catchup_s + 3 * 40 * STEP_S})
    _with_in_flight(costs, 8)
    costs.observe(4, prefill)
    assert costs.draft_step_at(8) == pytest.approx(40 * STEP_S)
    assert costs.catchup_at(8) == pytest.approx(40 * STEP_S)
    # Between 2 (0.1 x) and 8 (40 x): geometric on the load, at least the prior below it.
    assert costs.draft_step_at(4) == pytest.approx(2 * STEP_S)


def test_the_calibrations_prefill_cost_prices_a_draft_start_before_any_is_measured():
    # Rows up to 16 cost one forward, so at 8 sessions drafting pays round by round; a draft
    # 100 tokens behind, at the draft calibration's 20 ms per prefill token, delays all 8
    # sessions' verifies by 2 s: not worth it for the 100 tokens left.
    prior = dataclasses.replace(_batch_prior(flat_rows=16), catchup_token_s=0.02)
    costs = CostModel(_config(), prior)
    controller = KController(costs, _config(), acceptance=_FixedRate(0.5))
    for _ in range(8):
        costs.traffic.request_started()
    assert costs.catchup_token_seconds == pytest.approx(0.02)
    assert controller.choose(limit=99, draft_lag=100).k == 0
    unpriced = KController(
        CostModel(_config(), _batch_prior(flat_rows=16)), _config(), acceptance=_FixedRate(0.5)
    )
    for _ in range(8):
        unpriced.costs.traffic.request_started()
    assert unpriced.choose(limit=99, draft_lag=100).k > 0


def test_one_request_at_a_time_measures_the_draft_at_a_new_load():
    now = [0.0]
    costs = CostModel(_config(), _batch_prior(flat_rows=64), clock=lambda: now[0])
    burst = [KController(costs, _config(), acceptance=_FixedRate(0.9)) for _ in range(5)]
    _with_in_flight(costs, len(burst))
    first, second, *others = burst
    assert first.choose(limit=1000).k > 0  # drafting pays at the prior's prices
    assert [c.choose(limit=1000).k for c in (second, *others)] == [0, 0, 0, 0]
    assert first.choose(limit=1000).k > 0  # its turn holds until a round measures the load
    # Its round drafted nothing after all (the draft's prefill was not done): the turn passes.
    first.observe(0, 0, _round(0))
    assert second.choose(limit=1000).k > 0
    assert first.choose(limit=1000).k == 0
    # That request ended: the turn passes again.
    costs.traffic.request_ended(second)
    costs.traffic.request_started()
    assert others[0].choose(limit=1000).k > 0
    # A round whose catch-up was the draft's prefill measured no step: still its turn alone.
    prefill_only = _round(1, catchup_s=1.0, catchup_tokens=100)
    others[0].observe(1, 1, prefill_only)
    assert others[1].choose(limit=1000).k == 0
    now[0] = EXPLORE_S + 1  # its next round never reported: another one may try
    assert others[1].choose(limit=1000).k > 0
    assert others[2].choose(limit=1000).k == 0
    others[1].observe(4, 4, _round(4))  # a step measured at this load: everyone decides from it
    assert all(c.choose(limit=1000).k > 0 for c in burst)
    # Alone, the calibration prices the draft well enough: no turn to wait for, even where the
    # recent verify batches were large.
    lone = CostModel(_config(), _batch_prior(flat_rows=64))
    lone.traffic.request_started()
    for _ in range(WINDOW):
        lone.observe(0, _batched_round(0, 8, verify_s=0.2))
    assert lone.traffic.batch_sessions == 8
    controllers = [KController(lone, _config(), acceptance=_FixedRate(0.9)) for _ in range(2)]
    assert [c.choose(limit=1000).k > 0 for c in controllers] == [True, True]


def test_each_choice_is_logged_at_debug_with_its_prices(caplog):
    controller = KController(_measured(), _config())
    controller.acceptance.observe(8, 8)  # a high acceptance: speculation pays
    with caplog.at_level("DEBUG", logger="specdec.decoding.k_policy"):
        plan = controller.choose(limit=100)
    (record,) = caplog.records
    line = record.getMessage()
    assert line.startswith(f"k={plan.k} of 8:")
    predicted = [float(v) for v in line.rsplit(": ", 1)[1].split()]
    assert len(predicted) == 9 and max(predicted) == predicted[plan.k]
    caplog.clear()
    with caplog.at_level("INFO", logger="specdec.decoding.k_policy"):
        controller.choose(limit=100)
    assert not caplog.records


def _calibrated(exponent: float, tokens: int, seed: int = 0) -> ConfidenceCalibration:
    """A calibration fed rounds of 4 drafted tokens whose draft probabilities p are uniform in
    [0.2, 1) and which the target accepts with probability p ** exponent each."""
    rng = random.Random(seed)
    calibration = ConfidenceCalibration()
    while len(calibration._tokens) < tokens:
        confidences = [rng.uniform(0.2, 1.0) for _ in range(4)]
        accepted = 0
        while accepted < 4 and rng.random() < confidences[accepted] ** exponent:
            accepted += 1
        calibration.observe(confidences, accepted)
    return calibration


@pytest.mark.parametrize("exponent", [0.3, 1.0, 2.5])
def test_the_confidence_calibration_recovers_how_the_target_accepts(exponent):
    fitted = _calibrated(exponent, CONFIDENCE_WINDOW).exponent
    assert fitted == pytest.approx(exponent, rel=0.35)


def test_the_confidence_calibration_counts_tokens_up_to_the_first_rejection_only():
    calibration = ConfidenceCalibration()
    calibration.observe([0.9, 0.8, 0.7, 0.6], 1)  # the second token rejected, two unseen
    calibration.observe([0.5], 1)  # a one-token round, accepted
    assert list(calibration._tokens) == [(0.9, True), (0.8, False), (0.5, True)]


def test_an_uncalibrated_floor_is_the_raw_one_and_underconfidence_lowers_it():
    calibration = ConfidenceCalibration()
    calibration.observe([0.5] * 4, 4)
    assert calibration.exponent == 1.0  # too few tokens to fit
    assert calibration.raw_floor(0.3) == 0.3
    under = _calibrated(0.3, CONFIDENCE_WINDOW)
    assert under.raw_floor(0.3) == pytest.approx(0.3 ** (1 / under.exponent))
    assert under.raw_floor(0.3) < 0.05


def test_the_controller_sends_the_calibrated_floor():
    # As test_dynamic_length_floor_uses_the_draft_step_not_the_catchup, with a draft whose
    # confidences understate what the target accepts: the floor on its raw product is lower.
    prior = CostPrior(verify_s=[0.25] * 9, draft_step_s=0.03, catchup_s=0.3)
    controller = KController(
        CostModel(_config(), prior),
        _config(dynamic=True),
        acceptance=_FixedRate(0.7),
        confidence=_calibrated(0.3, CONFIDENCE_WINDOW),
    )
    floor = 0.03 * 2.94117 / 0.67
    plan = controller.choose(limit=1000)
    assert plan[:2] == (8, pytest.approx(floor ** (1 / controller.confidence.exponent), rel=1e-4))
    assert plan.min_draft_confidence < floor / 2


def test_a_dynamic_round_stops_before_the_token_that_needs_a_second_verify_forward():
    # Half precision on the AMX Xeon: one exact width, 7, so 1-7 rows cost one forward (0.28
    # s) and 8-13 two. The 7th draft token would cost a whole forward, more than any token is
    # worth at ~10 tokens/s; a smoothly growing verify lets the round go to k_max.
    step_s, a = 0.05, 0.9
    stepped = CostPrior(verify_s=[0.28] * 7 + [0.56] * 6, draft_step_s=step_s)
    smooth = CostPrior(verify_s=[0.28 + 0.01 * k for k in range(13)], draft_step_s=step_s)
    for prior, longest in ((stepped, 6), (smooth, 12)):
        controller = KController(
            CostModel(_config(12), prior), _config(12, dynamic=True), acceptance=_FixedRate(a)
        )
        assert controller.choose(limit=1000).k == longest


def test_one_slow_draft_batch_does_not_set_the_loaded_step():
    # 8 requests in flight: every session of a draft batch reports the batch's time, so each
    # batch gives 8 equal samples. Three batches step at STEP_S, then one at 0.15 s (a batch
    # that carried something else): the step stays STEP_S, as with one sample per batch.
    costs = CostModel(_config(), _batch_prior())
    _with_in_flight(costs, 8)
    slow = _round(2)
    slow = RoundTiming(**{**slow.__dict__, "draft_s": slow.catchup_s + 0.15})
    for timing in [_round(2)] * 24 + [slow] * 8:
        costs.observe(2, timing)
    assert costs.draft_step_seconds == pytest.approx(STEP_S)
    for _ in range(3 * 8):  # a real change of level shows after as many batches
        costs.observe(2, slow)
    assert costs.draft_step_seconds == pytest.approx(0.15)
