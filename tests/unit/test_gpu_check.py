"""The prepared GPU check (tests/gpu/check.py) runs end to end on the CPU in its smoke mode:
toy shapes, no compile, every stage in a process of its own, the JSON after every stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "gpu" / "check.py"


def run_check(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "check.json"
    command = [sys.executable, str(CHECK), "--device", "cpu", "--quick", "--no-compile"]
    command += ["--workdir", str(tmp_path / "work"), "--json", str(out), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_stage_measures_or_names_what_it_lacks_in_the_cpu_smoke_mode(tmp_path):
    report = run_check(tmp_path, "--skip", "service,pytest")
    stages = report["stages"]
    assert stages["service"]["status"] == "skipped" and stages["pytest"]["status"] == "skipped"
    assert stages["device"]["describe"].startswith("cpu: ")
    for stage in ("device", "prepare", "baseline", "runner", "engine", "exactness", "baseline_14b"):
        assert stages[stage]["status"] in ("ok", "partial"), (stage, stages[stage])
    for key, shape in (("baseline", "1.5b"), ("baseline_14b", "14b")):
        target = stages[key]["models"]["target"]
        assert shape in target["shape"] and target["decode_ms_per_token"] > 0, target
    assert stages["baseline"]["models"]["draft"]["decode_ms_per_token"] > 0
    runner = stages["runner"]
    if runner["target_runner"].startswith("none"):
        # The static runner is not on this branch: the stage says which call it lacks.
        assert any(".runner" in error for error in runner["errors"]), runner
    else:
        assert runner["forward_ms"]["b1_w1"] > 0 and runner["draft_step_ms"]["b1"] > 0, runner
    for k in ("k0", "k4"):
        assert stages["engine"]["runs"][k]["tokens_per_second"] > 0
    checks = stages["exactness"]["dtypes"]["float32"]
    assert {"k=1", "k=3", "k=auto", "batched k=3", "evicted k=3", "evicted k=auto"} <= set(checks)
    assert stages["exactness"]["passed"] is True, checks
    summary = report["summary"]
    assert summary["exact"] is True and summary["engine_k0_vs_compiled_generate"] > 0


def test_a_stage_the_budget_cannot_fit_is_skipped_with_the_reason(tmp_path):
    report = run_check(tmp_path, "--stages", "device,prepare", "--budget", "0")
    for stage in ("device", "prepare"):
        assert report["stages"][stage]["status"] == "skipped"
        assert "budget" in report["stages"][stage]["error"]
    assert report["stages"]["runner"]["error"].startswith("left out")
