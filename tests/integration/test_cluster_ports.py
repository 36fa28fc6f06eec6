"""The local cluster opens no more than it must (docs/operations.md, "Network exposure").

Every TCP port a process of the cluster listens on is on loopback, except the two Serve servers
Ray binds to all interfaces without a setting (the gRPC proxy and each replica's
inter-deployment server), which the test names. With a Ray auth token, the cluster runs with
token auth: a driver with the token connects, one without it or with another is refused.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from specdec.cluster import local
from specdec.cluster.processes import AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, auth_mode

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


def test_auth_mode_is_token_when_the_user_has_a_token(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    assert auth_mode({"HOME": str(home)}) == "disabled"
    assert auth_mode({"HOME": str(home), TOKEN_ENV: "t"}) == "token"
    assert auth_mode({"HOME": str(home), TOKEN_PATH_ENV: str(tmp_path / "token")}) == "token"
    (home / ".ray" / "auth_token").write_text("t")
    assert auth_mode({"HOME": str(home)}) == "token"
    # The user's explicit choice wins both ways.
    assert auth_mode({"HOME": str(home), AUTH_MODE_ENV: "disabled"}) == "disabled"
    assert auth_mode({"HOME": str(tmp_path), AUTH_MODE_ENV: "token"}) == "token"


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


# Run in fresh processes, with the environment each test gives them.
UP = """
import json, sys
from specdec.cluster import local
info = local.up(sys.argv[1])
# The environment each node's root started with (its children may overwrite their own
# /proc/<pid>/environ when they set their process title, so only the roots are read).
envs = [open(f"/proc/{n.pid}/environ").read().split("\\0") for n in info.nodes]
modes = [[e for e in env if e.startswith("RAY_AUTH_MODE=")] for env in envs]
print(json.dumps({"address": info.address, "modes": modes}))
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


def test_a_token_turns_auth_on_and_drivers_need_it(tmp_path):
    """In a separate environment (HOME and the token file under tmp_path, never ~/.ray): every
    node starts with RAY_AUTH_MODE=token; a driver with the token connects and runs a task on
    each pool node, a driver with no token or with another token is refused by the GCS."""
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    home = tmp_path / "home"
    home.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    base["HOME"] = str(home)
    # A refused driver retries until this connect timeout (default 60 s).
    base["RAY_py_gcs_connect_timeout_s"] = "10"
    with_token = {**base, TOKEN_PATH_ENV: str(token)}
    state = str(tmp_path / "state")
    up = _python(UP, state, with_token)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        started = json.loads(up.stdout.strip().splitlines()[-1])
        assert started["modes"] == [["RAY_AUTH_MODE=token"]] * 3, started

        ok = _python(DRIVER, started["address"], with_token)
        assert ok.returncode == 0 and "nodes 3 tasks 2" in ok.stdout, ok.stderr[-3000:]
        # A refused driver tries to connect once a second for RAY_gcs_server_port_wait_time_s
        # (ray/_private/node.py, _init_gcs_client; 20 tries by default).
        for env in ({}, {TOKEN_ENV: secrets.token_hex(32)}):
            env = {**base, **env, "RAY_gcs_server_port_wait_time_s": "3"}
            refused = _python(DRIVER, started["address"], env)
            assert refused.returncode != 0, refused.stdout
            assert "InvalidAuthToken" in refused.stderr, refused.stderr[-3000:]
    finally:
        down = _python(DOWN, state, with_token)
        assert down.returncode == 0, down.stderr[-3000:]
