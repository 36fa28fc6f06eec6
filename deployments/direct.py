"""The direct data path (service.direct_calls): a session's rounds over a gRPC channel straight
to the replica that holds its cache, instead of through a Serve handle each call.

Why: through a Serve handle, a verify on the local cluster spent 1.1 ms from the router to the
replica's method and 0.9 ms back (p50, tiny pair, k = 0), against 1.6 ms of compute; an idle
grpc.aio round trip between two replicas is about 0.5 ms (docs/service.md, "Direct calls").

A session's direct calls to a side travel as the messages of one bidirectional gRPC stream,
opened with the lease's secret: a message on an open stream costs about 0.4 ms there and back on
loopback against 0.9 ms for a unary call, which opens an HTTP/2 stream and sends headers and
trailers every time (docs/service.md, "Direct calls").

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
import collections
import contextlib
import functools
import hmac
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
LEASE_OPEN_S = 2.0  # the longest wait for a lease's first message
# After a lease or a direct call failed, the side's calls go through Serve this long.
LEASE_RETRY_S = 5.0
# How long a replica remembers a released session (a late lease of it ends at once).
RELEASED_KEEP_S = 60.0
_OPTIONS = [
    ("grpc.max_send_message_length", RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH),
    ("grpc.max_receive_message_length", RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH),
]


class _Session:
    """A session's leases on one replica: how many are open, its last call, its release."""

    def __init__(self) -> None:
        self.leases = 0
        self.last_call = time.monotonic()
        self.released = asyncio.Event()


class DirectServer:
    """A replica's direct endpoint: a grpc.aio server for ``handlers`` (method name in MESSAGES
    -> the replica's coroutine), started on the first lease, on the event loop that leases run
    on (the replica's user-code loop, where its Serve methods run). Each method is a
    bidirectional stream that answers its requests one by one, in order; a stream opened without
    the replica's secret (which a router learns only from a lease, over Serve) is refused
    UNAUTHENTICATED, and a request the handler refuses for its input (ValueError) ends its stream
    INVALID_ARGUMENT.

    At most ``max_sessions`` sessions hold leases at once; a lease past that answers "" at once
    and the session's calls go through Serve. A lease holds one of Serve's ongoing requests on
    the replica (max_ongoing_requests, 32 as shipped), and the calls of the sessions without one
    need the rest.

    Args:
        handlers: {"propose" or "verify": async (request message) -> response message}.
        idle_s: a lease ends once its session made no call this long (models.cache_idle_s;
            0: only its release or its router ends it).
        max_sessions: sessions that may hold leases at once (models.max_batch_size: a batch).
    """

    def __init__(
        self,
        handlers: Mapping[str, Callable[[object], Awaitable[object]]],
        idle_s: float,
        max_sessions: int,
    ) -> None:
        self._handlers = dict(handlers)
        self._idle_s = idle_s
        self._max_sessions = max_sessions
        self._secret = secrets.token_hex(16)
        self._server: grpc.aio.Server | None = None  # held: a collected server shuts down
        self._starting = asyncio.Lock()
        self._address: str | None = None
        self._sessions: dict[str, _Session] = {}
        # Sessions released lately: a lease that arrives after its session's release (its
        # cancel lost on the way) ends at once instead of holding a slot for idle_s.
        self._released: dict[str, float] = {}
        self.served = 0  # calls answered directly
        self.streams = 0  # call streams opened with the secret

    @property
    def open_leases(self) -> int:
        return sum(session.leases for session in self._sessions.values())

    async def lease(self, session_id: str) -> AsyncIterator[str]:
        """Yields "HOST:PORT SECRET" (or "" when the session may not lease, see the class),
        then holds until the session is released (released()) or idles past idle_s (its calls
        over either path count, see called())."""
        address = await self._start()
        # No await from this check to the session's entry: concurrent leases count each other.
        if session_id in self._released or (
            session_id not in self._sessions and len(self._sessions) >= self._max_sessions
        ):
            yield ""
            return
        session = self._sessions.setdefault(session_id, _Session())
        session.leases += 1
        try:
            yield f"{address} {self._secret}"
            while not session.released.is_set():
                idle = time.monotonic() - session.last_call
                if self._idle_s > 0 and idle >= self._idle_s:
                    return
                wait = self._idle_s - idle if self._idle_s > 0 else None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(session.released.wait(), wait)
        finally:
            session.leases -= 1
            if session.leases == 0 and self._sessions.get(session_id) is session:
                del self._sessions[session_id]

    def called(self, session_id: str) -> None:
        """A call of ``session_id`` arrived (over either path): its lease is not idle."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.last_call = time.monotonic()

    def released(self, session_id: str) -> None:
        """The session was released: its leases end, and a later lease of it ends at once."""
        now = time.monotonic()
        self._released = {s: t for s, t in self._released.items() if now - t < RELEASED_KEEP_S}
        self._released[session_id] = now
        session = self._sessions.get(session_id)
        if session is not None:
            session.released.set()

    async def _start(self) -> str:
        async with self._starting:  # concurrent first leases start one server
            if self._address is None:
                server = grpc.aio.server(options=_OPTIONS)
                rpcs = {
                    name: grpc.stream_stream_rpc_method_handler(
                        self._rpc(handler),
                        request_deserializer=MESSAGES[name][0].FromString,
                        response_serializer=MESSAGES[name][1].SerializeToString,
                    )
                    for name, handler in self._handlers.items()
                }
                generic = grpc.method_handlers_generic_handler(SERVICE, rpcs)
                server.add_generic_rpc_handlers((generic,))
                host = await asyncio.to_thread(node_host)
                bound = f"[{host}]" if ":" in host else host
                port = server.add_insecure_port(f"{bound}:0")
                await server.start()
                self._server, self._address = server, f"{bound}:{port}"
                log.info("direct calls served on %s", self._address)
        return self._address

    def _rpc(self, handler):
        secret = self._secret.encode()

        async def rpc(requests: AsyncIterator, context: grpc.aio.ServicerContext):
            sent = dict(context.invocation_metadata()).get(SECRET_HEADER, "")
            if not hmac.compare_digest(sent.encode(), secret):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no lease for this replica")
            self.streams += 1
            async for request in requests:
                try:
                    response = await handler(request)
                except ValueError as err:  # the call's own input: through Serve it fails again
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
                self.served += 1
                yield response

        return rpc


def node_host() -> str:
    """The IP address Ray knows this replica's node by (loopback on the local cluster)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


class Channels:
    """The router's channels to replicas' direct endpoints, one per address, opened on first
    use on the router's event loop and closed once a call finds that replica gone (forget):
    replicas come and go with autoscaling, and each channel holds a socket and reconnects."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Future] = set()  # held until closed (asyncio keeps weak refs)

    def __len__(self) -> int:
        return len(self._channels)

    def forget(self, address: str) -> None:
        """Closes the channel to ``address`` (its calls in flight raise CancelledError, which
        SessionLeases.call takes as a failed call; a later call opens a new channel)."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            closing = asyncio.ensure_future(channel.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def open(self, address: str, method: str, secret: str) -> grpc.aio.StreamStreamCall:
        """A new stream of ``method`` calls to the replica at ``address``, opened with its
        lease's ``secret``: write a request, read its response, one at a time."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, _OPTIONS)
        request, response = MESSAGES[method]
        calls = channel.stream_stream(
            f"/{SERVICE}/{method}",
            request_serializer=request.SerializeToString,
            response_deserializer=response.FromString,
        )
        return calls(metadata=((SECRET_HEADER, secret),))


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
        self._calls: dict[str, _CallStream] = {}  # side -> its direct calls
        self._called: set[str] = set()
        self._retry_at: dict[str, float] = {}
        # Per side: direct calls and lease openings that failed (the call went through Serve).
        self.failures: collections.Counter[str] = collections.Counter()

    async def call(self, side: str, handle: DeploymentHandle, method: str, request, timeout: float):
        """``method``'s response over the session's lease on ``side``, or None: the caller
        sends the call through Serve (the session's first call of the side, a lease that did
        not open, or a direct call that failed, whose lease is dropped).

        The side's calls share one stream (opened on the first); a call that fails or is
        cancelled closes it, since its response may still be on the way, and the next call
        opens a new one.

        Raises:
            asyncio.TimeoutError: a propose past ``timeout`` (a verify past it returns None).
            ValueError: the replica refused the request's input (INVALID_ARGUMENT).
        """
        lease = self._leases.get(side)
        if lease is None:
            lease = await self._open(side, handle, timeout)
            if lease is None:
                return None
        address, secret = lease
        calls = self._calls.get(side)
        if calls is None:
            opener = functools.partial(self._channels.open, address, method, secret)
            calls = self._calls[side] = _CallStream(opener)
        try:
            return await calls.call(request, timeout)
        except (Exception, asyncio.CancelledError) as err:  # noqa: BLE001 - through Serve
            if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the request itself was cancelled
            # Otherwise the call failed or timed out, or the channel closed under it: another
            # session's call found the replica gone (forget), and grpc.aio cancels a closed
            # channel's calls in flight.
            code = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
            if code == grpc.StatusCode.INVALID_ARGUMENT:  # the replica refused the call's input
                raise ValueError(err.details()) from err
            self._drop(side, backoff=True)
            self.failures[side] += 1
            if code == grpc.StatusCode.UNAVAILABLE:  # the replica is gone (or going)
                self._channels.forget(address)
            if method == "propose" and isinstance(err, asyncio.TimeoutError):
                raise
            log.info("direct %s to %s failed (%r); through Serve", method, address, err)
            return None

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
            first = await asyncio.wait_for(stream.__anext__(), min(timeout, LEASE_OPEN_S))
        except Exception as err:  # noqa: BLE001 - any failure: this side goes through Serve
            log.debug("no lease on %s (%r); through Serve", handle.deployment_name, err)
            self.failures[side] += 1
            first = ""
        if not first:  # failed, or refused: the replica's sessions with leases are a batch
            self._drop(side, backoff=True)
            return None
        address, secret = first.split(" ", 1)
        self._leases[side] = (address, secret)
        return address, secret

    def _drop(self, side: str, backoff: bool = False) -> None:
        """Ends the side's lease; with ``backoff``, its calls go through Serve for a while."""
        if backoff:
            self._retry_at[side] = time.monotonic() + LEASE_RETRY_S
        self._leases.pop(side, None)
        self._end_calls(side)
        stream = self._streams.pop(side, None)
        if stream is not None:
            stream.cancel()

    def _end_calls(self, side: str) -> None:
        calls = self._calls.pop(side, None)
        if calls is not None:
            calls.end()


class _CallStream:
    """A session side's direct calls to its leased replica, one at a time as the messages of
    one gRPC stream: opened on the first call, and again after a call that failed, timed out or
    was cancelled (which ends it, since its response may still be on the way) or once it ended
    while idle. Calls that overlap (the round loop sends none today) wait their turn, so each
    reads its own response.

    Args:
        open_stream: opens a new stream (Channels.open with the lease's address and secret).
    """

    def __init__(self, open_stream: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._open = open_stream
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._turn = asyncio.Lock()

    async def call(self, request, timeout: float):
        """The replica's response to ``request``.

        ``timeout`` bounds the whole call: its wait for its turn, the stream's opening and the
        answer (a replica that accepts the connection but never answers included). A call ends
        only the streams it wrote on, never the one another call is using.

        Raises:
            TimeoutError: no response within ``timeout`` seconds.
            grpc.aio.AioRpcError, asyncio.CancelledError, ConnectionError: the call failed
                (its stream was ended).
        """
        written: list[grpc.aio.StreamStreamCall] = []  # the streams this call wrote on
        try:
            async with asyncio.timeout(timeout), self._turn:
                stream = await self._send(request, written)
                response = await stream.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("the replica ended the call stream")
                return response
        except (Exception, asyncio.CancelledError):
            for stream in written:
                self._end(stream)
            raise

    async def _send(self, request, written: list) -> grpc.aio.StreamStreamCall:
        """The stream ``request`` was written on: the open one, or a new one where that had
        ended while idle (its replica restarted the connection or went away)."""
        stream = self._stream
        if stream is not None and not stream.done():
            written.append(stream)
            try:
                await stream.write(request)
                return stream
            except Exception as err:  # noqa: BLE001 - it ended while idle: a new one
                log.debug("direct call stream ended (%r); opening another", err)
                self._end(stream)
        stream = self._stream = self._open()
        written.append(stream)
        await stream.write(request)
        return stream

    def end(self) -> None:
        """Ends the stream (a call in flight on it raises CancelledError)."""
        if self._stream is not None:
            self._end(self._stream)

    def _end(self, stream: grpc.aio.StreamStreamCall) -> None:
        stream.cancel()
        if self._stream is stream:
            self._stream = None
