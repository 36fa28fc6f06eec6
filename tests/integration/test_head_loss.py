"""A head that can die (issue 44 item 4): the GCS is killed under load and serving goes on.

A real Redis server (Debian's ``redis-server``, started here and stopped by pid) keeps the GCS's
tables (``local.up(gcs_redis=...)``), as ``gcsFaultToleranceOptions`` does on KubeRay. The
routers then run on a node of their own, and Serve runs a proxy on every node that hosts
replicas (``proxy_location: EveryNode``; the proxies of one machine share the gRPC port through
SO_REUSEPORT).

Clients enter through the router node's proxy, as they enter through the router pods' on
Kubernetes (the ``specdec-router`` Service): each client has a connection of its own, and the
test knows which node's proxy is at its other end (psutil: a proxy's session is its node's).
Under their steady greedy load every process of the head (GCS, raylet, Serve controller, its
proxy) is SIGKILLed; no request fails, requests are answered while the head is down, the head
starts again on the same port and reads its tables back from Redis, the Serve controller
recovers the replicas that kept running, and every answer is the target's own tokens.

Why not through the head's proxy: a request cut there as the head dies stalls the router
replica that served it until the head is back (seen here: 12 s, every client of that router
waiting). Ray's streaming-generator task, which every Serve request is, ends by waiting in the
replica's event loop for the dead caller to acknowledge its results
(``TaskGeneratorBackpressureWaiter::WaitAllObjectsReported``), and learns of the caller's death
only from the GCS.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import grpc
import psutil
import pytest
import yaml
from conftest import write_config
from local_service import free_port, serving

from specdec.client import build_request, call_metadata
from specdec.cluster.faults import kill_node, restart_node
from specdec.cluster.processes import prepare_driver
from specdec.config import APPLICATION
from specdec.models.tiny import PROMPTS
from specdec.v1 import specdec_pb2_grpc

pytestmark = pytest.mark.integration
NEW_TOKENS = 24
DOWN_S = 8.0  # how long the head stays dead while the load goes on
REDIS = shutil.which("redis-server")


@dataclass
class Outcome:
    started: float
    ended: float
    tokens: list[int] | None = None
    code: grpc.StatusCode | None = None
    detail: str = ""


class Client:
    """One gRPC connection of its own (no subchannel shared with the other clients), the role
    of the node whose Serve proxy it reached, and the outcome of each request of its load."""

    def __init__(self, port: int, prompt: str, info):
        self.prompt = prompt
        self.outcomes: list[Outcome] = []
        before = _our_ports(port)
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.stub = specdec_pb2_grpc.SpeculativeDecodingStub(self.channel)
        self.warm = self.generate()  # also connects, and this proxy has now routed a request
        (local_port,) = _our_ports(port) - before
        self.proxy = _proxy_role(port, local_port, info)

    def generate(self) -> list[int]:
        request = build_request(self.prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=2)
        reply = self.stub.Generate(request, metadata=call_metadata(APPLICATION), timeout=120)
        return list(reply.token_ids)

    def load(self, stop: threading.Event) -> None:
        while not stop.is_set():
            outcome = Outcome(time.monotonic(), 0.0)
            try:
                outcome.tokens = self.generate()
            except grpc.RpcError as exc:
                outcome.code, outcome.detail = exc.code(), exc.details()
            outcome.ended = time.monotonic()
            self.outcomes.append(outcome)


def _our_ports(port: int) -> set[int]:
    """Local ports of this process's TCP connections to ``port``."""
    conns = psutil.Process().net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.raddr and c.raddr.port == port}


def _proxy_role(port: int, local_port: int, info) -> str:
    """The role of the node whose process holds the server end of our connection from
    ``local_port``: a node's processes all share its ``ray start`` root's session."""
    for c in psutil.net_connections(kind="tcp"):
        if c.pid and c.laddr.port == port and c.raddr and c.raddr.port == local_port:
            return next(n.role for n in info.nodes if n.pid == os.getsid(c.pid))
    raise AssertionError(f"no server end for local port {local_port}")


def _client_on(port: int, prompt: str, info, role: str) -> Client:
    """A client whose connection reached the proxy of the ``role`` node; the kernel spreads
    new connections over the proxies, so a few tries find it."""
    for _ in range(60):
        client = Client(port, prompt, info)
        if client.proxy == role:
            return client
        client.channel.close()
    raise AssertionError(f"no connection reached the {role} node's proxy")


@pytest.fixture
def redis_address(tmp_path):
    """ "127.0.0.1:PORT" of a fresh Redis server, stopped by its pid afterwards."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (make test installs Debian's redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not listen on {port}") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_gcs_killed_under_load_serving_continues(tmp_path, tiny_pair, reference, redis_address):
    import ray
    from ray import serve
    from ray.serve import context as serve_context

    config, port = write_config(tmp_path, *tiny_pair, target_replicas=1)
    spec = yaml.safe_load(config.read_text())
    spec["proxy_location"] = "EveryNode"
    config.write_text(yaml.safe_dump(spec))
    prompts = list(PROMPTS[:2])
    expected = {p: reference(p, NEW_TOKENS) for p in prompts}

    with serving(tmp_path, config, port, gcs_redis=redis_address) as (_, info, _):
        assert {n.role for n in info.nodes} == {"head", "draft", "target", "router"}
        clients = [_client_on(port, p, info, "router") for p in prompts]
        for c in clients:
            assert c.warm == expected[c.prompt]
        # The test process is a Ray driver: a driver whose GCS stays away exits, so leave first.
        ray.shutdown()
        serve_context._disconnect()

        stop = threading.Event()
        threads = [threading.Thread(target=c.load, args=(stop,)) for c in clients]
        for t in threads:
            t.start()
        try:
            time.sleep(3)
            assert kill_node(info.state_dir, "head"), "the head had no processes to kill"
            gone_at = time.monotonic()
            time.sleep(DOWN_S)
            back_from = time.monotonic()
            restart_node(info.state_dir, "head", wait_s=120)
            back_at = time.monotonic()
            time.sleep(3)
        finally:
            stop.set()
            for t in threads:
                t.join(150)
        for c in clients:
            assert all(o.code is None for o in c.outcomes), [o.detail for o in c.outcomes if o.code]
            assert all(o.tokens == expected[c.prompt] for o in c.outcomes)
            while_down = [o for o in c.outcomes if o.started > gone_at and o.ended < back_from]
            assert while_down, [
                (round(o.started - gone_at, 2), round(o.ended - gone_at, 2)) for o in c.outcomes
            ][-5:]
            assert any(o.started > back_at for o in c.outcomes), "none answered after the restart"

        # The restarted head's Serve controller recovered the application.
        prepare_driver()
        ray.init(address=info.address, logging_level="ERROR", log_to_driver=False)
        deadline = time.monotonic() + 60
        while serve.status().applications["specdec"].status != "RUNNING":
            assert time.monotonic() < deadline, serve.status()
            time.sleep(1)
