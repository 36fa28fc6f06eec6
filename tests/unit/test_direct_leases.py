"""SessionLeases and Channels (deployments/direct.py) against a real DirectServer on loopback;
the Serve handle that opens a lease is a stand-in that streams the server's own lease()."""

from __future__ import annotations

import asyncio

import pytest

from specdec.deployments import direct
from specdec.v1 import worker_pb2


class _LeaseHandle:
    """What SessionLeases uses of a DeploymentHandle: options(stream=True).lease.remote(id)."""

    deployment_name = "TargetModel"

    def __init__(self, server: direct.DirectServer) -> None:
        self.lease = self
        self._server = server

    def options(self, **_):
        return self

    def remote(self, session_id: str):
        return _Stream(self._server.lease(session_id))


class _Stream:
    def __init__(self, messages) -> None:
        self._messages = messages

    def __anext__(self):
        return self._messages.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self._messages.aclose())


def _request(prefix_len: int) -> worker_pb2.VerifyRequest:
    return worker_pb2.VerifyRequest(
        session=worker_pb2.SessionTokens(session_id="s", prefix_len=prefix_len, new_token_ids=[1])
    )


def _propose(prefix_len: int) -> worker_pb2.ProposeRequest:
    return worker_pb2.ProposeRequest(
        session=worker_pb2.SessionTokens(session_id="s", prefix_len=prefix_len)
    )


@pytest.fixture
def leases(monkeypatch):
    monkeypatch.setattr(direct, "node_host", lambda: "127.0.0.1")
    calls = []

    async def verify(request):
        calls.append(request.session.prefix_len)
        if request.session.prefix_len > 99:
            raise ValueError("session.prefix_len past the cache")
        return worker_pb2.VerifyResponse(num_accepted=request.session.prefix_len)

    def build():
        server = direct.DirectServer({"verify": verify}, idle_s=0, max_sessions=4)
        channels = direct.Channels()
        return server, channels, direct.SessionLeases("s", channels), _LeaseHandle(server)

    return build, calls


def test_refused_input_raises_once_and_a_gone_replica_falls_back(leases):
    build, calls = leases

    async def run():
        server, channels, session, handle = build()
        call = lambda n: session.call("target", handle, "verify", _request(n), 5.0)  # noqa: E731
        assert await call(1) is None  # the side's first call: through Serve
        assert (await call(2)).num_accepted == 2 and server.served == 1
        # The replica refuses the input: ValueError, computed once, the lease kept.
        with pytest.raises(ValueError, match="prefix_len"):
            await call(100)
        assert calls == [2, 100] and (await call(3)).num_accepted == 3
        assert session.failures["target"] == 0 and len(channels) == 1
        # The replica is gone: the call goes through Serve, counted, and its channel closed.
        await server._server.stop(None)
        assert await call(4) is None
        assert session.failures["target"] == 1 and len(channels) == 0
        session.close()

    asyncio.run(run())


def test_a_call_whose_channel_closes_under_it_goes_through_serve(monkeypatch):
    """Another session's failed call closes the shared channel to a dying replica: this
    session's call in flight on it goes through Serve (None) instead of cancelling the
    request, while a cancel of the request itself still propagates."""
    monkeypatch.setattr(direct, "node_host", lambda: "127.0.0.1")

    async def run():
        entered, hold = asyncio.Event(), asyncio.Event()

        async def verify(request):
            if request.session.prefix_len == 3:
                entered.set()
                await hold.wait()
            return worker_pb2.VerifyResponse(num_accepted=request.session.prefix_len)

        server = direct.DirectServer({"verify": verify}, idle_s=0, max_sessions=4)
        try:
            session, handle = direct.SessionLeases("s", direct.Channels()), _LeaseHandle(server)
            call = lambda n: session.call("target", handle, "verify", _request(n), 5.0)  # noqa: E731
            assert await call(1) is None  # the side's first call: through Serve
            for cancel_the_request in (True, False):
                session._retry_at.clear()  # lease again at once
                assert (await call(2)).num_accepted == 2
                entered.clear()
                pending = asyncio.ensure_future(call(3))
                await entered.wait()
                if cancel_the_request:
                    pending.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await pending
                else:
                    session._channels.forget(session._leases["target"][0])  # as a failed call does
                    assert await pending is None
                    assert session.failures["target"] == 1 and "target" not in session._leases
            hold.set()
            session.close()
        finally:
            if server._server is not None:
                await server._server.stop(None)

    asyncio.run(run())


def test_a_sides_calls_share_one_stream_and_a_broken_call_never_answers_the_next(monkeypatch):
    """Every direct call of a side travels on one stream; a call cancelled in flight, or a
    propose past its timeout, ends that stream (its late response must not answer the next
    call), and the next call opens another: each call gets its own response."""
    monkeypatch.setattr(direct, "node_host", lambda: "127.0.0.1")

    async def run():
        async def propose(request):
            if request.session.prefix_len in (3, 5):  # slower than the caller waits
                await asyncio.sleep(0.3)
            return worker_pb2.ProposeResponse(token_ids=[request.session.prefix_len])

        server = direct.DirectServer({"propose": propose}, idle_s=0, max_sessions=4)
        try:
            session, handle = direct.SessionLeases("s", direct.Channels()), _LeaseHandle(server)

            async def call(n: int, timeout: float = 5.0):
                response = await session.call("draft", handle, "propose", _propose(n), timeout)
                return None if response is None else list(response.token_ids)

            assert await call(1) is None  # the side's first call: through Serve
            assert [await call(2) for _ in range(4)] == [[2]] * 4
            # Overlapping calls of a side take turns on the stream: each reads its own answer.
            assert await asyncio.gather(call(5), call(2), call(3)) == [[5], [2], [3]]
            assert server.streams == 1 and server.served == 7
            # Cancelled in flight (the request ended): the next call has its own answer.
            pending = asyncio.ensure_future(call(3))
            await asyncio.sleep(0.1)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            assert await call(4) == [4] and server.streams == 2
            assert session.failures["draft"] == 0
            # A propose past its timeout raises and drops the lease (through Serve a while).
            with pytest.raises(asyncio.TimeoutError):
                await call(5, timeout=0.1)
            assert session.failures["draft"] == 1 and "draft" not in session._leases
            assert await call(6) is None
            session._retry_at.clear()
            await asyncio.sleep(0.4)  # the late answer to 5 would be waiting now
            assert await call(7) == [7] and server.streams == 3
            session.close()
        finally:
            if server._server is not None:
                await server._server.stop(None)

    asyncio.run(run())


def test_a_replica_that_never_answers_costs_a_call_its_timeout_only(monkeypatch):
    """A leased address that accepts the connection and never speaks (a hung process, a node
    gone without resetting its connections): the call still ends at its timeout and goes
    through Serve, where a cancelled stream alone would leave its opening write waiting."""

    async def run():
        async def silent(reader, writer):
            await asyncio.sleep(30)

        hole = await asyncio.start_server(silent, "127.0.0.1", 0)
        try:
            session = direct.SessionLeases("s", direct.Channels())
            session._leases["target"] = (f"127.0.0.1:{hole.sockets[0].getsockname()[1]}", "x")
            call = session.call("target", None, "verify", _request(1), 0.3)
            assert await asyncio.wait_for(call, 10) is None  # not the outer 10 s
            assert session.failures["target"] == 1 and "target" not in session._leases
        finally:
            hole.close()

    asyncio.run(run())


def test_a_waiting_call_that_times_out_leaves_the_call_in_flight_alone(monkeypatch):
    """Overlapping calls on one stream: the one waiting for its turn times out or is
    cancelled without ending the stream the other is reading from, which gets its answer."""
    monkeypatch.setattr(direct, "node_host", lambda: "127.0.0.1")

    async def run():
        async def propose(request):
            await asyncio.sleep(0.4 if request.session.prefix_len == 1 else 0.0)
            return worker_pb2.ProposeResponse(token_ids=[request.session.prefix_len])

        server = direct.DirectServer({"propose": propose}, idle_s=0, max_sessions=4)
        lease = server.lease("s")
        try:
            address, secret = (await lease.__anext__()).split(" ")
            calls = direct._CallStream(lambda: direct.Channels().open(address, "propose", secret))

            def call(n: int, timeout: float):
                return asyncio.ensure_future(calls.call(_propose(n), timeout))

            first, waiting = call(1, 5.0), call(2, 0.1)
            with pytest.raises(TimeoutError):
                await waiting
            cancelled = call(3, 5.0)
            await asyncio.sleep(0.05)
            cancelled.cancel()
            assert list((await first).token_ids) == [1]
            assert cancelled.cancelled() and server.streams == 1
            assert list((await call(4, 5.0)).token_ids) == [4] and server.streams == 1
            calls.end()
        finally:
            await lease.aclose()
            await server._server.stop(None)

    asyncio.run(run())
