"""The router's transport for one request: Serve handles to the draft and target deployments,
bound to the request's session id (ConsistentHashRouter keeps a session on one replica), using
Serve's per-replica gRPC transport, and with service.direct_calls the session's leases
(specdec.deployments.direct). The round loop (specdec.decoding.round_loop) calls it."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
from collections.abc import Collection

from ray.serve.handle import DeploymentHandle

from specdec.config import ServiceConfig
from specdec.decoding.phases import SIDES
from specdec.deployments import health
from specdec.deployments.direct import Channels, SessionLeases
from specdec.deployments.failures import ServiceUnavailable, retryable
from specdec.deployments.metrics import RouterMetrics
from specdec.v1 import worker_pb2

log = logging.getLogger("ray.serve")

_BACKGROUND: set[asyncio.Future] = set()  # calls no request waits for, kept until they end


# A target call waiting for an answer checks this often whether any target replica still runs
# (the check reads ReplicaCounts, refreshed at most once a second for the whole router).
NO_REPLICA_POLL_S = 0.5


def _keep(task: asyncio.Future) -> None:
    """Holds a reference to ``task`` until it ends (asyncio keeps only weak ones)."""
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


class HandleTransport:
    """The round loop's transport over Serve handles, for one session.

    A target call that fails because its replica died, drained or is missing (``retryable``)
    or did not answer within ``service.call_timeout_s`` is retried; Serve routes the retry to a live
    replica, which answers cache_miss, and the round loop resends the whole sequence so that
    replica rebuilds the session. Draws are keyed by position, so a retried call gives the same
    tokens. A retry never runs past ``service.unavailable_after_s`` after the call began (config
    guarantees call_timeout_s < unavailable_after_s); then it raises ServiceUnavailable. So when
    no replica exists (Serve queues the call until one does) a request ends within
    unavailable_after_s. With ``replicas``, a request that no target replica has answered yet
    is refused sooner: its verify, still waiting once a count taken after the call began finds
    no target replica RUNNING, ends with ServiceUnavailable (readiness says NOT_SERVING then
    too), and a release waiting so gives up. A request a replica has answered keeps waiting, up
    to unavailable_after_s, for a replacement that rebuilds its session (a lone replica that
    crashed restarts on its node). Without the count, a new request on a cluster whose target
    pool died waited unavailable_after_s (180 s as shipped on the local cluster) for its
    UNAVAILABLE and its release call_timeout_s more.
    """

    def __init__(
        self,
        draft: DeploymentHandle,
        target: DeploymentHandle,
        session_id: str,
        service: ServiceConfig,
        replicas: health.ReplicaCounts | None = None,
        channels: Channels | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._draft = draft.options(session_id=session_id)
        self._target = target.options(session_id=session_id)
        self._service = service
        # service.direct_calls: rounds over leases, Serve when a lease cannot carry a call.
        self._leases = SessionLeases(session_id, channels) if channels is not None else None
        # (side, path) -> propose and verify calls, added to ``metrics`` at the release.
        self._paths: collections.Counter[tuple[str, str]] = collections.Counter()
        self._metrics = metrics
        self._replicas = replicas
        self._target_answered = False

    async def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        """One attempt, never retried: the round loop goes on without the draft when it fails
        (specdec.decoding.degrade). A call that carries the whole sequence (a prefill, a
        rebuild) may take call_timeout_s, a round's catch-up and steps draft_timeout_s."""
        service = self._service
        full = request.session.prefix_len == 0
        timeout = service.call_timeout_s if full else service.draft_timeout_s
        if self._leases is not None:
            response = await self._leases.call("draft", self._draft, "propose", request, timeout)
            if response is not None:
                self._paths["draft", "direct"] += 1
                return response
        self._paths["draft", "serve"] += 1
        return await asyncio.wait_for(self._draft.propose.remote(request), timeout)

    async def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        response = None
        began = asyncio.get_running_loop().time()
        if self._leases is not None:
            timeout = self._service.call_timeout_s
            response = await self._leases.call("target", self._target, "verify", request, timeout)
        if response is None:  # a failed direct attempt counts against unavailable_after_s
            self._paths["target", "serve"] += 1
            response = await self._call("verify", request, began)
        else:
            self._paths["target", "direct"] += 1
        self._target_answered = True
        return response

    async def release(self, session_id: str, sides: Collection[str] = SIDES) -> None:
        """Drops the session on ``sides``: the target's release is awaited (within
        call_timeout_s), the draft's only sent. The draft is an optimisation, and its release
        must not hold a request that is done: with the draft pool gone, Serve queues the call
        until a draft replica exists, and every request then ended call_timeout_s late (120 s
        as shipped on the local cluster). A draft replica that never receives it frees the
        session once it idles `cache_idle_s`."""
        if self._metrics is not None:
            failures = self._leases.failures if self._leases is not None else {}
            self._metrics.record_calls(self._paths, failures)
            self._paths.clear()
        if self._leases is not None:
            self._leases.close()
        request = worker_pb2.ReleaseRequest(session_id=session_id)
        # Serve cancels the handle calls a request has in flight when that request is cancelled,
        # and a request can end before its release is answered (a closed HTTP stream: starlette
        # cancels the stream again at every await, so the round loop's shield returns early).
        # Made from a fresh context, the release calls are no child of the request: they always
        # reach the replicas, and a session's cache never outlives its request.
        if "draft" in sides:
            _keep(self._detached_release(self._draft, request))
        if "target" in sides:
            await self._detached_release(self._target, request)

    def _detached_release(
        self, handle: DeploymentHandle, request: worker_pb2.ReleaseRequest
    ) -> asyncio.Future:
        """_release as a task started from a fresh context (no child of the request)."""
        return contextvars.Context().run(asyncio.ensure_future, self._release(handle, request))

    async def _release(self, handle: DeploymentHandle, request: worker_pb2.ReleaseRequest) -> None:
        try:
            timeout = self._service.call_timeout_s
            await self._attempt(handle, "release", request, timeout, self._since())
        except Exception as err:  # noqa: BLE001 - a failed release is logged, never raised
            log.warning(
                "release of session %s on %s failed: %r",
                request.session_id,
                handle.deployment_name,
                err,
            )

    async def _call(self, method: str, request, began: float):
        """A target call, retried as the class says, until ``unavailable_after_s`` after
        ``began`` (the event loop's clock)."""
        handle = self._target
        loop = asyncio.get_running_loop()
        give_up = began + self._service.unavailable_after_s
        delay = 0.05
        timeout = min(self._service.call_timeout_s, max(give_up - loop.time(), delay))
        # A request no replica has answered is refused once a count since this call began
        # finds none running (the class docstring says why only such a request).
        refuse_since = self._since() if not self._target_answered else None
        while True:
            try:
                return await self._attempt(handle, method, request, timeout, refuse_since)
            except Exception as err:  # noqa: BLE001 - retryable() decides; others propagate
                if not retryable(err):
                    raise
                left = give_up - loop.time() - delay
                if left <= 0:
                    raise ServiceUnavailable(
                        f"{handle.deployment_name}.{method}: no replica answered within "
                        f"{self._service.unavailable_after_s:g} s ({type(err).__name__})"
                    ) from err
                log.warning("%s.%s failed (%r); retrying", handle.deployment_name, method, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                timeout = min(self._service.call_timeout_s, left)

    def _since(self) -> float | None:
        """Now, on the replica counts' clock (None without counts)."""
        return self._replicas.now() if self._replicas is not None else None

    async def _attempt(
        self,
        handle: DeploymentHandle,
        method: str,
        request,
        timeout: float,
        refuse_since: float | None = None,
    ):
        """One call, answered within ``timeout`` seconds or asyncio.TimeoutError. With
        ``refuse_since``, a target call still waiting when a replica count taken at or after
        that time finds no target replica RUNNING ends with ServiceUnavailable instead
        (checked every NO_REPLICA_POLL_S)."""
        response = getattr(handle, method).remote(request)
        counts = self._replicas if handle is self._target else None
        if counts is None or refuse_since is None:
            return await asyncio.wait_for(response, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        call = asyncio.ensure_future(response)
        try:
            while not call.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait({call}, timeout=min(NO_REPLICA_POLL_S, left))
                if not call.done() and counts.none_running("target", refuse_since):
                    raise ServiceUnavailable(
                        f"{handle.deployment_name}.{method}: no {handle.deployment_name} "
                        "replica is running"
                    )
            return call.result()
        finally:
            call.cancel()  # a no-op once it is done
