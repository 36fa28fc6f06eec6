"""`specdec bench` against the served tiny pair, with the in-process modes (engine, plain
generate, HF assisted) on the same files.

The file name orders it after test_cluster.py (which needs Ray not yet initialised in this
process) and before test_serving.py (whose last test kills the target node).
"""

from __future__ import annotations

import argparse
import json

import pytest
from local_service import write_prompt_set

from specdec.bench import speedup

pytestmark = pytest.mark.integration


def _args(tmp_path, address, **overrides):
    prompts = write_prompt_set(tmp_path)
    parser = argparse.ArgumentParser()
    speedup.add_cli_args(parser)  # the flags as `specdec bench` parses them
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


def test_bench_reports_every_mode_against_both_baselines(served, tmp_path, capsys):
    client, _ = served
    args = _args(tmp_path, client.address)

    assert speedup.main(args) == 0

    report = json.loads((tmp_path / "out.json").read_text())
    assert [p["id"] for p in report["prompts"]] == ["1", "2", "3"]
    summary = report["summary"]
    assert set(summary) == {"target_only", "speculative", "engine", "plain_generate", "hf_assisted"}
    spec = summary["speculative"]
    # Greedy: the service equals its own k = 0 path, the in-process engine and plain generate
    # (the tiny pair is float32 here) token for token.
    assert spec["exact_vs_k0"] == 1.0 and spec["exact_vs_plain"] == 1.0
    assert summary["engine"]["exact_vs_plain"] == 1.0
    assert summary["target_only"]["exact_vs_plain"] == 1.0
    assert spec["speedup_vs_plain"] > 0 and spec["speedup_vs_k0"] > 0
    assert spec["service_share_of_engine"] == pytest.approx(
        spec["tokens_per_second"] / summary["engine"]["tokens_per_second"]
    )
    assert spec["mean_k"] == pytest.approx(3.0, abs=1.0)
    assert 0.0 <= spec["acceptance_rate"] <= 1.0
    # The bound needs the replicas' calibration in GetModelInfo; without it none is claimed.
    if report["config"]["step_costs"] is None:
        assert spec["predicted_speedup"] is None
    else:
        assert spec["predicted_speedup"] > 0
    assert summary["target_only"]["acceptance_rate"] == 0.0
    assert report["config"]["modes"]["plain_generate"].startswith("the target alone")
    for record in report["prompts"]:
        modes = record["modes"]
        assert modes["speculative"]["token_ids"] == modes["target_only"]["token_ids"]
        assert modes["plain_generate"]["token_ids"] == modes["target_only"]["token_ids"]
        assert modes["target_only"]["stats"]["draft_tokens"] == 0
    assert (tmp_path / "out.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "vs plain" in out and "vs k=0" in out and "=plain" in out
    assert "# vs plain: tokens/s over plain_generate (the target alone" in out
    assert "service share of the in-process engine" in out
    assert "# machine (bench process): cpu: " in out


def test_bench_category_filter_and_sampling_without_hf_or_engine(served, tmp_path):
    client, _ = served
    args = _args(
        tmp_path,
        client.address,
        category="code",
        temperature=0.8,
        no_hf=True,
        no_engine=True,
        plot=None,
    )

    assert speedup.main(args) == 0

    report = json.loads((tmp_path / "out.json").read_text())
    assert [p["id"] for p in report["prompts"]] == ["1", "3"]
    assert set(report["summary"]) == {"target_only", "speculative", "plain_generate"}
    row = report["summary"]["speculative"]
    assert "exact_vs_k0" not in row and "exact_vs_plain" not in row  # sampled: no claim
    assert "service_share_of_engine" not in row


def test_bench_runs_one_speculative_mode_per_proposer(served, tmp_path, capsys):
    client, _ = served
    args = _args(
        tmp_path,
        client.address,
        proposer=["draft", "ngram"],
        no_plain=True,
        no_hf=True,
        no_engine=True,
        plot=None,
    )

    assert speedup.main(args) == 0

    report = json.loads((tmp_path / "out.json").read_text())
    assert report["config"]["proposers"] == ["draft", "ngram"]
    summary = report["summary"]
    assert list(summary) == ["target_only", "speculative_draft", "speculative_ngram"]
    for mode in ("speculative_draft", "speculative_ngram"):
        row = summary[mode]
        assert row["exact_vs_k0"] == 1.0  # greedy: exact whoever proposes
        assert set(row["proposed_tokens"]) == {"draft", "ngram"}
        assert sum(row["proposed_tokens"].values()) == sum(
            p["modes"][mode]["stats"]["draft_tokens"] for p in report["prompts"]
        )
    assert summary["speculative_draft"]["proposed_tokens"]["draft"] > 0  # --k=3, draft up
    assert summary["speculative_draft"]["proposed_tokens"]["ngram"] == 0
    assert summary["speculative_ngram"]["proposed_tokens"]["draft"] == 0
    out = capsys.readouterr().out
    assert "# speculative_ngram: proposed (accepted) tokens by proposer: draft " in out
    assert "proposers draft,ngram" in out  # the header
