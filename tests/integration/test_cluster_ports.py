"""The local cluster opens no more than it must (docs/operations.md, "Network exposure").

Every TCP port a process of the cluster listens on is on loopback, except the two Serve servers
Ray binds to all interfaces without a setting (the gRPC proxy and each replica's
inter-deployment server), which the test names. With a Ray auth token, the cluster runs with
token auth: a driver with the token connects, one without it or with another is refused.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from specdec.cluster import local
from specdec.cluster.processes import (
    AUTH_MODE_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    auth_env,
    ensure_local_token,
    local_token_path,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the local cluster reads /proc"
    ),
]

LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp{,6}
# Ray binds these to all interfaces whatever the node's address (docs/operations.md, "Network
# exposure").
GRPC_PROXY = "ray::ProxyActor"
REPLICA = "ray::ServeReplica:"


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    process: str  # the process title (Ray names its workers ray::<actor class>)

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback
        return (mapped or ip).is_loopback


def _ip(hex_address: str) -> str:
    """The address of a /proc/net/tcp{,6} entry (host-order 32-bit words, in hex)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:  # exited
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd.path)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
    except OSError:
        return "?"


def listening(pids: list[int]) -> list[Listener]:
    """Every TCP socket in LISTEN state that one of ``pids`` holds, with its address."""
    found = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                if fields[3] == LISTEN and fields[9] in inodes:
                    address, port = fields[1].split(":")
                    found.append(Listener(_ip(address), int(port, 16), pid, _title(pid)))
    return found


def test_listening_sees_this_processes_sockets():
    """The parser itself: a listening socket is found with its address, a bound one is not."""
    with socket.socket() as server, socket.socket() as bound:
        server.bind(("127.0.0.1", 0))
        server.listen()
        bound.bind(("127.0.0.1", 0))
        mine = {(x.address, x.port) for x in listening([os.getpid()])}
        assert ("127.0.0.1", server.getsockname()[1]) in mine
        assert ("127.0.0.1", bound.getsockname()[1]) not in mine


def test_auth_is_always_token_with_the_users_token_or_a_local_one(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    env = {"HOME": str(home)}
    assert auth_env(env) == {AUTH_MODE_ENV: "token"}  # no token anywhere yet
    local_token = ensure_local_token(env)
    assert local_token == local_token_path(env) and local_token.stat().st_mode & 0o777 == 0o600
    assert len(local_token.read_text()) == 64
    assert ensure_local_token(env) == local_token  # kept, not replaced
    assert auth_env(env) == {AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(local_token)}
    # The user's own token wins: none is created and the local one is not named.
    for users in ({TOKEN_ENV: "t"}, {TOKEN_PATH_ENV: str(tmp_path / "token")}):
        assert ensure_local_token({**env, **users}) is None
        assert auth_env({**env, **users}) == {AUTH_MODE_ENV: "token"}
    (home / ".ray" / "auth_token").write_text("t")
    assert auth_env(env) == {AUTH_MODE_ENV: "token"}
    # The user's explicit choice of mode wins.
    assert auth_env({**env, AUTH_MODE_ENV: "disabled"}) == {AUTH_MODE_ENV: "disabled"}


def _named_ports(info: local.ClusterInfo) -> dict[int, str]:
    """Port -> what it is, for every port the GCS records for the cluster and its nodes."""
    from specdec.cluster.status import gcs_nodes, node_role

    names = {info.gcs_port: "GCS", info.client_port: "Ray Client server"}
    fields = {
        "NodeManagerPort": "raylet",
        "ObjectManagerPort": "object manager",
        "MetricsAgentPort": "dashboard agent gRPC",
        "MetricsExportPort": "metrics export",
        "RuntimeEnvAgentPort": "runtime env agent",
        "DashboardAgentListenPort": "dashboard agent HTTP",
    }
    for node in gcs_nodes(info.address):
        for field, what in fields.items():
            if node.get(field):
                names[node[field]] = f"{what} ({node_role(node)})"
    return names


def test_ray_listens_on_loopback_only(tmp_path):
    import ray

    with local.LocalCluster(tmp_path / "state") as info:
        ray.init(address=info.address, logging_level="ERROR", log_to_driver=False)
        try:
            # A worker on a pool node: its core worker's server listens too.
            worker = ray.get(
                ray.remote(num_cpus=0, resources={"draft_pool": 1})(lambda: os.getpid()).remote(),
                timeout=60,
            )
            listeners = listening(local.cluster_pids(info))
            named = _named_ports(info)
        finally:
            ray.shutdown()
    exposed = [x for x in listeners if not x.loopback]
    assert not exposed, "listening beyond loopback: " + "; ".join(
        f"{x.address}:{x.port} {named.get(x.port, 'unnamed')} [{x.process}]" for x in exposed
    )
    # Not vacuous: the servers the GCS knows of and the worker were all seen listening.
    seen = {x.port for x in listeners}
    assert {port: what for port, what in named.items() if port not in seen} == {}
    assert worker in {x.pid for x in listeners}
    assert info.address == f"127.0.0.1:{info.gcs_port}"


def test_serve_exposes_only_the_grpc_proxy_and_replica_servers(served):
    """With the app deployed: loopback, except the gRPC proxy's port (Serve binds it to [::],
    ray/serve/_private/grpc_util.py, start_grpc_server) and one inter-deployment gRPC server per
    replica (bound to [::]:0, ray/serve/_private/replica.py); neither has a host setting."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    _, info = served
    details = ServeInstanceDetails(**serve.context._get_global_client().get_serve_details())
    replica_pids = {
        replica.pid
        for app in details.applications.values()
        for deployment in app.deployments.values()
        for replica in deployment.replicas
    }
    listeners = listening(local.cluster_pids(info))
    ports = {x.port: x for x in listeners}
    assert ports[details.http_options.port].loopback, ports[details.http_options.port]
    grpc_proxy = ports[details.grpc_options.port]
    assert grpc_proxy.process.startswith(GRPC_PROXY) and not grpc_proxy.loopback, grpc_proxy

    exposed = [x for x in listeners if not x.loopback and x != grpc_proxy]
    assert all(x.pid in replica_pids and x.process.startswith(REPLICA) for x in exposed), exposed
    assert sorted(x.pid for x in exposed) == sorted(replica_pids)  # one server per replica


# Run inside the probing network namespace: {port: outcome} for each port of argv[2] on the
# host argv[1]: "refused" (nothing listens there for this namespace), "timeout", or the status
# code of a call made without Ray's token to Serve's inter-deployment gRPC method (a server
# behind token auth answers UNAUTHENTICATED before it reads the request).
PROBE = """
import json, socket, sys
import grpc
host, ports, outcomes = sys.argv[1], json.loads(sys.argv[2]), {}
for port in ports:
    try:
        socket.create_connection((host, port), timeout=3).close()
    except ConnectionRefusedError:
        outcomes[port] = "refused"
        continue
    except OSError as err:
        outcomes[port] = type(err).__name__
        continue
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
        try:
            call(b"", timeout=5)
            outcomes[port] = "OK"
        except grpc.RpcError as err:
            outcomes[port] = err.code().name
print(json.dumps(outcomes))
"""


@contextlib.contextmanager
def _network_namespace():
    """(namespace name, the host's address as seen from it): a network namespace joined to this
    one by a veth pair on a private /30, removed (with the pair) on exit. Skips the test where
    namespaces cannot be made (not root, no CAP_NET_ADMIN, no iproute2)."""
    tag = secrets.token_hex(3)
    name, host_end, ns_end = f"specdec-probe-{tag}", f"sdh{tag}", f"sdn{tag}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end],
        ["ip", "link", "set", ns_end, "netns", name],
        ["ip", "addr", "add", f"{subnet}.1/30", "dev", host_end],
        ["ip", "link", "set", host_end, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{subnet}.2/30", "dev", ns_end],
        ["ip", "netns", "exec", name, "ip", "link", "set", ns_end, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                if step == steps[0]:
                    pytest.skip(f"cannot make a network namespace: {done.stderr.strip()}")
                raise RuntimeError(f"{' '.join(step)}: {done.stderr.strip()}")
        yield name, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's ip")
def test_from_another_network_namespace_no_port_answers_without_the_token(served):
    """From a second network namespace (another machine on the network, as far as sockets go):
    every port the cluster's processes listen on refuses the connection (loopback only) or
    refuses a call without Ray's token (UNAUTHENTICATED), except the gRPC proxy's data port,
    which is the service itself (behind API keys when they are configured)."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    _, info = served
    details = ServeInstanceDetails(**serve.context._get_global_client().get_serve_details())
    data_port = details.grpc_options.port
    listeners = listening(local.cluster_pids(info))
    ports = sorted({x.port for x in listeners} - {data_port})
    with _network_namespace() as (namespace, host):
        inside = ["ip", "netns", "exec", namespace, sys.executable, "-c", PROBE]
        probe = subprocess.run(
            [*inside, host, json.dumps(ports)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert probe.returncode == 0, probe.stderr[-3000:]
    outcomes = {int(port): outcome for port, outcome in json.loads(probe.stdout).items()}
    answered = {
        port: (outcome, next(x.process for x in listeners if x.port == port))
        for port, outcome in outcomes.items()
        if outcome not in ("refused", "UNAUTHENTICATED")
    }
    assert not answered, answered
    # Not vacuous: the replicas' all-interfaces servers were reached, and refused the call.
    exposed = {x.port for x in listeners if not x.loopback and x.port != data_port}
    assert exposed and {outcomes[port] for port in exposed} == {"UNAUTHENTICATED"}, outcomes


# Run in fresh processes, with the environment each test gives them.
UP = """
import json, sys
from specdec.cluster import local
info = local.up(sys.argv[1])
# The environment each node's root started with (its children may overwrite their own
# /proc/<pid>/environ when they set their process title, so only the roots are read).
envs = [open(f"/proc/{n.pid}/environ").read().split("\\0") for n in info.nodes]
modes = [[e for e in env if e.startswith("RAY_AUTH_MODE=")] for env in envs]
paths = [[e for e in env if e.startswith("RAY_AUTH_TOKEN_PATH=")] for env in envs]
print(json.dumps({"address": info.address, "modes": modes, "token_paths": paths}))
"""
DOWN = "import sys; from specdec.cluster import local; local.down(sys.argv[1])"
DRIVER = """
import sys, ray
from specdec.cluster.local import prepare_driver
prepare_driver()
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
pools = [ray.remote(num_cpus=0, resources={p: 1})(lambda: 1).remote()
         for p in ("draft_pool", "target_pool")]
print("nodes", len([n for n in ray.nodes() if n["Alive"]]), "tasks", sum(ray.get(pools)))
"""


def _python(script: str, arg: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, arg], env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize("users_token", [True, False], ids=["users-token", "local-token"])
def test_auth_is_on_and_drivers_need_the_token(tmp_path, users_token):
    """In a separate environment (HOME and the token file under tmp_path, never ~/.ray): every
    node starts with RAY_AUTH_MODE=token, with the user's token or, without one, the local token
    up() created; a driver with the token connects and runs a task on each pool node, a driver
    with no token or with another token is refused by the GCS."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # A refused driver retries until this connect timeout (default 60 s).
    base["RAY_py_gcs_connect_timeout_s"] = "10"
    with_token = {**base, "HOME": str(home)}
    if users_token:
        token = tmp_path / "token"
        token.write_text(secrets.token_hex(32))
        with_token[TOKEN_PATH_ENV] = str(token)
    else:
        token = local_token_path(with_token)
    state = str(tmp_path / "state")
    up = _python(UP, state, with_token)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        started = json.loads(up.stdout.strip().splitlines()[-1])
        assert started["modes"] == [["RAY_AUTH_MODE=token"]] * 3, started
        assert started["token_paths"] == [[f"{TOKEN_PATH_ENV}={token}"]] * 3, started

        ok = _python(DRIVER, started["address"], with_token)
        assert ok.returncode == 0 and "nodes 3 tasks 2" in ok.stdout, ok.stderr[-3000:]
        # A refused driver tries to connect once a second for RAY_gcs_server_port_wait_time_s
        # (ray/_private/node.py, _init_gcs_client; 20 tries by default).
        for env, error in (({}, "token"), ({TOKEN_ENV: secrets.token_hex(32)}, "InvalidAuthToken")):
            env = {**base, "HOME": str(elsewhere), **env, "RAY_gcs_server_port_wait_time_s": "3"}
            refused = _python(DRIVER, started["address"], env)
            assert refused.returncode != 0, refused.stdout
            assert error in refused.stderr, refused.stderr[-3000:]
    finally:
        down = _python(DOWN, state, with_token)
        assert down.returncode == 0, down.stderr[-3000:]
