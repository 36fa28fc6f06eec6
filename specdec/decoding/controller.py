"""Choosing k, the number of speculative tokens per round, from measured acceptance and costs.

With per-token acceptance rate a, a round that drafts k tokens commits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al. 2023, equation 1). The controller picks
the k in [0, k_max] with the highest E(k) / cost(k); k = 0 is plain target decoding (E = 1, no
draft call).

The cost of a round follows what the draft and the target actually run:

- k = 0: one target verify over 1 position, plus orchestration.
- k >= 1: the draft's catch-up (one forward over the 1-2 committed tokens its cache lacks: last
  round's last accepted token and the bonus or correction token; its logits give the first
  draft token), then k - 1 draft steps (one forward of one token each), one target verify over
  k + 1 positions, plus orchestration (two calls).

Verify cost is kept for each k separately, because it is not flat in k on every machine
(DESIGN.md, "Speed"). Acceptance is per request (AcceptanceEstimator, one per KController),
starting from the pooled acceptance of the router's recent rounds (PooledAcceptance, empirical
Bayes) so that one unlucky first round does not turn a request plain; the
costs are per device and shared by every request of an engine or router (CostModel), so they are
estimated robustly: each is the median of its last WINDOW steady-state samples younger than
MAX_AGE_S (the draft's: WINDOW per session of a draft batch at that load, each of which reports
the batch's time), and samples that are not steady state are not taken at all (a catch-up over
more than CATCHUP_STEADY_TOKENS tokens, which is a prefill, a rebuild or a return from plain
decoding, is kept apart as a cost per token; a verify or an orchestration time of a round in
which a side rebuilt its cache; the orchestration of a round while other requests are in
flight, mostly its wait in the batch queues).
Before a cost is measured, and once its samples have aged out, an optional CostPrior (the
replicas' start-up calibration) stands in for it. The draft's costs are kept by load (requests
in flight); a load not yet measured costs at least what lighter ones measured, and only one
request at a time drafts there until a round has measured it (CostModel.may_draft).

Under load a target replica verifies many sessions in one batch (specdec.worker.packed), so a
round's verify costs what the whole batch costs, and one session's k adds rows to everybody's
forward. When recent verifies shared batches of B > 1 sessions, the verify of k is priced as a
batch of B x (k + 1) rows (every session drafting the same k; the prior's cost curve by rows,
scaled to the measured level), and E(k) is the mean over the requests in flight: k then
maximises the batch's goodput, which falls to k = 0 when the batch's rows no longer come cheap
(vLLM, SmartSpec/TurboSpec do the same; Liu et al. 2024). B is the requests in flight, scaled
by the sessions per batch each of them brought lately (CostModel.batch_load).
A session whose draft must first catch up on many tokens pays that prefill once, priced by
KController.choose for the whole batch it delays; probes of plain-decoding requests are spread
over the batch (KController._probe_due).

With a dynamic draft length, the best fixed k only decides whether speculation pays; the round
then drafts up to k_max tokens and the draft stops on its own confidence, at a floor set by the
marginal cost of one more token (KController.choose).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from specdec.config import SpeculationConfig

# Samples per cost estimate. The median of 15 ignores up to 7 arbitrary samples among the last 15
# and follows a real change of level (load, longer contexts) after 8 samples.
WINDOW = 15
# A steady speculative round's draft catch-up feeds 1 token (after a rejection) or 2 (the last
# draft token and the bonus token, after a full acceptance); more is a prefill or a rebuild.
CATCHUP_STEADY_TOKENS = 2
ACCEPTANCE_DECAY = 0.9  # per-round forgetting of the acceptance counts
PRIOR_ACCEPTED = 1.5  # pseudo-counts: an acceptance rate of 0.6 before any round
PRIOR_REJECTED = 1.0
# A request's prior from the pooled rate of recent rounds weighs as much as this many acceptance
# events (accepted tokens plus rejections), about one round of k = 4-6: a first round that
# rejects its first token moves a pooled 0.8 to 0.65, not to 0.4; a request whose drafts are
# all rejected among neighbours who accept everything goes plain after about five rounds.
POOLED_PRIOR_EVENTS = 5.0
POOL_DECAY = 0.98  # per-round forgetting of the pooled counts: about the last 50 rounds
POOL_MIN_EVENTS = 8.0  # pooled events before the pool replaces the fixed prior
# A cost sample counts this long; past it an estimate falls back to the prior (the replicas'
# calibration) and lighter loads until measured again. Costs measured under load (batches of
# prefills on the draft, contention on a shared host) are many times the lone ones, and a request
# that then decodes plain never measures the draft again: with them kept, one busy minute stopped
# speculation for every later request (a lone request after 8 concurrent ones drafted 3 tokens
# in 62). A loaded router that decodes plain measures no draft step either; when its costs
# expire, one request drafts to measure them again (CostModel.may_draft).
MAX_AGE_S = 30.0
# The draft's costs are kept per load: 1, 2, 3-5, 6+ requests in flight on this router
# (CostModel.draft_load). Under load a draft batch carries other
# sessions' catch-ups and prefills, and on a shared host competes with the target's batches: a
# draft step measured at 8 sessions was 0.38 s against 0.05 s alone. One estimate for both
# either stopped speculation alone or kept it on under load, where it did not pay; kept apart,
# each load decides from its own measurements. The verify batch alone does not tell the load:
# requests out of step verify one at a time while the others draft, and their draft steps
# (0.21 s against 0.04 s alone) then priced the last request of a burst, alone, as loaded.
LOAD_BUCKETS = 4
PROBE_EVERY = 16  # rounds at k = 0 before drafting once to re-measure acceptance (alone)
# At a load whose draft costs are not measured yet, one request at a time drafts to measure them
# (CostModel.may_draft); another may try once this long has passed without a measurement
# (the first request's round failed, or it ended).
EXPLORE_S = 30.0
# How long the batch a round is priced in remembers a request that ended (CostModel.batch_load):
# under steady load another request takes its place within milliseconds (a client's next call),
# and a request that chose its k alone in that gap drafted for a lone round, k = 7-12 where 2 in
# flight choose 5, while the new request's prefill waited for that draft phase (AMX Xeon, 2
# streams: TTFT p50 1.56 s against 1.16 s at fixed k = 4). Shorter than one lone round (0.5-1.2
# s on the 2-core CPUs), so a burst's last request is priced alone from its next round on.
LOAD_HOLD_S = 0.5
# The confidence stop's calibration (ConfidenceCalibration): the drafted tokens it fits on, the
# fewest it trusts, and the range of its exponent.
CONFIDENCE_WINDOW = 256
CONFIDENCE_MIN_TOKENS = 16
EXPONENT_RANGE = (0.05, 4.0)

log = logging.getLogger(__name__)


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): tokens committed by a round drafting k tokens."""
    a = min(max(acceptance_rate, 0.0), 1.0)
    if a > 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def mean_expected_tokens(acceptance_rates: Sequence[float], k: int) -> float:
    """The mean of expected_tokens(a, k) over ``acceptance_rates`` (at least one): what a batch
    of sessions at those rates commits per session in a round drafting k each."""
    return statistics.fmean(expected_tokens(rate, k) for rate in acceptance_rates)


@dataclasses.dataclass(frozen=True)
class CostPrior:
    """Costs measured on the devices before any round ran (the replicas' start-up calibration).

    Attributes:
        verify_s: seconds of a target verify by number of draft tokens: verify_s[k] is a forward
            over k + 1 positions, i.e. the target calibration's forward_s[w - 1] for w = k + 1,
            k = 0 .. k_max (k_max + 1 values). A shorter list is extended with its last value and
            a longer one cut at k_max (a prior is only a starting point).
        draft_step_s: seconds of one draft step, a draft forward over 1 position (the draft
            calibration's forward_s[0]).
        catchup_s: seconds of a speculative round's draft catch-up over 1-2 committed tokens
            (e.g. the draft's forward_s[1]); None takes draft_step_s.
        catchup_token_s: seconds per token of a longer draft catch-up (a prefill; the draft
            calibration's prefill_s_per_token); None: 0 until measured.
        batch_verify_s: seconds of a batched verify by the rows of all its sessions:
            batch_verify_s[r - 1] for r rows (the target's exact widths, padding and chunks
            included); empty: batches are priced as single sessions.
    Raises:
        ValueError: verify_s empty, or a value not finite and > 0.
    """

    verify_s: Sequence[float]
    draft_step_s: float
    catchup_s: float | None = None
    batch_verify_s: Sequence[float] = ()
    catchup_token_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify_s", tuple(float(v) for v in self.verify_s))
        object.__setattr__(self, "batch_verify_s", tuple(float(v) for v in self.batch_verify_s))
        values = [*self.verify_s, *self.batch_verify_s, self.draft_step_s]
        values += [v for v in (self.catchup_s, self.catchup_token_s) if v is not None]
        if not self.verify_s or not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"CostPrior needs finite seconds > 0 and a verify_s, got {self}")

    def verify_table(self, k_max: int) -> list[float]:
        """verify_s as k_max + 1 values (extended with its last value, or cut)."""
        values = list(self.verify_s[: k_max + 1])
        return values + [values[-1]] * (k_max + 1 - len(values))

    def batch_seconds(self, rows: int) -> float | None:
        """batch_verify_s at ``rows`` rows, extended linearly past its end; None without it."""
        table = self.batch_verify_s
        if not table:
            return None
        if rows <= len(table):
            return table[max(rows, 1) - 1]
        return table[-1] * rows / len(table)


@dataclasses.dataclass(frozen=True)
class RoundTiming:
    """What one decode round measured, seconds (as the draft and target replicas report it).

    Attributes:
        verify_s: the target's compute_s.
        draft_s: the draft's compute_s, its catch-up included (0 when k = 0).
        catchup_s: of draft_s, the catch-up over the committed tokens the draft's cache lacked.
        catchup_tokens: tokens fed in that catch-up.
        overhead_s: the round's wall time outside both models (transport, scheduling).
        draft_rebuilt, target_rebuilt: that side missed its cache and the round resent the whole
            committed sequence, so the side rebuilt the session in this round.
        batch_sessions, batch_rows: the sessions that shared the verify's batch (this one
            included) and their rows (0: not reported, a lone verify).
    """

    verify_s: float
    draft_s: float = 0.0
    catchup_s: float = 0.0
    catchup_tokens: int = 0
    overhead_s: float = 0.0
    draft_rebuilt: bool = False
    target_rebuilt: bool = False
    batch_sessions: int = 0
    batch_rows: int = 0


class _WindowMedian:
    """The median of the last ``size`` samples younger than MAX_AGE_S seconds (None without)."""

    def __init__(self, clock: Callable[[], float], size: int = WINDOW) -> None:
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=size)
        self._clock = clock

    def add(self, sample: float) -> None:
        self._samples.append((self._clock(), sample))

    @property
    def value(self) -> float | None:
        horizon = self._clock() - MAX_AGE_S
        fresh = [sample for at, sample in self._samples if at >= horizon]
        return statistics.median(fresh) if fresh else None


def _load_bucket(sessions: float) -> int:
    """0 for a lone session, 1 for about 2 per batch, 2 for 3-5, 3 for 6 or more."""
    return min(round(math.log2(max(sessions, 1.0))), LOAD_BUCKETS - 1)


class _ByLoad:
    """One _WindowMedian per load bucket (_load_bucket of CostModel.draft_load), of WINDOW
    samples per session a draft batch holds at that load (1, 2, 4, 8).

    Why per session: every session of a draft batch reports the batch's time, so at 8 in
    flight one batch gives 8 equal samples. With WINDOW samples, one slow batch was the median:
    at 8 streams on the AMX Xeon one batch's steps of 0.15 s replaced 0.07 s, every request
    then decoded plain, and plain rounds measure no draft step, so the estimate stood until it
    expired 30 s later (auto 1.04x k = 0, against 1.27-1.41x in runs without such a batch).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._windows = [_WindowMedian(clock, WINDOW * 2**b) for b in range(LOAD_BUCKETS)]

    def add(self, sample: float, sessions: float) -> None:
        self._windows[_load_bucket(sessions)].add(sample)

    def value(self, sessions: float) -> float | None:
        return self._windows[_load_bucket(sessions)].value

    def estimate(self, sessions: float, prior: float | None) -> float | None:
        """The value at this load: measured there; else, between two measured loads (the
        prior stands for the lone load until it is measured), interpolated on log load
        (geometrically: the buckets are powers of two); else the largest of the lighter loads'
        values, since a cost does not fall as the load grows; else the nearest heavier load's;
        else None."""
        bucket = _load_bucket(sessions)
        values = [w.value for w in self._windows]  # each read once: a sample may age out
        known = {b: v for b, v in enumerate(values) if v is not None}
        if prior is not None:
            known.setdefault(0, prior)
        if bucket in known:
            return known[bucket]
        lighter = [b for b in known if b < bucket]
        heavier = [b for b in known if b > bucket]
        if not lighter:
            return known[min(heavier)] if heavier else None
        floor = max(known[b] for b in lighter)
        if not heavier:
            return floor
        (b0, b1) = max(lighter), min(heavier)
        v0, v1, share = known[b0], known[b1], (bucket - b0) / (b1 - b0)
        between = v0 * (v1 / v0) ** share if v0 > 0 and v1 > 0 else v0 + (v1 - v0) * share
        return max(floor, between)


class CostModel:
    """Per-round costs, shared by all requests of one engine or router (thread-safe).

    Keeps a robust estimate (the median of the last WINDOW steady-state samples, see the module
    docstring) of the draft step, of the draft catch-up of a speculative round, of the verify for
    each k in [0, k_max], and of the orchestration of speculative (k > 0) and plain rounds.

    Args:
        config: its max_speculative_tokens (k_max) sizes the verify table.
        prior: start-up calibration used until measurements replace it: a measured cost replaces
            its prior value outright; a verify cost at an unmeasured k is the prior's value there
            scaled by the measured/prior ratio interpolated from the nearest measured k (the
            prior's shape, the measurements' level). None: nothing is known before the first
            rounds (KController then drafts its initial_k).
        clock: seconds, monotonic: samples older than MAX_AGE_S no longer count (tests inject
            one).
    """

    def __init__(
        self,
        config: SpeculationConfig,
        prior: CostPrior | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        k_max = config.max_speculative_tokens
        self._lock = threading.Lock()
        self._prior = prior
        self._prior_verify = prior.verify_table(k_max) if prior else None
        self._step = _ByLoad(clock)
        self._catchup = _ByLoad(clock)
        self._catchup_token = _ByLoad(clock)  # seconds per token of a longer catch-up
        self._verify = [_WindowMedian(clock) for _ in range(k_max + 1)]
        self._overhead = {True: _WindowMedian(clock), False: _WindowMedian(clock)}
        self._batch_sessions = _WindowMedian(clock)
        # sessions per verify batch / requests in flight here, when each batch was reported
        self._batch_share = _WindowMedian(clock)
        self._members: dict[int, KController] = {}  # by id: the requests in flight (choose)
        self._batch_level = _WindowMedian(clock)  # measured / prior seconds of batched verifies
        self._in_flight = 0  # requests running on this engine or router now
        # (when, in_flight) at each change; the first entry is the count in force LOAD_HOLD_S ago
        self._in_flight_changes: collections.deque[tuple[float, int]] = collections.deque(
            [(clock(), 0)]
        )
        self._prefilling = 0  # of those, requests waiting for their first token
        self._clock = clock
        # load bucket -> (when, the KController) of the request measuring it (may_draft)
        self._exploring: dict[int, tuple[float, object]] = {}
        # Not a cost, but shared by the same requests: each KController's acceptance prior.
        self.pooled_acceptance = PooledAcceptance()

    def set_prior(self, prior: CostPrior) -> None:
        """Installs a prior after construction (a router learns the replicas' calibration only
        once they answer); measurements already taken keep precedence."""
        with self._lock:
            self._prior = prior
            self._prior_verify = prior.verify_table(len(self._verify) - 1)

    def observe(self, k: int, timing: RoundTiming) -> None:
        """Records one decode round that drafted k tokens (after any confidence stop).

        Draft steps: (draft_s - catchup_s) / (k - 1), from rounds with k >= 2 (a rebuilt draft
        included: its rebuild is all in the catch-up). Catch-up: from k >= 1 rounds whose
        catch-up fed 1..CATCHUP_STEADY_TOKENS tokens; a longer one gives a per-token cost
        (catchup_token_seconds). Verify: from rounds in which the target did not rebuild.
        Orchestration: from rounds of a request alone on this engine or router (no batch, no
        other request in flight) in which no side rebuilt. The draft's costs
        are kept for the load the round ran at (draft_load, LOAD_BUCKETS).
        """
        with self._lock:
            load = self.draft_load()
            if k >= 2:
                self._step.add(max(timing.draft_s - timing.catchup_s, 0.0) / (k - 1), load)
            steady_catchup = 0 < timing.catchup_tokens <= CATCHUP_STEADY_TOKENS
            if k >= 1 and steady_catchup and not timing.draft_rebuilt:
                self._catchup.add(timing.catchup_s, load)
            elif k >= 1 and timing.catchup_tokens > CATCHUP_STEADY_TOKENS:
                self._catchup_token.add(timing.catchup_s / timing.catchup_tokens, load)
            self._batch_sessions.add(max(timing.batch_sessions, 1))
            self._batch_share.add(max(timing.batch_sessions, 1) / max(self._in_flight, 1))
            prior_s = self._prior.batch_seconds(timing.batch_rows) if self._prior else None
            batched = timing.batch_sessions > 1 and prior_s is not None
            if batched and not timing.target_rebuilt:
                self._batch_level.add(timing.verify_s / prior_s)
            elif not timing.target_rebuilt:
                self._verify[k].add(timing.verify_s)
            # Under load a round's wall time outside compute is mostly its wait in the batch
            # queues, which the batch price already covers; priced again as orchestration it
            # stops speculation. A batched round waited for its batch, and so did a verify
            # that ran alone while another request was in flight: the target waited for that
            # request's call, the draft for its draft. Measured at 2 streams (AMX Xeon): such
            # rounds priced the k > 0 orchestration at about 0.9 s against 0.01 s alone, and
            # auto decoded plain for 144 of 176 choices at acceptance 0.93-0.97.
            lone = timing.batch_sessions <= 1 and self._in_flight <= 1
            if lone and not (timing.target_rebuilt or timing.draft_rebuilt):
                self._overhead[k > 0].add(max(timing.overhead_s, 0.0))

    def may_draft(self, owner: object) -> bool:
        """Whether the request ``owner`` (its KController) may draft at the current load
        (draft_load): always alone, or where a steady draft cost at that load is measured (a
        step or a catch-up; a prefill alone does not tell the steps); else only the request that
        asked first, until a round measures it, the request gives its turn back
        (release_turn), or EXPLORE_S passes. Probes (KController._probe_due) do not ask.

        Why: a load not yet measured is priced from lighter ones (at worst the calibration's
        lone costs), and where draft and target share a host the draft costs many times that
        under load. A burst of 8 requests on the AMX Xeon all started drafting at the lone
        price: 8 draft prefills of about 110 tokens beside the target's own, then draft steps
        of 0.3 s against 0.05 s alone, measured only after everyone had paid them (TTFT p50
        6.0 s against 2.0 s at k = 0; auto 0.63x k = 0). One request's round measures the
        load for all the others."""
        with self._lock:
            load = self.draft_load()
            if load <= 1:
                return True
            if self._step.value(load) is not None or self._catchup.value(load) is not None:
                return True
            bucket = _load_bucket(load)
            turn = self._exploring.get(bucket)
            if turn and turn[1] is not owner and self._clock() - turn[0] < EXPLORE_S:
                return False
            self._exploring[bucket] = (self._clock(), owner)
            return True

    def release_turn(self, owner: object) -> None:
        """Gives back the turns of may_draft that ``owner`` holds: its round drafted nothing
        after all (the draft's prefill not done yet, no draft replica), or its request ended."""
        with self._lock:
            for bucket, (_, holder) in list(self._exploring.items()):
                if holder is owner:
                    del self._exploring[bucket]

    def request_started(self, owner: KController | None = None) -> None:
        """A request of this engine or router began (RoundLoop.run); see in_flight. ``owner``:
        its KController, whose acceptance then counts in batch_expected_tokens until
        request_ended(owner)."""
        with self._lock:
            self._in_flight += 1
            self._in_flight_changed()
            if owner is not None:
                self._members[id(owner)] = owner

    def request_ended(self, owner: object | None = None) -> None:
        """A request that request_started counted has ended, however it ended; ``owner``: its
        KController, whose turns of may_draft are given back."""
        if owner is not None:
            self.release_turn(owner)
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._in_flight_changed()
            if owner is not None:
                self._members.pop(id(owner), None)

    def prefill_started(self) -> None:
        """A request of this engine or router began its target prefill (RoundLoop); see
        prefills_pending."""
        with self._lock:
            self._prefilling += 1

    def prefill_ended(self) -> None:
        """The prefill that prefill_started counted has ended, however it ended."""
        with self._lock:
            self._prefilling = max(0, self._prefilling - 1)

    @property
    def prefills_pending(self) -> int:
        """Requests of this engine or router waiting for their first token now (RoundLoop
        starts no draft beside them where draft and target share cores)."""
        return self._prefilling

    @property
    def in_flight(self) -> int:
        """Requests running on this engine or router now: a load that the verify batches show
        only a few rounds later (KController.choose prices a draft's start with it)."""
        return self._in_flight

    def draft_load(self) -> int:
        """The load the draft's costs are kept and priced at: the requests in flight on this
        engine or router (at least 1). The same in choose and observe, so the round that
        measures a load is the one priced at it; the verify batch does not tell it (requests
        out of step verify one at a time while the others draft)."""
        return max(self._in_flight, 1)

    @property
    def draft_step_seconds(self) -> float | None:
        """Seconds of one draft step at the current load (draft_step_at)."""
        return self.draft_step_at(self.draft_load())

    @property
    def catchup_seconds(self) -> float | None:
        """Seconds of a speculative round's draft catch-up at the current load (catchup_at)."""
        return self.catchup_at(self.draft_load())

    @property
    def catchup_token_seconds(self) -> float:
        """Seconds per token of a draft catch-up over more than CATCHUP_STEADY_TOKENS tokens (a
        prefill, a rebuild, a return from plain decoding) at the current load
        (catchup_token_at)."""
        return self.catchup_token_at(self.draft_load())

    # Each draft cost at a load is what was measured at that load; else interpolated between
    # measured loads, the calibration standing for the lone one; else, since a cost does not
    # fall as the load grows, the largest measured at a lighter load (_ByLoad.estimate). Priced
    # at the calibration's lone cost, 8 streams' first choices drafted 6 tokens at a 0.04 s
    # step and measured 0.25-0.9 s; and as a burst drained from 8 requests to 5, the 5 were
    # priced at the lone cost again although 8 had measured 0.36 s.

    def catchup_token_at(self, sessions: float) -> float:
        """catchup_token_seconds at a load of ``sessions``: as above, the prior being the
        draft calibration's prefill seconds per token; 0 when nothing is known."""
        prior = self._prior.catchup_token_s if self._prior else None
        return self._catchup_token.estimate(sessions, prior) or 0.0

    def draft_step_at(self, sessions: float) -> float | None:
        """draft_step_seconds at a load of ``sessions``, as above; None when nothing is known
        (without the heavier loads' fallback, a router without a calibration that had
        measured only loaded steps failed a request: int * None)."""
        return self._step.estimate(sessions, self._prior.draft_step_s if self._prior else None)

    def catchup_at(self, sessions: float) -> float | None:
        """catchup_seconds at a load of ``sessions``, as above, and where that load has draft
        steps measured but no catch-up yet, at least a step there (a forward over 1-2 rows
        costs at least one over 1: the first rounds at a load measure steps, their catch-up
        being the draft's prefill, and an 8-stream burst then priced k = 1 at the lone
        catch-up of 0.06 s beside steps of 0.34 s); else draft_step_at."""
        measured = self._catchup.value(sessions)
        if measured is not None:
            return measured
        prior = self._prior.catchup_s if self._prior else None
        floors = [self._catchup.estimate(sessions, prior), self._step.value(sessions)]
        floors = [v for v in floors if v is not None]
        return max(floors) if floors else self.draft_step_at(sessions)

    @property
    def ready(self) -> bool:
        """Whether round_seconds can price every k: a verify cost and a draft step are known
        (measured or from the prior)."""
        with self._lock:
            has_verify = self._prior_verify is not None or any(
                v.value is not None for v in self._verify
            )
            return has_verify and self.draft_step_seconds is not None

    def verify_seconds(self, k: int, sessions: float | None = None) -> float:
        """Predicted seconds of a verify over k draft tokens (k + 1 positions).

        Under load (verifies lately shared batches of B > 1 sessions, and the prior has the
        batch table): the prior's seconds of a batch of B x (k + 1) rows, scaled by the median
        measured/prior ratio of recent batches. Alone: measured at k: that. Otherwise, with
        a prior: the prior's value scaled as the class docstring says. Without one:
        interpolated between the nearest measured k on each side, or the nearest one beyond
        the measured range (an optimistic guess for larger k, which the controller then
        measures and corrects). ``sessions``: price a batch of that many sessions instead of
        the recent batches' (None: batch_sessions).

        Raises:
            ValueError: no verify cost is known yet (see ready).
        """
        with self._lock:
            return self._verify_seconds(k, sessions)

    def draft_seconds(self, k: int) -> float:
        """Predicted draft seconds of a round drafting k tokens: 0 for k = 0, else the catch-up
        plus k - 1 draft steps, at draft_load (needs ready)."""
        if k == 0:
            return 0.0
        load = self.draft_load()
        return self.catchup_at(load) + (k - 1) * self.draft_step_at(load)

    def round_seconds(self, k: int, sessions: float | None = None) -> float:
        """Predicted seconds of a round drafting k tokens: draft (at draft_load), verify
        (sessions: as for verify_seconds) and orchestration (the other kind of round's
        orchestration until this kind's is measured; needs ready)."""
        with self._lock:
            verify = self._verify_seconds(k, sessions)
            overhead = self._overhead[k > 0].value
            if overhead is None:
                overhead = self._overhead[k == 0].value or 0.0
            draft = self.draft_seconds(k)
        return max(draft + verify + overhead, 1e-9)

    @property
    def batch_sessions(self) -> float:
        """Sessions per verify batch lately (the median of the last WINDOW rounds; 1 before)."""
        return self._batch_sessions.value or 1.0

    @property
    def batch_load(self) -> float:
        """The sessions a round starting now is priced in: the most requests in flight here at
        any moment of the last LOAD_HOLD_S seconds (a request that ended counts a little longer,
        as under steady load another one takes its place at once), times the sessions per verify
        batch that each request in flight brought lately, if more than one (the median of
        batch_sessions / in_flight over the last WINDOW rounds: other routers' sessions share a
        target replica's batches too).

        Why not batch_sessions itself: its median follows the load WINDOW / 2 rounds late.
        After a burst of 8 streams on the AMX Xeon, the last request alone was still priced in
        batches of 3 sessions and drafted 3 tokens a round where alone it drafts up to 12; and
        a burst's first rounds would be priced alone (KController.choose)."""
        share = max(self._batch_share.value or 1.0, 1.0)
        with self._lock:
            held = self._held_in_flight()
        return max(held, 1) * share

    def _in_flight_changed(self) -> None:
        """Records the new in_flight for _held_in_flight (under self._lock)."""
        self._in_flight_changes.append((self._clock(), self._in_flight))
        self._held_in_flight()  # drops the changes older than the hold

    def _held_in_flight(self) -> int:
        """The most requests in flight at any moment of the last LOAD_HOLD_S seconds (under
        self._lock)."""
        changes, horizon = self._in_flight_changes, self._clock() - LOAD_HOLD_S
        while len(changes) > 1 and changes[1][0] <= horizon:
            changes.popleft()
        return max(count for _, count in changes)

    def batch_acceptance_rates(self) -> list[float] | None:
        """The acceptance rate of each request in flight (those started with their
        KController); None with fewer than 2 such requests."""
        with self._lock:
            rates = [member.acceptance.rate for member in self._members.values()]
        return rates if len(rates) >= 2 else None

    def batch_expected_tokens(self, k: int) -> float | None:
        """The mean over the requests in flight (batch_acceptance_rates) of the tokens a round
        drafting k commits, E(k) at each one's acceptance rate; None with fewer than 2 such
        requests."""
        rates = self.batch_acceptance_rates()
        return None if rates is None else mean_expected_tokens(rates, k)

    def _verify_seconds(self, k: int, sessions: float | None = None) -> float:
        sessions = self.batch_sessions if sessions is None else sessions
        if sessions > 1 and self._prior is not None and self._prior.batch_verify_s:
            # Under load every session of the batch is priced as drafting the same k: the
            # batch's rows grow by its size for each token of k (SmartSpec, Liu et al. 2024).
            rows = round(sessions * (k + 1))
            return (self._batch_level.value or 1.0) * self._prior.batch_seconds(rows)
        return self._single_verify_seconds(k)

    def _single_verify_seconds(self, k: int) -> float:
        measured = [v.value for v in self._verify]
        if measured[k] is not None:
            return measured[k]
        prior = self._prior_verify
        if all(v is None for v in measured):
            if prior is None:
                raise ValueError("no verify cost measured yet and no prior")
            return prior[k]
        if prior is None:
            return _interpolate(measured, k)
        ratios = [None if m is None else m / p for m, p in zip(measured, prior)]
        return prior[k] * _interpolate(ratios, k)


def _decayed_counts(
    accepted: float, rejected: float, decay: float, k: int, num_accepted: int
) -> tuple[float, float]:
    """(accepted, rejected) after a round that drafted k tokens and accepted num_accepted:
    num_accepted acceptances and, if num_accepted < k, one rejection, the old counts decayed;
    unchanged by a plain round (k = 0)."""
    if k == 0:
        return accepted, rejected
    return accepted * decay + num_accepted, rejected * decay + (num_accepted < k)


class AcceptanceEstimator:
    """Per-request acceptance rate, by maximum likelihood under i.i.d. acceptance.

    A round that accepts n of k draft tokens contributes n acceptances and, if n < k, one
    rejection; a = accepted / (accepted + rejected), with old rounds decayed (ACCEPTANCE_DECAY
    per round) and a prior.

    Args:
        prior_rate: the prior's acceptance rate, as POOLED_PRIOR_EVENTS pseudo-events (the
            pooled rate of the router's recent rounds, PooledAcceptance.rate); None: the fixed
            weak prior of 0.6 over PRIOR_ACCEPTED + PRIOR_REJECTED events.
    """

    def __init__(self, prior_rate: float | None = None) -> None:
        if prior_rate is None:
            self._accepted, self._rejected = PRIOR_ACCEPTED, PRIOR_REJECTED
        else:
            self._accepted = POOLED_PRIOR_EVENTS * prior_rate
            self._rejected = POOLED_PRIOR_EVENTS * (1.0 - prior_rate)

    def observe(self, k: int, num_accepted: int) -> None:
        self._accepted, self._rejected = _decayed_counts(
            self._accepted, self._rejected, ACCEPTANCE_DECAY, k, num_accepted
        )

    @property
    def rate(self) -> float:
        return self._accepted / (self._accepted + self._rejected)


class PooledAcceptance:
    """The acceptance rate of all requests' recent rounds on one engine or router
    (thread-safe): each request's AcceptanceEstimator starts from it (empirical Bayes; Robbins
    1956), so a request is judged on its own rounds once it has a few, and on its neighbours'
    before.

    Same estimator as AcceptanceEstimator, over every drafting round of every request, the
    counts decayed by POOL_DECAY per round. Why: with the fixed prior (0.6 over 2.5 events) a
    request whose first round rejected its first token fell to 0.42, below what pays, and
    decoded plain until its probe 16 rounds later: 4 of 20 HumanEval prompts on the AVX2 CPU,
    whose later rounds accepted 0.93.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accepted = 0.0
        self._rejected = 0.0

    def observe(self, k: int, num_accepted: int) -> None:
        """Records a round that drafted k tokens and accepted num_accepted of them."""
        with self._lock:
            self._accepted, self._rejected = _decayed_counts(
                self._accepted, self._rejected, POOL_DECAY, k, num_accepted
            )

    @property
    def rate(self) -> float | None:
        """The pooled rate in [0, 1]; None until POOL_MIN_EVENTS events are pooled."""
        with self._lock:
            events = self._accepted + self._rejected
            return self._accepted / events if events >= POOL_MIN_EVENTS else None


class ConfidenceCalibration:
    """How the draft's confidence translates into the target's acceptance, for one request.

    The dynamic draft length stops a round once the draft's own estimate that its block is
    accepted, the product of its probabilities of the block's tokens, falls below a floor. A
    draft is rarely calibrated to its target: on the bundled pair (greedy HumanEval, AMX Xeon)
    the target accepted 91% of the drafted tokens, yet the raw products stopped rounds after 3
    tokens where 6 paid. The exponent fitted below had a median of 0.71 over the HumanEval and
    Spec-Bench requests (probabilities understating acceptance); with it, HumanEval rounds
    drafted 5.3 tokens and the service went from 1.85x to 2.35x plain generate (20 prompts).

    The model: a drafted token of draft probability p is accepted with probability p^g. g is
    fitted by matching the expected number of accepted tokens to the observed one, sum(p_i^g) =
    sum(accepted_i), over the last CONFIDENCE_WINDOW drafted tokens with an outcome (a token
    after its round's first rejection has none); sum(p_i^g) falls as g grows, so bisection
    finds it. A block's acceptance is then prod(p_i^g) = prod(p_i)^g, and a floor f on it is
    the floor f^(1/g) on the draft's own product, which the draft replica applies unchanged
    (raw_floor). A one-parameter power calibration of the draft's confidence (cf. temperature
    scaling, Guo et al. 2017, section 4.2), chosen because it composes over a block; g = 1 (the
    raw product) until CONFIDENCE_MIN_TOKENS are known.
    """

    def __init__(self) -> None:
        self._tokens: collections.deque[tuple[float, bool]] = collections.deque(
            maxlen=CONFIDENCE_WINDOW
        )
        self._exponent: float | None = 1.0

    def observe(self, confidences: Sequence[float], num_accepted: int) -> None:
        """Records a round's drafted tokens' confidences (the draft's probability of each, in
        order) and how many of them the target accepted (the first num_accepted)."""
        outcomes = confidences[: num_accepted + 1]
        for i, p in enumerate(outcomes):
            self._tokens.append((min(max(float(p), 1e-9), 1.0), i < num_accepted))
        if outcomes:
            self._exponent = None  # refitted when next read

    @property
    def exponent(self) -> float:
        """g, within EXPONENT_RANGE: below 1 when the draft is underconfident (the target
        accepts more than its probabilities say), above 1 when overconfident."""
        if self._exponent is None:
            self._exponent = self._fit()
        return self._exponent

    def raw_floor(self, floor: float) -> float:
        """The floor on the draft's own product of probabilities that stops a block whose
        calibrated acceptance falls below ``floor`` (in [0, 1])."""
        return floor ** (1.0 / self.exponent)

    def _fit(self) -> float:
        if len(self._tokens) < CONFIDENCE_MIN_TOKENS:
            return 1.0
        logs = [math.log(p) for p, _ in self._tokens]
        accepted = sum(outcome for _, outcome in self._tokens)

        def expected(g: float) -> float:
            return sum(math.exp(g * log_p) for log_p in logs)

        low, high = EXPONENT_RANGE
        if expected(low) <= accepted:
            return low
        if expected(high) >= accepted:
            return high
        for _ in range(20):  # on log g: the range's ratio of 80 to within 0.5%
            middle = math.sqrt(low * high)
            low, high = (middle, high) if expected(middle) > accepted else (low, middle)
        return math.sqrt(low * high)


class RoundPlan(NamedTuple):
    """What one round drafts: at most k tokens, stopping early once the product of the draft's
    probabilities of its tokens falls below min_draft_confidence (0 = never)."""

    k: int
    min_draft_confidence: float = 0.0


@dataclasses.dataclass
class KController:
    """Picks k, and the draft's confidence stop, for each round of one request.

    Args:
        costs: the CostModel shared by all requests.
        config: k is at most its max_speculative_tokens (k_max); with its dynamic_draft_length,
            when speculation pays the round drafts up to k_max tokens and the draft stops on its
            confidence (RoundPlan.min_draft_confidence) instead of drafting a fixed k.
        fixed_k: use this k every round (still capped by ``limit``), no confidence stop;
            None = adaptive.
        initial_k: k of the first rounds, while the costs are not ready (no prior, nothing
            measured yet).
        acceptance: this request's acceptance estimate; None: one whose prior is the pooled
            acceptance of the costs' recent rounds (CostModel.pooled_acceptance).
    """

    costs: CostModel
    config: SpeculationConfig
    fixed_k: int | None = None
    initial_k: int = 4
    acceptance: AcceptanceEstimator | None = None
    confidence: ConfidenceCalibration = dataclasses.field(default_factory=ConfidenceCalibration)
    _plain_rounds: int = 0

    def __post_init__(self) -> None:
        if self.acceptance is None:
            self.acceptance = AcceptanceEstimator(self.costs.pooled_acceptance.rate)

    def choose(self, limit: int, draft_lag: int = 0) -> RoundPlan:
        """The next round's plan, k at most ``limit`` (tokens left before a length stop, minus
        one); ``draft_lag``: committed tokens the draft's cache lacks (its whole sequence before
        its first draft).

        After enough plain rounds in a row (_probe_due), one round drafts k = 1 to re-measure
        this request's acceptance. Otherwise k maximises E(k) / CostModel.round_seconds(k).

        Its ``min_draft_confidence`` is 0, or with a dynamic draft length the marginal rule.
        Drafting one more token costs a draft step plus what it adds to the verify, and commits
        one more token with about the probability that the draft's block so far is accepted (an
        upper estimate: the new token must be accepted too); that pays while the probability
        exceeds that marginal cost x the predicted tokens per second of the best fixed k. The
        probability is the product of the draft's confidences, calibrated to this request's
        acceptances (ConfidenceCalibration), so the floor sent is the calibration's raw_floor.
        With a fixed-width verify (half precision) the verify adds nothing; where it grows with
        k (float32 on a CPU) it raises the floor.

        A draft that lags more than CATCHUP_STEADY_TOKENS tokens first catches up on all of
        them (its prefill, before its first draft): P = lag x catchup_token_seconds, paid once
        for the ``limit`` + 1 tokens left, so a round of k commits E(k) tokens in
        round_seconds(k) + P x E(k) / (limit + 1). Under load P is charged B times, B the
        sessions of the batch: where draft and target share a host (the local cluster, CPU
        nodes), the prefill's compute delays every verify of the batch.

        The batch B a round is priced in is CostModel.batch_load, at least the requests in
        flight: every request in flight shares the target. Under a burst the verify batches
        show the load only a few rounds later; and requests that draft fall out of step, so
        their verifies run in smaller batches, each a forward of its own on the same device.
        Priced at those small batches, drafting looked cheap because drafting had broken the
        batch up: 8 streams on the AMX Xeon went from batches of 8 to 3 sessions, rounds of
        k = 12, and 0.76x the aggregate tokens/s of k = 0. With several target replicas
        in_flight overstates the batch, and the requests draft less than they could.

        In a batch (B > 1), E(k) is the mean over the requests in flight of each one's E(k)
        (CostModel.batch_expected_tokens), not this request's own: every request in flight then
        prices the same k for the same batch, as SmartSpec (Liu et al. 2024) chooses one k for
        a batch from its mean acceptance. Priced with its own rate, a request that had accepted
        every token drafted 7-12 tokens among 7 others at k = 0-2 (AMX Xeon, 8 streams); where
        the router alternates draft and verify phases (SpeculationConfig.alternate_phases), the
        whole batch's verify waited for that draft.

        Where the draft's costs at the current load are not measured yet, one request at a
        time may draft there (CostModel.may_draft); the others decode plain meanwhile.
        """
        cap = max(0, min(self.config.max_speculative_tokens, limit))
        if self.fixed_k is not None:
            return RoundPlan(min(self.fixed_k, cap))
        if not self.costs.ready:
            return RoundPlan(min(self.initial_k, cap))
        if self._probe_due(cap):
            log.debug("k=1: a probe after %d plain rounds", self._plain_rounds)
            return RoundPlan(min(1, cap))
        sessions, start_s = self.costs.batch_load, 0.0
        if draft_lag > CATCHUP_STEADY_TOKENS:
            per_token = self.costs.catchup_token_seconds
            start_s = draft_lag * per_token * sessions / (max(limit, 0) + 1)
        # Read once, so every k of this choice is priced at the same rates; alone, its own.
        rates = self.costs.batch_acceptance_rates() if sessions > 1 else None
        rates = rates or [self.acceptance.rate]

        def tokens_per_s(k: int) -> float:
            tokens = mean_expected_tokens(rates, k)
            start = start_s * tokens if k else 0.0
            return tokens / (self.costs.round_seconds(k, sessions) + start)

        best = max(range(cap + 1), key=tokens_per_s)
        if log.isEnabledFor(logging.DEBUG):
            self._log_choice(best, cap, draft_lag, sessions, start_s, tokens_per_s)
        if best and not self.costs.may_draft(self):
            log.debug("k=0: another request is measuring the draft at this load")
            return RoundPlan(0)
        if not self.config.dynamic_draft_length or best == 0:
            return RoundPlan(best)
        best_rate = tokens_per_s(best)
        longest, marginal_s = self._dynamic_length(best, cap, sessions, best_rate)
        floor = min(marginal_s * best_rate, 1.0)
        return RoundPlan(longest, self.confidence.raw_floor(floor))

    def _dynamic_length(
        self, best: int, cap: int, sessions: float, tokens_per_s: float
    ) -> tuple[int, float]:
        """(longest, marginal_s): how far a dynamic-length round may draft, and the seconds one
        more token costs up to there (a draft step plus the verify it adds, averaged).

        A token pays at most 1 / tokens_per_s seconds (its worth if certain to be accepted), so
        the round stops before the first token past ``best`` that costs more: in half precision
        the verify pads to one exact width (7 on the AMX Xeon), and the token that needs a
        second forward costs a whole one (0.28 s against a 0.05 s draft step). Where the verify
        grows smoothly (float32) every token to ``cap`` can pay."""
        step_s = self.costs.draft_step_seconds
        verify = [self.costs.verify_seconds(k, sessions) for k in range(best, cap + 1)]
        longest = best
        while longest < cap:
            added = max(verify[longest + 1 - best] - verify[longest - best], 0.0)
            if (step_s + added) * tokens_per_s >= 1.0:
                break
            longest += 1
        if longest == best:
            return longest, step_s
        added = max(verify[longest - best] - verify[0], 0.0)
        return longest, step_s + added / (longest - best)

    def _log_choice(
        self,
        best: int,
        cap: int,
        draft_lag: int,
        sessions: float,
        start_s: float,
        tokens_per_s: Callable[[int], float],
    ) -> None:
        """One DEBUG line per choice: what the prices were when it was made (the deployment's
        ``logging_config.log_level: DEBUG`` turns it on in a router's log)."""
        costs = self.costs
        log.debug(
            "k=%d of %d: acceptance %.2f (confidence exponent %.2f), batch %.1f sessions (%d "
            "in flight), draft lag %d (start %.4f s/token), draft step %.4f s, catch-up %.4f s; "
            "predicted tokens/s by k from 0: %s",
            best,
            cap,
            self.acceptance.rate,
            self.confidence.exponent,
            sessions,
            costs.in_flight,
            draft_lag,
            start_s,
            costs.draft_step_seconds,
            costs.catchup_seconds,
            " ".join(f"{tokens_per_s(k):.3f}" for k in range(cap + 1)),
        )

    def _probe_due(self, cap: int) -> bool:
        """Whether this plain-decoding request should draft once to re-measure its acceptance.

        A probe is not free: its draft catches up on every token committed since the last draft
        (a prefill, the first time), and its verify adds rows to the batch. Under load those
        costs fall on every session of the batch, and where draft and target share a host the
        draft's compute is taken from their verifies. So a request probes after PROBE_EVERY x B
        plain rounds, B the sessions per verify batch (batch_load): the batch as a whole probes
        about as often as a lone request does. (Probing only where full acceptance would pay, as
        tried, can stop probes for good: draft costs measured under load then stay stale.)
        """
        sessions = max(1, round(self.costs.batch_load))
        return cap >= 1 and self._plain_rounds >= PROBE_EVERY * sessions

    def observe(
        self,
        k: int,
        num_accepted: int,
        timing: RoundTiming,
        confidences: Sequence[float] = (),
    ) -> None:
        """Records a round that drafted k tokens (after any confidence stop), num_accepted of
        them accepted, and the draft's probability of each (``confidences``, when reported):
        the acceptance and the confidence calibration for this request, the costs for all."""
        self._plain_rounds = self._plain_rounds + 1 if k == 0 else 0
        if k == 0:
            self.costs.release_turn(self)
        self.acceptance.observe(k, num_accepted)
        self.costs.pooled_acceptance.observe(k, num_accepted)
        self.confidence.observe(confidences, num_accepted)
        self.costs.observe(k, timing)


def _interpolate(table: list[float | None], k: int) -> float:
    """table[k], or linear between the nearest non-None entries around k, or the nearest one
    (table has at least one non-None entry)."""
    if table[k] is not None:
        return table[k]
    below = next(((i, table[i]) for i in range(k - 1, -1, -1) if table[i] is not None), None)
    above = next(((i, table[i]) for i in range(k + 1, len(table)) if table[i] is not None), None)
    if below and above:
        (i0, v0), (i1, v1) = below, above
        return v0 + (v1 - v0) * (k - i0) / (i1 - i0)
    return (below or above)[1]
