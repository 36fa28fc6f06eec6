"""What a round costs: measured on the devices, estimated robustly, priced for a k and a batch.

The cost of a round follows what the draft and the target actually run:

- k = 0: one target verify over 1 position, plus orchestration.
- k >= 1: the draft's catch-up (one forward over the 1-2 committed tokens its cache lacks: last
  round's last accepted token and the bonus or correction token; its logits give the first
  draft token), then k - 1 draft steps (one forward of one token each), one target verify over
  k + 1 positions, plus orchestration (two calls).

Verify cost is kept for each k separately, because it is not flat in k on every machine
(DESIGN.md, "Speed"). The costs are per device and shared by every request of an engine or
router (CostModel), so they are estimated robustly: each is the median of its last WINDOW
steady-state samples younger than MAX_AGE_S (specdec.decoding.windows; the draft's: WINDOW per
session of a draft batch at that load, each of which reports the batch's time), and samples that
are not steady state are not taken at all (a catch-up over more than CATCHUP_STEADY_TOKENS
tokens, which is a prefill, a rebuild or a return from plain decoding, is kept apart as a cost
per token; a verify or an orchestration time of a round in which a side rebuilt its cache; the
orchestration of a round while other requests are in flight, mostly its wait in the batch
queues).
Before a cost is measured, and once its samples have aged out, an optional CostPrior (the
replicas' start-up calibration, CostPrior.of) stands in for it. The draft's costs are kept by load
(requests in flight, RequestTraffic.draft_load); a load not yet measured costs at least what
lighter ones measured, and only one request at a time drafts there until a round has measured it
(CostModel.may_draft).

Under load a target replica verifies many sessions in one batch (specdec.worker.packed), so a
round's verify costs what the whole batch costs, and one session's k adds rows to everybody's
forward. When recent verifies shared batches of B > 1 sessions, the verify of k is priced as a
batch of B x (k + 1) rows (every session drafting the same k; the prior's cost curve by rows,
scaled to the measured level); B is RequestTraffic.batch_load (specdec.decoding.traffic).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

from specdec.config import SpecdecConfig, SpeculationConfig
from specdec.decoding.traffic import RequestTraffic
from specdec.decoding.windows import ByLoad, WindowMedian, load_bucket
from specdec.v1 import worker_pb2

# A steady speculative round's draft catch-up feeds 1 token (after a rejection) or 2 (the last
# draft token and the bonus token, after a full acceptance); more is a prefill or a rebuild.
CATCHUP_STEADY_TOKENS = 2


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

    @classmethod
    def of(
        cls, target: worker_pb2.CostTable, draft: worker_pb2.CostTable, config: SpecdecConfig
    ) -> CostPrior | None:
        """The prior from the cost tables the target and the draft replicas computed from their
        calibrations (specdec.device.cost_prior.cost_table, with the same ``config``): verify
        of k draft tokens = the target's k + 1 rows in its exact widths (padding and chunks
        included), a draft step = the draft's 1-row forward, its catch-up = its 2-row forward,
        a longer catch-up = the draft's prefill seconds per token, and a batched verify of r
        rows, r up to models.max_batch_size x (k_max + 1), = the target's r rows. None when
        either side reported no costs. The router and the in-process engine both build their
        prior here."""
        if not target.rows_s or not draft.forward_s:
            return None
        k_max = config.speculation.max_speculative_tokens
        max_batch_size = config.models.max_batch_size
        rows_s = tuple(target.rows_s)
        prefill = draft.prefill_s_per_token
        return cls(
            verify_s=rows_s[: k_max + 1],
            draft_step_s=draft.forward_s[0],
            catchup_s=draft.forward_s[1] if len(draft.forward_s) > 1 else None,
            batch_verify_s=rows_s[: max_batch_size * (k_max + 1)] if max_batch_size > 1 else (),
            catchup_token_s=prefill if prefill > 0 else None,  # 0: not reported
        )

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
        draft_free: the round's tokens came from n-gram lookup (specdec.decoding.ngram), not
            the draft model: it made one call, and tells nothing of the draft's costs.
        ngram_tail: n-gram tokens verified after the draft model's in a mixed round
            (ProposerChoice.tail): the verify covered k + ngram_tail tokens.
        overlapped: the round's draft tokens were drafted while the previous round verified
            (pipelined drafting): its draft's costs and its orchestration were not on the
            round's path, so they price nothing.
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
    draft_free: bool = False
    ngram_tail: int = 0
    overlapped: bool = False


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
    Attributes:
        traffic: the requests of this engine or router (specdec.decoding.traffic), at whose load
            the draft's costs are kept and in whose batch a verify is priced.
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
        self._step = ByLoad(clock)
        self._catchup = ByLoad(clock)
        self._catchup_token = ByLoad(clock)  # seconds per token of a longer catch-up
        self._verify = [WindowMedian(clock) for _ in range(k_max + 1)]
        self._overhead = {True: WindowMedian(clock), False: WindowMedian(clock)}
        self._batch_level = WindowMedian(clock)  # measured / prior seconds of batched verifies
        # Not a cost, but what the costs are priced at: the requests on this engine or router.
        self.traffic = RequestTraffic(clock)

    @property
    def prior(self) -> CostPrior | None:
        """The start-up calibration's costs in use (None: none yet)."""
        return self._prior

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
        are kept for the load the round ran at (RequestTraffic.draft_load, LOAD_BUCKETS). A
        draft-free round (timing.draft_free: k tokens from n-gram lookup) gives its verify and
        a one-call orchestration, priced as a k = 0 round's, and nothing of the draft. A mixed
        round's verify counts for its k + timing.ngram_tail tokens.
        """
        with self._lock:
            load = self.traffic.draft_load()
            drafted = 0 if timing.draft_free else k
            if not timing.overlapped:
                self._observe_draft(drafted, timing, load)
            self.traffic.observe_batch(timing.batch_sessions)
            prior_s = self._prior.batch_seconds(timing.batch_rows) if self._prior else None
            batched = timing.batch_sessions > 1 and prior_s is not None
            if batched and not timing.target_rebuilt:
                self._batch_level.add(timing.verify_s / prior_s)
            elif not timing.target_rebuilt:
                self._verify[k + timing.ngram_tail].add(timing.verify_s)
            # Under load a round's wall time outside compute is mostly its wait in the batch
            # queues, which the batch price already covers; priced again as orchestration it
            # stops speculation. A batched round waited for its batch, and so did a verify
            # that ran alone while another request was in flight: the target waited for that
            # request's call, the draft for its draft. Measured at 2 streams (AMX Xeon): such
            # rounds priced the k > 0 orchestration at about 0.9 s against 0.01 s alone, and
            # auto decoded plain for 144 of 176 choices at acceptance 0.93-0.97.
            lone = timing.batch_sessions <= 1 and self.traffic.in_flight <= 1
            rebuilt = timing.target_rebuilt or timing.draft_rebuilt
            if lone and not (rebuilt or timing.overlapped):
                self._overhead[drafted > 0].add(max(timing.overhead_s, 0.0))

    def _observe_draft(self, k: int, timing: RoundTiming, load: float) -> None:
        """The draft's step and catch-up costs of a round that drafted k tokens (observe)."""
        if k >= 2:
            self._step.add(max(timing.draft_s - timing.catchup_s, 0.0) / (k - 1), load)
        steady_catchup = 0 < timing.catchup_tokens <= CATCHUP_STEADY_TOKENS
        if k >= 1 and steady_catchup and not timing.draft_rebuilt:
            self._catchup.add(timing.catchup_s, load)
        elif k >= 1 and timing.catchup_tokens > CATCHUP_STEADY_TOKENS:
            self._catchup_token.add(timing.catchup_s / timing.catchup_tokens, load)

    def may_draft(self, owner: object) -> bool:
        """Whether the request ``owner`` (its KController) may draft at the current load
        (RequestTraffic.draft_load): always alone, or where a steady draft cost at that load is
        measured (a step or a catch-up; a prefill alone does not tell the steps); else only the
        request whose turn it is (RequestTraffic.take_turn). Probes (KController._probe_due) do
        not ask.

        Why: a load not yet measured is priced from lighter ones (at worst the calibration's
        lone costs), and where draft and target share a host the draft costs many times that
        under load. A burst of 8 requests on the AMX Xeon all started drafting at the lone
        price: 8 draft prefills of about 110 tokens beside the target's own, then draft steps
        of 0.3 s against 0.05 s alone, measured only after everyone had paid them (TTFT p50
        6.0 s against 2.0 s at k = 0; auto 0.63x k = 0). One request's round measures the
        load for all the others."""
        load = self.traffic.draft_load()
        if load <= 1:
            return True
        with self._lock:
            if self._step.value(load) is not None or self._catchup.value(load) is not None:
                return True
        return self.traffic.take_turn(owner, load_bucket(load))

    @property
    def draft_step_seconds(self) -> float | None:
        """Seconds of one draft step at the current load (draft_step_at)."""
        return self.draft_step_at(self.traffic.draft_load())

    @property
    def catchup_seconds(self) -> float | None:
        """Seconds of a speculative round's draft catch-up at the current load (catchup_at)."""
        return self.catchup_at(self.traffic.draft_load())

    @property
    def catchup_token_seconds(self) -> float:
        """Seconds per token of a draft catch-up over more than CATCHUP_STEADY_TOKENS tokens (a
        prefill, a rebuild, a return from plain decoding) at the current load
        (catchup_token_at)."""
        return self.catchup_token_at(self.traffic.draft_load())

    # Each draft cost at a load is what was measured at that load; else interpolated between
    # measured loads, the calibration standing for the lone one; else, since a cost does not
    # fall as the load grows, the largest measured at a lighter load (ByLoad.estimate). Priced
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
        the recent batches' (None: RequestTraffic.batch_sessions).

        Raises:
            ValueError: no verify cost is known yet (see ready).
        """
        with self._lock:
            return self._verify_seconds(k, sessions)

    def draft_seconds(self, k: int) -> float:
        """Predicted draft seconds of a round drafting k tokens: 0 for k = 0, else the catch-up
        plus k - 1 draft steps, at RequestTraffic.draft_load (needs ready)."""
        if k == 0:
            return 0.0
        load = self.traffic.draft_load()
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

    def draft_free_round_seconds(self, k: int, sessions: float | None = None) -> float:
        """Predicted seconds of a round that verifies k tokens proposed without the draft model
        (n-gram lookup, specdec.decoding.ngram): the verify (sessions: as for verify_seconds)
        and one call's orchestration, a k = 0 round's (the other kind's until it is measured;
        needs ready)."""
        with self._lock:
            verify = self._verify_seconds(k, sessions)
            overhead = self._overhead[False].value
            if overhead is None:
                overhead = self._overhead[True].value or 0.0
        return max(verify + overhead, 1e-9)

    def _verify_seconds(self, k: int, sessions: float | None = None) -> float:
        sessions = self.traffic.batch_sessions if sessions is None else sessions
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
