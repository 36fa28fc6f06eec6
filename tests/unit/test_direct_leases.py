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
