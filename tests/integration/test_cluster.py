"""The local cluster: three real Ray nodes, pools on the right nodes, and a clean teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec.cluster import local

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the local cluster reads /proc"
    ),
]


def _processes() -> dict[int, int]:
    """pid -> start ticks of every process now (start ticks tell a pid from its reuse)."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[19])
    return found


@pytest.fixture
def canaries():
    """Bystanders that must survive down(): one named like a Ray process, in its own session,
    and one in our own process group."""
    procs = [
        subprocess.Popen(["bash", "-c", "exec -a raylet sleep 300"], start_new_session=True),
        subprocess.Popen(["sleep", "300"]),
    ]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_local_cluster_pools_and_teardown(tmp_path, canaries):
    import ray

    before = _processes()
    t0 = time.monotonic()
    cm = local.LocalCluster(tmp_path / "state")
    with cm as info:
        startup_s = time.monotonic() - t0
        assert local.address(tmp_path / "state") == info.address
        assert (tmp_path / "state" / local.STATE_FILE).exists()
        ray.init(address=info.address, logging_level="ERROR", log_to_driver=False)
        try:
            nodes = [n for n in ray.nodes() if n["Alive"]]
            assert len(nodes) == 3
            by_role = {n["Labels"][local.ROLE_LABEL]: n for n in nodes}
            assert set(by_role) == {"head", "draft", "target"}
            for pool in local.POOLS:
                assert sum(pool in n["Resources"] for n in nodes) == 1, pool
            assert by_role["draft"]["Resources"]["draft_pool"] == 100
            assert by_role["target"]["Resources"]["target_pool"] == 100
            assert not any(p in by_role["head"]["Resources"] for p in local.POOLS)

            # Defined here so cloudpickle ships it by value (workers cannot import this module).
            def where() -> str:
                return ray.get_runtime_context().get_node_id()

            task = ray.remote(num_cpus=0, resources={"draft_pool": 1})(where)
            assert ray.get(task.remote(), timeout=60) == by_role["draft"]["NodeID"]

            st = local.status(tmp_path / "state")
            assert st["running"] and {n["role"] for n in st["nodes"]} == {"head", "draft", "target"}
            assert "draft_pool 100" in local.format_status(st)
        finally:
            ray.shutdown()
        now = _processes()
        cluster = {p: now[p] for p in local.cluster_pids(info) if p in now}
        recorded = {n.pid: n.start_ticks for n in info.nodes}
        assert recorded.items() <= cluster.items()
        print(
            f"\nstartup {startup_s:.1f} s (up() says {info.startup_s} s), "
            f"{len(cluster)} processes, RSS {info.rss_bytes / 2**20:.0f} MiB after up"
        )

    stopped = set(cm.stopped)
    assert set(recorded) <= stopped
    assert not (tmp_path / "state" / local.STATE_FILE).exists()
    after = _processes()
    # Every process of the cluster is gone (a pid still present belongs to a newer process) ...
    assert not [p for p, ticks in {**cluster, **recorded}.items() if after.get(p) == ticks]
    # ... down() stopped nothing that existed before up() ...
    assert not [p for p in stopped if p in before and before[p] < min(recorded.values())]
    # ... and our bystanders, one of them named "raylet", are alive.
    assert all(p.poll() is None for p in canaries)
    # Idempotent, and a stopped cluster reads as such.
    assert local.down(tmp_path / "state") == []
    assert local.status(tmp_path / "state")["running"] is False
    with pytest.raises(RuntimeError):
        local.address(tmp_path / "state")
