"""Degrade, never fail, for speed: whether rounds may call the draft side right now.

The draft side is an optimisation. When a propose fails (any error: a dead node, replicas
restarting, a call past its timeout), the request that saw it goes on with k = 0, which is still
exact (the target alone), and every request of the same router stops calling the draft for a
while, so that none of them waits on a draft that is not there. The draft is then checked again
after ``retry_s`` seconds, doubling after each failed check up to ``max_retry_s``: it is a
circuit breaker (closed: speculate; open: target only; a check: half-open).

A check is either a cheap ``probe`` (the router asks a draft replica for its model info, in the
background, so no request's round waits on it) or, without one, the next round's propose itself
(the in-process engine, whose draft lives in the same process).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# The longest wait between two checks of a failed draft side, seconds.
MAX_RETRY_S = 30.0


class DraftAvailability:
    """A circuit breaker on the draft side, shared by all requests of one router or engine.

    Args:
        retry_s: seconds from a failure to the first check, > 0; doubled after each failed
            check, up to ``max_retry_s``, and reset by a successful propose.
        probe: optional async check (raises when the draft cannot answer); it runs in the
            background and bounds itself in time (the caller wraps it in a timeout).
        on_change: called with True / False whenever the draft becomes available / unavailable
            (the router's gauge).
        max_retry_s: the longest wait between two checks, seconds.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        retry_s: float = 1.0,
        probe: Callable[[], Awaitable[object]] | None = None,
        on_change: Callable[[bool], None] | None = None,
        max_retry_s: float = MAX_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_s > 0:
            raise ValueError(f"retry_s must be > 0 seconds, got {retry_s}")
        self._retry_s = retry_s
        self._max_retry_s = max(max_retry_s, retry_s)
        self._probe = probe
        self._on_change = on_change or (lambda available: None)
        self._clock = clock
        self._down = False
        self._delay = retry_s
        self._unresolved = False  # a failure not yet followed by a successful propose
        self._check_at = 0.0
        self._probing: asyncio.Future | None = None
        self.failures = 0

    @property
    def down(self) -> bool:
        """Whether the draft side is currently taken as unavailable."""
        return self._down

    @property
    def retry_delay_s(self) -> float:
        """Seconds between the last failure and the next check."""
        return self._delay

    def available(self) -> bool:
        """Whether the next round may call the draft. While down: False until the check is
        due; then, without a probe, the draft is tried again (True: this round's propose is
        the check), and with one the probe starts in the background (this round still goes
        without the draft)."""
        if not self._down:
            return True
        if self._clock() < self._check_at or self._probing is not None:
            return False
        if self._probe is None:
            self._up()
            return True
        self._probing = asyncio.ensure_future(self._run_probe())
        return False

    def failed(self, err: BaseException) -> None:
        """A propose failed: the draft is down until the next check. Failures while it is down
        are calls of the same incident and change nothing; a failure after a check let the
        draft back (before any propose succeeded) doubles the wait."""
        self.failures += 1
        if self._down:
            return
        if self._unresolved:
            self._delay = min(self._delay * 2, self._max_retry_s)
        self._unresolved = True
        self._down = True
        log.warning(
            "draft side unavailable (%s: %s); rounds run on the target alone, next check in %.3g s",
            type(err).__name__,
            err,
            self._delay,
        )
        self._on_change(False)
        self._check_at = self._clock() + self._delay

    def succeeded(self) -> None:
        """A propose answered: the draft is available and the next failure waits retry_s."""
        self._unresolved = False
        self._delay = self._retry_s
        self._up()

    def _up(self) -> None:
        if self._down:
            self._down = False
            log.warning("draft side taken back; speculation resumes")
            self._on_change(True)

    async def _run_probe(self) -> None:
        # A probe that answers lets the draft back but keeps the back-off: a draft that answers
        # the probe yet fails proposes (slower than draft_timeout_s) is let back ever less
        # often, until a propose succeeds.
        try:
            await self._probe()
        except Exception:  # noqa: BLE001 - any failure keeps the draft down
            self._delay = min(self._delay * 2, self._max_retry_s)
            self._check_at = self._clock() + self._delay
        else:
            self._up()
        finally:
            self._probing = None
