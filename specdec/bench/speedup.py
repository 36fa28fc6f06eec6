"""`specdec bench`: what speculation buys, measured through the deployed service.

For every prompt of a prompt set (specdec.bench.datasets), one request at a time, the three
modes one after the other before the next prompt (so that a busy host's drift over minutes
weighs on all three alike):

1. ``target_only``: the service with ``k = 0`` (plain decoding on the target deployment);
2. ``speculative``: the same service with ``--k`` (default adaptive); with ``--proposer
   auto,draft,ngram`` one mode per proposer instead, ``speculative_auto``,
   ``speculative_draft``, ``speculative_ngram``, in that order;
3. ``plain_generate``: the target alone with transformers' ``generate`` in this process, in
   the dtype measured fastest on this machine: THE baseline a user would run without us
   (skip: ``--no-plain``);

then, in this process and one mode's models at a time (specdec.bench.inprocess; each
freed before the next loads, each skipped with a printed reason when its models do not fit in
the memory available):

4. ``hf_assisted``: Hugging Face assisted generation, the target in plain_generate's dtype, the
   draft in the service's, its assistant settings picked by timing (skip: ``--no-hf``);
5. ``engine``: specdec.engine.SpeculativeEngine on the service's models, dtypes, k and first
   proposer (skip it with ``--no-engine``).

Reported per mode (specdec.bench.figures): tokens per second, TTFT, the speedup over
plain_generate (``vs plain``) and over the service's k = 0 (``vs k=0``), acceptance, tokens per
round, mean k, the bound predicted from acceptance per draft position and the replicas'
isolated step costs and the share of it achieved, orchestration per round, and, greedy only,
the share of outputs equal to target_only and to plain_generate token for token; under the
table, each baseline named, each speculative mode's proposed and accepted tokens by proposer
(the draft model, n-gram lookup) and the service's share of the in-process engine's tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.bench.datasets import BenchPrompt
from specdec.bench.figures import (
    ENGINE,
    HF_ASSISTED,
    PLAIN,
    TARGET_ONLY,
    PromptResult,
    Run,
    StepCosts,
    format_table,
    is_speculative,
    legend,
    speculative_mode,
    step_costs,
    summarize,
)
from specdec.bench.report import machine, run_record, write_json
from specdec.client import SpecdecClient, build_request
from specdec.config import PROPOSERS
from specdec.decoding.stats import SpeculationStats
from specdec.tools.args import (
    add_k_arg,
    add_prompt_set_args,
    check_report_paths,
    client_options,
    positive_int,
)

WARM_UP_TOKENS = 16


def proposer_list(text: str) -> list[str]:
    """argparse type of --proposer: ``"auto,draft,ngram"`` -> ["auto", "draft", "ngram"].

    Raises:
        argparse.ArgumentTypeError: a name not in specdec.config.PROPOSERS, or one twice.
    """
    names = [name.strip() for name in text.split(",")]
    bad = [name for name in names if name not in PROPOSERS]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"must be distinct names of {list(PROPOSERS)}, comma-separated, got {text!r}"
        )
    return names


def service_modes(proposers: Sequence[str] | None) -> dict[str, str | None]:
    """The service's modes in the order they run, each with the proposer its requests ask for
    (None: unset, the service's default): target_only, then one speculative mode per
    proposer, or ``speculative`` alone without --proposer."""
    return {TARGET_ONLY: None} | {speculative_mode(p): p for p in proposers or [None]}


def service_run(
    client: SpecdecClient,
    prompt: BenchPrompt,
    mode: str,
    k: int | None,
    sampling: dict[str, Any],
    proposer: str | None = None,
) -> Run:
    """One unary Generate call; ``k`` None = adaptive, ``proposer`` None = the service's
    default. Raises grpc.RpcError."""
    request = build_request(
        **prompt.request_fields(), num_speculative_tokens=k, proposer=proposer, **sampling
    )
    response = client.generate(request)
    stats = SpeculationStats.from_proto(response.stats)
    return Run(
        mode, list(response.token_ids), response.text, stats.tokens_per_second, stats.ttft_s, stats
    )


def write_report(
    path: str,
    results: Sequence[PromptResult],
    summary: dict,
    config: dict,
    costs: StepCosts | None = None,
) -> None:
    """The run as JSON: the command, the machine, the config, one record per prompt (with each
    mode's speedups, exactness and bound) and the summary."""
    greedy = not config["temperature"]
    prompts = [r.record(greedy, costs) for r in results]
    body = run_record(" ".join(sys.argv), config["machine"], config, prompts=prompts)
    write_json(path, {**body, "summary": summary})


# --- the command ------------------------------------------------------------------------------


def _sampling(args, i: int) -> dict[str, Any]:
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed + i,
    }


def run_service(
    client: SpecdecClient, prompts: Sequence[BenchPrompt], args, plain=None
) -> list[PromptResult]:
    """Every prompt through the service at k = 0 and at --k (once per --proposer), one request
    at a time, and through ``plain`` (a specdec.bench.inprocess.PlainGenerate, warmed up) right
    after them when given."""
    from tqdm.auto import tqdm

    proposers = service_modes(args.proposer)
    modes = [*proposers, *((PLAIN,) if plain else ())]
    results = []
    with tqdm(total=len(prompts) * len(modes), unit="run", desc="bench") as bar:
        for i, prompt in enumerate(prompts):
            runs = {}
            for mode in modes:
                bar.set_postfix_str(f"{prompt.id} {mode}")
                if mode == PLAIN:
                    runs[mode] = plain.run(prompt, args.max_new_tokens, _sampling(args, i))
                else:
                    k = 0 if mode == TARGET_ONLY else args.k
                    sampling = _sampling(args, i)
                    runs[mode] = service_run(client, prompt, mode, k, sampling, proposers[mode])
                bar.update()
            results.append(PromptResult(prompt, runs))
    return results


def run_in_process(mode: str, runner, results: Sequence[PromptResult], args) -> None:
    """One in-process mode over every prompt (after one warm-up run), added to ``results``."""
    from tqdm.auto import tqdm

    warm_up = {"max_new_tokens": WARM_UP_TOKENS, "temperature": args.temperature, "seed": args.seed}
    runner.run(results[0].prompt, WARM_UP_TOKENS, warm_up)
    for i, result in enumerate(tqdm(results, unit="run", desc=f"bench {mode}")):
        result.runs[mode] = runner.run(result.prompt, args.max_new_tokens, _sampling(args, i))


def load_plain(info, prompts: Sequence[BenchPrompt], args, device: str):
    """plain_generate's target (specdec.bench.inprocess.PlainGenerate), warmed up, loaded while the
    service runs so that its runs interleave with the service's; None when skipped
    (--no-plain, or not enough memory, said why)."""
    from specdec.bench import inprocess

    if args.no_plain:
        return None
    candidates = inprocess.candidate_dtypes(device, args.plain_gemms)
    widest = max(candidates, key=inprocess.dtype_bytes)
    if not inprocess.fits_in_memory(PLAIN, [(info.target_model, widest)], device):
        return None
    plain = inprocess.PlainGenerate(
        info.target_model, device, prompts[0], args.max_new_tokens, args.plain_gemms
    )
    warm_up = {"max_new_tokens": WARM_UP_TOKENS, "temperature": args.temperature, "seed": args.seed}
    plain.run(prompts[0], WARM_UP_TOKENS, warm_up)
    return plain


def in_process_modes(
    info, results: Sequence[PromptResult], args, device: str, plain=None
) -> dict[str, str]:
    """Runs hf_assisted (on ``plain``'s target when it ran) and engine (those not skipped) on
    the service's model files, freeing each mode's models, and ``plain``'s, before the next
    loads. Returns what each ran, in words, plain_generate's included."""
    from specdec.bench import inprocess

    described: dict[str, str] = {}
    if plain:
        described[PLAIN] = (
            f"the target alone, transformers generate, {plain.dtype}, in process, "
            "run right after the service's modes on each prompt; the fastest dtype for a "
            f"{args.max_new_tokens}-token request of the first prompt ({plain.pick_text()})"
        )
    if not args.no_hf:
        described.update(_hf_mode(info, results, args, device, plain))
    if plain:
        plain.close()
    inprocess.free_memory(device)
    if not args.no_engine:
        described.update(_engine_mode(info, results, args, device))
    return described


def model_files_here(info) -> bool:
    """Whether the service's model files are on this machine too, for the in-process modes
    (said why not)."""
    from specdec.bench import inprocess

    missing = [
        p
        for p in (info.draft_model, info.target_model)
        if not (Path(p).exists() or p.startswith("bundled:"))
    ]
    if missing:
        inprocess.say(f"in-process modes skipped: the service's model files {missing} are not here")
    return not missing


def _engine_mode(info, results: Sequence[PromptResult], args, device: str) -> dict[str, str]:
    from specdec.bench import inprocess

    models = [(info.draft_model, info.draft_dtype), (info.target_model, info.target_dtype)]
    if not inprocess.fits_in_memory(ENGINE, models, device):
        return {}
    what = f"SpeculativeEngine in process, target {info.target_dtype}, draft {info.draft_dtype}"
    inprocess.say(f"engine: {what}")
    proposer = args.proposer[0] if args.proposer else None
    runner = inprocess.EngineMode(info, device, args.k, proposer)
    run_in_process(ENGINE, runner, results, args)
    runner.close()
    inprocess.free_memory(device)
    return {ENGINE: what}


def _hf_mode(info, results: Sequence[PromptResult], args, device: str, plain) -> dict[str, str]:
    """HF assisted on plain_generate's target (its fastest dtype) when it ran, else on the
    service's target dtype."""
    from specdec.bench import inprocess

    target_dtype = plain.dtype if plain else info.target_dtype
    models = [(info.draft_model, info.draft_dtype)]
    if plain is None:
        models.append((info.target_model, target_dtype))
    if not inprocess.fits_in_memory(HF_ASSISTED, models, device):
        return {}
    hf = inprocess.HFAssisted(
        plain.target if plain else None,
        info.draft_model,
        info.draft_dtype,
        k_max=info.max_speculative_tokens,
        device=device,
        target_model=info.target_model,
        target_dtype=target_dtype,
    )
    if not args.no_hf_tune:
        hf.tune(results[0].prompt, args.max_new_tokens)
    what = f"target {target_dtype}, assistant {info.draft_dtype}, settings {hf.describe()}"
    inprocess.say(f"hf_assisted: {what}")
    run_in_process(HF_ASSISTED, hf, results, args)
    hf.close()
    return {HF_ASSISTED: what}


def _device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec bench`."""
    add_prompt_set_args(parser)
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="new tokens per request",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling: prompt i uses seed + i")
    add_k_arg(parser, "speculative tokens per round in the speculative mode: int or auto")
    parser.add_argument(
        "--proposer",
        type=proposer_list,
        help=f"one speculative mode per proposer, comma-separated names of {list(PROPOSERS)} "
        "(e.g. auto,draft,ngram); default: one mode, the service's speculation.proposer",
    )
    parser.add_argument(
        "--no-plain",
        action="store_true",
        help="skip plain_generate (the target alone with transformers generate, fastest dtype)",
    )
    parser.add_argument(
        "--plain-gemms",
        action="store_true",
        help="plain_generate (and HF assisted, which runs its target) also tries the service's "
        "CPU GEMMs (float32+dnnl, bfloat16+dnnl): speculation's speedup apart from the GEMM's",
    )
    parser.add_argument(
        "--no-engine",
        action="store_true",
        help="skip the in-process SpeculativeEngine (the service's share of its speed)",
    )
    parser.add_argument(
        "--no-hf",
        action="store_true",
        help="skip the in-process Hugging Face assisted-generation baseline",
    )
    parser.add_argument(
        "--no-hf-tune",
        action="store_true",
        help="run HF assisted with transformers' default assistant settings instead of timing "
        "each of specdec.bench.inprocess.HF_SETTINGS on the first prompt",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="device of the in-process modes (default: cuda if any, else cpu)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="per-request deadline, seconds"
    )
    parser.add_argument("--json", metavar="OUT", help="one record per prompt and a summary")
    parser.add_argument(
        "--plot", metavar="OUT.png", help="speedup per prompt, acceptance per draft position"
    )


def _header(args, info, n_prompts: int, device: str) -> str:
    greedy = not args.temperature
    k_text = "auto" if args.k is None else args.k
    if getattr(args, "proposer", None):
        k_text = f"{k_text}, proposers {','.join(args.proposer)}"
    lines = [
        f"# {args.dataset}{'/' + args.category if args.category else ''}: {n_prompts} prompts, "
        f"{args.max_new_tokens} new tokens, {'greedy' if greedy else f'T={args.temperature}'}, "
        f"k={k_text}; target {Path(info.target_model).name} ({info.target_dtype}), draft "
        f"{Path(info.draft_model).name} ({info.draft_dtype})",
        f"# machine (bench process): {machine(device)}",
    ]
    for role in ("target", "draft"):
        calibration = getattr(info, f"{role}_calibration")
        if calibration.device:
            how = "chosen by measurement" if calibration.automatic else "as configured"
            if calibration.reused:
                how += f"; reused a calibration of {calibration.seconds:.0f} s"
            lines.append(f"# {role} replica: {calibration.device}; {calibration.dtype} ({how})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`specdec bench` (flags: add_cli_args). Returns 1 when a greedy output of a speculative
    mode differs from target-only, else 0.

    Raises:
        ValueError: no directory for --json / --plot, or a bad dataset. ImportError: --plot
        without matplotlib. grpc.RpcError: the service refused or failed a request.
    """
    from specdec.bench.datasets import load_prompts

    prompts = load_prompts(
        args.dataset, category=args.category, limit=args.limit, data_file=args.data_file
    )
    check_report_paths(args)
    greedy = not args.temperature
    device = _device(args.device)
    with SpecdecClient(
        args.address, args.application, timeout_s=args.timeout, **client_options(args)
    ) as client:
        info = client.model_info()
        # The warm-up goes first: a request the service refuses fails before any model loads.
        warm_up = {
            "max_new_tokens": WARM_UP_TOKENS,
            "temperature": args.temperature,
            "seed": args.seed,
        }
        for mode, proposer in service_modes(args.proposer).items():
            k = 0 if mode == TARGET_ONLY else args.k
            service_run(client, prompts[0], "warm-up", k, warm_up, proposer)
        local = model_files_here(info)
        plain = load_plain(info, prompts, args, device) if local else None
        results = run_service(client, prompts, args, plain)
    described = {TARGET_ONLY: f"the service with k = 0, target {info.target_dtype}"}
    if local:
        described.update(in_process_modes(info, results, args, device, plain))
    costs = step_costs(info)
    summary = summarize(results, greedy, costs)
    header = _header(args, info, len(prompts), device)
    print(f"\n{header}")
    print(format_table(summary, greedy))
    print(legend(summary, described), flush=True)
    if args.json:
        config = {
            "dataset": args.dataset,
            "category": args.category,
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "k": "auto" if args.k is None else args.k,
            "proposers": args.proposer,
            "target_model": info.target_model,
            "target_dtype": info.target_dtype,
            "draft_model": info.draft_model,
            "draft_dtype": info.draft_dtype,
            "machine": machine(device),
            "torch": _torch_version(),
            "modes": described,
            "step_costs": dataclasses.asdict(costs) if costs else None,
        }
        write_report(args.json, results, summary, config, costs)
    if args.plot:
        from specdec.bench.plots import plot_speedup

        plot_speedup(results, summary, args.plot)
    inexact = greedy and any(
        row.get("exact_vs_k0", 1.0) < 1.0 for mode, row in summary.items() if is_speculative(mode)
    )
    if inexact:
        print(
            "specdec bench: a greedy speculative output differs from target-only", file=sys.stderr
        )
    return 1 if inexact else 0


def _torch_version() -> str:
    import torch

    return torch.__version__
