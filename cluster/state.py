"""What a running local cluster is: its nodes, ports and ids, kept in ``<state_dir>/cluster.json``.

``state_dir`` defaults to ``$SPECDEC_CLUSTER_DIR`` or ``~/.specdec/cluster``. This module only
describes and persists; ``processes`` starts and stops, ``local`` brings clusters up and down.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "cluster.json"
STATE_DIR_ENV = "SPECDEC_CLUSTER_DIR"
MARKER_ENV = "SPECDEC_CLUSTER_ID"
ROLE_LABEL = "specdec/role"
POOLS = ("draft_pool", "target_pool")
# The head advertises it so the router stays off the model nodes; a cluster whose head may die
# (GCS fault tolerance, ``ClusterInfo.gcs_redis``) has a fourth node, "router", advertise it.
ROUTER_POOL = "router_pool"
NODE_LABEL = "specdec/node"  # a random id per node process: a restarted node is not its dead one


@dataclass(frozen=True)
class NodeProcess:
    """One node: the ``ray start --block`` process at the root of its process tree."""

    role: str  # "head" | "draft" | "target" | "router"
    pid: int  # also the session id of every process of this node
    start_ticks: int  # /proc/<pid>/stat starttime: tells our pid from a reused one
    resources: dict[str, float]  # custom resources advertised (CPU excluded)
    num_cpus: int
    temp_dir: str  # Ray's --temp-dir for this node (session dir and logs live below)
    log_path: str  # stdout/stderr of `ray start`
    node_id_label: str = ""  # its NODE_LABEL value, as the GCS node table shows it


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
    gcs_redis: str = ""  # "host:port" of the Redis that keeps the GCS's tables; "" = in memory

    def node(self, role: str) -> NodeProcess:
        """The node of ``role``; raises StopIteration when there is none."""
        return next(n for n in self.nodes if n.role == role)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterInfo:
        """Parses ``to_json``'s text; raises ValueError (bad JSON) or TypeError (bad fields)."""
        raw = json.loads(text)
        raw["nodes"] = tuple(NodeProcess(**n) for n in raw.get("nodes", ()))
        return cls(**raw)


def state_dir_path(state_dir: Path | str | None = None) -> Path:
    """The state directory: the argument, else $SPECDEC_CLUSTER_DIR, else ~/.specdec/cluster.

    Returned absolute, with ``~`` expanded.
    """
    if state_dir is None:
        state_dir = os.environ.get(STATE_DIR_ENV) or Path.home() / ".specdec" / "cluster"
    return Path(state_dir).expanduser().resolve()


def load_state(state_dir: Path) -> ClusterInfo | None:
    """The cluster recorded in ``state_dir``, or None when no state file is there."""
    path = state_dir / STATE_FILE
    return ClusterInfo.from_json(path.read_text()) if path.exists() else None


def save_state(info: ClusterInfo) -> None:
    """Writes ``info`` to ``<info.state_dir>/cluster.json``; raises OSError if it cannot."""
    # Write-then-rename so a crash never leaves a half-written state file behind.
    path = Path(info.state_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(info.to_json())
    os.replace(tmp, path)
