"""The direct data path (service.direct_calls): a session's rounds over a gRPC channel straight
to the replica that holds its cache, instead of through a Serve handle each call.

Why: through a Serve handle, a verify on the local cluster spent 1.1 ms from the router to the
replica's method and 0.9 ms back (p50, tiny pair, k = 0), against 1.6 ms of compute; an idle
grpc.aio round trip between two replicas is about 0.5 ms (docs/service.md, "Direct calls").

Serve still places every session. The router opens a *lease*: a streaming Serve call routed by
the session id like every other call of the session, which the replica answers with its direct
address and a secret, then holds open until the session is released, idles past
models.cache_idle_s, or the router cancels it. A lease is one ongoing request on its replica, so
Serve's autoscaling, max_ongoing_requests and draining count sessions (as they counted calls).

A direct call that fails for any reason (its replica died or drained away, an error, a verify
past its timeout) drops the lease, and the caller sends that call through the Serve handle, which
routes it to a live replica (where the session rebuilds, as without direct calls) or raises its
own error. A later call leases again. A propose past its timeout raises, as through Serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import grpc
from ray.serve._private.constants import RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
from ray.serve.handle import DeploymentHandle

from specdec.v1 import worker_pb2

log = logging.getLogger("ray.serve")

SERVICE = "specdec.v1.ReplicaData"
SECRET_HEADER = "x-specdec-lease-secret"
# The direct calls and their messages (the same as the Serve methods of the same names).
MESSAGES = {
    "propose": (worker_pb2.ProposeRequest, worker_pb2.ProposeResponse),
    "verify": (worker_pb2.VerifyRequest, worker_pb2.VerifyResponse),
}
LEASE_RETRY_S = 1.0  # after a lease failed to open, the session's calls go through Serve this long
_OPTIONS = [
    ("grpc.max_send_message_length", RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH),
    ("grpc.max_receive_message_length", RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH),
]


class DirectServer:
    """A replica's direct endpoint: a grpc.aio server for ``handlers`` (method name in MESSAGES
    -> the replica's coroutine), started on the first lease, on the event loop that leases run
    on (the replica's user-code loop, where its Serve methods run). Calls without the replica's
    secret (sent only in leases, over Serve) are refused UNAUTHENTICATED.

    Args:
        handlers: {"propose" or "verify": async (request message) -> response message}.
        idle_s: a lease ends once its session made no call this long (models.cache_idle_s).
    """

    def __init__(
        self, handlers: Mapping[str, Callable[[object], Awaitable[object]]], idle_s: float
    ) -> None:
        self._handlers = dict(handlers)
        self._idle_s = idle_s
        self._secret = secrets.token_hex(16)
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None
        self._last_call: dict[str, float] = {}
        self._released: dict[str, asyncio.Event] = {}
        self.served = 0  # calls answered directly

    async def lease(self, session_id: str) -> AsyncIterator[str]:
        """Yields "HOST:PORT SECRET", then holds until the session is released (released())
        or idles past idle_s (its calls over either path count, see called())."""
        address = await self._start()
        released = self._released.setdefault(session_id, asyncio.Event())
        self._last_call.setdefault(session_id, time.monotonic())
        try:
            yield f"{address} {self._secret}"
            while not released.is_set():
                idle = time.monotonic() - self._last_call.get(session_id, 0.0)
                if idle >= self._idle_s:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(released.wait(), self._idle_s - idle)
        finally:
            if self._released.get(session_id) is released:
                del self._released[session_id]
                self._last_call.pop(session_id, None)

    @property
    def open_leases(self) -> int:
        return len(self._released)

    def called(self, session_id: str) -> None:
        """A call of ``session_id`` arrived (over either path): its lease is not idle."""
        if session_id in self._released:
            self._last_call[session_id] = time.monotonic()

    def released(self, session_id: str) -> None:
        """The session was released: its lease ends."""
        event = self._released.get(session_id)
        if event is not None:
            event.set()

    async def _start(self) -> str:
        if self._address is None:
            server = grpc.aio.server(options=_OPTIONS)
            rpcs = {
                name: grpc.unary_unary_rpc_method_handler(
                    self._rpc(handler),
                    request_deserializer=MESSAGES[name][0].FromString,
                    response_serializer=MESSAGES[name][1].SerializeToString,
                )
                for name, handler in self._handlers.items()
            }
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, rpcs),))
            host = node_host()
            port = server.add_insecure_port(f"{host}:0")
            await server.start()
            self._server, self._address = server, f"{host}:{port}"
            log.info("direct calls served on %s", self._address)
        return self._address

    def _rpc(self, handler):
        async def rpc(request, context: grpc.aio.ServicerContext):
            if dict(context.invocation_metadata()).get(SECRET_HEADER) != self._secret:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no lease for this replica")
            response = await handler(request)
            self.served += 1
            return response

        return rpc


def node_host() -> str:
    """The IP address Ray knows this replica's node by (loopback on the local cluster)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


class Channels:
    """The router's channels to replicas' direct endpoints, one per address, opened on first
    use on the router's event loop and kept for its life."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def call(self, address: str, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, _OPTIONS)
        request, response = MESSAGES[method]
        return channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=request.SerializeToString,
            response_deserializer=response.FromString,
        )


class SessionLeases:
    """One request's leases, one per side, and its direct calls over them.

    A session's first call of a side goes through Serve (its prefill: the time to first token
    pays no lease); its second opens the lease and waits for its first message before it calls.
    Never both at once: a Serve call sent for a session while that session's lease was being
    dispatched never reached its replica (Ray 2.60, ConsistentHashRouter, seen on the local
    cluster; a call sent once the lease had answered arrived).

    Args:
        session_id: the request's session (the Serve handles passed to call() route by it).
        channels: the router's Channels.
    """

    def __init__(self, session_id: str, channels: Channels) -> None:
        self._session_id = session_id
        self._channels = channels
        self._leases: dict[str, tuple[str, str]] = {}  # side -> (address, secret)
        self._streams: dict[str, object] = {}  # side -> the lease's Serve response stream
        self._called: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self.direct = 0  # calls answered over a lease
        self.fallbacks = 0  # direct calls that failed (sent through Serve instead)

    async def call(self, side: str, handle: DeploymentHandle, method: str, request, timeout: float):
        """``method``'s response over the session's lease on ``side``, or None: the caller
        sends the call through Serve (the session's first call of the side, a lease that did
        not open, or a direct call that failed, whose lease is dropped).

        Raises:
            asyncio.TimeoutError: a propose past ``timeout`` (a verify past it returns None).
        """
        lease = self._leases.get(side)
        if lease is None:
            lease = await self._open(side, handle, timeout)
            if lease is None:
                return None
        address, secret = lease
        call = self._channels.call(address, method)
        try:
            response = await call(request, timeout=timeout, metadata=((SECRET_HEADER, secret),))
        except grpc.aio.AioRpcError as err:
            self._drop(side)
            self.fallbacks += 1
            if method == "propose" and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise asyncio.TimeoutError from err
            log.info("direct %s to %s failed (%s); through Serve", method, address, err.code())
            return None
        self.direct += 1
        return response

    def close(self) -> None:
        """Ends every lease (the request is over)."""
        for side in list(self._streams):
            self._drop(side)

    async def _open(
        self, side: str, handle: DeploymentHandle, timeout: float
    ) -> tuple[str, str] | None:
        if side not in self._called:
            self._called.add(side)
            return None
        if time.monotonic() < self._retry_at.get(side, 0.0):
            return None
        stream = handle.options(stream=True).lease.remote(self._session_id)
        self._streams[side] = stream
        try:
            first = await asyncio.wait_for(stream.__anext__(), timeout)
        except Exception as err:  # noqa: BLE001 - any failure: this side goes through Serve
            log.info("lease on %s failed (%r); through Serve", handle.deployment_name, err)
            self._drop(side)
            self._retry_at[side] = time.monotonic() + LEASE_RETRY_S
            return None
        address, secret = first.split(" ", 1)
        self._leases[side] = (address, secret)
        return address, secret

    def _drop(self, side: str) -> None:
        self._leases.pop(side, None)
        stream = self._streams.pop(side, None)
        if stream is not None:
            stream.cancel()
