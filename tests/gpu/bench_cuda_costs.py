"""Costs of the bundled pair's architectures on a GPU, with random weights (not collected by
pytest).

    python tests/gpu/bench_cuda_costs.py --target-config DIR --draft-config DIR --json OUT

Each DIR holds a model's config.json and tokenizer files (the bundled pair's, without weights:
a GPU machine here has neither the part packages nor a network). The script builds random
weights of those shapes, then measures on the first CUDA device:

- plain ``generate(do_sample=False)`` of the target alone: TTFT and decode tokens/s, in bfloat16
  and float16, with the dynamic cache and then the static cache (which transformers compiles);
- what ``dtype: auto`` chose for each side (SpeculativeEngine.from_pretrained), with its
  forward seconds by width and its exact widths;
- the in-process engine at k = 0 (target only) and k = 4: TTFT, tokens/s and where a round's
  time goes (draft, verify, orchestration).

Random weights make acceptance meaningless (the draft almost never matches), so speculative
speed is not measured here; the step costs are what the weights do not change. Results are
written to the JSON after every stage, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, StaticCache

from specdec import SamplingParams, SpeculativeEngine
from specdec.device.exact_widths import ROW_WISE_ATTENTION

PROMPT = (
    "def has_close_elements(numbers: list[float], threshold: float) -> bool:\n"
    '    """Check if in given list of numbers, are any two numbers closer to each other than\n'
    "    given threshold.\n"
    "    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
    "    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n"
    '    """\n'
)
DEVICE = "cuda"  # --device replaces it before any stage runs
WIDTHS = (1, 2, 4, 8, 13)  # rows of the timed forwards (forward_costs)
PREFIX_TOKENS = 128  # cache length they extend


def random_model(config_dir: Path, out_dir: Path) -> Path:
    """Saves random bfloat16 weights of config_dir's architecture with its tokenizer files."""
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    for path in config_dir.iterdir():
        if path.name != "config.json" and path.is_file():
            shutil.copy(path, out_dir / path.name)
    del model
    return out_dir


def synchronize() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up, synchronised with the device."""
    fn()
    seconds = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def plain_generate(target_dir: Path, dtype: str, cache: str, new_tokens: int) -> dict:
    """The target alone with transformers' generate: TTFT (1 new token) and decode tokens/s."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype))
    model = model.to(DEVICE).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(DEVICE)
    settings = {"do_sample": False, "eos_token_id": None, "pad_token_id": tokenizer.eos_token_id}
    if cache == "static":
        settings["cache_implementation"] = "static"

    def run(n):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **settings)

    ttft = timed(run(1), 5)
    total = timed(run(new_tokens), 3)
    return {
        "dtype": dtype,
        "cache": cache,
        "prompt_tokens": ids.shape[1],
        "ttft_s": ttft,
        "seconds": total,
        "tokens_per_second": new_tokens / total,
        "decode_s_per_token": (total - ttft) / (new_tokens - 1),
    }


def calibration_record(side) -> dict:
    """What a TargetVerifier or DraftProposer measured at load and chose."""
    c = side.calibration
    return {
        "device": c.device,
        "dtype": str(c.candidate),
        "seconds": c.seconds,
        "exact_widths": list(c.chosen.exact.widths) if c.chosen.exact else None,
        "candidates": [
            {
                "dtype": str(m.candidate),
                "forward_s": list(m.forward_s),
                "prefill_s_per_token": m.prefill_s_per_token,
                "predicted_s": m.predicted_s,
                "exact_widths": list(m.exact.widths) if m.exact else None,
            }
            for m in c.candidates
        ],
    }


def engine_runs(engine: SpeculativeEngine, new_tokens: int) -> list[dict]:
    params = SamplingParams(max_new_tokens=new_tokens)
    records = []
    for k in (0, 4):
        engine.generate(PROMPT, params, k)  # warm-up
        outs = [engine.generate(PROMPT, params, k) for _ in range(3)]
        out = min(outs, key=lambda o: o.stats.wall_time_s)
        s = out.stats
        records.append(
            {
                "k": k,
                "tokens": len(out.token_ids),
                "ttft_s": s.ttft_s,
                "wall_s": s.wall_time_s,
                "tokens_per_second": len(out.token_ids) / s.wall_time_s,
                "rounds": s.rounds,
                "accepted_tokens": s.accepted_tokens,
                "draft_tokens": s.draft_tokens,
                "draft_time_s": s.draft_time_s,
                "verify_time_s": s.verify_time_s,
                "overhead_time_s": s.overhead_time_s,
                "prefill_verify_time_s": s.prefill_verify_time_s,
            }
        )
    return records


def forward_costs(target_config: Path) -> dict:
    """Median seconds of one bfloat16 target forward of w new positions on a PREFIX_TOKENS-token
    cache: eagerly with row-wise attention (what the verifier runs), eagerly with plain SDPA
    (a causal mask over the shared key block), and with SDPA over a static cache replayed as a
    captured CUDA graph (what a graph-captured verifier could run)."""
    config = AutoConfig.from_pretrained(target_config)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prefix = torch.randint(0, min(1000, config.vocab_size), (1, PREFIX_TOKENS), device=DEVICE)
    out = {a: eager_forward_seconds(model, config, prefix, a) for a in (ROW_WISE_ATTENTION, "sdpa")}
    try:
        out["sdpa_cuda_graph"] = {
            w: graph_forward_seconds(model, config, prefix, w) for w in WIDTHS
        }
    except Exception as error:  # noqa: BLE001 - a measurement that failed is reported, not fatal
        out["sdpa_cuda_graph"] = f"{type(error).__name__}: {error}"[:500]
    return out


def eager_forward_seconds(model, config, prefix: torch.Tensor, attention: str) -> dict:
    """{w: seconds} of eager w-position forwards with ``attention``, each cropped back after."""
    model.set_attn_implementation(attention)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(prefix, cache=cache, use_cache=True)

        def step(w):
            def run():
                model(prefix[:, :w], cache=cache, use_cache=True)
                cache.crop(-w)

            return run

        return {w: timed(step(w), 10) for w in WIDTHS}


def graph_forward_seconds(model, config, prefix: torch.Tensor, width: int) -> float:
    """One w-position forward on a static cache, captured once as a CUDA graph, then replayed.

    The static cache appends at its own length whatever cache_position says (transformers
    5.25), so it holds room for the warm-ups and the capture (the replays repeat the captured
    positions)."""
    cache = StaticCache(config=config, max_cache_len=PREFIX_TOKENS + 8 * width)
    with torch.no_grad():
        model(prefix, cache=cache, cache_position=torch.arange(PREFIX_TOKENS, device=DEVICE))
        ids = prefix[:, :width].clone()
        positions = torch.arange(PREFIX_TOKENS, PREFIX_TOKENS + width, device=DEVICE)

        def forward():
            return model(ids, cache=cache, cache_position=positions, use_cache=True)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
    return timed(graph.replay, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-config", type=Path, required=True)
    parser.add_argument("--draft-config", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/specdec-random-pair"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--stages", default="all", help="all, or comma-separated: plain,engine,forward,static"
    )
    parser.add_argument("--device", default=DEVICE, help="cuda[:N]; cpu only to try the script")
    args = parser.parse_args()
    globals()["DEVICE"] = args.device
    cuda = args.device.startswith("cuda")
    result = {
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }

    def save(stage: str, value) -> None:
        result[stage] = value
        args.json.write_text(json.dumps(result, indent=1))
        print(stage, json.dumps(value, indent=1), flush=True)

    stages = (
        {"plain", "engine", "forward", "static"}
        if args.stages == "all"
        else set(args.stages.split(","))
    )
    n = args.max_new_tokens
    if "forward" in stages:
        save("forward_s", forward_costs(args.target_config))
    if not stages & {"plain", "engine", "static"}:
        return
    target = random_model(args.target_config, args.workdir / "target")
    draft = random_model(args.draft_config, args.workdir / "draft")
    if "plain" in stages:
        save("plain", [plain_generate(target, d, "dynamic", n) for d in ("bfloat16", "float16")])
    if "engine" in stages:
        engine_stage(draft, target, n, save)
    if "static" in stages:
        save("plain_static", [plain_generate(target, "bfloat16", "static", n)])


def engine_stage(draft: Path, target: Path, n: int, save) -> None:
    """The engine with ``dtype: auto``: load time, both calibrations, the k = 0 and k = 4 runs."""
    start = time.perf_counter()
    engine = SpeculativeEngine.from_pretrained(draft, target, device=DEVICE, dtype="auto")
    save("engine_load_s", time.perf_counter() - start)
    save(
        "calibration",
        {"target": calibration_record(engine.transport.verifier)}
        | {"draft": calibration_record(engine.transport.proposer)},
    )
    save("engine", engine_runs(engine, n))
    if DEVICE.startswith("cuda"):
        save("gpu_memory_peak_bytes", torch.cuda.max_memory_allocated())


if __name__ == "__main__":
    main()
