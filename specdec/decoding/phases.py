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
    running side queue behind it. A call that has waited ``max_wait_s`` seconds takes the phase
    for its side, with every call of its side still queued: the calls of the phase it ends run
    on beside it, and new calls of its side enter at once. Why: when the running phase is a call
    stuck on a lost replica (a draft call waiting for a pool that died, up to call_timeout_s),
    a waiter that only ran beside it left the phase with the stuck call, so every later verify
    of every request waited max_wait_s again: 5 s a round, and streams of 200 tokens passed
    their 120 s deadline.

    Args:
        max_wait_s: seconds a call waits at most (MAX_WAIT_S).
    """

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self._max_wait_s = max_wait_s
        self._phase: str | None = None  # the side whose phase runs; None when no call runs
        self._running: dict[str, set[_Call]] = {side: set() for side in SIDES}  # in the phase
        self._queue: collections.deque[tuple[_Call, asyncio.Future]] = collections.deque()

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
        call = _Call(side)
        await self._enter(call)
        try:
            yield
        finally:
            self._exit(call)

    async def _enter(self, call: _Call) -> None:
        if self._phase in (None, call.side) and not self._queue:
            self._phase = call.side
            self._running[call.side].add(call)
            return
        admitted = asyncio.get_running_loop().create_future()
        self._queue.append((call, admitted))
        try:
            await asyncio.wait_for(asyncio.shield(admitted), self._max_wait_s)
        except (TimeoutError, asyncio.CancelledError) as err:
            if admitted.done():  # admitted as the wait ended: the call holds its phase
                if isinstance(err, TimeoutError):
                    return
                self._exit(call)
                raise
            self._queue.remove((call, admitted))
            admitted.cancel()
            if isinstance(err, asyncio.CancelledError):
                raise
            # Past max_wait_s the running phase is taken as stuck: its calls run on beside.
            for stuck in self._running[self._other(call.side)]:
                stuck.beside = True
            self._running[self._other(call.side)].clear()
            self._take_phase(call.side)
            self._running[call.side].add(call)

    def _exit(self, call: _Call) -> None:
        if call.beside:
            return
        self._running[call.side].discard(call)
        if self._running[call.side]:
            return
        if self._queue:
            self._take_phase(self._queue[0][0].side)
        else:
            self._phase = None

    def _take_phase(self, side: str) -> None:
        """Gives the phase to ``side`` and admits every call of that side still queued."""
        self._phase = side
        for entry in [entry for entry in self._queue if entry[0].side == side]:
            self._queue.remove(entry)
            self._running[side].add(entry[0])
            entry[1].set_result(None)

    @staticmethod
    def _other(side: str) -> str:
        return SIDES[1 - SIDES.index(side)]


class _Call:
    """One call through the gate: its side, and whether it runs beside the phase (a phase
    taken from it as stuck, PhaseGate._enter) rather than in it."""

    __slots__ = ("side", "beside")

    def __init__(self, side: str) -> None:
        self.side, self.beside = side, False
