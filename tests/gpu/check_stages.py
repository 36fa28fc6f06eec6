"""The stages of tests/gpu/check.py, each run in a process of its own (run_child).

Every measurement is in a try/except of its own: what fails is recorded in the stage's
``errors`` (naming the call, e.g. a runner method this branch does not have yet) and the
stage goes on with the next measurement.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DRAFT_CHAIN = 4  # k of the timed chained draft steps
BATCHES = (1, 2, 4, 8)
PROMPT_TOKENS = 128  # the random prompt of the speed stages (quick: 16)


class Recorder:
    """The records of one child, ``{key: {field: value}}``, written to ``path`` after every
    change for the parent to merge."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict] = {}

    def put(self, key: str, **fields: Any) -> dict:
        record = self.records.setdefault(key, {})
        record.update(fields)
        self._write()
        return record

    def error(self, key: str, what: str, error: BaseException) -> None:
        """Records ``what`` failed with ``error`` (type, message, innermost frame)."""
        frame = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
        where = f" at {Path(frame[0].filename).name}:{frame[0].lineno}" if frame else ""
        text = f"{what}: {type(error).__name__}: {error}"[:800] + where
        print(f"  error: {text}", flush=True)
        self.records.setdefault(key, {}).setdefault("errors", []).append(text)
        self._write()

    def finish(self, *keys: str) -> None:
        """Sets each key's status: ok, or partial when some measurement failed."""
        for key in keys:
            record = self.records.setdefault(key, {})
            record.setdefault("status", "partial" if record.get("errors") else "ok")
        self._write()

    def _write(self) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(self.records, indent=1, default=str))
        temporary.replace(self.path)


def say(message: str) -> None:
    print(f"  {time.strftime('%H:%M:%S')} {message}", flush=True)


def synchronize(device: str) -> None:
    import torch

    from specdec.worker.static.runner import synchronize as wait

    wait(torch.device(device))


def seconds_of(fn: Callable[[], Any], device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], device: str, repeats: int) -> float:
    return statistics.median(seconds_of(fn, device) for _ in range(max(repeats, 1)))


# ------------------------------------------------------------------------------------ device


def stage_device(s: dict, rec: Recorder) -> None:
    import torch
    import transformers

    from specdec.device.hardware import describe_device

    fields: dict[str, Any] = {
        "describe": describe_device(s["device"]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": describe_device("cpu"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain")),
    }
    try:
        import ray

        fields["ray"] = ray.__version__
    except ImportError:
        fields["ray"] = None
    if s["device"].startswith("cuda"):
        props = torch.cuda.get_device_properties(s["device"])
        fields |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_count": torch.cuda.device_count(),
            "driver": _nvidia_smi("driver_version"),
            "mig": _nvidia_smi("mig.mode.current"),
        }
    rec.put("device", **fields)
    say(f"device: {fields['describe']}; torch {fields['torch']} (CUDA {fields['cuda']})")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


# ------------------------------------------------------------------------------------ pair


def pair_dirs(s: dict) -> tuple[Path, Path]:
    """(draft_dir, target_dir): the random-weight bundled pair (toy shapes when quick), written
    once per workdir and settings."""
    from specdec.models import shapes

    root = Path(s["workdir"]) / "pair"
    stamp = root / "stamp.json"
    wanted = {"quick": s["quick"], "dtype": s["dtype"]}
    dirs = root / "draft", root / "target"
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return dirs
    stamp.unlink(missing_ok=True)
    draft = shapes.load_shape(shapes.BUNDLED_DRAFT, toy=s["quick"])
    target = shapes.load_shape(shapes.BUNDLED_TARGET, toy=s["quick"])
    device = s["device"]
    shapes.save_random_pair(root, draft, target, device=device, dtype=s["dtype"])
    stamp.write_text(json.dumps(wanted))
    return dirs


def stage_prepare(s: dict, rec: Recorder) -> None:
    start = time.perf_counter()
    draft, target = pair_dirs(s)
    size = sum(p.stat().st_size for d in (draft, target) for p in d.iterdir())
    rec.put(
        "prepare",
        draft_dir=str(draft),
        target_dir=str(target),
        bytes=size,
        write_s=round(time.perf_counter() - start, 2),
    )


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """Random ids in [1, vocab_size): a prompt that no tokenizer is needed for."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (length,), generator=generator).tolist()


# ------------------------------------------------------------------------------------ baselines


def stage_baseline(s: dict, rec: Recorder, key: str = "baseline", big: bool = False) -> None:
    """Compiled generate of the target shape and (not ``big``) of the draft shape."""
    from specdec.models import shapes

    roles = {"target": shapes.TARGET_14B}
    if not big:
        roles = {"target": shapes.BUNDLED_TARGET, "draft": shapes.BUNDLED_DRAFT}
    models: dict[str, dict] = {}
    for role, name in roles.items():
        say(f"{key}: compiled generate of {name}")
        models[role] = {"shape": name}
        try:
            config = shapes.load_shape(name, toy=s["quick"])
            new_tokens = s["new_tokens"] // 2 if big else s["new_tokens"]
            models[role] |= plain_generate(
                config, s, new_tokens, lambda: rec.put(key, models=models)
            )
        except Exception as error:  # noqa: BLE001 - recorded; the next model still runs
            rec.error(key, f"generate of {name}", error)
        rec.put(key, models=models)


def stage_baseline_14b(s: dict, rec: Recorder) -> None:
    stage_baseline(s, rec, key="baseline_14b", big=True)


def plain_generate(config, s: dict, new_tokens: int, save: Callable[[], Any]) -> dict:
    """The target alone with transformers' generate, greedy, batch 1, static cache, compiled
    as transformers documents for the fastest decode (mode reduce-overhead: CUDA graphs;
    fullgraph) unless the settings say no compile.

    Returns (filled in as measured; ``save`` is called after each figure): ``first_call_s``
    (the call that compiles), ``ttft_s``, ``seconds`` (``new_tokens`` tokens),
    ``decode_ms_per_token`` (the difference of two lengths over their token difference: no
    prefill in it), ``tokens_per_second`` and ``decode_tokens_per_second``.
    """
    import torch
    from transformers import CompileConfig

    from specdec.models import shapes

    device = s["device"]
    out: dict[str, Any] = {"dtype": s["dtype"], "new_tokens": new_tokens}
    start = time.perf_counter()
    model = shapes.random_model(
        config, device=device, dtype=s["dtype"], never_emit=shapes.end_ids(config)
    )
    synchronize(device)
    out["build_s"] = round(time.perf_counter() - start, 2)
    out["parameters"] = shapes.parameter_count(model)
    length = 16 if s["quick"] else PROMPT_TOKENS
    ids = torch.tensor([prompt_ids(config.vocab_size, length)], device=device)
    settings: dict[str, Any] = {
        "do_sample": False,
        "eos_token_id": None,
        "pad_token_id": 0,
        "cache_implementation": "static",
    }
    if s["compile"]:
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        compile_config._compile_all_devices = not device.startswith("cuda") or None
        settings["compile_config"] = compile_config
    else:
        settings["disable_compile"] = True
    out["compile"] = dict(settings.get("compile_config").to_dict()) if s["compile"] else None

    def run(n: int) -> Callable[[], Any]:
        def generate():  # generate runs under no_grad itself; the compiled graphs expect it
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **settings)

        return generate

    try:
        out["first_call_s"] = round(seconds_of(run(new_tokens), device), 2)
    except Exception as error:  # noqa: BLE001 - fullgraph refused: transformers' default
        out["fullgraph_error"] = f"{type(error).__name__}: {error}"[:500]
        settings["compile_config"] = CompileConfig(mode="reduce-overhead")
        out["compile"] = settings["compile_config"].to_dict()
        out["first_call_s"] = round(seconds_of(run(new_tokens), device), 2)
    out["compiled"] = hasattr(model, "_compiled_call")
    save()
    out["second_call_s"] = round(seconds_of(run(new_tokens), device), 3)
    short = max(2, new_tokens // 4)
    seconds_of(run(short), device)  # a shorter call reuses the longer static cache
    repeats = 1 if s["quick"] else 3
    total = median_seconds(run(new_tokens), device, repeats)
    part = median_seconds(run(short), device, repeats)
    decode_s = max(total - part, 1e-9) / (new_tokens - short)
    out |= {
        "prompt_tokens": length,
        "ttft_s": round(median_seconds(run(1), device, repeats), 4),
        "seconds": round(total, 4),
        "tokens_per_second": round(new_tokens / total, 2),
        "decode_ms_per_token": round(1e3 * decode_s, 3),
        "decode_tokens_per_second": round(1 / decode_s, 2),
    }
    if device.startswith("cuda"):
        out["gpu_memory_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    say(f"  {out['decode_ms_per_token']} ms/token, {out['tokens_per_second']} tokens/s")
    return out


# ------------------------------------------------------------------------------------ runner


def stage_runner(s: dict, rec: Recorder) -> None:
    """The static runner's forwards and chained draft steps, then the in-process engine."""
    from specdec import SpeculativeEngine

    draft_dir, target_dir = pair_dirs(s)
    start = time.perf_counter()
    engine = SpeculativeEngine.from_pretrained(
        draft_dir,
        target_dir,
        device=s["device"],
        dtype=s["dtype"],
        runner="static",
        max_speculative_tokens=s["k_max"],
    )
    rec.put("runner", load_s=round(time.perf_counter() - start, 2), **runner_names(engine))
    say(f"runner: engine loaded in {time.perf_counter() - start:.1f} s ({runner_names(engine)})")
    measure_runner(engine, s, rec)
    rec.finish("runner")
    engine_runs(engine, s, rec)
    rec.finish("engine")


def runner_names(engine) -> dict:
    """Which runner each side uses: its class, or the note that the side has none."""
    names = {}
    for side, worker in (
        ("target", engine.transport.verifier),
        ("draft", engine.transport.proposer),
    ):
        runner = getattr(worker, "runner", None)
        names[f"{side}_runner"] = type(runner).__name__ if runner else "none (dynamic path)"
    return names


def measure_runner(engine, s: dict, rec: Recorder) -> None:
    repeats, widths = s["repeats"], (1, s["k_max"] + 1)
    forward_ms: dict[str, float] = {}
    draft_chain_ms: dict[str, float] = {}
    try:
        target = engine.transport.verifier.runner
        for batch in BATCHES:
            for width in widths:
                try:
                    seconds = target.benchmark_forward(batch, width, repeats)
                    forward_ms[f"b{batch}_w{width}"] = round(1e3 * seconds, 4)
                    rec.put("runner", forward_ms=forward_ms)
                except Exception as error:  # noqa: BLE001
                    rec.error("runner", f"benchmark_forward({batch}, {width})", error)
    except AttributeError as error:
        rec.error("runner", "engine.transport.verifier.runner", error)
    try:
        draft = engine.transport.proposer.runner
        for batch in (1, 8):
            try:
                seconds = draft.benchmark_draft(batch, DRAFT_CHAIN, repeats)
                draft_chain_ms[f"b{batch}"] = round(1e3 * seconds, 4)
                steps = {b: round(ms / DRAFT_CHAIN, 4) for b, ms in draft_chain_ms.items()}
                rec.put("runner", draft_chain_ms=draft_chain_ms, draft_step_ms=steps)
            except Exception as error:  # noqa: BLE001
                rec.error("runner", f"benchmark_draft({batch}, {DRAFT_CHAIN})", error)
    except AttributeError as error:
        rec.error("runner", "engine.transport.proposer.runner", error)
    rec.put("runner", k_max=s["k_max"], repeats=repeats, draft_chain_k=DRAFT_CHAIN)


def engine_runs(engine, s: dict, rec: Recorder) -> None:
    """The engine at k = 0 (target alone) and k = 4: the best of 3 after a warm-up."""
    from specdec import SamplingParams

    vocab = engine.limits.vocab_size
    prompt = prompt_ids(vocab, 16 if s["quick"] else PROMPT_TOKENS, seed=1)
    params = SamplingParams(max_new_tokens=s["new_tokens"])
    runs: dict[str, dict] = {}
    for k in (0, 4):
        try:
            engine.generate(prompt, params, k)
            outs = [engine.generate(prompt, params, k) for _ in range(1 if s["quick"] else 3)]
            best = min(outs, key=lambda o: o.stats.wall_time_s)
            stats = best.stats
            runs[f"k{k}"] = {
                "tokens": len(best.token_ids),
                "tokens_per_second": round(len(best.token_ids) / stats.wall_time_s, 2),
                "ttft_s": round(stats.ttft_s, 4),
                "acceptance_rate": stats.acceptance_rate,
                "draft_ms_per_round": round(1e3 * stats.draft_s_per_round, 3),
                "verify_ms_per_round": round(1e3 * stats.verify_s_per_round, 3),
                "orchestration_ms_per_round": round(1e3 * stats.orchestration_s_per_round, 3),
                "stats": stats.as_dict(),
            }
            say(f"engine k={k}: {runs[f'k{k}']['tokens_per_second']} tokens/s")
        except Exception as error:  # noqa: BLE001
            rec.error("engine", f"engine.generate(k={k})", error)
        rec.put("engine", runs=runs, prompt_tokens=len(prompt), **runner_names(engine))


# ------------------------------------------------------------------------------------ exactness


def stage_exactness(s: dict, rec: Recorder) -> None:
    """Speculative output equals k = 0 token for token and logprob for logprob on the tiny
    pair, in bfloat16 and float16 with the static runner: alone (k = 1, 3, auto), batched
    (asyncio.gather) and with every session evicted after every round."""
    from specdec import SamplingParams, SpeculativeEngine
    from specdec.models.tiny import PROMPTS, save_pair

    root = Path(s["workdir"]) / "tiny"
    if not (root / "target" / "config.json").is_file():
        save_pair(root, noise=0.05, pad_vocab=7)
    prompts = PROMPTS[:3] if s["quick"] else PROMPTS
    greedy = SamplingParams(max_new_tokens=12 if s["quick"] else 32)
    dtypes: dict[str, dict] = {}
    gpu = s["device"].startswith("cuda")
    for dtype in ("bfloat16", "float16") if gpu else (s["dtype"],):
        checks: dict[str, Any] = {}
        dtypes[dtype] = checks
        say(f"exactness: {dtype}")
        try:
            engine = SpeculativeEngine.from_pretrained(
                root / "draft", root / "target", device=s["device"], dtype=dtype, runner="static"
            )
            checks.update(runner_names(engine))
            exactness_checks(
                engine, prompts, greedy, checks, lambda: rec.put("exactness", dtypes=dtypes)
            )
        except Exception as error:  # noqa: BLE001
            rec.error("exactness", f"{dtype}", error)
        rec.put("exactness", dtypes=dtypes)
    verdicts = [c["passed"] for d in dtypes.values() for c in d.values() if isinstance(c, dict)]
    errors = rec.records.get("exactness", {}).get("errors")
    rec.put("exactness", passed=bool(verdicts) and all(verdicts) and not errors)


def exactness_checks(engine, prompts, greedy, checks: dict, save: Callable[[], Any]) -> None:
    from rebuilds import stream_evicting

    def outputs(k) -> dict:
        return {p: _output(engine.generate(p, greedy, k)) for p in prompts}

    reference = outputs(0)
    for k in (1, 3, "auto"):
        checks[f"k={k}"] = verdict(reference, outputs(k))
        save()

    async def together():
        return await asyncio.gather(*(engine.agenerate(p, greedy, 3) for p in prompts))

    batched = {p: _output(o) for p, o in zip(prompts, asyncio.run(together()))}
    checks["batched k=3"] = verdict(reference, batched)
    save()
    sides = (engine.transport.proposer, engine.transport.verifier)
    for k in (3, "auto"):
        outs = {p: stream_evicting(engine, p, greedy, k, sides) for p in prompts[:2]}
        checks[f"evicted k={k}"] = verdict({p: reference[p] for p in outs}, outs)
        save()


def _output(completion) -> tuple[list[int], list[float]]:
    return completion.token_ids, completion.logprobs


def verdict(expected: dict, got: dict) -> dict:
    """{"passed", "first_mismatch"}: the first prompt and position where (token ids,
    logprobs) differ, with both sides' values there."""
    for prompt, (tokens, logprobs) in expected.items():
        out_tokens, out_logprobs = got[prompt]
        for i, want in enumerate(zip(tokens, logprobs)):
            have = (out_tokens[i], out_logprobs[i]) if i < len(out_tokens) else None
            if have != want:
                mismatch = {"prompt": prompt, "position": i, "expected": want, "got": have}
                return {"passed": False, "first_mismatch": mismatch}
        if len(out_tokens) != len(tokens):
            mismatch = {"prompt": prompt, "position": len(tokens), "expected": None, "got": "more"}
            return {"passed": False, "first_mismatch": mismatch}
    return {"passed": True, "first_mismatch": None}


# ------------------------------------------------------------------------------------ pytest


def stage_pytest(s: dict, rec: Recorder) -> None:
    limit = max(s.get("limit_s", 120) - 15, 10)
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"]
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        lines = (out.stdout + out.stderr).strip().splitlines()
        rec.put(
            "pytest",
            returncode=out.returncode,
            summary=lines[-1] if lines else "",
            tail=lines[-15:],
        )
    except subprocess.TimeoutExpired:
        rec.put("pytest", status="timeout", error=f"pytest tests/gpu ran past {limit} s")


def stage_service(s: dict, rec: Recorder) -> None:
    import check_service

    check_service.run(s, rec, pair_dirs(s))


STAGES: dict[str, Callable[[dict, Recorder], None]] = {
    "device": stage_device,
    "prepare": stage_prepare,
    "baseline": stage_baseline,
    "runner": stage_runner,
    "exactness": stage_exactness,
    "baseline_14b": stage_baseline_14b,
    "service": stage_service,
    "pytest": stage_pytest,
}


def run_child(stage: str, settings: dict, out: Path) -> int:
    """Runs one stage in this process, recording to ``out``; returns 0 (a stage's failure is
    in its record, not the exit status)."""
    sys.path.insert(0, str(ROOT / "tests"))
    rec = Recorder(out)
    try:
        STAGES[stage](settings, rec)
    except Exception as error:  # noqa: BLE001 - the stage's record says what failed
        rec.error(stage, stage, error)
        traceback.print_exc()
        rec.put(stage, status="error")
    rec.finish(stage)
    return 0
