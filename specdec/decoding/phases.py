"""Alternating draft and verify phases across the requests of one router, where draft and target
share a machine's cores.

On separate devices a request's draft call may run beside another request's verify: the two
overlap and the service pipelines. On shared CPU cores the two forwards take each other's cores
(and each model process starts as many threads as there are cores), so overlapping calls are
slower than the same calls one after the other, and each side's batches break up: a request
that drafts while the others verify joins neither their verify batch nor a draft batch. The
PhaseGate makes the router's calls alternate in phases instead: every draft call that waits
runs together (one draft batch), then every verify call that waits (one verify batch), and so
on; a round's draft and verify of many requests then run in step, as in the engine step of a
batching server (vLLM's scheduler drafts and verifies its whole batch in turn).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

SIDES = ("draft", "target")
# How long a call waits for its phase before it runs anyway. The gate only orders calls for
# speed: a call stuck on a lost replica (a draft call may take draft_timeout_s, a verify
# call_timeout_s) must not hold every other request's calls of the other side as long. Longer
# than one phase normally lasts (a verify batch of 8 sessions, about 1 s on the 2-core CPUs),
# shorter than a batch of prompt prefills (tens of seconds), beside which calls then run as
# without the gate.
MAX_WAIT_S = 5.0


class PhaseGate:
    """Lets the calls of one side (``"draft"`` or ``"target"``) run together, never beside the
    other side's, in alternating phases (asyncio; one event loop).

    A call enters at once when no call runs, or when its side's phase runs and none of the other
    side waits; otherwise it queues. When the last call of a phase ends, the phase passes to the
    side of the longest-waiting call, and every queued call of that side enters together (the
    next batch). So neither side starves: once a call of the other side waits, new calls of the
    running side queue behind it. A call that has waited ``max_wait_s`` seconds runs anyway.

    Args:
        max_wait_s: seconds a call waits at most (MAX_WAIT_S).
    """

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self._max_wait_s = max_wait_s
        self._phase: str | None = None  # the side whose phase runs; None when no call runs
        self._running = dict.fromkeys(SIDES, 0)
        self._queue: collections.deque[tuple[str, asyncio.Future]] = collections.deque()

    @property
    def phase(self) -> str | None:
        """The side whose calls run now, or None."""
        return self._phase

    @contextlib.asynccontextmanager
    async def call(self, side: str) -> AsyncIterator[None]:
        """Holds one call of ``side`` ("draft" or "target") for the ``async with`` body.

        Raises:
            ValueError: an unknown side.
        """
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        await self._enter(side)
        try:
            yield
        finally:
            self._exit(side)

    async def _enter(self, side: str) -> None:
        if self._phase in (None, side) and not self._queue:
            self._phase = side
            self._running[side] += 1
            return
        admitted = asyncio.get_running_loop().create_future()
        self._queue.append((side, admitted))
        try:
            await asyncio.wait_for(asyncio.shield(admitted), self._max_wait_s)
        except (TimeoutError, asyncio.CancelledError) as err:
            if admitted.done():  # admitted as the wait ended: the call holds its phase
                if isinstance(err, TimeoutError):
                    return
                self._exit(side)
                raise
            self._queue.remove((side, admitted))
            admitted.cancel()
            if isinstance(err, asyncio.CancelledError):
                raise
            self._running[side] += 1  # past max_wait_s: runs beside the phase, not in it

    def _exit(self, side: str) -> None:
        self._running[side] -= 1
        if self._running[self._phase] > 0:
            return
        if not self._queue:
            self._phase = None if not any(self._running.values()) else self._other(self._phase)
            return
        self._phase = self._queue[0][0]
        for entry in [entry for entry in self._queue if entry[0] == self._phase]:
            self._queue.remove(entry)
            self._running[self._phase] += 1
            entry[1].set_result(None)

    @staticmethod
    def _other(side: str) -> str:
        return SIDES[1 - SIDES.index(side)]
