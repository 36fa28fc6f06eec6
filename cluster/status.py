"""What the local cluster is doing: its nodes as the GCS sees them, Serve apps and replicas.

Ray is imported inside the functions that need it, so the rest of ``specdec.cluster`` loads
without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from specdec.cluster.processes import (
    GCS_RECONNECT_S,
    cluster_pids,
    owned,
    prepare_driver,
    rss_bytes,
)
from specdec.cluster.state import (
    NODE_LABEL,
    POOLS,
    ROLE_LABEL,
    ClusterInfo,
    load_state,
    state_dir_path,
)


def gcs_nodes(address: str) -> list[dict[str, Any]]:
    """The GCS node table (same records as ``ray.nodes()``) without becoming a Ray driver.

    ``address`` is the GCS "ip:port". The state API (``ray.util.state``) is served by the
    dashboard's HTTP server, which ``--include-dashboard=false`` turns off, so we read the GCS
    directly, as Ray's own ``ray.cluster_utils`` does. Raises whatever Ray raises while the GCS
    does not answer.
    """
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

    prepare_driver()  # the GCS refuses a client without the token when auth is on
    state = GlobalState()
    state._initialize_global_state(
        GcsClientOptions.create(
            address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False
        )
    )
    try:
        return state.node_table()
    finally:
        state.disconnect()


def node_role(node: Mapping[str, Any]) -> str:
    """The role label ("head", "draft", "target", "router") of a GCS node record; "?" when
    unlabelled."""
    return node.get("Labels", {}).get(ROLE_LABEL, "?")


@contextlib.contextmanager
def _driver(addr: str) -> Iterator[None]:
    import ray

    if ray.is_initialized():  # reuse the caller's connection; it is theirs to shut down
        connected = ray.get_runtime_context().gcs_address
        if connected != addr:
            raise RuntimeError(
                f"this process is connected to Ray at {connected}, not the local cluster at {addr}"
            )
        yield
        return
    prepare_driver()
    ray.init(address=addr, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def status(state_dir: Path | str | None = None) -> dict[str, Any]:
    """Nodes, Serve applications and replica placement of the local cluster.

    Connects as a Ray driver for the call, or reuses this process's connection to the same
    cluster. Returns a dict: ``running`` (bool: the head is up), ``address``, ``state_dir``,
    ``processes`` and ``rss_bytes`` (all cluster processes, now), ``nodes`` (role, node_id,
    alive, pid, resources, pool; a node that died is listed with alive False),
    ``applications`` (name -> status, deployments -> status, target_replicas,
    replica_states, replicas_by_node {role: count}) and ``system_actors`` (Serve controller
    and proxies with their node role). Serve is never started just to look.

    A stopped cluster gives ``{"running": False, "state_dir": ...}``; one whose head is down
    while other nodes still run adds ``nodes_up`` (their roles) and ``gcs_redis``. Raises
    RuntimeError if this process is already connected to a different Ray cluster.
    """
    sd = state_dir_path(state_dir)
    info = load_state(sd)
    result: dict[str, Any] = {"running": False, "state_dir": str(sd)}
    if info is None:
        return result
    if not owned(info.node("head")):
        up = [n.role for n in info.nodes if n.role != "head" and owned(n)]
        if up:
            result.update(nodes_up=up, gcs_redis=info.gcs_redis)
        return result
    pids = cluster_pids(info)
    result.update(address=info.address, processes=len(pids), rss_bytes=rss_bytes(pids))
    with _driver(info.address):
        import ray

        nodes = ray.nodes()  # one GCS per up(): every node listed is one of ours
        roles = {n["NodeID"]: node_role(n) for n in nodes if n.get("Alive")}
        order = {n.role: i for i, n in enumerate(info.nodes)}
        result["nodes"] = sorted(
            (_node_summary(n, info) for n in nodes), key=lambda n: order.get(n["role"], 99)
        )
        result["applications"], result["system_actors"] = _serve_summary(roles)
    result["running"] = True
    return result


def _node_summary(node: Mapping[str, Any], info: ClusterInfo) -> dict[str, Any]:
    role = node_role(node)
    res = node.get("Resources", {})
    shown = {k: v for k, v in res.items() if k in ("CPU", "GPU") + POOLS}
    # The node process of this record: a node that died and was restarted left a record of
    # the same role behind, which its label tells apart.
    label = node.get("Labels", {}).get(NODE_LABEL)
    proc = next((n for n in info.nodes if n.role == role and n.node_id_label == label), None)
    pool = next((p for p in POOLS if p in res), None)
    # The GCS notices a dead node only after its health checks time out; the root process
    # tells at once.
    alive = bool(node["Alive"]) and proc is not None and owned(proc)
    return {
        "role": role,
        "node_id": node["NodeID"],
        "alive": alive,
        "pid": proc and proc.pid,
        "resources": shown,
        "pool": pool,
    }


def _serve_details() -> dict[str, Any] | None:
    """Serve's own view (what its REST API returns): apps, deployments, replicas with node ids.

    ``serve.status()`` builds its answer from this same call but drops the replica placement,
    and the state API is unavailable without the dashboard's HTTP server.
    """
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else client.get_serve_details()


def _text(value: Any) -> str:
    return str(getattr(value, "value", value))  # Serve's status enums -> "RUNNING"


def _serve_summary(roles: Mapping[str, str]) -> tuple[dict, list]:
    details = _serve_details()
    if details is None:  # Serve not started: do not start it just to look
        return {}, []
    system = [
        {
            "class": "ServeController",
            "role": roles.get(details["controller_info"].get("node_id"), "?"),
        }
    ]
    system += [
        {"class": "ProxyActor", "role": roles.get(p.get("node_id"), "?")}
        for p in details.get("proxies", {}).values()
    ]
    apps: dict[str, Any] = {}
    for name, app in details.get("applications", {}).items():
        apps[name] = {"status": _text(app["status"]), "deployments": {}}
        for dname, d in app.get("deployments", {}).items():
            states: dict[str, int] = {}
            where: dict[str, int] = {}
            for r in d.get("replicas", []):
                states[_text(r["state"])] = states.get(_text(r["state"]), 0) + 1
                role = roles.get(r.get("node_id"), "?")
                where[role] = where.get(role, 0) + 1
            apps[name]["deployments"][dname] = {
                "status": _text(d["status"]),
                "target_replicas": d.get("target_num_replicas"),
                "replica_states": states,
                "replicas_by_node": where,
            }
    return apps, system


def format_status(st: Mapping[str, Any]) -> str:
    """Human-readable text for a ``status()`` dict."""
    if st.get("nodes_up"):
        back = (
            'faults.restart_node(state_dir, "head") brings it back; they exit '
            f"{GCS_RECONNECT_S} s after it died"
            if st["gcs_redis"]
            else "no GCS fault tolerance: `specdec cluster down` stops them"
        )
        return (
            f"local cluster: the head is down, {', '.join(st['nodes_up'])} still running "
            f"({back}; state dir {st['state_dir']})"
        )
    if not st.get("running"):
        return f"local cluster: not running (state dir {st.get('state_dir')})"
    lines = [
        f"local cluster {st['address']}  ({st['processes']} processes, "
        f"RSS {st['rss_bytes'] / 2**30:.2f} GiB, state {st['state_dir']})",
        "nodes:",
    ]
    for n in st["nodes"]:
        res = ", ".join(f"{k} {v:g}" for k, v in sorted(n["resources"].items()))
        lines.append(
            f"  {n['role']:<7} {'alive' if n['alive'] else 'DEAD':<6}"
            f" {n['node_id'][:12]}  pid {n['pid'] or '-'}  {res}"
        )
    system = ", ".join(f"{a['class']}@{a['role']}" for a in st.get("system_actors", []))
    lines.append(f"serve: {system or 'not started'}")
    for app, a in st.get("applications", {}).items():
        lines.append(f"  app {app}: {a['status']}")
        for dname, d in a["deployments"].items():
            states = ", ".join(f"{k} {v}" for k, v in d["replica_states"].items()) or "no replicas"
            where = ", ".join(f"{r} {c}" for r, c in sorted(d["replicas_by_node"].items())) or "-"
            lines.append(f"    {dname:<16} {d['status']:<10} {states:<20} on: {where}")
    return "\n".join(lines)
