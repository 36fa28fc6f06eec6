"""GCS fault tolerance on the local cluster, without starting it: which node gets which Redis
settings, and that only a cluster with Redis lets its head be killed. The head killed under
load is tests/integration/test_head_loss.py."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from specdec.cluster import local
from specdec.cluster.faults import kill_node
from specdec.cluster.processes import GCS_RECONNECT_S, free_ports, gcs_redis_env, proc_stat
from specdec.cluster.state import ClusterInfo, NodeProcess, save_state
from specdec.cluster.status import format_status, status


def _info(tmp_path, gcs_redis=""):
    head = NodeProcess("head", 1, 0, {}, 1, str(tmp_path), str(tmp_path / "head.log"))
    return ClusterInfo(
        address="127.0.0.1:1",
        gcs_port=1,
        dashboard_port=2,
        client_port=3,
        cluster_id="c0ffee",
        state_dir=str(tmp_path),
        temp_root=str(tmp_path),
        nodes=(head,),
        gcs_redis=gcs_redis,
    )


def test_the_head_keeps_its_tables_in_redis_and_every_node_waits_for_it(tmp_path):
    info = _info(tmp_path, "127.0.0.1:6390")
    wait = {"RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_S)}
    assert gcs_redis_env(info, "head") == {
        **wait,
        "RAY_REDIS_ADDRESS": "127.0.0.1:6390",
        "RAY_external_storage_namespace": "specdec-c0ffee",
    }
    assert gcs_redis_env(info, "draft") == gcs_redis_env(info, "router") == wait
    assert gcs_redis_env(_info(tmp_path), "head") == {}


def test_the_head_of_a_cluster_without_redis_is_not_killed(tmp_path):
    save_state(_info(tmp_path))
    with pytest.raises(RuntimeError, match="without GCS fault tolerance"):
        kill_node(tmp_path, "head")


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("redis://127.0.0.1:6379", "HOST:PORT"),
        ("127.0.0.1", "HOST:PORT"),
        ("", "HOST:PORT"),
        (None, "nothing answers"),
    ],
)
def test_a_redis_that_is_not_there_is_refused_before_anything_starts(tmp_path, address, message):
    if address is None:
        address = f"127.0.0.1:{free_ports(1)[0]}"  # free a moment ago: nothing listens
    with pytest.raises(ValueError, match=message):
        local.up(tmp_path / "state", gcs_redis=address)
    assert not (tmp_path / "state").exists()


def test_status_tells_a_dead_head_from_a_stopped_cluster(tmp_path):
    info = _info(tmp_path, "127.0.0.1:6390")
    draft = NodeProcess("draft", os.getpid(), proc_stat(os.getpid())[2], {}, 1, "", "")
    save_state(replace(info, nodes=(*info.nodes, draft)))  # the head's pid 1 is not ours
    st = status(tmp_path)
    assert st == {
        "running": False,
        "state_dir": str(tmp_path),
        "nodes_up": ["draft"],
        "gcs_redis": "127.0.0.1:6390",
    }
    assert "the head is down, draft still running" in format_status(st)
    assert "restart_node" in format_status(st)
    (tmp_path / "cluster.json").unlink()
    assert "not running" in format_status(status(tmp_path))
