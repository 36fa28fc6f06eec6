"""`specdec bench` against the served tiny pair, HF assisted baseline included.

The file name orders it after test_cluster.py (which needs Ray not yet initialised in this
process) and before test_serving.py (whose last test kills the target node).
"""

from __future__ import annotations

import argparse
import json

import pytest

from specdec.tools import bench

pytestmark = pytest.mark.integration


def _args(tmp_path, address, **overrides):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"question_id": 1, "category": "code", "prompt": "def add(a, b):"}\n'
        '{"question_id": 2, "category": "chat", "turns": ["Say hi.", "Again."]}\n'
        '{"question_id": 3, "category": "code", "prompt": "import os\\n"}\n'
    )
    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)  # the flags as `specdec bench` parses them
    args = parser.parse_args(
        [
            f"--address={address}",
            f"--dataset={prompts}",
            "--max-new-tokens=12",
            "--k=3",
            "--timeout=120",
            f"--json={tmp_path / 'out.json'}",
            f"--plot={tmp_path / 'out.png'}",
        ]
    )
    return argparse.Namespace(**{**vars(args), **overrides})


def test_bench_reports_every_mode_and_exactness(served, tmp_path, capsys):
    client, _ = served
    args = _args(tmp_path, client.address)

    assert bench.main(args) == 0

    report = json.loads((tmp_path / "out.json").read_text())
    assert [p["id"] for p in report["prompts"]] == ["1", "2", "3"]
    summary = report["summary"]
    assert set(summary) == {"target_only", "speculative", "hf_assisted"}
    assert summary["speculative"]["exact_share"] == 1.0
    assert summary["speculative"]["mean_k"] == pytest.approx(3.0, abs=1.0)
    assert 0.0 <= summary["speculative"]["acceptance_rate"] <= 1.0
    assert summary["speculative"]["predicted_speedup"] > 0
    assert summary["target_only"]["acceptance_rate"] == 0.0
    for record in report["prompts"]:
        modes = record["modes"]
        assert modes["speculative"]["token_ids"] == modes["target_only"]["token_ids"]
        assert modes["target_only"]["stats"]["draft_tokens"] == 0
    assert (tmp_path / "out.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "speculative" in table and "hf_assisted" in table and "exact" in table


def test_bench_category_filter_and_sampling_without_hf(served, tmp_path):
    client, _ = served
    args = _args(tmp_path, client.address, category="code", temperature=0.8, no_hf=True, plot=None)

    assert bench.main(args) == 0

    report = json.loads((tmp_path / "out.json").read_text())
    assert [p["id"] for p in report["prompts"]] == ["1", "3"]
    assert set(report["summary"]) == {"target_only", "speculative"}
    assert "exact_share" not in report["summary"]["speculative"]  # sampled: no exactness claim
