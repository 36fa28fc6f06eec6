"""Choosing k, the number of speculative tokens per round, from measured acceptance and costs.

With per-token acceptance rate a, a round that drafts k tokens commits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al. 2023, equation 1). Its cost is the draft
time for k tokens, one target verify over k + 1 positions, and the round's orchestration. The
controller picks the k in [0, k_max] with the highest E(k) / cost(k); k = 0 is plain target
decoding (E = 1, no draft call). Verify cost is measured for each k separately, because it is not
flat in k on every machine (DESIGN.md, "Speed").

With a dynamic draft length, that best fixed k only decides whether speculation pays; the round
then drafts up to k_max tokens and the draft stops on its own confidence, at a floor set by the
marginal cost of one more token (KController.choose).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

from specdec.config import SpeculationConfig

EMA_WEIGHT = 0.2  # weight of a new cost sample
ACCEPTANCE_DECAY = 0.9  # per-round forgetting of the acceptance counts
PRIOR_ACCEPTED = 1.5  # pseudo-counts: an acceptance rate of 0.6 before any round
PRIOR_REJECTED = 1.0
PROBE_EVERY = 16  # rounds at k = 0 before drafting once to re-measure acceptance


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): tokens committed by a round drafting k tokens."""
    a = min(max(acceptance_rate, 0.0), 1.0)
    if a > 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class CostModel:
    """Measured per-round costs, shared by all requests of one engine or router (thread-safe).

    Keeps an exponential moving average of the draft time per drafted token, of the verify time
    for each k in [0, config.max_speculative_tokens], and of the orchestration overhead of
    speculative (k > 0) and plain rounds.
    """

    def __init__(self, config: SpeculationConfig) -> None:
        self._lock = threading.Lock()
        self._draft_per_token: float | None = None
        self._verify: list[float | None] = [None] * (config.max_speculative_tokens + 1)
        self._overhead: dict[bool, float] = {}

    def observe(self, k: int, draft_s: float, verify_s: float, overhead_s: float) -> None:
        """Records one round: k drafted tokens, draft and verify compute, and the rest (seconds)."""
        with self._lock:
            if k > 0:
                self._draft_per_token = _ema(self._draft_per_token, draft_s / k)
            self._verify[k] = _ema(self._verify[k], verify_s)
            self._overhead[k > 0] = _ema(self._overhead.get(k > 0), max(overhead_s, 0.0))

    @property
    def draft_seconds_per_token(self) -> float:
        """Measured draft time per drafted token, seconds (0 before any round drafted)."""
        return self._draft_per_token or 0.0

    @property
    def measured(self) -> bool:
        return any(v is not None for v in self._verify)

    def verify_seconds(self, k: int) -> float:
        """Predicted seconds of a verify over k draft tokens (interpolated as round_seconds)."""
        with self._lock:
            return _interpolate(self._verify, k)

    def round_seconds(self, k: int) -> float:
        """Predicted seconds of a round drafting k tokens (needs at least one observation).

        An unmeasured verify cost is interpolated between the nearest measured k on each side,
        or taken from the nearest one beyond the measured range: an optimistic guess for larger
        k, which the controller then measures and corrects.
        """
        with self._lock:
            verify = _interpolate(self._verify, k)
            overhead = self._overhead.get(k > 0, self._overhead.get(k == 0, 0.0))
            draft = k * (self._draft_per_token or 0.0)
        return max(draft + verify + overhead, 1e-9)


class AcceptanceEstimator:
    """Per-request acceptance rate, by maximum likelihood under i.i.d. acceptance.

    A round that accepts n of k draft tokens contributes n acceptances and, if n < k, one
    rejection; a = accepted / (accepted + rejected), with old rounds decayed and a weak prior.
    """

    def __init__(self) -> None:
        self._accepted = PRIOR_ACCEPTED
        self._rejected = PRIOR_REJECTED

    def observe(self, k: int, num_accepted: int) -> None:
        if k == 0:
            return
        self._accepted = self._accepted * ACCEPTANCE_DECAY + num_accepted
        self._rejected = self._rejected * ACCEPTANCE_DECAY + (num_accepted < k)

    @property
    def rate(self) -> float:
        return self._accepted / (self._accepted + self._rejected)


class RoundPlan(NamedTuple):
    """What one round drafts: at most k tokens, stopping early once the product of the draft's
    probabilities of its tokens falls below min_draft_confidence (0 = never)."""

    k: int
    min_draft_confidence: float = 0.0


@dataclasses.dataclass
class KController:
    """Picks k, and the draft's confidence stop, for each round of one request.

    Args:
        costs: the shared CostModel.
        config: k is at most its max_speculative_tokens (k_max); with its dynamic_draft_length,
            when speculation pays the round drafts up to k_max tokens and the draft stops on its
            confidence (RoundPlan.min_draft_confidence) instead of drafting a fixed k.
        fixed_k: use this k every round (still capped by ``limit``), no confidence stop;
            None = adaptive.
        initial_k: k of the first rounds, before any cost is measured.
    """

    costs: CostModel
    config: SpeculationConfig
    fixed_k: int | None = None
    initial_k: int = 4
    acceptance: AcceptanceEstimator = dataclasses.field(default_factory=AcceptanceEstimator)
    _plain_rounds: int = 0

    def choose(self, limit: int) -> RoundPlan:
        """The next round's plan, k at most ``limit`` (tokens left before a length stop, minus
        one).

        Its ``min_draft_confidence`` is 0, or with a dynamic draft length the marginal rule.
        Drafting one more token costs its draft step plus what it adds to the verify, and commits
        one more token with about the probability that the draft's block so far is accepted, the
        product of its confidences (an upper estimate: the new token must be accepted too); that
        pays while the product exceeds that marginal cost x the predicted tokens per second of
        the best fixed k. With a fixed-width verify (half precision) the verify adds nothing;
        where it grows with k (float32 on a CPU) it raises the floor.
        """
        cap = max(0, min(self.config.max_speculative_tokens, limit))
        if self.fixed_k is not None:
            return RoundPlan(min(self.fixed_k, cap))
        draft_s = self.costs.draft_seconds_per_token
        if not self.costs.measured or draft_s == 0.0:  # no round (or no draft step) measured yet
            return RoundPlan(min(self.initial_k, cap))
        if self._plain_rounds >= PROBE_EVERY:
            return RoundPlan(min(1, cap))
        rate = self.acceptance.rate

        def tokens_per_s(k: int) -> float:
            return expected_tokens(rate, k) / self.costs.round_seconds(k)

        best = max(range(cap + 1), key=tokens_per_s)
        if not self.config.dynamic_draft_length or best == 0:
            return RoundPlan(best)
        verify_s = 0.0
        if cap > best:
            added = self.costs.verify_seconds(cap) - self.costs.verify_seconds(best)
            verify_s = max(added, 0.0) / (cap - best)
        return RoundPlan(cap, min((draft_s + verify_s) * tokens_per_s(best), 1.0))

    def observe(
        self, k: int, num_accepted: int, draft_s: float, verify_s: float, overhead_s: float
    ) -> None:
        """Records a round that drafted k tokens (after any confidence stop)."""
        self._plain_rounds = self._plain_rounds + 1 if k == 0 else 0
        self.acceptance.observe(k, num_accepted)
        self.costs.observe(k, draft_s, verify_s, overhead_s)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - EMA_WEIGHT) * old + EMA_WEIGHT * new


def _interpolate(table: list[float | None], k: int) -> float:
    if table[k] is not None:
        return table[k]
    below = next(((i, table[i]) for i in range(k - 1, -1, -1) if table[i] is not None), None)
    above = next(((i, table[i]) for i in range(k + 1, len(table)) if table[i] is not None), None)
    if below and above:
        (i0, v0), (i1, v1) = below, above
        return v0 + (v1 - v0) * (k - i0) / (i1 - i0)
    return (below or above)[1]
