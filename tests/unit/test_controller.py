"""Choosing k from acceptance and measured costs."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.config import SpeculationConfig
from specdec.decoding.acceptance import AcceptanceEstimator, expected_tokens
from specdec.decoding.costs import CostModel, RoundTiming
from specdec.decoding.k_policy import PROBE_EVERY, KController


def _config(k_max: int = 8, dynamic: bool = False) -> SpeculationConfig:
    return SpeculationConfig(max_speculative_tokens=k_max, dynamic_draft_length=dynamic)


def _set_dynamic(controller: KController, dynamic: bool) -> None:
    controller.config = dataclasses.replace(controller.config, dynamic_draft_length=dynamic)


@pytest.mark.parametrize(
    "a, k, expected", [(0.0, 5, 1.0), (1.0, 4, 5.0), (0.5, 2, 1.75), (0.8, 0, 1.0)]
)
def test_expected_tokens_per_round(a, k, expected):
    assert expected_tokens(a, k) == pytest.approx(expected)


def _timing(k: int, step_s: float, verify_s: float, overhead_s: float = 0.001) -> RoundTiming:
    """A steady round drafting k tokens: a one-token catch-up and each draft step take step_s,
    so the draft's compute is k x step_s."""
    catchup_s = step_s if k else 0.0
    return RoundTiming(
        verify_s=verify_s,
        draft_s=step_s * k,
        catchup_s=catchup_s,
        catchup_tokens=1 if k else 0,
        overhead_s=overhead_s,
    )


def _controller(acceptance, verify_s, draft_per_token, k_max=8):
    """A controller whose costs were measured at every k and whose acceptance has converged."""
    costs = CostModel(_config(k_max))
    for k in range(k_max + 1):
        for _ in range(30):
            costs.observe(k, _timing(k, draft_per_token, verify_s(k)))
    controller = KController(costs, _config(k_max))
    for _ in range(200):
        controller.acceptance.observe(4, round(4 * acceptance) if acceptance < 1 else 4)
    return controller


def test_flat_verify_and_high_acceptance_choose_large_k():
    controller = _controller(1.0, lambda k: 0.1, draft_per_token=0.005)
    assert controller.choose(limit=100).k == 8


def test_expensive_draft_and_low_acceptance_choose_plain_decoding():
    controller = _controller(0.0, lambda k: 0.1 + 0.05 * k, draft_per_token=0.08)
    assert controller.choose(limit=100).k == 0


def test_measured_verify_cost_per_k_drives_the_choice():
    # DESIGN.md's CPU numbers: verifying 2 tokens costs less than 1; 4 costs twice as much.
    table = {0: 0.243, 1: 0.243, 2: 0.214, 3: 0.34, 4: 0.465, 5: 0.464, 6: 0.463, 7: 0.52, 8: 0.583}
    controller = _controller(0.5, table.__getitem__, draft_per_token=0.02)
    assert controller.choose(limit=100).k == 2


def test_limit_caps_k_and_fixed_k_is_respected():
    controller = _controller(1.0, lambda k: 0.1, draft_per_token=0.001)
    assert controller.choose(limit=3).k == 3
    assert controller.choose(limit=0).k == 0
    fixed = KController(CostModel(_config()), _config(), fixed_k=5)
    assert fixed.choose(limit=100).k == 5 and fixed.choose(limit=2).k == 2


def test_plain_decoding_probes_speculation_again():
    # Acceptance 0 makes plain decoding best; with every draft token accepted, k = 1 would
    # commit 2 tokens in 0.17 s against 1 in 0.1 s, so a probe can find out.
    controller = _controller(0.0, lambda k: 0.1 + 0.05 * k, draft_per_token=0.02)
    for _ in range(PROBE_EVERY):
        assert controller.choose(limit=100).k == 0
        controller.observe(0, 0, _timing(0, 0.0, 0.1))
    assert controller.choose(limit=100).k == 1


def _cpu_like_costs() -> CostModel:
    """Costs where speculation pays from an acceptance of about 0.5: the verify's second row
    costs 0.2 s more than one row (a CPU's GEMM), a draft step 0.09 s. At 0.42 plain decoding
    is best (2.00 tokens/s against 1.75 at k = 1); at 0.70 k = 3 (2.46)."""
    costs = CostModel(_config())
    for k in range(9):
        for _ in range(30):
            costs.observe(k, _timing(k, 0.09, 0.5 + (0.2 if k else 0.0) + 0.02 * k))
    return costs


def _pool(costs: CostModel, accepted_pattern: list[int], k: int = 4, rounds: int = 60) -> None:
    """Other requests' rounds of k draft tokens, accepting accepted_pattern in turn."""
    for i in range(rounds):
        other = KController(costs, _config())
        other.observe(k, accepted_pattern[i % len(accepted_pattern)], _timing(k, 0.09, 0.78))


def test_a_request_starts_from_the_pooled_acceptance_of_recent_rounds():
    costs = _cpu_like_costs()
    assert KController(costs, _config()).acceptance.rate == pytest.approx(0.6)  # nothing pooled
    _pool(costs, [4, 0])  # 4 of 4, then 0 of 4: 4 accepted per rejection, a = 0.8
    assert KController(costs, _config()).acceptance.rate == pytest.approx(0.8, abs=0.02)


def test_one_rejected_first_round_does_not_turn_a_request_plain():
    """The AVX2 HumanEval case: the first round rejects its first token. With the fixed prior
    the request's estimate falls from 0.6 to 0.42 and it decodes plain until a probe 16 rounds
    later; starting from its neighbours' 0.8 it falls to about 0.65 and keeps drafting."""
    alone = KController(_cpu_like_costs(), _config())
    first = alone.choose(limit=100).k
    alone.observe(first, 0, _timing(first, 0.09, 0.78))
    assert alone.acceptance.rate == pytest.approx(0.42, abs=0.01)
    assert alone.choose(limit=100).k == 0

    costs = _cpu_like_costs()
    _pool(costs, [4, 0])
    pooled = KController(costs, _config())
    first = pooled.choose(limit=100).k
    assert first >= 3
    pooled.observe(first, 0, _timing(first, 0.09, 0.78))
    assert pooled.acceptance.rate == pytest.approx(0.65, abs=0.02)
    assert pooled.choose(limit=100).k >= 3


def test_a_request_among_rejected_drafts_starts_plain():
    costs = _cpu_like_costs()
    _pool(costs, [0, 1])  # 1 accepted per 2 rejections: a = 0.33
    controller = KController(costs, _config())
    assert controller.acceptance.rate == pytest.approx(1 / 3, abs=0.02)
    assert controller.choose(limit=100).k == 0


def test_acceptance_estimate_is_the_truncated_geometric_mle():
    estimator = AcceptanceEstimator()
    for _ in range(500):
        estimator.observe(4, 2)  # two accepted, then a rejection: a = 2 / 3
    assert estimator.rate == pytest.approx(2 / 3, abs=0.01)


class _FixedRate:
    rate = 0.8

    def observe(self, k, num_accepted):
        pass


def _dynamic(verify_s):
    """Acceptance 0.8, a draft step 50 ms, 1 ms orchestration, the given verify cost per k."""
    costs = CostModel(_config())
    for k in range(9):
        costs.observe(k, _timing(k, 0.05, verify_s(k)))
    return KController(costs, _config(dynamic=True), acceptance=_FixedRate())


@pytest.mark.parametrize(
    "verify_s, floor",
    [
        # Flat verify: round cost 0.301 + 0.05 k; the best fixed k is 4 (E = 3.3616 tokens in
        # 0.501 s, 6.7098 tokens/s), so one more draft step pays while P > 0.05 x 6.7098.
        (lambda k: 0.3, 0.05 * 3.3616 / 0.501),
        # Verify growing 20 ms per token: round cost 0.301 + 0.07 k, best k 4 again (3.3616 tokens
        # in 0.581 s); each further token also adds 20 ms of verify.
        (lambda k: 0.3 + 0.02 * k, 0.07 * 3.3616 / 0.581),
    ],
    ids=["flat-verify", "growing-verify"],
)
def test_dynamic_length_drafts_up_to_k_max_with_the_marginal_confidence_floor(verify_s, floor):
    controller = _dynamic(verify_s)
    assert controller.choose(limit=100)[:2] == (8, pytest.approx(floor, rel=1e-3))
    _set_dynamic(controller, False)
    assert controller.choose(limit=100)[:2] == (4, 0.0)
    _set_dynamic(controller, True)
    assert controller.choose(limit=3).k == 3


def test_dynamic_length_waits_for_a_measured_draft_step():
    costs = CostModel(_config())
    costs.observe(0, _timing(0, 0.0, 0.3))  # target-only rounds only: no draft cost known yet
    controller = KController(costs, _config(dynamic=True), acceptance=_FixedRate())
    assert controller.choose(limit=100)[:2] == (controller.initial_k, 0.0)


def test_dynamic_length_keeps_plain_decoding_and_fixed_k_without_a_floor():
    plain = _controller(0.0, lambda k: 0.1 + 0.05 * k, draft_per_token=0.08)
    _set_dynamic(plain, True)
    assert plain.choose(limit=100)[:2] == (0, 0.0)
    fixed = KController(CostModel(_config()), _config(dynamic=True), fixed_k=5)
    assert fixed.choose(limit=100)[:2] == (5, 0.0)
