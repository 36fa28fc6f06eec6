"""`specdec sweep` against the served tiny pair: every (concurrency, mode) cell, greedy outputs
equal to k=0 token for token under concurrent, batched requests.

The file name orders it after test_service_bench.py and before test_serving.py (whose last
test kills the target node).
"""

from __future__ import annotations

import argparse
import json

import pytest
from local_service import write_prompt_set

from specdec.bench import sweep

pytestmark = pytest.mark.integration


def test_sweep_reports_every_cell_with_outputs_equal_to_k0(served, tmp_path, capsys):
    client, _ = served
    prompts = write_prompt_set(tmp_path)
    parser = argparse.ArgumentParser()
    sweep.add_cli_args(parser)  # the flags as `specdec sweep` parses them
    args = parser.parse_args(
        [
            f"--address={client.address}",
            f"--dataset={prompts}",
            "--concurrency=1,2",
            "--k=0,auto,2",
            "--max-new-tokens=12",
            "--requests-per-stream=2",
            "--timeout=120",
            f"--json={tmp_path / 'out.json'}",
            f"--plot={tmp_path / 'out.png'}",
        ]
    )

    assert sweep.main(args) == 0

    report = json.loads((tmp_path / "out.json").read_text())
    summary = report["summary"]
    cells = {(c["concurrency"], c["mode"]): c for c in summary["cells"]}
    assert list(cells) == [(c, m) for c in (1, 2) for m in ("k=0", "auto", "k=2")]
    for (concurrency, _), cell in cells.items():
        assert cell["requests"] == cell["completed"] == 2 * concurrency
        assert cell["errors"] == {}
        assert cell["tokens"] > 0 and cell["aggregate_tokens_per_s"] > 0
        assert cell["checked"] == cell["requests"] and cell["mismatches"] == 0
        assert cell["ttft_s"]["p50"] <= cell["latency_s"]["p95"]
    assert summary["notes"] == []
    # c=2, two requests per stream: stream 0 sends prompts 0 and 2, stream 1 prompts 1 and 0.
    two = [r for r in report["requests"] if r["concurrency"] == 2 and r["mode"] == "auto"]
    assert [(r["stream"], r["prompt_id"]) for r in two] == [(0, "1"), (0, "3"), (1, "2"), (1, "1")]
    for record in report["requests"]:
        assert record["code"] == "OK" and record["match"] is True
        assert 0 < record["tokens"] <= 12 and record["tokens"] == len(record["token_ids"])
    by_c = summary["by_concurrency"]
    assert [row["concurrency"] for row in by_c] == [1, 2]
    assert all(row["best_fixed_k"] == "k=2" and row["auto_vs_k0"] > 0 for row in by_c)
    assert by_c[1]["scaling"]["k=0"] > 0
    assert (tmp_path / "out.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "# machine (sweep process): cpu: " in out
    assert "# c=2: best fixed k: k=2" in out
