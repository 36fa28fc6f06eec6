"""Robust cost estimates: the median of a window of recent samples, kept per load.

A cost shared by every request of an engine or router is estimated robustly: the median of its
last WINDOW samples younger than MAX_AGE_S (WindowMedian); the draft's costs are kept per load
(ByLoad), WINDOW samples per session of a draft batch at that load, each of which reports the
batch's time. A load not yet measured costs at least what lighter ones measured.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable

# Samples per cost estimate. The median of 15 ignores up to 7 arbitrary samples among the last 15
# and follows a real change of level (load, longer contexts) after 8 samples.
WINDOW = 15
# A cost sample counts this long; past it an estimate falls back to the prior (the replicas'
# calibration) and lighter loads until measured again. Costs measured under load (batches of
# prefills on the draft, contention on a shared host) are many times the lone ones, and a request
# that then decodes plain never measures the draft again: with them kept, one busy minute stopped
# speculation for every later request (a lone request after 8 concurrent ones drafted 3 tokens
# in 62). A loaded router that decodes plain measures no draft step either; when its costs
# expire, one request drafts to measure them again (CostModel.may_draft).
MAX_AGE_S = 30.0
# The draft's costs are kept per load: 1, 2, 3-5, 6+ requests in flight on this router
# (RequestTraffic.draft_load). Under load a draft batch carries other
# sessions' catch-ups and prefills, and on a shared host competes with the target's batches: a
# draft step measured at 8 sessions was 0.38 s against 0.05 s alone. One estimate for both
# either stopped speculation alone or kept it on under load, where it did not pay; kept apart,
# each load decides from its own measurements. The verify batch alone does not tell the load:
# requests out of step verify one at a time while the others draft, and their draft steps
# (0.21 s against 0.04 s alone) then priced the last request of a burst, alone, as loaded.
LOAD_BUCKETS = 4


class WindowMedian:
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


def load_bucket(sessions: float) -> int:
    """0 for a lone session, 1 for about 2 per batch, 2 for 3-5, 3 for 6 or more."""
    return min(round(math.log2(max(sessions, 1.0))), LOAD_BUCKETS - 1)


class ByLoad:
    """One WindowMedian per load bucket (load_bucket of RequestTraffic.draft_load), of WINDOW
    samples per session a draft batch holds at that load (1, 2, 4, 8).

    Why per session: every session of a draft batch reports the batch's time, so at 8 in
    flight one batch gives 8 equal samples. With WINDOW samples, one slow batch was the median:
    at 8 streams on the AMX Xeon one batch's steps of 0.15 s replaced 0.07 s, every request
    then decoded plain, and plain rounds measure no draft step, so the estimate stood until it
    expired 30 s later (auto 1.04x k = 0, against 1.27-1.41x in runs without such a batch).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._windows = [WindowMedian(clock, WINDOW * 2**b) for b in range(LOAD_BUCKETS)]

    def add(self, sample: float, sessions: float) -> None:
        self._windows[load_bucket(sessions)].add(sample)

    def value(self, sessions: float) -> float | None:
        return self._windows[load_bucket(sessions)].value

    def estimate(self, sessions: float, prior: float | None) -> float | None:
        """The value at this load: measured there; else, between two measured loads (the
        prior stands for the lone load until it is measured), interpolated on log load
        (geometrically: the buckets are powers of two); else the largest of the lighter loads'
        values, since a cost does not fall as the load grows; else the nearest heavier load's;
        else None."""
        bucket = load_bucket(sessions)
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
