"""A real local Ray cluster (head + draft-pool node + target-pool node) serving tiny models.

One cluster and one deployment for the whole integration session: starting Ray costs tens of
seconds on two cores. The config is the shipped local config with test-sized numbers: a free
gRPC port, short timeouts, two fixed target replicas (so a replica can be killed mid-request).
"""

from __future__ import annotations

import contextlib
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


def write_config(tmp: Path, draft: Path, target: Path,
                 autoscaling: dict[str, dict] | None = None) -> tuple[Path, int]:
    """The shipped local config with the tiny pair, free ports and short timeouts.

    Without ``autoscaling``: fixed replicas (two targets). With it: {deployment name: fields}
    replace each named deployment's autoscaling_config fields (the shipped delays are minutes).
    """
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    port = _free_port()
    config["grpc_options"]["port"] = port
    config["http_options"]["port"] = _free_port()
    app = config["applications"][0]
    app["args"].update(draft_model=str(draft), target_model=str(target), call_timeout_s=5,
                       unavailable_after_s=8, cache_capacity_bytes=64 * 1024**2)
    for deployment in app["deployments"]:
        if autoscaling is None:
            deployment.pop("autoscaling_config")
            deployment["num_replicas"] = 2 if deployment["name"] == "TargetModel" else 1
        else:
            deployment["autoscaling_config"].update(autoscaling.get(deployment["name"], {}))
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


@contextlib.contextmanager
def serving(tmp: Path, config: Path, port: int):
    """Starts a local cluster in ``tmp/state``, deploys ``config`` and yields (client,
    ClusterInfo, gRPC address); afterwards shuts Serve down, disconnects and stops exactly that
    cluster."""
    import ray
    from ray import serve

    from specdec.cluster.local import LocalCluster
    from specdec.deployments.deploy import deploy

    with LocalCluster(tmp / "state") as info:
        try:
            deploy(config, address=info.address, timeout_s=300)
            address = f"127.0.0.1:{port}"
            with SpecdecClient(address, timeout_s=120) as client:
                yield client, info, address
        finally:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()


@pytest.fixture(scope="session")
def tiny_service(tiny_pair):
    """A factory: ``with tiny_service(tmp, autoscaling=None) as (client, info, address):`` the
    tiny pair served on a fresh local cluster of its own (see write_config, serving)."""
    pytest.importorskip("ray")
    return lambda tmp, autoscaling=None: serving(tmp, *write_config(tmp, *tiny_pair, autoscaling))


@pytest.fixture(scope="session")
def served(tmp_path_factory, tiny_service):
    """(client, ClusterInfo): the tiny pair deployed on a fresh local cluster."""
    with tiny_service(tmp_path_factory.mktemp("cluster")) as (client, info, _):
        yield client, info
