"""Who proposes a round's tokens: the draft model, n-gram lookup, or nobody (k = 0).

A request's ``proposer`` (specdec.config.PROPOSERS) bounds the choice:

- ``none``: every round verifies one position (plain target decoding).
- ``ngram``: n-gram lookup only (specdec.decoding.ngram); the draft model is never called.
- ``draft``: the draft model, as KController plans it; n-gram lookup only while the draft side
  cannot be called (down, slow, or its prefill still running).
- ``auto``: each round, the best of the draft's plan (KController: its k, priced at the draft's
  measured acceptance and costs) and the n-gram proposal (its length m, priced at the measured
  acceptance of n-gram proposals that matched as long an n-gram, for a verify of m tokens and
  one call); a k = 0 plan is among them. A fixed ``num_speculative_tokens`` drafts that many
  with the draft model, as under ``draft``.

Under ``auto``, a round that drafts may also be mixed: after the draft model's tokens comes a
tail of n-gram lookup continuing the text and those drafts (``tail``), verified in the same
forward. The tail counts only if every draft token is accepted, so it is priced at the
calibrated probability of that (ConfidenceCalibration.block_acceptance) and at what its tokens
add to the verify: where the verify pads to a fixed width (half precision), a tail that fits in
the padding costs nothing. Either way the draft model's cache catches up on the committed
tokens it missed at its next call (KController prices that catch-up).

Under ``auto`` the draft's start (its catch-up on a lag of more than a steady round's tokens:
its prompt's prefill, before its first draft) must pay for itself against what this request's
rounds without the draft deliver (before it has a few, the router's recent ones), not only
against k = 0 (``_start_pays``). A draft that would start, on a probe too, is left out where its
rounds cannot repay the start over the tokens left. Measured case: on Spec-Bench summaries
(420-1150-token prompts) on an AVX2-only EPYC, lookup committed most tokens, and each request
paid the draft's whole prefill (6.6-10.5 s), in its first round or in its k = 1 probe after 16
rounds without the draft, for a handful of draft tokens; ``auto`` ran at 0.86x ``ngram``.

The acceptance of n-gram proposals is estimated per request and per matched n-gram length (a
4-gram match predicts its continuation better than a 2-gram one), each from a prior that is
the pooled acceptance of every request's n-gram rounds on this router
(RequestTraffic.pooled_ngram_acceptance).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from specdec.config import AUTO
from specdec.decoding.acceptance import (
    AcceptanceEstimator,
    DraftFreeRounds,
    DraftFreeSummary,
    expected_tokens,
)
from specdec.decoding.costs import CostModel
from specdec.decoding.k_policy import KController, RoundPlan
from specdec.decoding.ngram import RequestNgrams

DRAFT, NGRAM, NONE = "draft", "ngram", "none"
# Rounds in a row that pass over an n-gram match before one is verified anyway (a probe).
NGRAM_PROBE_EVERY = 16
# Rounds without the draft model after which a request's own (DraftFreeRounds) replace the
# router's pooled ones in _start_pays.
OWN_DRAFT_FREE_ROUNDS = 3


class Proposal(NamedTuple):
    """One round's choice.

    Attributes:
        source: DRAFT (call the draft model with ``plan``), NGRAM (verify ``tokens``), or NONE
            (verify nothing: k = 0).
        plan: the draft's plan (its k and confidence floor); for NGRAM and NONE, k is the
            number of tokens proposed.
        tokens: the n-gram proposal (NGRAM only).
        ngram_n: the length of the n-gram it matched (NGRAM only).
        without_draft: the round would have called the draft model but could not (the draft
            side unavailable): it counts in rounds_without_draft.
    """

    source: str
    plan: RoundPlan
    tokens: tuple[int, ...] = ()
    ngram_n: int = 0
    without_draft: bool = False


class ProposerChoice:
    """Chooses each round's proposer for one request (module docstring).

    Args:
        proposer: the request's proposer (specdec.config.PROPOSERS).
        controller: the request's KController (the draft's plan, the costs).
        ngrams: the request's n-gram lookup.
    """

    def __init__(self, proposer: str, controller: KController, ngrams: RequestNgrams) -> None:
        self.proposer = proposer
        self._controller = controller
        self._ngrams = ngrams
        self._ngram_acceptance: dict[int, AcceptanceEstimator] = {}
        self._ngram_passed = 0  # rounds in a row whose n-gram match went unverified
        self._draft_free = DraftFreeRounds()  # this request's rounds without the draft

    @property
    def uses_draft(self) -> bool:
        """Whether this request may call the draft model at all."""
        return self.proposer in (AUTO, DRAFT) and self._controller.fixed_k != 0

    @property
    def costs(self) -> CostModel:
        return self._controller.costs

    @property
    def ngrams(self) -> RequestNgrams:
        """The request's n-gram lookup."""
        return self._ngrams

    def choose(
        self, limit: int, draft_lag: int, draft_available: bool, draft_ready: bool
    ) -> Proposal:
        """The next round's proposal.

        Args:
            limit: tokens left before a length stop, minus one (the most a round may propose).
            draft_lag: committed tokens the draft's cache lacks (KController.choose).
            draft_available: the draft side answers (specdec.decoding.degrade).
            draft_ready: this request's draft may be called now (its prefill has ended).
        """
        controller = self._controller
        cap, fixed = self._cap(limit), controller.fixed_k is not None
        if self.proposer == NONE or cap == 0:
            return Proposal(NONE, RoundPlan(0))
        if self.proposer == NGRAM:
            return self._ngram_or_none(cap)
        plan = controller.choose(limit, draft_lag=draft_lag)
        only_draft = self.proposer == DRAFT or fixed
        if plan.k == 0 and only_draft:
            return Proposal(NONE, plan)
        if not (draft_available and draft_ready):
            # The draft cannot be called now: n-gram lookup stands in for it.
            fallback = self._ngram_or_none(cap)
            return fallback._replace(without_draft=plan.k > 0 and not draft_available)
        drafted = Proposal(DRAFT if plan.k else NONE, plan)
        if not only_draft and plan.k and not self._start_pays(plan, limit, draft_lag):
            return self._ngram_or_none(cap)
        if only_draft or plan.tokens_per_s is None and plan.k:
            return drafted  # a fixed k; or the draft's plan was not priced (a probe, no costs)
        ngram = self._ngram_or_none(cap, probe=True)
        rate = ngram.plan.tokens_per_s
        if ngram.source == NGRAM and (rate is None or rate > (plan.tokens_per_s or 0.0)):
            self._ngram_passed = 0
            return ngram
        self._ngram_passed += ngram.source == NGRAM
        return drafted

    def tail(self, drafts: Sequence[int], confidences: Sequence[float], limit: int) -> Proposal:
        """The n-gram tail of a mixed round (module docstring): the tokens lookup proposes
        after the draft model's ``drafts`` (their draft probabilities ``confidences``, as the
        draft reported them; empty: priced at the request's acceptance rate), cut to the length
        t that maximises the round's predicted goodput

            (E(k) + P(all k accepted) x (E_ngram(t) - 1)) / (round(k) + verify(k + t) - verify(k))

        with E(k) the expected tokens of the k drafts, E_ngram(t) those of a t-token lookup
        proposal at its measured acceptance (its own estimator per matched n, as for a whole
        n-gram round). Under load verify(k + t) prices t more rows for every session of the
        batch, an overestimate that only makes tails rarer. NONE for t = 0, and always outside
        ``auto``, under a fixed k (it drafts exactly k), before the costs are known, and with
        SpeculationConfig.mixed_rounds off.

        Args:
            drafts: the draft model's k tokens of this round.
            confidences: their draft probabilities (ProposeResponse.confidences).
            limit: as for choose.
        """
        none = Proposal(NONE, RoundPlan(0))
        controller, costs, k = self._controller, self.costs, len(drafts)
        room = self._cap(limit) - k
        adaptive_auto = self.proposer == AUTO and controller.fixed_k is None
        if not (adaptive_auto and controller.config.mixed_rounds and k and room > 0):
            return none
        if not costs.ready:
            return none
        tokens, n = self._ngrams.propose(room, after=drafts)
        if not tokens:
            return none
        sessions, rate = costs.traffic.batch_load, controller.acceptance.rate
        reach = (
            controller.confidence.block_acceptance(confidences)
            if len(confidences) == k
            else rate**k
        )
        drafted_tokens, round_s = expected_tokens(rate, k), costs.round_seconds(k, sessions)
        verify = [costs.verify_seconds(k + t, sessions) for t in range(len(tokens) + 1)]
        tail_rate = self._acceptance(n).rate

        def tokens_per_s(t: int) -> float:
            gained = reach * (expected_tokens(tail_rate, t) - 1.0)
            return (drafted_tokens + gained) / (round_s + max(verify[t] - verify[0], 0.0))

        best = max(range(len(tokens) + 1), key=tokens_per_s)
        if best == 0:
            return none
        return Proposal(
            NGRAM, RoundPlan(best, tokens_per_s=tokens_per_s(best)), tuple(tokens[:best]), n
        )

    def _start_pays(self, plan: RoundPlan, limit: int, draft_lag: int) -> bool:
        """Whether a round of ``plan`` (k > 0) under ``auto`` may start the draft: its catch-up
        on ``draft_lag`` tokens, KController.start_seconds per token left, is at most what the
        draft's rounds save per token over this request's rounds without it
        (_seconds_saved), the draft priced at the plan's own rate less that
        start, or, for an unpriced plan (a probe, which re-measures the acceptance), at its
        best: every token of the k <= cap of the fewest seconds per token accepted. Always
        true for a steady lag, without n-gram rounds and before the costs are known: without
        n-gram rounds the choice of k already weighs the start against k = 0 alone
        (KController.choose). The rounds are the request's own once it has
        OWN_DRAFT_FREE_ROUNDS, before that the router's recent ones (RequestTraffic.
        pooled_draft_free): the choice at a request's first round, where its prompt's
        prefill is at stake, is then made on its neighbours' lookup."""
        costs = self.costs
        sessions = costs.traffic.batch_load
        start_s = self._controller.start_seconds(limit, draft_lag, sessions)  # 0: steady lag
        if start_s <= 0.0 or not costs.ready:
            return True
        if plan.tokens_per_s is None:
            ks = range(1, self._cap(limit) + 1)
            draft_s = min(costs.round_seconds(k, sessions) / (k + 1) for k in ks)
        else:
            draft_s = 1.0 / plan.tokens_per_s - start_s
        own = self._draft_free
        rounds = own if own.rounds >= OWN_DRAFT_FREE_ROUNDS else costs.traffic.pooled_draft_free
        summary = rounds.summary()
        return summary is None or start_s <= self._seconds_saved(summary, draft_s, sessions)

    def _seconds_saved(self, rounds: DraftFreeSummary, draft_s: float, sessions: float) -> float:
        """Seconds per token that rounds of the draft model at ``draft_s`` seconds per token
        save over ``rounds`` (rounds without it), each kind of round replaced where the draft
        is faster: g x max(t_ngram - draft_s, 0) + (1 - g) x max(t_0 - draft_s, 0), g their
        tokens' n-gram share, t_ngram the seconds per token of an n-gram round (its mean
        proposal's verify and one call, CostModel.draft_free_round_seconds, over its mean
        committed tokens), t_0 a k = 0 round's, both priced for a batch of ``sessions``."""
        costs, share = self.costs, rounds.ngram_share
        proposed = max(1, round(rounds.ngram_proposed))
        ngram_s = costs.draft_free_round_seconds(proposed, sessions) / max(
            rounds.ngram_committed, 1.0
        )
        plain_s = costs.round_seconds(0, sessions)
        return share * max(ngram_s - draft_s, 0.0) + (1 - share) * max(plain_s - draft_s, 0.0)

    def fallback(self, limit: int) -> Proposal:
        """The round's proposal when its draft call failed: n-gram lookup's, or NONE."""
        return self._ngram_or_none(self._cap(limit))

    def _cap(self, limit: int) -> int:
        """The most tokens a round may propose: k_max, the request's fixed k, ``limit``."""
        cap = max(0, min(limit, self._controller.config.max_speculative_tokens))
        fixed_k = self._controller.fixed_k
        return cap if fixed_k is None else min(cap, fixed_k)

    def _ngram_or_none(self, cap: int, probe: bool = False) -> Proposal:
        """The n-gram proposal cut to the length m <= cap of the highest predicted goodput,
        where m = 0 (NONE) is one choice (all of it under a fixed k, as the draft drafts exactly
        k, and where costs are not ready yet); NONE without a match.

        A request whose n-gram proposals are priced below k = 0 (or, with ``probe``, below the
        draft's plan) for NGRAM_PROBE_EVERY rounds in a row verifies its next one anyway, so
        that a low estimate, its own or the pooled prior it started from, can recover.
        Without it a router whose first requests were chat would never try n-gram lookup on a
        later summary."""
        tokens, n = self._ngrams.propose(cap)
        if not tokens:
            return Proposal(NONE, RoundPlan(0))
        costs = self.costs
        fixed = self._controller.fixed_k is not None  # a fixed k: all of it, as the draft
        if fixed or not costs.ready or self._ngram_passed >= NGRAM_PROBE_EVERY:
            return Proposal(NGRAM, RoundPlan(len(tokens)), tuple(tokens), n)
        rate = self._acceptance(n).rate
        sessions = costs.traffic.batch_load

        def tokens_per_s(m: int) -> float:
            return expected_tokens(rate, m) / costs.draft_free_round_seconds(m, sessions)

        best = max(range(len(tokens) + 1), key=tokens_per_s)
        if best == 0 and not probe:
            self._ngram_passed += 1
            return Proposal(NONE, RoundPlan(0, tokens_per_s=tokens_per_s(0)))
        best = max(best, 1)
        return Proposal(
            NGRAM, RoundPlan(best, tokens_per_s=tokens_per_s(best)), tuple(tokens[:best]), n
        )

    def _acceptance(self, n: int) -> AcceptanceEstimator:
        estimator = self._ngram_acceptance.get(n)
        if estimator is None:
            pooled = self.costs.traffic.pooled_ngram_acceptance.rate
            estimator = self._ngram_acceptance[n] = AcceptanceEstimator(pooled)
        return estimator

    def observe_ngram(self, proposal: Proposal, num_accepted: int, tail: bool = False) -> None:
        """Records how many tokens of an NGRAM proposal the target accepted: a whole round's,
        or a mixed round's ``tail``."""
        k = len(proposal.tokens)
        self._ngram_passed = 0
        self._acceptance(proposal.ngram_n).observe(k, num_accepted)
        self.costs.traffic.pooled_ngram_acceptance.observe(k, num_accepted)
        if not tail:
            self._observe_draft_free(k, num_accepted + 1)

    def observe_plain(self) -> None:
        """Records a round that proposed nothing (k = 0: one token committed), where lookup
        was consulted: a k = 0 round of ``auto`` or ``ngram``. A request that asked for k = 0
        (``none``, a fixed k of 0), or drafts with the model only, is no sample of what rounds
        without the draft deliver: counted, benchmarks' k = 0 requests between ``auto`` ones
        made every pooled round a plain one."""
        fixed_k = self._controller.fixed_k
        if (self.proposer == AUTO and fixed_k is None) or (self.proposer == NGRAM and fixed_k != 0):
            self._observe_draft_free(0, 1)

    def _observe_draft_free(self, proposed: int, committed: int) -> None:
        self._draft_free.observe(proposed, committed)
        self.costs.traffic.pooled_draft_free.observe(proposed, committed)
