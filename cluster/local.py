"""A real three-node Ray cluster on this one machine: ``up``, ``down``, ``address``.

Nodes: a **head** (GCS, Serve controller and proxy, no model replicas), a **draft** node
advertising the custom resource ``draft_pool`` and a **target** node advertising
``target_pool``. Deployments request those resources, so the same Serve config that places
draft and target replicas on separate KubeRay worker groups places them on separate nodes here.
With GCS fault tolerance (``up(gcs_redis=...)``) a fourth node, **router**, hosts the routers,
so that they outlive the head, as the router-pool pods do on Kubernetes.

How a node's processes are started, found and stopped is in ``processes``; the state file
(``<state_dir>/cluster.json``) in ``state``; ``status()`` in ``status``. The public names of
those modules that callers use are re-exported here. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdec.cluster.processes import (
    NODE_IP,
    cluster_pids,
    ensure_local_token,
    free_ports,
    owned,
    pid_alive,
    prepare_driver,
    reap,
    rss_bytes,
    signal_pids,
    start_node,
    stop_nodes,
)
from specdec.cluster.state import (
    MARKER_ENV,
    POOLS,
    ROLE_LABEL,
    ROUTER_POOL,
    STATE_DIR_ENV,
    STATE_FILE,
    ClusterInfo,
    NodeProcess,
    load_state,
    save_state,
    state_dir_path,
)
from specdec.cluster.status import format_status, gcs_nodes, node_role, status

__all__ = [
    "MARKER_ENV",
    "MB",
    "POOLS",
    "ROLE_LABEL",
    "ROUTER_POOL",
    "STATE_DIR_ENV",
    "STATE_FILE",
    "ClusterInfo",
    "LocalCluster",
    "NodeProcess",
    "address",
    "cluster_pids",
    "down",
    "format_status",
    "prepare_driver",
    "state_dir_path",
    "status",
    "up",
]

MB = 1_000_000


# ---------------------------------------------------------------- up


def _fail(info: ClusterInfo, message: str) -> RuntimeError:
    logs = ", ".join(n.log_path for n in info.nodes)
    return RuntimeError(
        f"{message}; logs: {logs}; Ray logs under {info.temp_root}/<role>/session_latest/logs"
    )


def _wait_port(info: ClusterInfo, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not pid_alive(info.node("head").pid):
            raise _fail(info, "the head node exited during startup")
        with (
            contextlib.suppress(OSError),
            socket.create_connection((NODE_IP, info.gcs_port), 0.5),
        ):
            return
        time.sleep(0.2)
    raise _fail(info, f"GCS did not listen on port {info.gcs_port} in time")


def _node_problems(info: ClusterInfo) -> list[str]:
    """What is still missing before the cluster is ready (empty list: ready)."""

    try:
        nodes = gcs_nodes(info.address)
    except Exception as exc:  # GCS still starting
        return [f"GCS not answering ({type(exc).__name__}: {exc})"]
    alive = {node_role(n): n for n in nodes if n.get("Alive")}
    problems = []
    for want in info.nodes:
        node = alive.get(want.role)
        if node is None:
            problems.append(f"{want.role} node not alive")
            continue
        have = {k: v for k, v in node.get("Resources", {}).items() if k in (*POOLS, ROUTER_POOL)}
        if have != want.resources:
            problems.append(f"{want.role} node advertises {have}, expected {want.resources}")
    return problems


def _wait_nodes(info: ClusterInfo, deadline: float) -> None:
    problems = ["not checked"]
    while time.monotonic() < deadline:
        dead = [n.role for n in info.nodes if not owned(n)]
        if dead:
            raise _fail(info, f"node(s) {dead} exited during startup")
        problems = _node_problems(info)
        if not problems:
            return
        time.sleep(0.5)
    raise _fail(info, "cluster not ready in time: " + "; ".join(problems))


def up(
    state_dir: Path | str | None = None,
    *,
    object_store_bytes: int = 200 * MB,
    head_port: int | None = None,
    head_cpus: int = 1,
    worker_cpus: int = 1,
    draft_resources: Mapping[str, float] | None = None,
    target_resources: Mapping[str, float] | None = None,
    target_gpus: int = 0,
    gcs_redis: str | None = None,
    wait_s: float = 60.0,
) -> ClusterInfo:
    """Start the head, draft and target nodes and wait until all three are alive.

    Args:
        state_dir: where the state file and `ray start` logs go (see ``state_dir_path``).
        object_store_bytes: object store size of each node, in bytes (Ray's minimum ~75 MB).
        head_port: GCS port; None picks a free one, so several clusters can coexist.
        head_cpus: logical CPUs of the head. The Serve controller and proxies need 0 CPUs;
            1 lets a plain task or driver-side actor still run there.
        worker_cpus: logical CPUs of each pool node (replicas request 0 CPUs plus a pool).
        draft_resources / target_resources: custom resources of the pool nodes; default
            ``{"draft_pool": 100}`` and ``{"target_pool": 100}``.
        target_gpus: GPUs the target node advertises (the other nodes none): 1 on a one-GPU
            machine serves deployments/config/one-gpu.yaml, whose draft and target replicas
            share that GPU by fractional ``num_gpus``.
        gcs_redis: "host:port" of a running Redis: the GCS keeps its tables there (Ray's GCS
            fault tolerance), so the head can die and be started again
            (``faults.restart_node``) while the other nodes, and the replicas on them, keep
            running. The routers then need a node that survives the head: a fourth node,
            "router", advertises ``router_pool`` instead of the head.
        wait_s: seconds to wait for all nodes to be alive with their resources.

    Every node listens on 127.0.0.1 only (see ``processes.ray_start_main``), and token auth is
    always on: with the caller's Ray auth token, else with the local one, created on first use
    (``processes.ensure_local_token``, ``processes.auth_env``). This process is prepared to
    connect to the cluster as a driver (``prepare_driver``); another process calls
    ``prepare_driver`` itself before ``ray.init(address=...)``.

    Returns the ClusterInfo, also written to ``<state_dir>/cluster.json``.

    Raises:
        ValueError: ``gcs_redis`` is not "host:port", or nothing listens there.
        RuntimeError: a cluster from this state_dir is already running, or the cluster did
            not come up within ``wait_s`` (the message names the logs; whatever was started
            has been stopped again).
    """
    t0 = time.monotonic()
    if gcs_redis is not None:
        _check_redis(gcs_redis)
    sd = state_dir_path(state_dir)
    sd.mkdir(parents=True, exist_ok=True)
    _clear_stale(sd)
    ensure_local_token(os.environ)
    prepare_driver()  # up() itself reads the GCS node table
    # Ray's socket paths must stay under ~107 bytes, so the temp root is short and fixed per
    # state_dir; it is wiped on the next up() but outlives down() for post-mortem logs.
    temp_root = Path("/tmp") / f"specdec-{hashlib.sha1(str(sd).encode()).hexdigest()[:10]}"
    shutil.rmtree(temp_root, ignore_errors=True)
    gcs, dash, client, *agents = free_ports(7)
    gcs = head_port or gcs
    info = ClusterInfo(
        address=f"{NODE_IP}:{gcs}",
        gcs_port=gcs,
        dashboard_port=dash,
        client_port=client,
        cluster_id=os.urandom(6).hex(),
        state_dir=str(sd),
        temp_root=str(temp_root),
        gcs_redis=gcs_redis or "",
    )
    routers = {ROUTER_POOL: 100}
    specs = [
        ("head", head_cpus, {} if gcs_redis else routers),
        ("draft", worker_cpus, dict(draft_resources or {"draft_pool": 100})),
        ("target", worker_cpus, dict(target_resources or {"target_pool": 100})),
        *([("router", worker_cpus, routers)] if gcs_redis else []),
    ]
    deadline = t0 + wait_s
    try:
        for (role, cpus, res), agent_port in zip(specs, agents):
            node = start_node(
                info,
                role,
                num_cpus=cpus,
                resources=res,
                object_store_bytes=object_store_bytes,
                agent_port=agent_port,
                num_gpus=target_gpus if role == "target" else 0,
            )
            info = replace(info, nodes=info.nodes + (node,))
            save_state(info)  # record every pid as soon as it exists, so down() can clean up
            if role == "head":
                _wait_port(info, deadline)  # workers need the GCS before they can join
        _wait_nodes(info, deadline)
    except BaseException:
        down(sd)
        raise
    # Record the address exactly as the cluster itself reports it: were Ray to rewrite the
    # loopback node IP again (see processes.ray_start_main), drivers would follow.
    head_ip = next(
        n["NodeManagerAddress"]
        for n in gcs_nodes(info.address)
        if n.get("Alive") and node_role(n) == "head"
    )
    info = replace(
        info,
        address=f"{head_ip}:{info.gcs_port}",
        startup_s=round(time.monotonic() - t0, 2),
        rss_bytes=rss_bytes(cluster_pids(info)),
    )
    save_state(info)
    return info


def _check_redis(address: str) -> None:
    """Refuses, before anything starts, a ``gcs_redis`` that is no "host:port" or where nothing
    listens: a GCS that cannot reach its Redis retries for minutes instead of failing."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        raise ValueError(f"gcs_redis must be HOST:PORT of a running Redis, got {address!r}")
    try:
        socket.create_connection((host, int(port)), 2.0).close()
    except OSError as exc:
        raise ValueError(f"gcs_redis: nothing answers at {address} ({exc})") from None


def _clear_stale(sd: Path) -> None:
    info = load_state(sd)
    if info is None:
        return
    if any(owned(n) for n in info.nodes):
        raise RuntimeError(
            f"a local cluster is already running at {info.address} (state in {sd}); "
            "stop it first (`specdec cluster down`, or down())"
        )
    down(sd)  # a crashed cluster: sweep whatever it left and drop the state file


# ---------------------------------------------------------------- down


def down(
    state_dir: Path | str | None = None, *, grace_s: float = 10.0, keep_logs: bool = True
) -> list[int]:
    """Stop every process of the local cluster and remove its state file.

    SIGTERM goes to each node's ``ray start --block`` root, which stops its raylet (taking
    the raylet's workers with it), agents and, on the head, the GCS; pool nodes go first, as
    a raylet whose GCS is already gone stalls its shutdown for seconds. Once a root has exited
    (or ``grace_s`` seconds passed), what is left of its node gets SIGTERM, and finally any
    process of the cluster still alive (see ``cluster_pids``) gets SIGKILL. Idempotent: with no
    state file it does nothing and returns [].

    ``keep_logs=False`` also deletes the Ray temp dir (session
    dirs and logs, ~0.5 MB); by default it stays for post-mortems until the next ``up()``.

    Returns the sorted pids that were stopped (node roots and everything found below them).

    Raises RuntimeError if a process of the cluster survives SIGKILL (the state file is kept).
    """
    sd = state_dir_path(state_dir)
    info = load_state(sd)
    if info is None:
        return []
    seen = set(cluster_pids(info))
    for group in (("draft", "target", "router"), ("head",)):
        stop_nodes(info, [n for n in info.nodes if n.role in group], seen, grace_s)
    leftovers = cluster_pids(info)  # stragglers of any node, and marker-only processes
    seen |= set(leftovers)
    signal_pids(leftovers, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while (still := cluster_pids(info)) and time.monotonic() < deadline:
        reap([n.pid for n in info.nodes])
        time.sleep(0.1)
    if still:
        raise RuntimeError(f"processes {still} of the local cluster survived SIGKILL")
    reap([n.pid for n in info.nodes])  # if up() ran in this process, the roots are our zombies
    (sd / STATE_FILE).unlink(missing_ok=True)
    if not keep_logs:
        shutil.rmtree(info.temp_root, ignore_errors=True)
    return sorted(seen)


# ---------------------------------------------------------------- address


def address(state_dir: Path | str | None = None) -> str:
    """GCS address ("ip:port") of the running local cluster; a driver connects to it after
    ``prepare_driver()`` (the auth mode and loopback address of the nodes).

    Raises RuntimeError when no cluster from this state_dir is running.
    """
    sd = state_dir_path(state_dir)
    info = load_state(sd)
    if info is None or not owned(info.node("head")):
        raise RuntimeError(f"no local cluster running (state dir {sd}); start one with up()")
    return info.address


# ---------------------------------------------------------------- tests


class LocalCluster(contextlib.AbstractContextManager):
    """``with LocalCluster(tmp_path) as info:`` brings the cluster up and always tears it down.

    Keyword arguments go to ``up()``. On a clean exit the Ray temp dir is deleted too (tests
    use a fresh state dir each time, so it would pile up in /tmp); after an exception it is
    kept for the logs. ``stopped`` holds ``down()``'s pids afterwards.
    """

    def __init__(self, state_dir: Path | str | None = None, **up_kwargs: Any):
        self.state_dir = state_dir_path(state_dir)
        self.up_kwargs = up_kwargs
        self.info: ClusterInfo | None = None
        self.stopped: list[int] = []

    def __enter__(self) -> ClusterInfo:
        self.info = up(self.state_dir, **self.up_kwargs)
        return self.info

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.stopped = down(self.state_dir, keep_logs=exc_type is not None)
