"""Forcing the adaptive controller's round plans and mixed rounds, for tests that need a kind
of round whose choice would otherwise depend on measured costs."""

from __future__ import annotations

from collections.abc import Callable

from specdec.decoding.k_policy import KController, RoundPlan
from specdec.decoding.proposers import NGRAM, NONE, Proposal


def confidence_stop_choose(k: int, floor: float) -> Callable:
    """A replacement for KController.choose: every adaptive (k "auto") round drafts up to ``k``
    tokens and stops on the draft's confidence at ``floor`` (the controller would choose both
    from measured costs); target-only and fixed-k requests stay as they are."""
    adaptive_choose = KController.choose

    def choose(self, limit, draft_lag=0):
        if self.fixed_k is not None:
            return adaptive_choose(self, limit, draft_lag)
        return RoundPlan(max(0, min(k, limit)), floor)

    return choose


def unpriced_tail(tokens: int) -> Callable:
    """A replacement for ProposerChoice.tail: every round that drafts verifies up to ``tokens``
    tokens of n-gram lookup after the draft model's wherever lookup matches (the real tail is
    priced, and on the tiny pairs often not worth it)."""

    def tail(self, drafts, confidences, limit):
        found, n = self.ngrams.propose(min(tokens, limit - len(drafts)), after=drafts)
        if not found:
            return Proposal(NONE, RoundPlan(0))
        return Proposal(NGRAM, RoundPlan(len(found)), tuple(found), n)

    return tail
