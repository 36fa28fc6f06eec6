"""`specdec bench`: what speculation buys, measured through the deployed service.

For every prompt of a prompt set (specdec.tools.datasets) it runs, one request at a time:

1. ``target_only``: the service with ``k = 0`` (plain decoding on the target deployment);
2. ``speculative``: the same service with ``--k`` (default adaptive);
3. ``hf_assisted``: Hugging Face assisted generation (``generate(assistant_model=...)``) in this
   process, on the same model files, dtypes and token ids (skip it with ``--no-hf``).

Reported per mode: tokens per second, TTFT, speedup over target-only, acceptance rate, tokens per
round, mean k, the speedup predicted from measured acceptance and step costs and the share of
it achieved, orchestration overhead per round, and, greedy only, the share of prompts whose
output equals target-only token for token.

The predicted speedup is the decode-phase bound of Leviathan et al. 2023 (§3.1) with measured
quantities in place of its model: tokens per round * t_target / (t_draft_round + t_verify_round),
where tokens per round is the measured mean (accepted + 1 per round; the paper's
(1 - a^(k+1)) / (1 - a) assumes independent acceptances, and code drafts are accepted in bursts,
so it underestimates), t_target is the target-only decode step and the round costs are the
speculative run's measured compute (prefill excluded). Orchestration is not in the bound, so
the share achieved (decode-phase speedup / bound) shows what transport and scheduling cost.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.client import DEFAULT_ADDRESS, DEFAULT_APPLICATION, SpecdecClient, build_request
from specdec.decoding.stats import SpeculationStats
from specdec.tools.args import add_k_arg, positive_int
from specdec.tools.datasets import BenchPrompt

TARGET_ONLY, SPECULATIVE, HF_ASSISTED = "target_only", "speculative", "hf_assisted"


@dataclasses.dataclass
class Run:
    """One prompt in one mode.

    Attributes:
        token_ids: the completion's token ids.
        tokens_per_second: completion tokens / seconds from the request's start to its end.
        ttft_s: seconds to the first token.
        stats: the service's speculation stats (None for the in-process baseline).
    """

    mode: str
    token_ids: list[int]
    text: str
    tokens_per_second: float
    ttft_s: float
    stats: SpeculationStats | None = None

    @property
    def seconds(self) -> float:
        return len(self.token_ids) / self.tokens_per_second if self.tokens_per_second else 0.0

    @property
    def decode_seconds(self) -> float:
        """Seconds after the first token."""
        return max(self.seconds - self.ttft_s, 1e-9)

    def record(self) -> dict[str, Any]:
        out = {
            "mode": self.mode,
            "completion_tokens": len(self.token_ids),
            "tokens_per_second": self.tokens_per_second,
            "ttft_s": self.ttft_s,
            "text": self.text,
            "token_ids": self.token_ids,
        }
        if self.stats is not None:
            out["stats"] = self.stats.as_dict()
        return out


def service_run(
    client: SpecdecClient, prompt: BenchPrompt, mode: str, k: int | None, sampling: dict[str, Any]
) -> Run:
    """One unary Generate call; ``k`` None = adaptive. Raises grpc.RpcError."""
    request = build_request(**prompt.request_fields(), num_speculative_tokens=k, **sampling)
    response = client.generate(request)
    stats = SpeculationStats.from_proto(response.stats)
    return Run(
        mode, list(response.token_ids), response.text, stats.tokens_per_second, stats.ttft_s, stats
    )


class HFAssisted:
    """Hugging Face assisted generation in this process, on the service's model files.

    Loads the target in ``target_dtype`` and the draft in ``draft_dtype`` with
    specdec.models.load_model (so an int8 draft is the same int8 draft), and generates with
    ``target.generate(..., assistant_model=draft)`` and transformers' default assistant
    schedule. Prompts are encoded exactly as the router encodes them.
    """

    def __init__(
        self, draft_model: str, target_model: str, *, draft_dtype: str, target_dtype: str
    ) -> None:
        from specdec.models.loading import load_model_pair

        self.draft, self.target = load_model_pair(
            draft_model, target_model, dtype=target_dtype, draft_dtype=draft_dtype
        )

    def run(self, prompt: BenchPrompt, max_new_tokens: int, sampling: dict[str, Any]) -> Run:
        import torch

        from specdec.decoding.request import encode_prompt

        fields = prompt.request_fields()
        ids = encode_prompt(self.target.tokenizer, fields.get("prompt"), fields.get("messages"))
        temperature = sampling.get("temperature") or 0.0
        kwargs = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(
                temperature=temperature,
                top_p=sampling.get("top_p") or 1.0,
                top_k=sampling.get("top_k") or 0,
            )
            torch.manual_seed(sampling.get("seed") or 0)
        clock = _FirstTokenClock()
        with torch.inference_mode(), _quiet_transformers():
            out = self.target.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                assistant_model=self.draft.model,
                max_new_tokens=max_new_tokens,
                eos_token_id=sorted(self.target.eos_token_ids),
                pad_token_id=self.target.tokenizer.pad_token_id,
                streamer=clock,
                **kwargs,
            )
        seconds = time.perf_counter() - clock.start
        token_ids = [int(t) for t in out[0, len(ids) :]]  # EOS kept, as the service keeps it
        text = self.target.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Run(
            HF_ASSISTED,
            token_ids,
            text,
            len(token_ids) / seconds,
            (clock.first or time.perf_counter()) - clock.start,
        )


@contextlib.contextmanager
def _quiet_transformers():
    """generate() warns about arguments every call; the bench's own output is the point."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class _FirstTokenClock:
    """A generate() streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._puts = 0

    def put(self, value) -> None:
        self._puts += 1  # the first put is the prompt
        if self._puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


# --- figures ------------------------------------------------------------------------------------


def predicted_speedup(spec: SpeculationStats, base: SpeculationStats) -> float | None:
    """The decode-phase bound (module docstring) from one speculative and one target-only run,
    or summed stats of many: tokens per decode round x target step / round compute, each a
    SpeculationStats figure. None when either has no decode round or the rounds cost nothing."""
    if spec.decode_rounds == 0 or base.decode_rounds == 0:
        return None
    round_s = spec.draft_s_per_round + spec.verify_s_per_round
    if round_s <= 0:
        return None
    return spec.mean_accepted_tokens * base.verify_s_per_round / round_s


@dataclasses.dataclass
class PromptResult:
    prompt: BenchPrompt
    runs: dict[str, Run]

    def record(self, greedy: bool) -> dict[str, Any]:
        base = self.runs[TARGET_ONLY]
        out: dict[str, Any] = {
            "id": self.prompt.id,
            "category": self.prompt.category,
            "modes": {m: r.record() for m, r in self.runs.items()},
        }
        for mode, run in self.runs.items():
            if mode == TARGET_ONLY:
                continue
            entry = out["modes"][mode]
            entry["speedup"] = run.tokens_per_second / base.tokens_per_second
            if greedy:
                entry["exact"] = run.token_ids == base.token_ids
            if run.stats is not None:
                entry["predicted_speedup"] = predicted_speedup(run.stats, base.stats)
        return out


def summarize(results: Sequence[PromptResult], greedy: bool) -> dict[str, dict[str, Any]]:
    """Per mode: aggregate tokens/s (all tokens / all seconds), median TTFT, speedups, the
    speculation figures from summed stats, and the exact-match share (greedy)."""
    modes = list(results[0].runs)
    base_runs = [r.runs[TARGET_ONLY] for r in results]
    base_tps = _aggregate_tps(base_runs)
    base_decode = _decode_tps(base_runs)
    base_stats = SpeculationStats.total(r.stats for r in base_runs)
    summary = {}
    for mode in modes:
        runs = [r.runs[mode] for r in results]
        row: dict[str, Any] = {
            "prompts": len(runs),
            "tokens": sum(len(r.token_ids) for r in runs),
            "tokens_per_second": _aggregate_tps(runs),
            "ttft_s": statistics.median(r.ttft_s for r in runs),
            "speedup": _aggregate_tps(runs) / base_tps,
            "median_prompt_speedup": statistics.median(
                r.tokens_per_second / b.tokens_per_second for r, b in zip(runs, base_runs)
            ),
            "decode_speedup": _decode_tps(runs) / base_decode,
        }
        if greedy and mode != TARGET_ONLY:
            row["exact_share"] = sum(
                r.token_ids == b.token_ids for r, b in zip(runs, base_runs)
            ) / len(runs)
        if all(r.stats is not None for r in runs):
            total = SpeculationStats.total(r.stats for r in runs)
            row.update(
                acceptance_rate=total.acceptance_rate,
                tokens_per_round=total.mean_accepted_tokens,
                mean_k=total.mean_k,
                overhead_ms_per_round=1e3 * total.orchestration_s_per_round,
                acceptance_per_position=total.acceptance_per_position,
            )
            if mode != TARGET_ONLY:
                bound = predicted_speedup(total, base_stats)
                row["predicted_speedup"] = bound
                row["share_of_bound"] = row["decode_speedup"] / bound if bound else None
        summary[mode] = row
    return summary


def _timing(run: Run) -> SpeculationStats:
    """A run's tokens and times as stats, so its rates are the SpeculationStats figures (the
    in-process baseline has no stats of its own)."""
    return SpeculationStats(
        completion_tokens=len(run.token_ids), wall_time_s=run.seconds, ttft_s=run.ttft_s
    )


def _aggregate_tps(runs: Sequence[Run]) -> float:
    """All tokens / all seconds of the runs, tokens/s."""
    return SpeculationStats.total(map(_timing, runs)).tokens_per_second


def _decode_tps(runs: Sequence[Run]) -> float:
    """All tokens after the first / all seconds after the first token, tokens/s."""
    return SpeculationStats.total(map(_timing, runs)).decode_tokens_per_second


def format_table(summary: dict[str, dict[str, Any]], greedy: bool) -> str:
    """The summary as a fixed-width text table, one row per mode ("-": not measured)."""
    columns = [
        ("mode", 12, None, "s"),
        ("tok/s", 7, "tokens_per_second", ".2f"),
        ("TTFT ms", 8, "ttft_ms", ".0f"),
        ("speedup", 8, "speedup", ".2fx"),
        ("accept", 7, "acceptance_rate", ".2f"),
        ("tok/rnd", 8, "tokens_per_round", ".2f"),
        ("mean k", 7, "mean_k", ".2f"),
        ("decode", 7, "decode_speedup", ".2fx"),
        ("bound", 7, "predicted_speedup", ".2fx"),
        ("share", 6, "share_of_bound", ".0%"),
        ("ovh ms", 7, "overhead_ms_per_round", ".1f"),
    ]
    if greedy:
        columns.append(("exact", 6, "exact_share", ".0%"))

    def cell(value, width, spec):
        if value is None:
            text = "-"
        elif spec.endswith("x"):
            text = format(value, spec[:-1]) + "x"
        else:
            text = format(value, spec)
        return text.ljust(width) if spec == "s" else text.rjust(width)

    lines = [
        " ".join(
            name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w, _, _) in enumerate(columns)
        )
    ]
    lines.append("-" * len(lines[0]))
    for mode, row in summary.items():
        values = {**row, "ttft_ms": row["ttft_s"] * 1e3}
        lines.append(
            " ".join(
                cell(mode if key is None else values.get(key), width, spec)
                for _, width, key, spec in columns
            )
        )
    return "\n".join(lines)


def plot(results: Sequence[PromptResult], summary: dict[str, dict[str, Any]], path: str) -> None:
    """Speedup per prompt (one bar per mode) and acceptance per draft position, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in results[0].runs if m != TARGET_ONLY]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        speedups = [
            r.runs[mode].tokens_per_second / r.runs[TARGET_ONLY].tokens_per_second for r in results
        ]
        left.bar([x + i * width for x in range(len(results))], speedups, width, label=mode)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(
        [x + width * (len(modes) - 1) / 2 for x in range(len(results))],
        [r.prompt.id for r in results],
        rotation=60,
        ha="right",
        fontsize=7,
    )
    left.set_ylabel("speedup over target-only (tokens/s)")
    left.set_title("Speedup per prompt")
    left.legend()
    per_position = summary.get(SPECULATIVE, {}).get("acceptance_per_position") or []
    points = [(i + 1, a) for i, a in enumerate(per_position) if a is not None]
    if points:
        right.plot([p for p, _ in points], [a for _, a in points], marker="o")
    right.set_ylim(0, 1.05)
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance rate")
    right.set_title("Acceptance per draft position (speculative)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> str:
    """A one-line description of this machine: CPU model, cores, memory, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    try:
        import os

        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
        cores = os.cpu_count()
    except (ValueError, OSError, AttributeError):
        memory, cores = "", "?"
    return f"{cpu}, {cores} cores{memory}, Python {platform.python_version()}"


def write_json(
    path: str, results: Sequence[PromptResult], summary: dict, config: dict, greedy: bool
) -> None:
    Path(path).write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "machine": machine(),
                "config": config,
                "prompts": [r.record(greedy) for r in results],
                "summary": summary,
            },
            indent=1,
        )
    )


# --- the command ------------------------------------------------------------------------------


def run_all(
    client: SpecdecClient,
    prompts: Sequence[BenchPrompt],
    *,
    k: int | None,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    hf: HFAssisted | None,
) -> list[PromptResult]:
    """Every prompt in every mode, one request at a time, under a progress bar."""
    from tqdm.auto import tqdm

    modes = [TARGET_ONLY, SPECULATIVE] + ([HF_ASSISTED] if hf else [])
    results = []
    with tqdm(total=len(prompts) * len(modes), unit="run", desc="bench") as progress:
        for i, prompt in enumerate(prompts):
            sampling = {
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "seed": seed + i,
            }
            runs = {}
            for mode in modes:
                progress.set_postfix_str(f"{prompt.id} {mode}")
                if mode == HF_ASSISTED:
                    runs[mode] = hf.run(prompt, max_new_tokens, sampling)
                else:
                    runs[mode] = service_run(
                        client, prompt, mode, 0 if mode == TARGET_ONLY else k, sampling
                    )
                progress.update()
            results.append(PromptResult(prompt, runs))
    return results


def _check_outputs(args) -> None:
    """Fails before the run, not after it, on an unwritable --json / --plot or no matplotlib."""
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"--json/--plot: no directory for {path}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise ImportError("--plot needs matplotlib: pip install 'specdec[bench]'") from err


def _load_hf(info, no_hf: bool) -> HFAssisted | None:
    if no_hf:
        return None
    if not (Path(info.draft_model).exists() and Path(info.target_model).exists()):
        print(
            f"# HF baseline skipped: the service's model files ({info.draft_model}, "
            f"{info.target_model}) are not on this machine",
            file=sys.stderr,
        )
        return None
    print(
        f"# loading the HF baseline: target {info.target_dtype}, draft {info.draft_dtype}",
        file=sys.stderr,
        flush=True,
    )
    return HFAssisted(
        info.draft_model,
        info.target_model,
        draft_dtype=info.draft_dtype,
        target_dtype=info.target_dtype,
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec bench`."""
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="gRPC HOST:PORT")
    parser.add_argument("--application", default=DEFAULT_APPLICATION)
    parser.add_argument(
        "--dataset", default="humaneval", help="humaneval, mt-bench, spec-bench, or a .jsonl path"
    )
    parser.add_argument("--data-file", help="the question file of mt-bench / spec-bench")
    parser.add_argument("--category", help="only this category of the dataset")
    parser.add_argument(
        "--limit", type=positive_int, default=20, help="first N prompts (default 20)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="new tokens per request (default 128)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling: prompt i uses seed + i")
    add_k_arg(parser, "speculative tokens per round in the speculative mode: int or auto")
    parser.add_argument(
        "--no-hf",
        action="store_true",
        help="skip the in-process Hugging Face assisted-generation baseline",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, s")
    parser.add_argument("--json", metavar="OUT", help="one record per prompt and a summary")
    parser.add_argument(
        "--plot", metavar="OUT.png", help="speedup per prompt, acceptance per draft position"
    )


def main(args: argparse.Namespace) -> int:
    """`specdec bench` (flags: add_cli_args). Returns 1 when a greedy speculative output differs
    from target-only, else 0.

    Raises:
        ValueError: no directory for --json / --plot, or a bad dataset. ImportError: --plot
        without matplotlib. grpc.RpcError: the service refused or failed a request.
    """
    from specdec.tools.datasets import load_prompts

    prompts = load_prompts(
        args.dataset, category=args.category, limit=args.limit, data_file=args.data_file
    )
    _check_outputs(args)
    greedy = not args.temperature
    with SpecdecClient(args.address, args.application, timeout_s=args.timeout) as client:
        info = client.model_info()
        # The warm-up goes first: a request the service refuses fails before any model loads.
        warm_up = {"max_new_tokens": 16, "temperature": args.temperature, "seed": args.seed}
        for k in (0, args.k):
            service_run(client, prompts[0], "warm-up", k, warm_up)
        hf = _load_hf(info, args.no_hf)
        if hf:
            hf.run(prompts[0], 16, warm_up)
        results = run_all(
            client,
            prompts,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            hf=hf,
        )
    summary = summarize(results, greedy)
    k_text = "auto" if args.k is None else args.k
    config = {
        "dataset": args.dataset,
        "category": args.category,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "k": k_text,
        "target_model": info.target_model,
        "target_dtype": info.target_dtype,
        "draft_model": info.draft_model,
        "draft_dtype": info.draft_dtype,
    }
    print(
        f"\n# {args.dataset}{'/' + args.category if args.category else ''}: {len(prompts)} "
        f"prompts, {args.max_new_tokens} new tokens, "
        f"{'greedy' if greedy else f'temperature {args.temperature}'}, k={k_text}; target "
        f"{Path(info.target_model).name} ({info.target_dtype}), draft "
        f"{Path(info.draft_model).name} ({info.draft_dtype})\n# machine: {machine()}"
    )
    print(format_table(summary, greedy), flush=True)
    if args.json:
        write_json(args.json, results, summary, config, greedy)
    if args.plot:
        plot(results, summary, args.plot)
    inexact = greedy and summary[SPECULATIVE].get("exact_share", 1.0) < 1.0
    if inexact:
        print(
            "specdec bench: a greedy speculative output differs from target-only", file=sys.stderr
        )
    return 1 if inexact else 0
