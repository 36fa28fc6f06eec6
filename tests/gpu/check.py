"""The prepared GPU check of issue 41: one command, under 8 minutes on one H100 or H200, no
network and no model download (random weights in real shapes; the tiny pair for exactness).

    python tests/gpu/check.py --json benchmarks/results/gpu-check.json     # or: make gpu-check
    python tests/gpu/check.py --device cpu --quick --no-compile --json /tmp/check.json  # smoke

Stages, each in a process of its own (a CUDA error or a hang in one cannot spoil the next; its
GPU memory is freed when it ends) with a time budget of its own, in this order:

    device        the GPU, driver, torch, CUDA and transformers versions
    prepare       the random-weight bundled pair written to --workdir (0.5B draft, 1.5B target)
    baseline      compiled generate (static cache) of the 1.5B target and the 0.5B draft
    runner        the static runner's target forwards by batch and width, the draft's chained
                  steps; then "engine": the in-process engine at k = 0 and k = 4
    exactness     speculative == k = 0 on the GPU (tiny pair, bfloat16 and float16), in
                  batches and after evictions
    baseline_14b  compiled generate of the Qwen2.5-Coder-14B-Instruct shape
    service       the whole service on the one GPU (deployments/config/one-gpu.yaml)
    pytest        python -m pytest tests/gpu, with the time left

The JSON is rewritten after every stage and, while a stage runs, whenever it records a
measurement, so a run cut short keeps what it measured. A stage that fails, times out or is
skipped says so (``status``, ``error``) and the next one runs. tests/gpu/README.md lists the
fields.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = (
    "device",
    "prepare",
    "baseline",
    "runner",
    "exactness",
    "baseline_14b",
    "service",
    "pytest",
)
# Seconds each stage may run on a GPU, and the least worth starting with (a stage given less
# is skipped): their sum stays under the 450 s default budget with the stages' start-ups.
BUDGET_S = {
    "device": (30, 10),
    "prepare": (45, 20),
    "baseline": (100, 60),
    "runner": (100, 45),
    "exactness": (60, 30),
    "baseline_14b": (100, 60),
    "service": (150, 120),
    "pytest": (120, 30),
}
# A 2-core CPU starts the local cluster and deploys the toy pair in 30-90 s.
QUICK_BUDGET_S = {stage: (60, 5) for stage in STAGES} | {"service": (180, 5)}
K_MAX = 8  # the shipped gpu.yaml's max_speculative_tokens
START = time.monotonic()


def log(message: str) -> None:
    """Prints a progress line with the wall time and the seconds since the check began."""
    now = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{now} +{time.monotonic() - START:6.1f}s] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/gpu-check.json")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run")
    parser.add_argument(
        "--dtype",
        help="the speed stages' dtype (default bfloat16 on a GPU, float32 on a CPU, whose "
        "half-precision calibration takes minutes); exactness runs bfloat16 and float16 on a GPU",
    )
    parser.add_argument("--quick", action="store_true", help="toy shapes, few tokens: seconds")
    parser.add_argument(
        "--no-compile", action="store_true", help="baselines without torch.compile (CPU smoke)"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/specdec-gpu-check"))
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all stages")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset")
    parser.add_argument("--skip", default="", help="comma-separated stages to leave out")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a stage, run in this process
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-limit", type=float, default=120.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    wanted = [s for s in args.stages.split(",") if s]
    unknown = (set(wanted) | set(filter(None, args.skip.split(",")))) - set(STAGES)
    if unknown:
        parser.error(f"unknown stage(s) {sorted(unknown)}; stages: {', '.join(STAGES)}")
    args.left_out = [s for s in STAGES if s not in wanted or s in args.skip.split(",")]
    args.run = [s for s in STAGES if s not in args.left_out]
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.workdir, args.json = args.workdir.resolve(), args.json.resolve()
    return args


def settings(args: argparse.Namespace) -> dict:
    """What every stage is told (JSON ``settings``)."""
    return {
        "device": args.device,
        "dtype": args.dtype,
        "quick": args.quick,
        "compile": not args.no_compile,
        "workdir": str(args.workdir),
        "k_max": K_MAX,
        "new_tokens": 16 if args.quick else 128,
        "repeats": 2 if args.quick else 20,
    }


class Report:
    """The JSON document, written whole after every change (a temporary file, then a rename:
    a reader never sees half of it)."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.data: dict = {
            "schema": 1,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "settings": settings(args),
            "stages": {},
            "summary": {},
        }
        path.parent.mkdir(parents=True, exist_ok=True)

    def update(self, records: dict) -> None:
        self.data["stages"].update(records)
        self.data["summary"] = summary(self.data["stages"])
        self.data["elapsed_s"] = round(time.monotonic() - START, 1)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        temporary.replace(self.path)


def run_stage(stage: str, args: argparse.Namespace, limit_s: float, report: Report) -> None:
    """Runs ``stage`` in a child process for at most ``limit_s`` seconds, merging what it
    records into ``report`` as it goes; a child that runs over is killed with its process
    group, and a service stage's cluster is stopped."""
    partial = args.workdir / "stages" / f"{stage}.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.unlink(missing_ok=True)
    logs = args.workdir / "logs" / f"{stage}.log"
    logs.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--device", args.device, "--dtype", args.dtype]
    command += ["--quick"] * args.quick + ["--no-compile"] * args.no_compile
    command += ["--workdir", args.workdir, "--child", stage, "--child-out", partial]
    command += ["--child-limit", f"{limit_s:.0f}"]
    paths = [*args.import_roots, str(ROOT / "tests"), os.environ.get("PYTHONPATH")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, paths)),
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
        # A rerun on the same machine reuses the compiled kernels (minutes of compile saved)
        # and the replicas' calibrations (each checked for exactness before it is reused).
        "TORCHINDUCTOR_CACHE_DIR": str(args.workdir / "inductor"),
        "SPECDEC_CALIBRATION_CACHE": str(args.workdir / "calibrations"),
    }
    started = time.monotonic()
    with open(logs, "wb") as log_file:
        child = subprocess.Popen(
            [str(c) for c in command],
            cwd=args.workdir,  # not the checkout: its specdec/ would shadow import_roots'
            env=env,
            stdout=None,  # progress lines go straight to the console
            stderr=log_file,
            start_new_session=True,
        )
        status = None
        while status is None:
            try:
                status = child.wait(timeout=2)
            except subprocess.TimeoutExpired:
                _merge(partial, report)
                if time.monotonic() - started > limit_s:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                    status = "timeout"
    records = _merge(partial, report)
    own = records.get(stage, {})
    seconds = round(time.monotonic() - started, 1)
    if status == "timeout" or status != 0 or "status" not in own:
        error = (
            f"ran past its {limit_s:.0f} s budget and was stopped"
            if status == "timeout"
            else f"exited with status {status}: {_tail(logs)}"
        )
        verdict = {"status": "timeout" if status == "timeout" else "error", "error": error}
        own = {**own, **verdict}
        # What the child recorded under other keys (the runner stage's "engine") and never
        # finished ends the same way.
        report.update({k: {**r, **verdict} for k, r in records.items() if "status" not in r})
    report.update({stage: {**own, "seconds": seconds, "log": str(logs)}})
    if stage == "service" and status != 0:
        _stop_service_cluster(args)
    log(f"{stage}: {report.data['stages'][stage]['status']} in {seconds} s")


def import_roots(workdir: Path) -> list[str]:
    """Where the stages (and the Ray workers they start, which inherit PYTHONPATH) import
    specdec from: nothing extra where it is installed; else a folder in ``workdir`` whose
    ``specdec`` links this checkout's package with ``cluster/`` and ``deployments/`` inside it,
    as pyproject.toml's package-dir installs them (a lent GPU machine has the checkout only)."""
    import importlib.util

    if importlib.util.find_spec("specdec") is not None:
        return []
    package = workdir / "import-root" / "specdec"
    package.mkdir(parents=True, exist_ok=True)
    sources = {p.name: p for p in (ROOT / "specdec").iterdir() if p.name != "__pycache__"}
    sources |= {"cluster": ROOT / "cluster", "deployments": ROOT / "deployments"}
    for name, source in sources.items():
        link = package / name
        if not link.is_symlink():
            link.symlink_to(source)
    return [str(package.parent)]


def _merge(partial: Path, report: Report) -> dict:
    try:
        records = json.loads(partial.read_text())
    except (OSError, ValueError):
        return {}
    report.update(records)
    return records


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _stop_service_cluster(args: argparse.Namespace) -> None:
    """A killed service stage leaves its local cluster running (own sessions): stop exactly
    that cluster's processes, by the pids its state file records."""
    sys.path[:0] = args.import_roots
    try:
        from specdec.cluster import local

        stopped = local.down(args.workdir / "cluster")
        if stopped:
            log(f"service: stopped the stage's cluster (pids {stopped})")
    except Exception as error:  # noqa: BLE001 - reported; the next stage still runs
        log(f"service: could not stop its cluster: {type(error).__name__}: {error}")


def summary(stages: dict) -> dict:
    """The issue's figures from the stages' records (absent where a stage did not measure)."""
    out: dict = {}
    base = stages.get("baseline", {}).get("models", {})
    generate_ms = base.get("target", {}).get("decode_ms_per_token")
    runner = stages.get("runner", {})
    forward_ms = runner.get("forward_ms", {})
    step_ms = forward_ms.get("b1_w1")
    if generate_ms and step_ms:
        out["runner_step_vs_compiled_generate"] = round(generate_ms / step_ms, 3)
    if step_ms:
        for key in ("b8_w1", f"b1_w{K_MAX + 1}", f"b8_w{K_MAX + 1}"):
            if forward_ms.get(key):
                out[f"forward_{key}_vs_b1_w1"] = round(forward_ms[key] / step_ms, 3)
    if runner.get("draft_step_ms", {}).get("b1"):
        out["draft_step_ms"] = runner["draft_step_ms"]["b1"]
    if base.get("draft", {}).get("decode_ms_per_token"):
        out["draft_compiled_generate_ms"] = base["draft"]["decode_ms_per_token"]
    engine = stages.get("engine", {}).get("runs", {})
    plain_tps = base.get("target", {}).get("tokens_per_second")
    for k, run in engine.items():
        if plain_tps and run.get("tokens_per_second"):
            out[f"engine_{k}_vs_compiled_generate"] = round(run["tokens_per_second"] / plain_tps, 3)
    big = stages.get("baseline_14b", {}).get("models", {}).get("target", {})
    if big.get("decode_ms_per_token"):
        out["compiled_generate_14b_ms"] = big["decode_ms_per_token"]
    exact = stages.get("exactness", {})
    if "passed" in exact:
        out["exact"] = exact["passed"]
    service = stages.get("service", {}).get("runs", {})
    for k, run in service.items():
        if run.get("orchestration_ms_per_round") is not None:
            out[f"service_{k}_orchestration_ms_per_round"] = run["orchestration_ms_per_round"]
    out["targets"] = {
        "runner_step_vs_compiled_generate": ">= 0.9",
        "forward_b8_w1_vs_b1_w1": "<= 1.3",
        "draft_step_ms": "<= 1.5 (0.5B shape)",
        "service_orchestration_ms_per_round": "<= 2",
    }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        import check_stages

        return check_stages.run_child(
            args.child, settings(args) | {"limit_s": args.child_limit}, args.child_out
        )
    args.import_roots = import_roots(args.workdir)
    report = Report(args.json, args)
    report.update(
        {s: {"status": "skipped", "error": "left out (--stages, --skip)"} for s in args.left_out}
    )
    budgets = QUICK_BUDGET_S if args.quick else BUDGET_S
    deadline = START + args.budget
    log(f"GPU check: stages {', '.join(args.run)}; {args.budget:.0f} s; JSON {args.json}")
    for stage in args.run:
        budget, least = budgets[stage]
        left = deadline - time.monotonic()
        if left < least:
            reason = f"{left:.0f} s of the budget left, the stage needs at least {least} s"
            report.update({stage: {"status": "skipped", "error": reason}})
            log(f"{stage}: skipped ({reason})")
            continue
        log(f"{stage}: starting (at most {min(budget, left):.0f} s)")
        run_stage(stage, args, min(budget, left), report)
    log(f"done: {json.dumps(report.data['summary'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
