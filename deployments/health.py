"""Readiness as the router sees it, for gRPC health (grpc.health.v1) and HTTP /ready.

The router is ready once a target replica has answered ``model_info``: a target replica is
running and the router knows the limits it validates requests against. The draft is not needed
for readiness: while no draft replica answers, the service is degraded (requests run on the
target alone, specdec.decoding.degrade) but the router still serves. Nothing here imports Ray,
so the decision is unit-tested with fake fetchers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from specdec.v1 import worker_pb2

T = TypeVar("T")

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


async def readiness(info: ModelInfoCache, probe_s: float = PROBE_S) -> tuple[bool, str]:
    """(ready, reason): ready once the target's model_info is known; the draft's is fetched on
    the side and only changes the reason.

    Waits at most probe_s seconds (for the target's first answer) and never raises.
    """
    info.prefetch("draft")
    try:
        await info.get("target", probe_s)
    except Exception as err:  # noqa: BLE001 - any failure means "not ready yet"
        return False, f"not ready: no target replica has answered yet ({type(err).__name__})"
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
