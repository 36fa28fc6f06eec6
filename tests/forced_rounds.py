"""Forcing the adaptive controller's round plans, for tests that need both draft lengths."""

from __future__ import annotations

from collections.abc import Callable

from specdec.decoding.k_policy import KController, RoundPlan


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
