"""`specdec soak`: minutes of mixed greedy load on the tiny pair while the service scales and
loses parts of itself; every request must succeed with exactly the target-only output.

On its own it writes the tiny pair to a work folder, computes the undisturbed reference
(target-only greedy in process, ``k = 0``), starts a local cluster of its own (head, draft and
target nodes on loopback), deploys the shipped ``local.yaml`` with the tiny pair, short timeouts
and autoscaling on every deployment with delays of seconds, and then runs the load for
``--duration`` seconds:

- a few client threads send greedy requests: every prompt of specdec.models.tiny, 16..64 new
  tokens, k 0, 1, 3 or adaptive, unary or streaming (a fixed shuffled cycle);
- the number of busy clients follows ``--schedule`` (default ``1@0,6@0.15,1@0.7``: 1 client,
  6 from 15 % of the run, 1 again from 70 %), so the target scales 1 -> 2 -> 1;
- at 30 % the newest TargetModel replica is killed (``ray.kill``), at 50 % the draft pool's
  node is SIGKILLed and at 60 % started again (specdec.cluster.faults);
- a monitor thread samples Serve's replica details every ``--interval`` seconds: RUNNING
  replicas per deployment and each replica process's resident memory (``/proc/PID/statm``).

The schedule's clock stops at a few gates until what comes next can mean something: before the
target kill until the target has two RUNNING replicas (with one, its requests would wait for a
new one), before the load falls until a new draft replica runs and a request drafted again, and
at the end until the target scaled back down. A replica starts in seconds on an idle machine and
in a minute on a busy one, so a short soak waits instead of failing by the clock; each gate
holds at most ``--max-hold`` seconds and the summary shows every hold.

It prints the counts and the checks, writes them as JSON (``--out``) and stops exactly the
cluster it started. Exit status 1 when any request failed, any greedy output differed from the
reference, the target did not scale up and back down, a fault did not happen (or the draft did
not come back and draft again), the model replicas' caches kept more sessions after the load
than replica changes can strand (``strandable_sessions``), or a replica's resident memory grew
by more than ``--max-growth-mb`` (default 50 MB, a tenth of a tiny-pair replica's ~0.5 GB)
from its baseline, the first sample after its first ``--warmup`` seconds, to its last sample.

Times are seconds since the start of the load (``t``); memory is in bytes in the JSON, MB
(10^6 bytes) in the printed summary.

This module is the command (the setup, the cluster, the report file); its parts: the schedule
and its gates (soak_schedule), the request mix and its client threads (soak_load), the
reference outputs (soak_reference), the faults (soak_faults), the replica and memory sampling
(soak_memory), the run that drives them (soak_run) and the checks and summary (soak_verdict).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specdec.bench.replicas import DRAFT, ROUTER, TARGET
from specdec.bench.report import cpu_line, write_json
from specdec.bench.soak_memory import MB
from specdec.bench.soak_reference import compute_references
from specdec.bench.soak_run import Runner
from specdec.bench.soak_schedule import DEFAULT_SCHEDULE, parse_schedule
from specdec.bench.soak_verdict import analyse, format_summary
from specdec.tools.args import run_standalone

# Autoscaling with delays of seconds (the shipped ones are minutes); tests/integration/
# test_autoscaling.py uses these too: they scale reliably on 2 cores.
FAST_AUTOSCALING = dict(
    min_replicas=1,
    max_replicas=2,
    target_ongoing_requests=2,
    metrics_interval_s=0.5,
    look_back_period_s=2,
    upscale_delay_s=1,
    downscale_delay_s=4,
)


AUTOSCALING = {
    DRAFT: FAST_AUTOSCALING,
    TARGET: FAST_AUTOSCALING,
    ROUTER: {**FAST_AUTOSCALING, "target_ongoing_requests": 3},
}


# Short router timeouts: a lost replica or node is noticed in seconds, so a soak of minutes sees
# the recovery, not the wait.
SHORT_TIMEOUTS = dict(call_timeout_s=5, unavailable_after_s=8, draft_timeout_s=3, draft_retry_s=0.5)


def write_serve_config(workdir: Path, draft: Path, target: Path, dtype: str) -> tuple[Path, int]:
    """The shipped local.yaml with the tiny pair in ``dtype`` on both sides, free loopback
    ports, short timeouts and fast autoscaling (1..2 replicas of every deployment). Returns
    (config path, gRPC port)."""
    import yaml

    from specdec.cluster.processes import free_ports
    from specdec.tools.args import config_path

    config = yaml.safe_load(config_path("local.yaml").read_text())
    grpc_port, http_port = free_ports(2)
    config["grpc_options"]["port"] = grpc_port
    config["http_options"]["port"] = http_port
    app = config["applications"][0]
    app["args"].pop("draft_dtype", None)  # the half-precision config: bfloat16 on both sides
    app["args"].update(
        draft_model=str(draft),
        target_model=str(target),
        dtype=dtype,
        cache_capacity_bytes=64 * 1024**2,
        **SHORT_TIMEOUTS,
    )
    for deployment in app["deployments"]:
        deployment["autoscaling_config"].update(AUTOSCALING[deployment["name"]])
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, grpc_port


class _KeepLogs(Exception):
    """Raised inside the cluster's context when the soak failed, so LocalCluster keeps the
    Ray logs for the post-mortem."""


def soak(opts: argparse.Namespace, workdir: Path) -> dict:
    """Sets up (pair, references, cluster, deployment), runs the soak, analyses; returns the
    report with its ``config``, ``gates``, ``notes`` and ``samples``. Stops its cluster in
    every case; keeps its Ray logs when the soak failed.

    Raises:
        RuntimeError: the cluster or the deployment did not come up.
    """
    from specdec.cluster.local import LocalCluster
    from specdec.models.tiny import PROMPTS, save_pair

    schedule = parse_schedule(opts.schedule, opts.duration)
    started = time.monotonic()
    draft, target = save_pair(workdir / "models", noise=0.05, pad_vocab=7)
    references = compute_references(draft, target, opts.dtype, PROMPTS)
    config_file, port = write_serve_config(workdir, draft, target, opts.dtype)
    config = {
        "dtype": opts.dtype,
        "duration_s": opts.duration,
        "schedule": schedule.describe(),
        "machine": cpu_line(),
        "date": datetime.date.today().isoformat(),
        "workdir": str(workdir),
        "serve_config": str(config_file),
    }
    report: dict[str, Any] = {}
    try:
        with LocalCluster(workdir / "state") as info:
            config["ray_logs"] = f"{info.temp_root}/<role>/session_latest/logs"
            runner, (outcomes, samples, events, notes) = _deploy_and_run(
                info, config_file, port, references, schedule, opts, started
            )
            config["setup_s"], config["load_s"] = runner.setup_s, runner.load_s
            report = analyse(
                outcomes,
                samples,
                events,
                runner.phases,
                runner.caches,
                warmup_s=opts.warmup if opts.warmup is not None else min(120, 0.2 * opts.duration),
                min_span_s=min(60.0, 0.1 * opts.duration),
                max_growth_bytes=int(opts.max_growth_mb * MB),
                sample_interval_s=opts.interval,
            )
            report.update(config=config, gates=runner.gate_records(), notes=notes)
            report["samples"] = samples
            if not report["passed"]:
                raise _KeepLogs
    except _KeepLogs:
        pass
    return report


def _deploy_and_run(info, config_file, port, references, schedule, opts, started) -> tuple:
    """Deploys on the cluster ``info``, runs the soak, disconnects; returns (runner, what
    Runner.run returned). ``runner.setup_s``: seconds from ``started`` to the load."""
    import ray
    from ray import serve

    from specdec.deployments.deploy import deploy

    try:
        deploy(config_file, address=info.address, timeout_s=600)
        runner = Runner(f"127.0.0.1:{port}", Path(info.state_dir), references, schedule, opts)
        runner.setup_s = round(time.monotonic() - started, 1)
        return runner, runner.run()
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec soak`."""
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the tiny pair on both sides",
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument(
        "--schedule",
        default=DEFAULT_SCHEDULE,
        help="busy clients: CONCURRENCY@START_FRACTION,... (fractions of --duration)",
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between replica samples"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="deadline of each request, seconds"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        help="seconds before a replica's memory baseline (default: min(120, duration/5))",
    )
    parser.add_argument(
        "--max-growth-mb",
        type=float,
        default=50.0,
        help="largest RSS growth of a replica after its warm-up, MB",
    )
    parser.add_argument(
        "--max-hold",
        type=float,
        default=300.0,
        help="longest wait of the schedule at one gate (e.g. for a second target replica), seconds",
    )
    parser.add_argument("--seed", type=int, default=0, help="order of the request mix")
    parser.add_argument("--out", help="write the report (with every sample) as JSON")
    parser.add_argument(
        "--workdir",
        help="folder for the pair, the config and the cluster state (default: a new temp dir, "
        "deleted after a passing run)",
    )


def main(args: argparse.Namespace) -> int:
    """``specdec soak``: run, print the summary, write JSON; 1 when a check failed.

    Raises:
        ValueError: a bad --schedule or --duration. RuntimeError: the cluster or the deployment
        did not come up (its logs are kept and named).
    """
    parse_schedule(args.schedule, args.duration)  # refuse a bad schedule before any setup
    own = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="specdec-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = soak(args, workdir)
    if args.out:
        write_json(args.out, report, default=str)
    for note in report.get("notes", ()):
        print(f"note: {note}", file=sys.stderr)
    print(format_summary(report))
    if report["passed"] and own:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not report["passed"]:
        print(
            f"kept for the post-mortem: {workdir} (node logs in state/), "
            f"Ray logs in {report['config']['ray_logs']}",
            file=sys.stderr,
        )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    run_standalone(add_cli_args, main, prog="python -m specdec.bench.soak", description=__doc__)
