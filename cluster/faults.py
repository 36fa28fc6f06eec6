"""Faults on the local cluster, for the tests and the soak: a node dies and comes back.

``kill_node`` SIGKILLs every process of one node (its ``ray start`` root, raylet, workers and
agents), as a machine that loses power would; ``restart_node`` starts that role's node again
with the same resources and waits until the GCS lists it alive. The head can die only on a
cluster with GCS fault tolerance (``local.up(gcs_redis=...)``): its GCS comes back on the same
port from the tables in Redis, and the other nodes reconnect to it. Only the cluster's own pids
(found through its state file, as ``down`` finds them) are ever signalled.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace
from pathlib import Path

from specdec.cluster.processes import (
    cluster_pids,
    free_ports,
    pid_alive,
    reap,
    signal_pids,
    start_node,
)
from specdec.cluster.state import (
    NODE_LABEL,
    NodeProcess,
    load_state,
    save_state,
    state_dir_path,
)
from specdec.cluster.status import gcs_nodes

DEFAULT_OBJECT_STORE_BYTES = 200_000_000


def kill_node(state_dir: Path | str | None, role: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILLs every process of the cluster's ``role`` node ("draft", "target", "router", or
    "head" where the cluster has GCS fault tolerance); returns their pids, sorted.

    Raises:
        RuntimeError: no running cluster in state_dir, the role is the head of a cluster
            without GCS fault tolerance (the cluster would be gone), or a process survived
            ``wait_s`` seconds.
    """
    info = _running(state_dir)
    if role == "head" and not info.gcs_redis:
        raise RuntimeError(
            "the head of a cluster without GCS fault tolerance is the cluster; "
            "start it with up(gcs_redis=...) to let the head die"
        )
    node = info.node(role)
    pids = cluster_pids(replace(info, nodes=(node,)), marker=False)
    signal_pids(pids, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(pid_alive(p) for p in pids):
        reap([node.pid])  # the root is our child when up() ran in this process
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of the {role} node survived SIGKILL: {pids}")
        time.sleep(0.05)
    return sorted(pids)


def restart_node(
    state_dir: Path | str | None,
    role: str,
    *,
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES,
    wait_s: float = 60.0,
) -> NodeProcess:
    """Starts the ``role`` node again (same CPUs and pool resources; ``object_store_bytes`` in
    bytes) and waits up to ``wait_s`` seconds for the GCS to list the new node alive. A head
    comes back on the cluster's GCS port and reads the GCS's tables back from Redis (the Serve
    controller restarts on it and finds the replicas that kept running). Records the node in
    the state file, so ``down`` stops it. Returns the new node.

    Raises:
        RuntimeError: no running cluster, the old node still runs, or the new one is not alive
            in time (its log is named).
    """
    info = _running(state_dir)
    old = info.node(role)
    if pid_alive(old.pid):
        raise RuntimeError(f"the {role} node (pid {old.pid}) still runs; kill_node it first")
    if role == "head":
        # `ray start --head` refuses a port that the address file of its temp dir names while
        # any raylet on this machine was started with that GCS address: ours all were.
        (Path(old.temp_dir) / "ray_current_cluster").unlink(missing_ok=True)
    (agent_port,) = free_ports(1)
    node = start_node(
        info,
        role,
        num_cpus=old.num_cpus,
        resources=old.resources,
        object_store_bytes=object_store_bytes,
        agent_port=agent_port,
    )
    info = replace(info, nodes=tuple(node if n.role == role else n for n in info.nodes))
    save_state(info)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not pid_alive(node.pid):
            raise RuntimeError(f"the restarted {role} node exited; log: {node.log_path}")
        if _alive_in_gcs(info.address, node):
            return node
        time.sleep(0.5)
    raise RuntimeError(f"the restarted {role} node is not alive after {wait_s} s: {node.log_path}")


def _alive_in_gcs(address: str, node: NodeProcess) -> bool:
    try:
        nodes = gcs_nodes(address)
    except Exception:  # a restarting head's GCS does not answer yet
        return False
    return any(
        n.get("Alive") and n.get("Labels", {}).get(NODE_LABEL) == node.node_id_label for n in nodes
    )


def _running(state_dir: Path | str | None):
    info = load_state(state_dir_path(state_dir))
    if info is None:
        raise RuntimeError(f"no local cluster running (state dir {state_dir_path(state_dir)})")
    return info
