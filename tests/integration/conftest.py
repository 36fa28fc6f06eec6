"""A real local Ray cluster (head + draft-pool node + target-pool node) serving tiny models.

One cluster and one deployment for the whole integration session: starting Ray costs tens of
seconds on two cores. The config is the shipped local config with test-sized numbers: a free
gRPC port, short timeouts, two fixed target replicas (so a replica can be killed mid-request).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from specdec.client import SpecdecClient

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = ROOT / "deployments" / "config" / "local.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp: Path, draft: Path, target: Path) -> tuple[Path, int]:
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    port = _free_port()
    config["grpc_options"]["port"] = port
    config["http_options"]["port"] = _free_port()
    app = config["applications"][0]
    app["args"].update(draft_model=str(draft), target_model=str(target), call_timeout_s=5,
                       unavailable_after_s=8, cache_capacity_bytes=64 * 1024**2)
    for deployment in app["deployments"]:
        deployment.pop("autoscaling_config")
        deployment["num_replicas"] = 2 if deployment["name"] == "TargetModel" else 1
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


@pytest.fixture(scope="session")
def served(tmp_path_factory, tiny_pair):
    """(client, ClusterInfo): the tiny pair deployed on a fresh local cluster."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from specdec.cluster.local import LocalCluster
    from specdec.deployments.deploy import deploy

    tmp = tmp_path_factory.mktemp("cluster")
    config, port = write_config(tmp, *tiny_pair)
    with LocalCluster(tmp / "state") as info:
        try:
            deploy(config, address=info.address, timeout_s=300)
            with SpecdecClient(f"127.0.0.1:{port}", timeout_s=120) as client:
                yield client, info
        finally:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
