"""A real three-node Ray cluster on this one machine.

Nodes: a **head** (GCS, Serve controller and proxy, no model replicas), a **draft** node
advertising the custom resource ``draft_pool`` and a **target** node advertising
``target_pool``. Deployments request those resources, so the same Serve config that places
draft and target replicas on separate KubeRay worker groups places them on separate nodes here.

Each node is one ``ray start --block`` subprocess that we start as the leader of a new
session. Everything that node spawns (GCS, raylet, agents, and the workers the raylet forks,
which Ray moves into their own process groups but not out of the session) keeps that session
id, and also inherits a marker variable ``SPECDEC_CLUSTER_ID=<id>`` in its environment. ``down()``
stops exactly the processes matching either rule, and nothing else: no ``ray stop``, no
``pkill``.

The running cluster is described by ``<state_dir>/cluster.json``; ``state_dir`` defaults to
``$SPECDEC_CLUSTER_DIR`` or ``~/.specdec/cluster``. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

STATE_FILE = "cluster.json"
STATE_DIR_ENV = "SPECDEC_CLUSTER_DIR"
MARKER_ENV = "SPECDEC_CLUSTER_ID"
ROLE_LABEL = "specdec/role"
POOLS = ("draft_pool", "target_pool")
MB = 1_000_000


@dataclass(frozen=True)
class NodeProcess:
    """One node: the ``ray start --block`` process at the root of its process tree."""

    role: str  # "head" | "draft" | "target"
    pid: int  # also the session id of every process of this node
    start_ticks: int  # /proc/<pid>/stat starttime: tells our pid from a reused one
    resources: dict[str, float]  # custom resources advertised (CPU excluded)
    num_cpus: int
    temp_dir: str  # Ray's --temp-dir for this node (session dir and logs live below)
    log_path: str  # stdout/stderr of `ray start`


@dataclass(frozen=True)
class ClusterInfo:
    """What ``up()`` started; persisted as JSON in ``<state_dir>/cluster.json``."""

    address: str  # GCS address "ip:port" as the cluster advertises it, for ray.init(address=...)
    gcs_port: int
    dashboard_port: int  # Ray's headless API server (no HTTP without the dashboard)
    client_port: int  # Ray Client server on the head
    cluster_id: str
    state_dir: str
    temp_root: str
    nodes: tuple[NodeProcess, ...] = ()
    startup_s: float = 0.0
    rss_bytes: int = 0  # total RSS of the cluster's processes right after startup

    def node(self, role: str) -> NodeProcess:
        return next(n for n in self.nodes if n.role == role)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterInfo:
        raw = json.loads(text)
        raw["nodes"] = tuple(NodeProcess(**n) for n in raw.get("nodes", ()))
        return cls(**raw)


# ---------------------------------------------------------------- state file


def state_dir_path(state_dir: Path | str | None = None) -> Path:
    """The state directory: the argument, else ``$SPECDEC_CLUSTER_DIR``, else ``~/.specdec/cluster``."""
    if state_dir is None:
        state_dir = os.environ.get(STATE_DIR_ENV) or Path.home() / ".specdec" / "cluster"
    return Path(state_dir).expanduser().resolve()


def _load(state_dir: Path) -> ClusterInfo | None:
    path = state_dir / STATE_FILE
    return ClusterInfo.from_json(path.read_text()) if path.exists() else None


def _save(info: ClusterInfo) -> None:
    # Write-then-rename so a crash never leaves a half-written state file behind.
    path = Path(info.state_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(info.to_json())
    os.replace(tmp, path)


# ---------------------------------------------------------------- /proc helpers


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, session id, start ticks) of a process, or None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    rest = text[text.rindex(")") + 2 :].split()
    return rest[0], int(rest[3]), int(rest[19])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in "ZX"  # a zombie has already exited


def _has_marker(pid: int, cluster_id: str) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER_ENV}={cluster_id}".encode() in env.split(b"\0")


def cluster_pids(info: ClusterInfo, *, marker: bool = True) -> list[int]:
    """Live pids that belong to this cluster.

    A process belongs if it carries our environment marker, or if it is in the session of one
    of our node roots and started no earlier than that root (so a recycled session id of a
    stranger never matches).
    """
    roots = {n.pid: n.start_ticks for n in info.nodes}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        st = _stat(pid)
        if st is None or st[0] in "ZX":
            continue
        in_session = st[1] in roots and st[2] >= roots[st[1]]
        if in_session or (marker and _has_marker(pid, info.cluster_id)):
            found.append(pid)
    return sorted(found)


def _rss_bytes(pids: list[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
    return total


# ---------------------------------------------------------------- up


def _free_ports(n: int) -> list[int]:
    # Hold all sockets open together so the n ports are distinct; the kernel will not hand
    # them out again for a while, which leaves Ray time to bind them.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ray_executable() -> str:
    exe = Path(sys.executable).parent / "ray"
    if not exe.exists():
        raise RuntimeError(f"no `ray` executable next to {sys.executable}; install ray[serve]")
    return str(exe)


def _node_env(cluster_id: str) -> dict[str, str]:
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
        }
    )
    # Unset, Ray turns token auth on whenever ~/.ray/auth_token happens to exist, and then
    # drivers connecting with an explicit address are refused. Be explicit; honour a choice
    # the caller made in their environment (their drivers will share it).
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env


def _start_node(
    info: ClusterInfo,
    role: str,
    *,
    num_cpus: int,
    resources: Mapping[str, float],
    object_store_bytes: int,
    agent_port: int,
) -> NodeProcess:
    temp_dir = Path(info.temp_root) / role
    temp_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(info.state_dir) / "logs" / f"{role}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    head = role == "head"
    cmd = [
        _ray_executable(),
        "start",
        "--block",  # keeps `ray start` alive as the root of this node's process tree
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        f"--resources={json.dumps(dict(resources))}",
        f"--labels={ROLE_LABEL}={role}",
        f"--node-name=specdec-{role}",
        f"--object-store-memory={object_store_bytes}",
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={agent_port}",  # default 52365 would collide
        "--min-worker-port=0",  # 0/0: any free port; the default range is shared by all nodes
        "--max-worker-port=0",
        "--disable-usage-stats",
        "--log-style=record",
    ]
    if head:
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
            env=_node_env(info.cluster_id),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session: survives our exit and terminal Ctrl-C
        )
    st = _stat(proc.pid)
    return NodeProcess(
        role=role,
        pid=proc.pid,
        start_ticks=st[2] if st else 0,
        resources=dict(resources),
        num_cpus=num_cpus,
        temp_dir=str(temp_dir),
        log_path=str(log_path),
    )


def _fail(info: ClusterInfo, message: str) -> RuntimeError:
    logs = ", ".join(n.log_path for n in info.nodes)
    return RuntimeError(
        f"{message}; logs: {logs}; Ray logs under {info.temp_root}/<role>/session_latest/logs"
    )


def _wait_port(info: ClusterInfo, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not _alive(info.node("head").pid):
            raise _fail(info, "the head node exited during startup")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", info.gcs_port), 0.5),
        ):
            return
        time.sleep(0.2)
    raise _fail(info, f"GCS did not listen on port {info.gcs_port} in time")


def _gcs_nodes(address: str) -> list[dict[str, Any]]:
    """The GCS node table (same records as ``ray.nodes()``) without becoming a Ray driver.

    The state API (``ray.util.state``) is served by the dashboard's HTTP server, which
    ``--include-dashboard=false`` turns off, so we read the GCS directly, as Ray's own
    ``ray.cluster_utils`` does.
    """
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

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


def _node_problems(info: ClusterInfo) -> list[str]:
    """What is still missing before the cluster is ready (empty list: ready)."""

    try:
        nodes = _gcs_nodes(info.address)
    except Exception as exc:  # GCS still starting
        return [f"GCS not answering ({type(exc).__name__}: {exc})"]
    alive = {_role(n): n for n in nodes if n.get("Alive")}
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
        dead = [n.role for n in info.nodes if not _owned(n)]
        if dead:
            raise _fail(info, f"node(s) {dead} exited during startup")
        problems = _node_problems(info)
        if not problems:
            return
        time.sleep(0.5)
    raise _fail(info, "cluster not ready in time: " + "; ".join(problems))


ROUTER_POOL = "router_pool"  # the head advertises it so the router stays off the model nodes


def up(
    state_dir: Path | str | None = None,
    *,
    object_store_bytes: int = 200 * MB,
    head_port: int | None = None,
    head_cpus: int = 1,
    worker_cpus: int = 1,
    draft_resources: Mapping[str, float] | None = None,
    target_resources: Mapping[str, float] | None = None,
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
        wait_s: seconds to wait for all nodes to be alive with their resources.

    Returns the ClusterInfo, also written to ``<state_dir>/cluster.json``.

    Raises:
        RuntimeError: a cluster from this state_dir is already running, or the cluster did
            not come up within ``wait_s`` (the message names the logs; whatever was started
            has been stopped again).
    """
    t0 = time.monotonic()
    sd = state_dir_path(state_dir)
    sd.mkdir(parents=True, exist_ok=True)
    _clear_stale(sd)
    # Ray's socket paths must stay under ~107 bytes, so the temp root is short and fixed per
    # state_dir; it is wiped on the next up() but outlives down() for post-mortem logs.
    temp_root = Path("/tmp") / f"specdec-{hashlib.sha1(str(sd).encode()).hexdigest()[:10]}"
    shutil.rmtree(temp_root, ignore_errors=True)
    gcs, dash, client, *agents = _free_ports(6)
    gcs = head_port or gcs
    info = ClusterInfo(
        address=f"127.0.0.1:{gcs}",
        gcs_port=gcs,
        dashboard_port=dash,
        client_port=client,
        cluster_id=os.urandom(6).hex(),
        state_dir=str(sd),
        temp_root=str(temp_root),
    )
    specs = [
        ("head", head_cpus, {ROUTER_POOL: 100}),
        ("draft", worker_cpus, dict(draft_resources or {"draft_pool": 100})),
        ("target", worker_cpus, dict(target_resources or {"target_pool": 100})),
    ]
    deadline = t0 + wait_s
    try:
        for (role, cpus, res), agent_port in zip(specs, agents):
            node = _start_node(
                info,
                role,
                num_cpus=cpus,
                resources=res,
                object_store_bytes=object_store_bytes,
                agent_port=agent_port,
            )
            info = replace(info, nodes=info.nodes + (node,))
            _save(info)  # record every pid as soon as it exists, so down() can always clean up
            if role == "head":
                _wait_port(info, deadline)  # workers need the GCS before they can join
        _wait_nodes(info, deadline)
    except BaseException:
        down(sd)
        raise
    # Ray advertises the machine's routable IP even for a 127.0.0.1 bootstrap address (it
    # rewrites loopback), so record the address exactly as the cluster itself reports it.
    head_ip = next(
        n["NodeManagerAddress"]
        for n in _gcs_nodes(info.address)
        if n.get("Alive") and _role(n) == "head"
    )
    info = replace(
        info,
        address=f"{head_ip}:{info.gcs_port}",
        startup_s=round(time.monotonic() - t0, 2),
        rss_bytes=_rss_bytes(cluster_pids(info)),
    )
    _save(info)
    return info


def _clear_stale(sd: Path) -> None:
    info = _load(sd)
    if info is None:
        return
    if any(_owned(n) for n in info.nodes):
        raise RuntimeError(
            f"a local cluster is already running at {info.address} (state in {sd}); call down() first"
        )
    down(sd)  # a crashed cluster: sweep whatever it left and drop the state file


# ---------------------------------------------------------------- down


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(pids: list[int]) -> None:
    # Roots started by this very process turn into zombies until waited for.
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _stop_nodes(
    info: ClusterInfo, nodes: list[NodeProcess], seen: set[int], grace_s: float
) -> None:
    """SIGTERM the roots of ``nodes``, wait for their own cleanup, then SIGTERM what is left.

    Leftovers are orphans: e.g. a node's dashboard/runtime-env agents survive for minutes
    when its ``ray start`` root was killed hard. Everything seen is added to ``seen``.
    """
    roots = [n.pid for n in nodes if _owned(n)]
    sub = replace(info, nodes=tuple(nodes))
    seen |= set(cluster_pids(sub, marker=False))
    _signal(roots, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in roots):
        _reap(roots)
        seen |= set(cluster_pids(sub, marker=False))  # workers forked during shutdown
        time.sleep(0.1)
    orphans = cluster_pids(sub, marker=False)
    seen |= set(orphans)
    _signal(orphans, signal.SIGTERM)
    deadline = time.monotonic() + min(grace_s, 3.0)
    while time.monotonic() < deadline and cluster_pids(sub, marker=False):
        time.sleep(0.1)


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
    info = _load(sd)
    if info is None:
        return []
    seen = set(cluster_pids(info))
    for group in (("draft", "target"), ("head",)):
        _stop_nodes(info, [n for n in info.nodes if n.role in group], seen, grace_s)
    leftovers = cluster_pids(info)  # stragglers of any node, and marker-only processes
    seen |= set(leftovers)
    _signal(leftovers, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while (still := cluster_pids(info)) and time.monotonic() < deadline:
        _reap([n.pid for n in info.nodes])
        time.sleep(0.1)
    if still:
        raise RuntimeError(f"processes {still} of the local cluster survived SIGKILL")
    _reap([n.pid for n in info.nodes])  # if up() ran in this process, the roots are our zombies
    (sd / STATE_FILE).unlink(missing_ok=True)
    if not keep_logs:
        shutil.rmtree(info.temp_root, ignore_errors=True)
    return sorted(seen)


def _owned(node: NodeProcess) -> bool:
    """True while ``node.pid`` is still the process we started (not a recycled pid)."""
    st = _stat(node.pid)
    return st is not None and st[0] not in "ZX" and st[2] == node.start_ticks


# ---------------------------------------------------------------- status


def address(state_dir: Path | str | None = None) -> str:
    """GCS address ("ip:port") of the running local cluster.

    Raises RuntimeError when no cluster from this state_dir is running.
    """
    sd = state_dir_path(state_dir)
    info = _load(sd)
    if info is None or not _owned(info.node("head")):
        raise RuntimeError(f"no local cluster running (state dir {sd}); start one with up()")
    return info.address


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
    ray.init(address=addr, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _role(node: Mapping[str, Any]) -> str:
    return node.get("Labels", {}).get(ROLE_LABEL, "?")


def status(state_dir: Path | str | None = None) -> dict[str, Any]:
    """Nodes, Serve applications and replica placement of the local cluster.

    Connects as a Ray driver for the call, or reuses this process's connection to the same
    cluster. Returns a dict: ``running`` (bool: the head is up), ``address``, ``state_dir``,
    ``processes`` and ``rss_bytes`` (all cluster processes, now), ``nodes`` (role, node_id,
    alive, pid, resources, pool; a node that died is listed with alive False),
    ``applications`` (name -> status, deployments -> status, target_replicas,
    replica_states, replicas_by_node {role: count}) and ``system_actors`` (Serve controller
    and proxies with their node role). Serve is never started just to look.

    A stopped cluster gives ``{"running": False, "state_dir": ...}``. Raises RuntimeError if
    this process is already connected to a different Ray cluster.
    """
    sd = state_dir_path(state_dir)
    info = _load(sd)
    result: dict[str, Any] = {"running": False, "state_dir": str(sd)}
    if info is None or not _owned(info.node("head")):
        return result
    pids = cluster_pids(info)
    result.update(address=info.address, processes=len(pids), rss_bytes=_rss_bytes(pids))
    with _driver(info.address):
        import ray

        nodes = ray.nodes()  # one GCS per up(): every node listed is one of ours
        roles = {n["NodeID"]: _role(n) for n in nodes if n.get("Alive")}
        order = {n.role: i for i, n in enumerate(info.nodes)}
        result["nodes"] = sorted(
            (_node_summary(n, info) for n in nodes), key=lambda n: order.get(n["role"], 99)
        )
        result["applications"], result["system_actors"] = _serve_summary(roles)
    result["running"] = True
    return result


def _node_summary(node: Mapping[str, Any], info: ClusterInfo) -> dict[str, Any]:
    role = _role(node)
    res = node.get("Resources", {})
    shown = {k: v for k, v in res.items() if k in ("CPU", "GPU") + POOLS}
    proc = next((n for n in info.nodes if n.role == role), None)
    pool = next((p for p in POOLS if p in res), None)
    # The GCS notices a dead node only after its health checks time out; the root process
    # tells at once.
    alive = bool(node["Alive"]) and proc is not None and _owned(proc)
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
            f" {n['node_id'][:12]}  pid {n['pid']}  {res}"
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
