"""A one-minute `specdec soak` in float32 (the 10-minute runs in both dtypes are in
benchmarks/RESULTS.md): mixed greedy load while the target scales 1 -> 2 -> 1, one target
replica is killed and the draft node is killed and started again; no request fails and every
output is the target-only one.

Marked ``soak`` (minutes on a cluster of its own): `make test` leaves it out; run it with
``pytest -m soak tests/integration/test_soak.py``. The soak runs as a subprocess: it connects
to a cluster it starts itself, while this session's other tests may hold a Ray connection.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.soak,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the local cluster reads /proc"
    ),
]


def test_short_soak_loses_nothing_and_changes_nothing(tmp_path):
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "specdec.cli", "soak", "--dtype", "float32"]
    command += ["--duration", "60", "--interval", "1", "--out", str(out)]
    command += ["--workdir", str(tmp_path / "work")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert out.exists(), run.stderr[-4000:]
    report = json.loads(out.read_text())
    summary = run.stdout
    requests = report["requests"]
    assert requests["failed"] == 0 and requests["by_code"] == {"OK": requests["sent"]}, summary
    assert requests["ok"] == requests["sent"] > 20, summary
    assert requests["mismatches"] == 0, summary
    assert set(requests["by_k"]) == {"k=0", "k=1", "k=3", "k=auto"}, summary
    assert set(requests["by_mode"]) == {"unary", "stream"}, summary
    assert requests["rounds_without_draft"] > 0, summary  # the draft's absence was felt
    faults = {e["name"]: e for e in report["faults"]}
    assert set(faults) == {"kill_target_replica", "kill_draft_node", "restart_draft_node"}
    assert all(e["ok"] for e in faults.values()), faults
    target = report["scaling"]["TargetModel"]
    assert (target["min"], target["max"]) == (1, 2), summary
    assert target["scaled_up_at"] is not None and target["scaled_down_at"] is not None, summary
    assert report["draft_recovery"]["replica_back_at"] is not None, summary
    judged = [r for r in report["memory"] if r["judged"]]
    assert judged and all(r["ok"] for r in judged), summary
    assert all(c["ok"] for c in report["checks"].values()), summary
    assert report["passed"] and run.returncode == 0, summary + run.stderr[-4000:]
