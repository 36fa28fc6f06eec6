"""Readiness as the router sees it, for gRPC health (grpc.health.v1) and HTTP /ready.

The router is ready while a target replica is running and once one has answered
``model_info`` (the router then knows the limits it validates requests against). The running
replicas are counted from Serve's controller (ReplicaCounts), so readiness turns NOT_SERVING when
the last target replica is gone, not only before the first one answered. The draft is not needed
for readiness: while no draft replica runs, the service is degraded (requests run on the target
alone, specdec.decoding.degrade) but the router still serves.

A probe never waits on the requests in flight: the counts are refreshed in a worker thread and
answered from the last refresh, and nothing on the router's event loop grows with the length of
a completion (specdec.decoding.stopping detokenizes incrementally). Nothing here imports Ray, so
the decision is unit-tested with fake fetchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from specdec.v1 import worker_pb2

T = TypeVar("T")
log = logging.getLogger("ray.serve")

# A readiness probe waits this long for the target's first answer: long enough for a running
# replica (model_info is answered on its event loop, beside any forward pass), short enough for
# a kubelet probe's timeout and a gRPC health Check's deadline.
PROBE_S = 1.0
# Watch re-checks this often and answers only when the status changed.
WATCH_POLL_S = 1.0
# A Watch stream ends after this long (the client watches again): an open stream counts as an
# ongoing request, and a router replica being scaled down or updated waits for its ongoing
# requests for up to graceful_shutdown_timeout_s (300 s), so endless streams would hold it.
WATCH_MAX_S = 60.0
# Replica counts older than this are refreshed (in the background) when a probe asks: Serve's
# status is one controller call and a parse of every application's details, so not per probe.
COUNTS_MAX_AGE_S = 1.0


class ModelInfoCache:
    """The draft's and target's ``model_info``, each fetched once a replica answers, then kept.

    A model's info never changes while the application runs, so one answer per side is enough.
    Callers that ask at the same time share one fetch, so probes never pile calls on replicas;
    a fetch that failed or timed out is started again by the next caller.

    Args:
        fetchers: {side ("draft" / "target"): async callable returning that deployment's
            model_info, a specdec.v1.ReplicaInfo (specdec.worker.info)}.
        timeout_s: seconds one fetch may run before it is given up.
    """

    def __init__(
        self,
        fetchers: Mapping[str, Callable[[], Awaitable[worker_pb2.ReplicaInfo]]],
        timeout_s: float,
    ) -> None:
        self._fetchers = dict(fetchers)
        self._timeout_s = timeout_s
        self._known: dict[str, worker_pb2.ReplicaInfo] = {}
        self._pending: dict[str, asyncio.Future] = {}

    def known(self, side: str) -> worker_pb2.ReplicaInfo | None:
        """The side's info if a replica has answered already, else None; never waits."""
        return self._known.get(side)

    def prefetch(self, side: str) -> None:
        """Starts fetching the side's info in the background unless it is known or on its way."""
        self._fetch(side)

    async def get(self, side: str, wait_s: float | None = None) -> worker_pb2.ReplicaInfo:
        """The side's info, fetched if not known yet.

        Args:
            wait_s: seconds to wait for it (default: the fetch's own timeout_s); the fetch goes
                on in the background when the wait ends first.

        Raises:
            asyncio.TimeoutError: no answer within wait_s (or within the fetch's timeout_s).
            Whatever the fetcher raised (e.g. RayActorError when the replica died).
        """
        if side in self._known:
            return self._known[side]
        wait_s = self._timeout_s if wait_s is None else wait_s
        return await asyncio.wait_for(asyncio.shield(self._fetch(side)), wait_s)

    def _fetch(self, side: str) -> asyncio.Future:
        pending = self._pending.get(side)
        if side not in self._known and (pending is None or pending.done()):
            pending = asyncio.ensure_future(self._fetch_once(side))
            # A fetch nobody waits for any more still finishes; reading its error here keeps
            # asyncio from logging "exception was never retrieved".
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._pending[side] = pending
        return pending

    async def _fetch_once(self, side: str) -> worker_pb2.ReplicaInfo:
        info = await asyncio.wait_for(_awaited(self._fetchers[side]), self._timeout_s)
        self._known[side] = info
        return info


async def _awaited(fetch: Callable[[], Awaitable[T]]) -> T:
    # A Serve DeploymentResponse is awaitable but not a coroutine; wait_for wants one.
    return await fetch()


class ReplicaCounts:
    """RUNNING replicas per side, as Serve's controller reports them, refreshed on demand.

    ``get`` answers from the last refresh and starts a new one (in a worker thread: the count
    is a blocking controller call) once that refresh is older than max_age_s; only the very
    first answer is waited for. ``none_running`` answers the router's calls the same way, never
    waiting. A refresh that fails keeps the last counts (a controller that cannot be reached
    does not stop the replicas from serving). A refresh is dated when it starts, so a count
    dated after an event saw the cluster after it.

    Args:
        count: blocking callable returning {side ("draft" / "target"): RUNNING replicas}.
        max_age_s: seconds a refresh is answered from before the next one starts.
        clock: seconds, monotonic (tests inject one).
    """

    def __init__(
        self,
        count: Callable[[], Mapping[str, int]],
        max_age_s: float = COUNTS_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._count, self._max_age_s, self._clock = count, max_age_s, clock
        self._counts: Mapping[str, int] | None = None
        self._at = -math.inf
        self._pending: asyncio.Future | None = None

    def now(self) -> float:
        """This object's clock, in seconds."""
        return self._clock()

    async def get(self, wait_s: float) -> Mapping[str, int] | None:
        """The last counts, or None while none has arrived within wait_s seconds; never
        raises."""
        self._refresh_if_old()
        if self._counts is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._pending), wait_s)
        return self._counts

    def none_running(self, side: str, since: float) -> bool:
        """Whether a count that started at or after ``since`` (``now()`` seconds) found no
        RUNNING replica of ``side``. Never waits: starts a refresh when the last is old, and
        answers False until a recent enough count says otherwise."""
        self._refresh_if_old()
        return self._counts is not None and self._at >= since and self._counts.get(side) == 0

    def _refresh_if_old(self) -> None:
        if self._clock() - self._at > self._max_age_s and (
            self._pending is None or self._pending.done()
        ):
            self._pending = asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        started = self._clock()
        try:
            self._counts = await asyncio.to_thread(self._count)
            self._at = started
        except Exception:  # noqa: BLE001 - keep the last counts, try again at the next probe
            log.warning("counting the running replicas failed", exc_info=True)


async def readiness(
    info: ModelInfoCache, replicas: ReplicaCounts | None = None, probe_s: float = PROBE_S
) -> tuple[bool, str]:
    """(ready, reason): ready while a target replica is running (per ``replicas``; unknown
    counts do not block) and once the target's model_info is known; the draft's is fetched on
    the side and only changes the reason.

    Waits at most probe_s seconds (for the target's first answer, and the first counts) and
    never raises.
    """
    info.prefetch("draft")
    counts = await replicas.get(probe_s) if replicas is not None else None
    counts = counts or {}
    if counts.get("target") == 0:
        return False, "not ready: no target replica is running"
    try:
        await info.get("target", probe_s)
    except Exception as err:  # noqa: BLE001 - any failure means "not ready yet"
        return False, f"not ready: no target replica has answered yet ({type(err).__name__})"
    if counts.get("draft") == 0:
        return True, "ready, degraded: no draft replica is running"
    if info.known("draft") is None:
        return True, "ready, degraded: no draft replica has answered yet"
    return True, "ready"


async def watch(
    check: Callable[[], Awaitable[T]],
    poll_s: float = WATCH_POLL_S,
    max_s: float = WATCH_MAX_S,
) -> AsyncIterator[T]:
    """Yields check()'s answer, then each answer that differs from the one before, checking
    every poll_s seconds, until max_s seconds have passed or the consumer stops iterating.

    Raises:
        Whatever check raises.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + max_s
    last: object = object()
    while True:
        current = await check()
        if current != last:
            last = current
            yield current
        if loop.time() + poll_s > end:
            return
        await asyncio.sleep(poll_s)
