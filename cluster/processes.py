"""The processes of a local cluster: starting a node, finding its processes, stopping them.

Each node is one ``ray start --block`` subprocess (Ray's CLI run by ``ray_start_main``, so that
its node IP stays 127.0.0.1 and its servers listen on loopback only) that we start as the leader
of a new session. Everything that node spawns (GCS, raylet, agents, and the workers the raylet
forks, which Ray moves into their own process groups but not out of the session) keeps that
session id, and also inherits a marker variable ``SPECDEC_CLUSTER_ID=<id>`` in its environment.
``cluster_pids`` finds exactly the processes matching either rule, and nothing else: no
``ray stop``, no ``pkill``. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from specdec.cluster.state import MARKER_ENV, NODE_LABEL, ROLE_LABEL, ClusterInfo, NodeProcess

# ---------------------------------------------------------------- /proc


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, session id, start ticks) of a process, or None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    rest = text[text.rindex(")") + 2 :].split()
    return rest[0], int(rest[3]), int(rest[19])


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and has not exited (a zombie has already exited)."""
    st = proc_stat(pid)
    return st is not None and st[0] not in "ZX"


def owned(node: NodeProcess) -> bool:
    """True while ``node.pid`` is still the process we started (not a recycled pid)."""
    st = proc_stat(node.pid)
    return st is not None and st[0] not in "ZX" and st[2] == node.start_ticks


def has_marker(pid: int, cluster_id: str) -> bool:
    """True when ``pid``'s environment carries ``SPECDEC_CLUSTER_ID=<cluster_id>``."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER_ENV}={cluster_id}".encode() in env.split(b"\0")


def cluster_pids(info: ClusterInfo, *, marker: bool = True) -> list[int]:
    """Live pids that belong to this cluster, sorted.

    A process belongs if it carries our environment marker (only looked at with ``marker``),
    or if it is in the session of one of our node roots and started no earlier than that root
    (so a recycled session id of a stranger never matches).
    """
    roots = {n.pid: n.start_ticks for n in info.nodes}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        st = proc_stat(pid)
        if st is None or st[0] in "ZX":
            continue
        in_session = st[1] in roots and st[2] >= roots[st[1]]
        if in_session or (marker and has_marker(pid, info.cluster_id)):
            found.append(pid)
    return sorted(found)


def rss_bytes(pids: list[int]) -> int:
    """Total resident set size of ``pids`` in bytes; pids that are gone count 0."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
    return total


# ---------------------------------------------------------------- start


# Ports the kernel never assigns on its own: below its ephemeral range (Linux:
# /proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default) and above the well-known and
# registered services most hosts run. A port taken from the ephemeral range with bind(0) was
# free a moment ago, but the dozens of sockets a starting Ray cluster opens with bind(0) (its
# workers, gRPC servers, agents) may be handed it next: CI saw Serve's HTTP proxy fail with
# "Address already in use" on such a port.
_PORT_FLOOR = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _unassigned_port_range() -> range:
    """Ports from _PORT_FLOOR up to the kernel's ephemeral range; empty where that range is
    unknown or starts lower."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(_PORT_FLOOR, low)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago, chosen where the kernel
    does not assign ports by itself (_unassigned_port_range), so that only a process that asks
    for the same port by number can take it before its user binds it. Falls back to ports the
    kernel picks (bind to 0) where that range is empty or full."""
    # All sockets stay open together, so the n ports are distinct.
    socks: list[socket.socket] = []
    candidates = list(_unassigned_port_range())
    random.shuffle(candidates)
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ---------------------------------------------------------------- environment

# Every node's address: its servers then listen on loopback only (see ray_start_main).
NODE_IP = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# Ray's switch for machines where it supports no multi-node clusters (on by default on macOS and
# Windows). Set to "0", a process resolves "this machine" to 127.0.0.1 instead of its routable
# IP, so ray.init(address="127.0.0.1:port") stays on loopback (ray/_private/services.py,
# get_node_ip_address and resolve_ip_for_localhost). It changes nothing else in a driver.
SINGLE_HOST_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def has_auth_token(env: Mapping[str, str]) -> bool:
    """Whether Ray would find an auth token of the user's in ``env``: ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` (Ray refuses to start when that file is unreadable or empty, rather
    than going on without) or ``$HOME/.ray/auth_token``; the sources of Ray's token loader,
    docs.ray.io "Token Authentication" (ray-core/internals)."""
    if env.get(TOKEN_ENV) or env.get(TOKEN_PATH_ENV):
        return True
    return (_home(env) / ".ray" / "auth_token").is_file()


def local_token_path(env: Mapping[str, str]) -> Path:
    """Where the local cluster's own token lives when the user has none:
    ``$HOME/.specdec/ray_auth_token``. One file for every local cluster of the user, not one
    per state directory: a Ray driver process loads its token once, and the test suite's
    driver connects to several clusters in turn."""
    return _home(env) / ".specdec" / "ray_auth_token"


def ensure_local_token(env: Mapping[str, str]) -> Path | None:
    """Creates the local cluster's token (32 random bytes, hex, mode 0600) unless the user has
    a token of their own (``has_auth_token``) or it exists; returns its path, or None when the
    user's token is used. Raises OSError when it cannot be written."""
    if has_auth_token(env):
        return None
    path = local_token_path(env)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.replace(path.with_suffix(".tmp"), path)
    return path


def auth_env(env: Mapping[str, str]) -> dict[str, str]:
    """The auth variables a node or driver of the local cluster adds to ``env``:
    ``RAY_AUTH_MODE`` (the caller's when set, else "token") and, when the user has no token of
    their own, ``RAY_AUTH_TOKEN_PATH`` naming the local one (``local_token_path``) if it exists.

    Ray itself turns token auth on for a token only in ``ray start --head`` and in drivers that
    find their cluster by themselves (ray/_private/worker.py, ``ray.init``: "an explicit address
    (argument or RAY_ADDRESS) never does"; ray/scripts/scripts.py, the worker-node path never
    does): left to Ray, our pool nodes and drivers would not speak to an authenticated head.
    """
    added = {AUTH_MODE_ENV: env.get(AUTH_MODE_ENV) or "token"}
    local = local_token_path(env)
    if not has_auth_token(env) and local.is_file():
        added[TOKEN_PATH_ENV] = str(local)
    return added


def _home(env: Mapping[str, str]) -> Path:
    return Path(env["HOME"]) if env.get("HOME") else Path.home()


def prepare_driver() -> None:
    """Prepares this process to connect to the local cluster (``ray.init(address=...)``, a GCS
    client such as ``status.gcs_nodes``): sets the auth variables as the nodes have them
    (``auth_env``: token mode, and the local token when the user has none) and
    ``SINGLE_HOST_ENV=0`` (Ray would otherwise rewrite the cluster's 127.0.0.1 address to the
    machine's routable IP, where nothing listens), in ``os.environ`` so that child processes
    inherit them.

    Ray reads these when it is imported and when its config is built; when Ray is already
    imported, its copies are updated too (``Config.initialize("")`` is how Ray itself re-reads
    the auth mode, ray/_private/authentication/authentication_token_setup.py). Call it before
    ``ray.init``, not while connected; calling it again changes nothing.
    """
    added = auth_env(os.environ)
    changed = any(os.environ.get(k) != v for k, v in added.items())
    os.environ.update(added)
    os.environ[SINGLE_HOST_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
    raylet = sys.modules.get("ray._raylet")
    if changed and raylet is not None:
        raylet.Config.initialize("")


# How long a raylet waits for a GCS that went away before it exits (Ray's default is 60 s, which
# a restarting head on two busy cores can overrun; KubeRay sets 600 s on worker pods of a
# cluster with GCS fault tolerance).
GCS_RECONNECT_S = 300


def gcs_redis_env(info: ClusterInfo, role: str) -> dict[str, str]:
    """What a node of a cluster with GCS fault tolerance (``info.gcs_redis``) adds to its
    environment: on the head, Ray's ``RAY_REDIS_ADDRESS`` (the GCS keeps its tables in that
    Redis) under a namespace of this cluster's own (``RAY_external_storage_namespace``), so a
    restarted head finds them; on every node, ``GCS_RECONNECT_S``. Empty without Redis."""
    if not info.gcs_redis:
        return {}
    env = {"RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_S)}
    if role == "head":
        env["RAY_REDIS_ADDRESS"] = info.gcs_redis
        env["RAY_external_storage_namespace"] = f"specdec-{info.cluster_id}"
    return env


def node_env(cluster_id: str) -> dict[str, str]:
    """The environment of a node's ``ray start``: ours, marked with ``cluster_id``, with the
    auth variables of ``auth_env`` and ``SINGLE_HOST_ENV=0`` (for every process the node starts:
    agents, workers and the Serve actors resolve this machine to 127.0.0.1, as drivers do)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # never let a user's RAY_ADDRESS steer our nodes
    env.update(
        {
            MARKER_ENV: cluster_id,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DEDUP_LOGS": "0",
            # On SIGTERM a node otherwise drains for up to 30 s to protect in-flight traffic;
            # down() stops the whole cluster, so there is no traffic to protect.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            SINGLE_HOST_ENV: "0",
            **auth_env(env),
        }
    )
    return env


def ray_start_command() -> list[str]:
    """``ray start`` as this interpreter runs it through ``ray_start_main``.

    Raises RuntimeError when Ray is not installed.
    """
    if importlib.util.find_spec("ray") is None:
        raise RuntimeError(f"Ray is not installed for {sys.executable}; install ray[serve]")
    return [sys.executable, "-m", __name__, "start"]


def ray_start_main() -> None:
    """Runs Ray's CLI (``sys.argv[1:]``, e.g. ``start --address=127.0.0.1:port ...``) keeping a
    loopback ``--node-ip-address`` and ``--address`` as given.

    Every Ray server picks its listening address from its node's IP: loopback only when that IP
    is a localhost address, all interfaces otherwise (e.g. ray/dashboard/agent.py, the agent's
    gRPC server; ray/autoscaler/_private/monitor.py, the metrics server). But on Linux
    ``ray start`` replaces a loopback node IP by the machine's routable one
    (ray/scripts/scripts.py, ``services.resolve_ip_for_localhost(node_ip_address)``), and
    ``SINGLE_HOST_ENV=0``, which would keep it, also refuses to start any non-head node. So in
    this process alone, node starts are allowed and loopback is kept; everything the node starts
    inherits ``SINGLE_HOST_ENV=0`` from ``node_env``.
    """
    from ray._private import ray_constants, services
    from ray.scripts.scripts import main

    ray_constants.ENABLE_RAY_CLUSTER = True
    services.resolve_ip_for_localhost = lambda host: host
    sys.argv[0] = "ray"
    main()


def start_node(
    info: ClusterInfo,
    role: str,
    *,
    num_cpus: int,
    resources: Mapping[str, float],
    object_store_bytes: int,
    agent_port: int,
    num_gpus: int = 0,
) -> NodeProcess:
    """Starts one node of ``info``'s cluster as ``ray start --block`` in a new session.

    The head ("head") binds ``info``'s GCS, dashboard and client ports (and, with
    ``info.gcs_redis``, keeps the GCS's tables in that Redis: ``gcs_redis_env``); any other
    role joins ``info.address``. ``object_store_bytes`` is in bytes; ``agent_port`` is the
    node's dashboard agent port; ``num_gpus`` the GPUs it advertises. The node carries the label
    ``NODE_LABEL=<random id>`` (``NodeProcess.node_id_label``). Returns at once, without waiting
    for the node to be up; its output goes to ``<state_dir>/logs/<role>.log``. Raises
    RuntimeError when ``ray`` is not installed.
    """
    node_id_label = secrets.token_hex(6)
    temp_dir = Path(info.temp_root) / role
    temp_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(info.state_dir) / "logs" / f"{role}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        *ray_start_command(),
        "--block",  # keeps `ray start` alive as the root of this node's process tree
        f"--node-ip-address={NODE_IP}",
        f"--num-cpus={num_cpus}",
        f"--num-gpus={num_gpus}",
        f"--resources={json.dumps(dict(resources))}",
        f"--labels={ROLE_LABEL}={role},{NODE_LABEL}={node_id_label}",
        f"--node-name=specdec-{role}",
        f"--object-store-memory={object_store_bytes}",
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={agent_port}",  # default 52365 would collide
        "--min-worker-port=0",  # 0/0: any free port; the default range is shared by all nodes
        "--max-worker-port=0",
        "--disable-usage-stats",
        "--log-style=record",
    ]
    if role == "head":
        cmd += [
            "--head",
            f"--port={info.gcs_port}",
            "--include-dashboard=false",
            "--dashboard-host=127.0.0.1",
            # A headless API server still starts and binds this port (default 8265 collides).
            f"--dashboard-port={info.dashboard_port}",
            f"--ray-client-server-port={info.client_port}",
        ]
    else:
        cmd.append(f"--address={info.address}")
    with open(log_path, "wb") as log:  # fresh per up(), like the Ray temp dir
        proc = subprocess.Popen(
            cmd,
            env={**node_env(info.cluster_id), **gcs_redis_env(info, role)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session: survives our exit and terminal Ctrl-C
        )
    st = proc_stat(proc.pid)
    return NodeProcess(
        role=role,
        pid=proc.pid,
        start_ticks=st[2] if st else 0,
        resources=dict(resources),
        num_cpus=num_cpus,
        temp_dir=str(temp_dir),
        log_path=str(log_path),
        node_id_label=node_id_label,
    )


# ---------------------------------------------------------------- stop


def signal_pids(pids: list[int], sig: int) -> None:
    """Sends ``sig`` to each pid, skipping those that are gone or not ours to signal."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap(pids: list[int]) -> None:
    """Collects the exit status of those ``pids`` that are exited children of this process."""
    # Roots started by this very process turn into zombies until waited for.
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def stop_nodes(info: ClusterInfo, nodes: list[NodeProcess], seen: set[int], grace_s: float) -> None:
    """SIGTERM the roots of ``nodes``, wait for their own cleanup, then SIGTERM what is left.

    Waits up to ``grace_s`` seconds for the roots, then up to min(grace_s, 3) seconds for the
    leftovers. Leftovers are orphans: e.g. a node's dashboard/runtime-env agents survive for
    minutes when its ``ray start`` root was killed hard. Every pid seen is added to ``seen``.
    """
    roots = [n.pid for n in nodes if owned(n)]
    sub = replace(info, nodes=tuple(nodes))
    seen |= set(cluster_pids(sub, marker=False))
    signal_pids(roots, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in roots):
        reap(roots)
        seen |= set(cluster_pids(sub, marker=False))  # workers forked during shutdown
        time.sleep(0.1)
    orphans = cluster_pids(sub, marker=False)
    seen |= set(orphans)
    signal_pids(orphans, signal.SIGTERM)
    deadline = time.monotonic() + min(grace_s, 3.0)
    while time.monotonic() < deadline and cluster_pids(sub, marker=False):
        time.sleep(0.1)


if __name__ == "__main__":
    ray_start_main()
