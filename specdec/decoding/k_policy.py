"""Choosing k, the number of speculative tokens per round, from measured acceptance and costs.

With per-token acceptance rate a, a round that drafts k tokens commits on average E(k) tokens
(specdec.decoding.acceptance.expected_tokens). KController picks the k in [0, k_max] with the
highest E(k) / cost(k) (specdec.decoding.costs.CostModel.round_seconds); k = 0 is plain target
decoding (E = 1, no draft call).

Under load, when recent verifies shared batches of B > 1 sessions (specdec.decoding.traffic),
E(k) is the mean over the requests in flight: k then maximises the batch's goodput, which falls
to k = 0 when the batch's rows no longer come cheap (vLLM, SmartSpec/TurboSpec do the same; Liu
et al. 2024). A session whose draft must first catch up on many tokens pays that prefill once,
priced by KController.choose for the whole batch it delays; probes of plain-decoding requests
are spread over the batch (KController._probe_due).

With a dynamic draft length, the best fixed k only decides whether speculation pays; the round
then drafts up to k_max tokens and the draft stops on its own confidence, at a floor set by the
marginal cost of one more token (KController.choose).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from specdec.config import SpeculationConfig
from specdec.decoding.acceptance import (
    AcceptanceEstimator,
    ConfidenceCalibration,
    mean_expected_tokens,
)
from specdec.decoding.costs import CATCHUP_STEADY_TOKENS, CostModel, RoundTiming

PROBE_EVERY = 16  # rounds at k = 0 before drafting once to re-measure acceptance (alone)

log = logging.getLogger(__name__)


class RoundPlan(NamedTuple):
    """What one round drafts: at most k tokens, stopping early once the product of the draft's
    probabilities of its tokens falls below min_draft_confidence (0 = never); tokens_per_s:
    the goodput it was chosen at (tokens per second, predicted), None where it was not priced
    (a fixed k, costs not ready, a probe)."""

    k: int
    min_draft_confidence: float = 0.0
    tokens_per_s: float | None = None


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
            acceptance of the costs' recent rounds (RequestTraffic.pooled_acceptance).
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
            self.acceptance = AcceptanceEstimator(self.costs.traffic.pooled_acceptance.rate)

    def choose(self, limit: int, draft_lag: int = 0) -> RoundPlan:
        """The next round's plan, k at most ``limit`` (tokens left before a length stop, minus
        one); ``draft_lag``: committed tokens the draft's cache lacks (its whole sequence before
        its first draft).

        After enough plain rounds in a row (_probe_due), one round drafts k = 1 to re-measure
        this request's acceptance. Otherwise k maximises E(k) / CostModel.round_seconds(k)
        (with pipelined drafting its expectation over hits, _round_seconds).

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

        The batch B a round is priced in is RequestTraffic.batch_load, at least the requests in
        flight: every request in flight shares the target. Under a burst the verify batches
        show the load only a few rounds later; and requests that draft fall out of step, so
        their verifies run in smaller batches, each a forward of its own on the same device.
        Priced at those small batches, drafting looked cheap because drafting had broken the
        batch up: 8 streams on the AMX Xeon went from batches of 8 to 3 sessions, rounds of
        k = 12, and 0.76x the aggregate tokens/s of k = 0. With several target replicas
        in_flight overstates the batch, and the requests draft less than they could.

        In a batch (B > 1), E(k) is the mean over the requests in flight of each one's E(k)
        (RequestTraffic.batch_expected_tokens), not this request's own: every request in flight then
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
        sessions = self.costs.traffic.batch_load
        start_s = self.start_seconds(limit, draft_lag, sessions)
        # Read once, so every k of this choice is priced at the same rates; alone, its own.
        rates = self.costs.traffic.batch_acceptance_rates() if sessions > 1 else None
        rates = rates or [self.acceptance.rate]

        def tokens_per_s(k: int) -> float:
            tokens = mean_expected_tokens(rates, k)
            start = start_s * tokens if k else 0.0
            return tokens / (self._round_seconds(k, sessions, rates) + start)

        best = max(range(cap + 1), key=tokens_per_s)
        if log.isEnabledFor(logging.DEBUG):
            self._log_choice(best, cap, draft_lag, sessions, start_s, tokens_per_s)
        if best and not self.costs.may_draft(self):
            log.debug("k=0: another request is measuring the draft at this load")
            return RoundPlan(0, tokens_per_s=tokens_per_s(0))
        best_rate = tokens_per_s(best)
        if not self.config.dynamic_draft_length or best == 0:
            return RoundPlan(best, tokens_per_s=best_rate)
        longest, marginal_s = self._dynamic_length(best, cap, sessions, best_rate)
        floor = min(marginal_s * best_rate, 1.0)
        return RoundPlan(longest, self.confidence.raw_floor(floor), best_rate)

    def start_seconds(self, limit: int, draft_lag: int, sessions: float) -> float:
        """Seconds per token left that the draft's catch-up on ``draft_lag`` tokens adds before
        its first draft (choose): P x ``sessions`` / (``limit`` + 1), P = draft_lag x
        catchup_token_seconds; 0 for a lag of at most CATCHUP_STEADY_TOKENS (a steady
        catch-up, priced in every round)."""
        if draft_lag <= CATCHUP_STEADY_TOKENS:
            return 0.0
        per_token = self.costs.catchup_token_seconds
        return draft_lag * per_token * sessions / (max(limit, 0) + 1)

    def _round_seconds(self, k: int, sessions: float, rates: Sequence[float]) -> float:
        """CostModel.round_seconds(k), or with pipelined drafting its expectation: a round is a
        hit (its tokens drafted during the last verify, no draft call of its own: priced as
        draft_free_round_seconds) when the round before it, drafting k too, was accepted whole
        and the draft guessed its bonus token, about rate^(k + 1) (the guess taken as likely as
        an accepted token)."""
        full = self.costs.round_seconds(k, sessions)
        if not (self.config.pipelined_drafting and k):
            return full
        hit = sum(rate ** (k + 1) for rate in rates) / len(rates)
        return full - hit * (full - self.costs.draft_free_round_seconds(k, sessions))

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
            costs.traffic.in_flight,
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
        sessions = max(1, round(self.costs.traffic.batch_load))
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
        the acceptance and the confidence calibration for this request, the costs for all. A
        round of k tokens from n-gram lookup (timing.draft_free) gives only its costs
        (_observe_draft_free)."""
        if timing.draft_free:
            self._observe_draft_free(k, timing)
            return
        self._plain_rounds = self._plain_rounds + 1 if k == 0 else 0
        if k == 0:
            self.costs.traffic.release_turn(self)
        self.acceptance.observe(k, num_accepted)
        self.costs.traffic.pooled_acceptance.observe(k, num_accepted)
        self.confidence.observe(confidences, num_accepted)
        self.costs.observe(k, timing)

    def _observe_draft_free(self, k: int, timing: RoundTiming) -> None:
        """A round of k tokens from n-gram lookup: a plain round for the draft (its probes and
        turns), a verify of k for the costs; the draft's acceptance learns nothing from it."""
        self._plain_rounds += 1
        self.costs.traffic.release_turn(self)
        self.costs.observe(k, timing)
