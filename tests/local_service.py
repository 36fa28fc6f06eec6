"""Serving on a real local cluster, for the integration and e2e tests."""

from __future__ import annotations

import contextlib
from pathlib import Path

from specdec.client import SpecdecClient
from specdec.cluster.processes import free_ports

ROOT = Path(__file__).resolve().parents[1]
LOCAL_CONFIG = ROOT / "deployments" / "config" / "local.yaml"


def write_prompt_set(folder: Path) -> Path:
    """A 3-prompt .jsonl prompt set in specdec.bench.datasets' format (ids 1-3; the second a
    two-turn chat), for the benchmark commands' tests."""
    path = folder / "prompts.jsonl"
    path.write_text(
        '{"question_id": 1, "category": "code", "prompt": "def add(a, b):"}\n'
        '{"question_id": 2, "category": "chat", "turns": ["Say hi.", "Again."]}\n'
        '{"question_id": 3, "category": "code", "prompt": "import os\\n"}\n'
    )
    return path


def free_port() -> int:
    """A port for Serve's gRPC or HTTP proxy (specdec.cluster.processes.free_ports: outside the
    range the cluster's own sockets are given)."""
    (port,) = free_ports(1)
    return port


@contextlib.contextmanager
def serving(
    tmp: Path,
    config: Path,
    port: int,
    deploy_timeout_s: float = 300,
    call_timeout_s: float = 120,
    **cluster_args,
):
    """Starts a local cluster in ``tmp/state`` (``cluster_args`` go to ``local.up``), deploys
    ``config`` and yields (client, ClusterInfo, gRPC address); afterwards disconnects and stops
    exactly that cluster. Serve is not shut down first: the cluster's processes, Serve's among
    them, all stop with it, and a graceful shutdown waited up to 25 s for replicas on a node a
    test had killed."""
    import ray
    from ray.serve import context as serve_context

    from specdec.cluster.local import LocalCluster
    from specdec.deployments.deploy import deploy

    with LocalCluster(tmp / "state", **cluster_args) as info:
        try:
            deploy(config, address=info.address, timeout_s=deploy_timeout_s)
            address = f"127.0.0.1:{port}"
            with SpecdecClient(address, timeout_s=call_timeout_s) as client:
                yield client, info, address
        finally:
            if ray.is_initialized():
                ray.shutdown()
            # Serve caches its controller client per process and keys it by job id, which
            # restarts at 01000000 on every cluster: without serve.shutdown() the next cluster's
            # first driver would be handed this dead cluster's controller. Forget it (Serve's
            # own disconnect: it stops nothing).
            serve_context._disconnect()
