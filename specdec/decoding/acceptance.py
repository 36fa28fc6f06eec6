"""The acceptance rate a, and what it predicts: the tokens a round commits.

With per-token acceptance rate a, a round that drafts k tokens commits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al. 2023, equation 1; expected_tokens).
Acceptance is per request (AcceptanceEstimator, one per KController), starting from the pooled
acceptance of the router's recent rounds (PooledAcceptance, empirical Bayes) so that one unlucky
first round does not turn a request plain. The draft's own confidence in its tokens predicts
their acceptance once calibrated to the request (ConfidenceCalibration): the dynamic draft
length stops a round on it.
"""

from __future__ import annotations

import collections
import math
import statistics
import threading
from collections.abc import Sequence
from typing import NamedTuple

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
# Per-round forgetting of a request's DraftFreeRounds: about its last 20 rounds without the
# draft (a router's pooled ones forget at POOL_DECAY).
DRAFT_FREE_DECAY = 0.95
# The confidence stop's calibration (ConfidenceCalibration): the drafted tokens it fits on, the
# fewest it trusts, and the range of its exponent.
CONFIDENCE_WINDOW = 256
CONFIDENCE_MIN_TOKENS = 16
EXPONENT_RANGE = (0.05, 4.0)


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

    def block_acceptance(self, confidences: Sequence[float]) -> float:
        """The calibrated probability that the target accepts a whole drafted block whose
        tokens had the draft probabilities ``confidences``: prod(p_i)^g (1 for no tokens)."""
        product = math.prod(min(max(float(p), 1e-9), 1.0) for p in confidences)
        return product**self.exponent

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


class DraftFreeSummary(NamedTuple):
    """What rounds without the draft committed (DraftFreeRounds.summary).

    Attributes:
        ngram_share: the share g of their tokens that n-gram rounds committed (the rest: k = 0
            rounds).
        ngram_proposed: tokens an n-gram round proposed, on average.
        ngram_committed: tokens an n-gram round committed, on average (its accepted ones and
            the target's next).
    """

    ngram_share: float
    ngram_proposed: float
    ngram_committed: float


class DraftFreeRounds:
    """What rounds without the draft model commit, one request's or (pooled) a router's:
    n-gram rounds (their tokens, proposed and committed) and k = 0 rounds (one token each),
    recent rounds weighing more (``decay`` a round; thread-safe).

    specdec.decoding.proposers weighs the draft's start against them (ProposerChoice.
    _start_pays)."""

    def __init__(self, decay: float = DRAFT_FREE_DECAY) -> None:
        self._lock = threading.Lock()
        self._decay = decay
        self._ngram_rounds = self._proposed = self._ngram_tokens = self._plain_tokens = 0.0
        self._count = 0

    @property
    def rounds(self) -> int:
        """How many rounds were recorded."""
        with self._lock:
            return self._count

    def observe(self, proposed: int, committed: int) -> None:
        """A round without the draft: ``proposed`` n-gram tokens (0: a k = 0 round), of which
        ``committed`` tokens were committed (its accepted ones and the target's next)."""
        with self._lock:
            self._count += 1
            decay = self._decay
            self._ngram_rounds *= decay
            self._proposed *= decay
            self._ngram_tokens *= decay
            self._plain_tokens *= decay
            if proposed:
                self._ngram_rounds += 1.0
                self._proposed += proposed
                self._ngram_tokens += committed
            else:
                self._plain_tokens += committed

    def summary(self) -> DraftFreeSummary | None:
        """The recorded rounds in brief; None before any n-gram round."""
        with self._lock:
            if self._ngram_rounds <= 0.0:
                return None
            return DraftFreeSummary(
                ngram_share=self._ngram_tokens / (self._ngram_tokens + self._plain_tokens),
                ngram_proposed=self._proposed / self._ngram_rounds,
                ngram_committed=self._ngram_tokens / self._ngram_rounds,
            )
