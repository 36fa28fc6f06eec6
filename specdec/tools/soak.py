"""`specdec soak`: minutes of mixed greedy load on the tiny pair while the service scales and
loses parts of itself; every request must succeed with exactly the target-only output.

On its own it writes the tiny pair to a work folder, computes the undisturbed reference
(target-only greedy in process, ``k = 0``), starts a local cluster of its own (head, draft and
target nodes on loopback), deploys the shipped ``local.yaml`` with the tiny pair, short timeouts
and autoscaling on every deployment with delays of seconds, and then runs the load for
``--duration`` seconds:

- a few client threads send greedy requests: every prompt of specdec.pairs.tiny, 16..64 new
  tokens, k 0, 1, 3 or adaptive, unary or streaming (a fixed shuffled cycle);
- the number of busy clients follows ``--schedule`` (default ``1@0,6@0.15,1@0.7``: 1 client,
  6 from 15 % of the run, 1 again from 70 %), so the target scales 1 -> 2 -> 1;
- at 30 % the newest TargetModel replica is killed (``ray.kill``, once the target has two), at
  50 % the draft pool's node is SIGKILLed and at 60 % started again
  (specdec.cluster.faults);
- a monitor thread samples Serve's replica details every ``--interval`` seconds: RUNNING
  replicas per deployment and each replica process's resident memory (``/proc/PID/statm``).

It prints the counts and the checks, writes them as JSON (``--out``) and stops exactly the
cluster it started. Exit status 1 when any request failed, any greedy output differed from the
reference, the target did not scale up and back down, a fault did not happen (or the draft did
not come back), or a replica's memory grew past ``--max-growth-mb`` after its warm-up.

Times are seconds since the start of the load (``t``); memory is in bytes in the JSON, MB
(10^6 bytes) in the printed summary.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import itertools
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

DRAFT, TARGET, ROUTER = "DraftModel", "TargetModel", "SpeculativeRouter"
DEPLOYMENTS = (DRAFT, TARGET, ROUTER)
APPLICATION = "specdec"
MB = 1_000_000
KS: tuple[int | None, ...] = (0, 1, 3, None)  # None: num_speculative_tokens unset (adaptive)
NEW_TOKENS = (16, 32, 48, 64)
DEFAULT_SCHEDULE = "1@0,6@0.15,1@0.7"
# Fault times, as fractions of the load's duration.
KILL_TARGET_AT, KILL_DRAFT_AT, RESTART_DRAFT_AT = 0.30, 0.50, 0.60
# Autoscaling with delays of seconds (the shipped ones are minutes); the values of
# tests/integration/test_autoscaling.py, which scale reliably on 2 cores.
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
# The router's timeouts of tests/integration/conftest.py: a lost replica or node is noticed in
# seconds, so a soak of minutes sees the recovery, not the wait.
SHORT_TIMEOUTS = dict(call_timeout_s=5, unavailable_after_s=8, draft_timeout_s=3, draft_retry_s=0.5)
_STEP = re.compile(r"^(\d+)@(\d*\.?\d+)$")


# ---------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How many clients are busy when, and when the faults come.

    Args:
        duration_s: seconds of load, > 0.
        steps: ((start fraction of the duration, concurrency), ...): the first starts at 0,
            fractions increase and stay below 1, concurrencies are >= 1; the load must rise
            to its peak before the target kill and fall below it after the draft restart,
            so that scaling up and down are seen apart from the faults.

    Raises:
        ValueError: a rule above is broken (the message says which).
    """

    duration_s: float
    steps: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        starts = [f for f, _ in self.steps]
        counts = [c for _, c in self.steps]
        if not starts or starts[0] != 0:
            raise ValueError("the schedule's first step must start at 0")
        if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= 1:
            raise ValueError("step fractions must increase and stay below 1")
        if min(counts) < 1:
            raise ValueError("every step needs at least 1 client")
        if not (counts[0] < self.peak and self.rise_fraction < KILL_TARGET_AT):
            raise ValueError(f"the load must rise to its peak before {KILL_TARGET_AT:.0%}")
        if not (counts[-1] < self.peak and starts[-1] > RESTART_DRAFT_AT):
            raise ValueError(f"the load must fall after the draft restart ({RESTART_DRAFT_AT:.0%})")

    @property
    def peak(self) -> int:
        return max(c for _, c in self.steps)

    @property
    def rise_fraction(self) -> float:
        return next(f for f, c in self.steps if c == self.peak)

    @property
    def rise_s(self) -> float:
        """When the load first reaches its peak, s."""
        return self.rise_fraction * self.duration_s

    @property
    def fall_s(self) -> float:
        """When the last (lower) step starts, s: later 2 -> 1 transitions are scale-downs."""
        return self.steps[-1][0] * self.duration_s

    def at(self, fraction: float) -> float:
        return fraction * self.duration_s

    def concurrency(self, t: float) -> int:
        """Busy clients at ``t`` seconds (0 from the end of the load on)."""
        if t >= self.duration_s:
            return 0
        return [c for f, c in self.steps if f * self.duration_s <= t][-1]

    def describe(self) -> str:
        return ",".join(f"{c}@{f:g}" for f, c in self.steps)


def parse_schedule(text: str, duration_s: float) -> Schedule:
    """``"1@0,6@0.15,1@0.7"`` -> Schedule: CONCURRENCY@START_FRACTION steps.

    Raises:
        ValueError: a step that does not parse, or a schedule Schedule refuses.
    """
    steps = []
    for part in (p.strip() for p in text.split(",")):
        match = _STEP.match(part)
        if not match:
            raise ValueError(f"--schedule: {part!r} is not CONCURRENCY@FRACTION (e.g. 6@0.15)")
        steps.append((float(match[2]), int(match[1])))
    return Schedule(duration_s, tuple(steps))


# ---------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One greedy request of the soak: prompt (index into specdec.pairs.tiny.PROMPTS), new
    tokens, speculative tokens (None: adaptive) and unary or streaming."""

    prompt_index: int
    max_new_tokens: int
    k: int | None
    stream: bool

    @property
    def k_label(self) -> str:
        return "auto" if self.k is None else str(self.k)


def request_plan(n_prompts: int, seed: int = 0) -> list[RequestSpec]:
    """Every (prompt, NEW_TOKENS, KS, unary/stream) combination once, in a shuffled order that
    the clients cycle through (so every kind runs in every phase)."""
    specs = [
        RequestSpec(p, n, k, stream)
        for p in range(n_prompts)
        for n in NEW_TOKENS
        for k in KS
        for stream in (False, True)
    ]
    random.Random(seed).shuffle(specs)
    return specs


@dataclasses.dataclass
class Outcome:
    """What one request did. ``code`` is the gRPC status name (or CLIENT_<Exception>);
    ``mismatch_at`` the first token index where the output left the reference (None: equal or
    failed); times in s since the load's start."""

    index: int
    spec: RequestSpec
    start_s: float
    end_s: float = float("nan")
    code: str = "OK"
    details: str = ""
    tokens: int = 0
    mismatch_at: int | None = None
    rounds_without_draft: int = 0
    draft_tokens: int = 0


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first token where ``got`` and ``want`` differ (length counts); None if
    equal."""
    if list(got) == list(want):
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


# ---------------------------------------------------------------------- analysis (pure)


def running_series(samples: Sequence[Mapping], deployment: str) -> list[tuple[float, int]]:
    """[(t, RUNNING replicas of ``deployment``)] over the monitor's samples."""
    return [(s["t"], s["running"].get(deployment, 0)) for s in samples if s.get("running")]


def transitions(series: Sequence[tuple[float, int]]) -> list[tuple[float, int, int]]:
    """[(t, before, after)] wherever the count changed between two samples (t: the later)."""
    return [(t, a, b) for (_, a), (t, b) in zip(series, series[1:]) if a != b]


def scale_events(samples: Sequence[Mapping], schedule: Schedule) -> dict[str, dict]:
    """Per deployment: min/max RUNNING, its transitions, and whether an autoscaling up
    (<= 1 -> >= 2 once the load has risen) and down (>= 2 -> 1 after the load fell, when no
    fault comes any more) was seen."""
    out = {}
    for name in DEPLOYMENTS:
        series = running_series(samples, name)
        moves = transitions(series)
        counts = [n for _, n in series]
        out[name] = {
            "min": min(counts, default=None),
            "max": max(counts, default=None),
            "transitions": [list(m) for m in moves],
            "scaled_up_at": next(
                (t for t, a, b in moves if a <= 1 and b >= 2 and schedule.rise_s <= t), None
            ),
            "scaled_down_at": next(
                (t for t, a, b in moves if a >= 2 and b == 1 and t >= schedule.fall_s), None
            ),
        }
    return out


def memory_rows(
    samples: Sequence[Mapping], warmup_s: float, min_span_s: float, max_growth_bytes: int
) -> list[dict]:
    """Per replica: resident memory at its baseline and at its last sample, and the growth.

    The baseline is the first sample at least ``warmup_s`` into the load and into the
    replica's life (``born_s``, from Serve's start time): model loading, calibration and the
    first batches' buffers come before it. A replica is judged when its baseline and last
    sample are at least ``min_span_s`` apart; it passes when it grew by at most
    ``max_growth_bytes``. ``peak_bytes`` is its largest sample from the baseline on.
    """
    series: dict[str, dict] = {}
    for sample in samples:
        for r in sample.get("replicas", ()):
            if r.get("rss_bytes") is None:
                continue
            entry = series.setdefault(
                r["replica_id"],
                {"deployment": r["deployment"], "pid": r["pid"], "born_s": r.get("born_s")},
            )
            entry.setdefault("points", []).append((sample["t"], r["rss_bytes"]))
    rows = []
    for replica_id, e in sorted(series.items(), key=lambda kv: (kv[1]["deployment"], kv[0])):
        points = e["points"]
        born = points[0][0] if e["born_s"] is None else e["born_s"]
        after = [p for p in points if p[0] >= max(warmup_s, born + warmup_s)]
        judged = bool(after) and after[-1][0] - after[0][0] >= min_span_s
        growth = after[-1][1] - after[0][1] if after else None
        rows.append(
            {
                "deployment": e["deployment"],
                "replica_id": replica_id,
                "pid": e["pid"],
                "born_s": round(born, 1),
                "first": list(points[0]),
                "baseline": list(after[0]) if after else None,
                "end": list(points[-1]),
                "peak_bytes": max(b for _, b in after) if after else None,
                "growth_bytes": growth,
                "judged": judged,
                "ok": (not judged) or growth <= max_growth_bytes,
            }
        )
    return rows


def request_counts(outcomes: Sequence[Outcome]) -> dict:
    """Counts by gRPC code, kind (unary/stream, k) and phase; mismatches; degraded rounds."""
    codes = collections.Counter(o.code for o in outcomes)
    ok = [o for o in outcomes if o.code == "OK"]
    return {
        "sent": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "by_code": dict(codes),
        "mismatches": sum(o.mismatch_at is not None for o in ok),
        "by_mode": dict(collections.Counter("stream" if o.spec.stream else "unary" for o in ok)),
        "by_k": dict(collections.Counter(f"k={o.spec.k_label}" for o in ok)),
        "tokens": sum(o.tokens for o in ok),
        "rounds_without_draft": sum(o.rounds_without_draft for o in ok),
        "requests_without_draft": sum(o.rounds_without_draft > 0 for o in ok),
    }


def _event(events: Iterable[Mapping], name: str) -> Mapping | None:
    return next((e for e in events if e["name"] == name), None)


def draft_recovery(
    samples: Sequence[Mapping], events: Sequence[Mapping], outcomes: Sequence[Outcome]
) -> dict:
    """After the draft node's restart: when a DraftModel replica that did not exist before the
    kill was RUNNING, and when a request started after the restart drafted again."""
    kill, restart = _event(events, "kill_draft_node"), _event(events, "restart_draft_node")
    if not (kill and kill["ok"] and restart and restart["ok"]):
        return {"replica_back_at": None, "speculating_again_at": None}
    before = set(kill.get("draft_replicas", ()))
    back = next(
        (
            s["t"]
            for s in samples
            if s["t"] >= restart["t"]
            for r in s.get("replicas", ())
            if r["deployment"] == DRAFT
            and r["state"] == "RUNNING"
            and r["replica_id"] not in before
        ),
        None,
    )
    drafted = [
        o.start_s
        for o in outcomes
        if o.code == "OK" and o.start_s >= restart["t_done"] and o.draft_tokens > 0
    ]
    return {"replica_back_at": back, "speculating_again_at": min(drafted, default=None)}


def checks(report: Mapping) -> dict[str, dict]:
    """{check: {"ok": bool, "detail": str}} of a soak report (see ``analyse``)."""
    req, scale, mem = report["requests"], report["scaling"][TARGET], report["memory"]
    events, recovery = report["faults"], report["draft_recovery"]
    judged = [r for r in mem if r["judged"]]
    grown = [r for r in judged if not r["ok"]]

    def fault(name: str) -> tuple[bool, str]:
        e = _event(events, name)
        if e is None:
            return False, "never ran"
        return bool(e["ok"]), f"at {e['t']:.1f} s" if e["ok"] else e.get("error", "failed")

    out = {
        "no failed requests": (
            req["failed"] == 0 and req["ok"] > 0,
            f"{req['ok']} OK of {req['sent']}, by code {req['by_code']}",
        ),
        "greedy outputs equal the reference": (
            req["mismatches"] == 0 and req["ok"] > 0,
            f"{req['mismatches']} mismatches in {req['ok']}",
        ),
        "target scaled up": (scale["scaled_up_at"] is not None, f"at {scale['scaled_up_at']}"),
        "target scaled down": (
            scale["scaled_down_at"] is not None,
            f"at {scale['scaled_down_at']}",
        ),
        "target replica killed": fault("kill_target_replica"),
        "draft node killed": fault("kill_draft_node"),
        "draft node restarted": fault("restart_draft_node"),
        "ran without the draft": (
            req["rounds_without_draft"] > 0,
            f"{req['rounds_without_draft']} rounds in {req['requests_without_draft']} requests",
        ),
        "draft replica back": (
            recovery["replica_back_at"] is not None,
            f"RUNNING at {recovery['replica_back_at']}",
        ),
        "speculation resumed": (
            recovery["speculating_again_at"] is not None,
            f"first drafting request started at {recovery['speculating_again_at']}",
        ),
        "replica memory flat": (
            not grown and any(r["deployment"] == TARGET for r in judged),
            f"{len(judged)} replicas judged, {len(grown)} grew past "
            f"{report['limits']['max_growth_bytes'] / MB:.0f} MB",
        ),
    }
    return {name: {"ok": bool(ok), "detail": detail} for name, (ok, detail) in out.items()}


def analyse(
    outcomes: Sequence[Outcome],
    samples: Sequence[Mapping],
    events: Sequence[Mapping],
    schedule: Schedule,
    *,
    warmup_s: float,
    min_span_s: float,
    max_growth_bytes: int,
) -> dict:
    """The soak's report (JSON-ready): requests, faults, scaling, draft recovery, memory,
    limits, checks and ``passed``."""
    report = {
        "requests": request_counts(outcomes),
        "faults": list(events),
        "scaling": scale_events(samples, schedule),
        "draft_recovery": draft_recovery(samples, events, outcomes),
        "memory": memory_rows(samples, warmup_s, min_span_s, max_growth_bytes),
        "limits": {
            "warmup_s": warmup_s,
            "min_span_s": min_span_s,
            "max_growth_bytes": max_growth_bytes,
        },
        "problems": [
            dataclasses.asdict(o) for o in outcomes if o.code != "OK" or o.mismatch_at is not None
        ][:100],
    }
    report["checks"] = checks(report)
    report["passed"] = all(c["ok"] for c in report["checks"].values())
    return report


# ---------------------------------------------------------------------- summary


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.1f}"


def _at(t: float | None) -> str:
    return "never" if t is None else f"{t:.1f} s"


def format_summary(report: Mapping) -> str:
    """The printed summary: header, requests, faults, replicas, memory, checks, verdict."""
    cfg, req = report["config"], report["requests"]
    lines = [
        f"specdec soak: dtype {cfg['dtype']}, {cfg['duration_s']:.0f} s of load "
        f"(schedule {cfg['schedule']}), tiny pair; {cfg['machine']}; {cfg['date']}",
        f"requests: {req['sent']} sent, {req['ok']} OK, {req['failed']} failed "
        f"{req['by_code']}; greedy mismatches {req['mismatches']}; {req['tokens']} tokens",
        f"  OK by mode {req['by_mode']}; by k {req['by_k']}",
        f"  rounds_without_draft {req['rounds_without_draft']} "
        f"(in {req['requests_without_draft']} requests)",
        "faults:",
    ]
    for e in report["faults"]:
        status = "ok" if e["ok"] else f"FAILED: {e.get('error', '')}"
        lines.append(f"  t={e['t']:7.1f} s  {e['name']:<20} {e.get('what', '')}  {status}")
    rec = report["draft_recovery"]
    lines.append(
        f"  new DraftModel replica RUNNING at {_at(rec['replica_back_at'])}; "
        f"first drafting request after the restart at {_at(rec['speculating_again_at'])}"
    )
    lines.append("replicas (RUNNING, min-max; autoscaling up / down):")
    for name, s in report["scaling"].items():
        lines.append(
            f"  {name:<18} {s['min']}-{s['max']}  up {_at(s['scaled_up_at'])}, "
            f"down {_at(s['scaled_down_at'])}, {len(s['transitions'])} changes"
        )
    lim = report["limits"]
    lines.append(
        f"memory (RSS MB; baseline: first sample >= {lim['warmup_s']:.0f} s into the load and "
        f"the replica's life; judged over >= {lim['min_span_s']:.0f} s; "
        f"limit +{lim['max_growth_bytes'] / MB:.0f} MB):"
    )
    lines.append(
        f"  {'deployment':<18} {'pid':>7} {'born':>7} {'first':>13} {'baseline':>13} "
        f"{'end':>13} {'peak':>7} {'growth':>7}  judged"
    )
    for r in report["memory"]:

        def point(p):
            return "-" if p is None else f"{p[1] / MB:.1f}@{p[0]:.0f}"

        verdict = ("ok" if r["ok"] else "GREW") if r["judged"] else "no (too short)"
        lines.append(
            f"  {r['deployment']:<18} {r['pid']:>7} {r['born_s']:>7.0f} {point(r['first']):>13} "
            f"{point(r['baseline']):>13} {point(r['end']):>13} {_mb(r['peak_bytes']):>7} "
            f"{_mb(r['growth_bytes']):>7}  {verdict}"
        )
    lines.append("checks:")
    for name, c in report["checks"].items():
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {name}: {c['detail']}")
    lines.append(f"verdict: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- setup


def compute_references(
    draft: Path, target: Path, dtype: str, prompts: Sequence[str]
) -> dict[tuple[int, int], list[int]]:
    """{(prompt index, max_new_tokens): token ids} of the target alone (k = 0, greedy), in
    process, in ``dtype``: the undisturbed output every greedy request must equal."""
    from specdec import SamplingParams, SpeculativeEngine

    engine = SpeculativeEngine.from_pretrained(draft, target, dtype=dtype)
    return {
        (i, n): list(engine.generate(prompt, SamplingParams(max_new_tokens=n), 0).token_ids)
        for i, prompt in enumerate(prompts)
        for n in NEW_TOKENS
    }


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


# ---------------------------------------------------------------------- runtime (Ray)


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of ``pid`` in bytes (/proc/PID/statm), None when it is gone."""
    if not pid:
        return None
    try:
        resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident * os.sysconf("SC_PAGE_SIZE")


def serve_replicas() -> list[dict]:
    """Every replica of the application from Serve's details: deployment, replica_id,
    actor_name, pid, state, start_time_s (epoch s). Needs this process connected to Serve."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    details = ServeInstanceDetails(**serve.context._get_global_client().get_serve_details())
    app = details.applications.get(APPLICATION)
    if app is None:
        return []
    return [
        {
            "deployment": name,
            "replica_id": r.replica_id,
            "actor_name": r.actor_name,
            "pid": r.pid,
            "state": str(getattr(r.state, "value", r.state)),
            "start_time_s": r.start_time_s,
        }
        for name, d in app.deployments.items()
        for r in d.replicas
    ]


class Monitor(threading.Thread):
    """Samples replica states and their processes' RSS every ``interval_s`` seconds.

    ``samples``: [{"t", "running": {deployment: n}, "replicas": [...]}], each replica with
    ``born_s`` (its start, s since the load's start) and ``rss_bytes`` (RUNNING ones only).
    A failed sample (a controller hiccup) is counted in ``errors``, not fatal.
    """

    def __init__(self, clock: Callable[[], float], wall_t0: float, interval_s: float) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.clock, self.wall_t0, self.interval_s = clock, wall_t0, interval_s
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def sample(self) -> dict:
        replicas = serve_replicas()
        for r in replicas:
            r["born_s"] = None if not r["start_time_s"] else r["start_time_s"] - self.wall_t0
            r["rss_bytes"] = rss_bytes(r["pid"]) if r["state"] == "RUNNING" else None
        running = dict.fromkeys(DEPLOYMENTS, 0)
        for r in replicas:
            running[r["deployment"]] = running.get(r["deployment"], 0) + (r["state"] == "RUNNING")
        return {"t": round(self.clock(), 2), "running": running, "replicas": replicas}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append(self.sample())
            except Exception as err:  # noqa: BLE001 - counted and reported, the soak goes on
                self.errors.append(f"{self.clock():.1f}: {type(err).__name__}: {err}")
            self.stop.wait(self.interval_s)


class Load:
    """Client threads that cycle through ``plan``; thread ``slot`` sends only while
    ``slot < concurrency``. Every outcome is checked against ``references``."""

    def __init__(
        self,
        address: str,
        plan: Sequence[RequestSpec],
        references: Mapping[tuple[int, int], Sequence[int]],
        clock: Callable[[], float],
        timeout_s: float,
    ) -> None:
        from specdec.client import SpecdecClient

        self.client = SpecdecClient(address, APPLICATION, timeout_s=timeout_s)
        self.plan, self.references, self.clock = plan, references, clock
        self.concurrency = 0
        self.outcomes: list[Outcome] = []
        self._next = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, slots: int) -> None:
        for slot in range(slots):
            thread = threading.Thread(target=self._worker, args=(slot,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float) -> int:
        """Lets every client finish its request, then ends; returns how many threads were
        still running after ``timeout_s`` seconds (their requests stay unrecorded)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.client.close()
        return sum(t.is_alive() for t in self._threads)

    def _worker(self, slot: int) -> None:
        while not self._stop.is_set():
            if slot >= self.concurrency:
                self._stop.wait(0.1)
                continue
            index = next(self._next)
            self.outcomes.append(self._call(index, self.plan[index % len(self.plan)]))

    def _call(self, index: int, spec: RequestSpec) -> Outcome:
        import grpc

        from specdec.client import build_request
        from specdec.pairs.tiny import PROMPTS

        outcome = Outcome(index, spec, round(self.clock(), 3))
        request = build_request(
            PROMPTS[spec.prompt_index],
            max_new_tokens=spec.max_new_tokens,
            num_speculative_tokens=spec.k,
        )
        try:
            if spec.stream:
                tokens, stats = [], None
                for message in self.client.generate_stream(request):
                    tokens += message.token_ids
                    stats = message.stats  # the final message carries the request's stats
            else:
                response = self.client.generate(request)
                tokens, stats = list(response.token_ids), response.stats
        except grpc.RpcError as err:
            outcome.code, outcome.details = err.code().name, str(err.details())
        except Exception as err:  # noqa: BLE001 - a client-side failure is a failed request
            outcome.code, outcome.details = f"CLIENT_{type(err).__name__}", str(err)
        else:
            outcome.tokens = len(tokens)
            want = self.references[(spec.prompt_index, spec.max_new_tokens)]
            outcome.mismatch_at = first_difference(tokens, want)
            if stats is not None:
                outcome.rounds_without_draft = stats.rounds_without_draft
                outcome.draft_tokens = stats.draft_tokens
        outcome.end_s = round(self.clock(), 3)
        return outcome


class Faults(threading.Thread):
    """Kills the newest TargetModel replica at KILL_TARGET_AT (waiting, until the draft kill,
    for the target to have two RUNNING: with one, its requests would wait for a new replica),
    SIGKILLs the draft node at KILL_DRAFT_AT and starts it again at RESTART_DRAFT_AT.

    ``events``: [{"name", "t", "ok", "what", ...}] (``error`` when a fault failed).
    """

    def __init__(self, state_dir: Path, schedule: Schedule, clock: Callable[[], float]) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.state_dir, self.schedule, self.clock = state_dir, schedule, clock
        self.events: list[dict] = []
        self.stop = threading.Event()

    def _sleep_until(self, t: float) -> bool:
        """False when stopped before ``t``."""
        return not self.stop.wait(max(0.0, t - self.clock()))

    def _record(self, name: str, action: Callable[[], dict]) -> dict:
        event = {"name": name, "t": round(self.clock(), 2)}
        try:
            event.update(action(), ok=True)
        except Exception as err:  # noqa: BLE001 - a fault that did not happen fails a check
            event.update(ok=False, error=f"{type(err).__name__}: {err}")
        event["t_done"] = round(self.clock(), 2)
        self.events.append(event)
        return event

    def _kill_target(self) -> dict:
        import ray

        deadline = self.schedule.at(KILL_DRAFT_AT)
        while True:
            running = [
                r for r in serve_replicas() if r["deployment"] == TARGET and r["state"] == "RUNNING"
            ]
            if len(running) >= 2:
                break
            if self.clock() > deadline or self.stop.is_set():
                raise RuntimeError(f"TargetModel never had 2 RUNNING replicas ({len(running)})")
            time.sleep(0.5)
        victim = max(running, key=lambda r: r["start_time_s"] or 0.0)
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        return {"what": f"replica {victim['replica_id']} (pid {victim['pid']})", **victim}

    def _kill_draft(self) -> dict:
        from specdec.cluster.faults import kill_node

        before = [r["replica_id"] for r in serve_replicas() if r["deployment"] == DRAFT]
        pids = kill_node(self.state_dir, "draft")
        return {"what": f"{len(pids)} processes", "pids": pids, "draft_replicas": before}

    def _restart_draft(self) -> dict:
        from specdec.cluster.faults import restart_node

        node = restart_node(self.state_dir, "draft")
        return {"what": f"node pid {node.pid} alive", "pid": node.pid}

    def run(self) -> None:
        if not self._sleep_until(self.schedule.at(KILL_TARGET_AT)):
            return
        self._record("kill_target_replica", self._kill_target)
        if not self._sleep_until(self.schedule.at(KILL_DRAFT_AT)):
            return
        if not self._record("kill_draft_node", self._kill_draft)["ok"]:
            return
        if self._sleep_until(self.schedule.at(RESTART_DRAFT_AT)):
            self._record("restart_draft_node", self._restart_draft)


def _machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def run_load(
    address: str,
    state_dir: Path,
    references: Mapping[tuple[int, int], Sequence[int]],
    schedule: Schedule,
    opts: argparse.Namespace,
) -> tuple[list[Outcome], list[dict], list[dict], list[str]]:
    """Runs the scheduled load, the monitor and the faults against the deployed service;
    returns (outcomes, samples, fault events, notes)."""
    t0 = time.monotonic()
    clock = lambda: time.monotonic() - t0  # noqa: E731
    from specdec.pairs.tiny import PROMPTS

    monitor = Monitor(clock, time.time(), opts.interval)
    load = Load(address, request_plan(len(PROMPTS), opts.seed), references, clock, opts.timeout)
    faults = Faults(state_dir, schedule, clock)
    monitor.start()
    load.start(schedule.peak)
    faults.start()
    last_progress = -1
    while (t := clock()) < schedule.duration_s:
        load.concurrency = schedule.concurrency(t)
        if int(t) // 30 != last_progress:
            last_progress = int(t) // 30
            _progress(t, load, monitor)
        time.sleep(0.2)
    load.concurrency = 0
    faults.stop.set()
    stuck = load.stop(opts.timeout + 10)
    faults.join(120)
    time.sleep(opts.interval)  # one more sample after the last request
    monitor.stop.set()
    monitor.join(30)
    notes = [f"monitor: {e}" for e in monitor.errors[:20]]
    if stuck:
        notes.append(f"{stuck} client threads did not finish within the request timeout")
    return load.outcomes, monitor.samples, faults.events, notes


def _progress(t: float, load: Load, monitor: Monitor) -> None:
    done = list(load.outcomes)
    failed = sum(o.code != "OK" for o in done)
    running = monitor.samples[-1]["running"] if monitor.samples else {}
    print(
        f"[soak {t:5.0f} s] clients {load.concurrency}, requests {len(done)}, failed {failed}, "
        f"replicas {running}",
        file=sys.stderr,
        flush=True,
    )


class _KeepLogs(Exception):
    """Raised inside the cluster's context when the soak failed, so LocalCluster keeps the
    Ray logs for the post-mortem."""


def soak(opts: argparse.Namespace, workdir: Path) -> dict:
    """Sets up (pair, references, cluster, deployment), runs the load, analyses; returns the
    report with its ``config`` and ``notes``. Stops its cluster in every case."""
    import ray
    from ray import serve

    from specdec.cluster.local import LocalCluster
    from specdec.deployments.deploy import deploy
    from specdec.pairs.tiny import PROMPTS, save_pair

    schedule = parse_schedule(opts.schedule, opts.duration)
    warmup_s = opts.warmup if opts.warmup is not None else min(120.0, 0.2 * opts.duration)
    started = time.monotonic()
    draft, target = save_pair(workdir / "models", noise=0.05, pad_vocab=7)
    references = compute_references(draft, target, opts.dtype, PROMPTS)
    config_file, port = write_serve_config(workdir, draft, target, opts.dtype)
    config = {
        "dtype": opts.dtype,
        "duration_s": opts.duration,
        "schedule": schedule.describe(),
        "machine": _machine(),
        "date": datetime.date.today().isoformat(),
        "workdir": str(workdir),
        "serve_config": str(config_file),
    }
    report: dict[str, Any] = {}
    try:
        with LocalCluster(workdir / "state") as info:
            config["ray_logs"] = f"{info.temp_root}/<role>/session_latest/logs"
            try:
                deploy(config_file, address=info.address, timeout_s=600)
                config["setup_s"] = round(time.monotonic() - started, 1)
                outcomes, samples, events, notes = run_load(
                    f"127.0.0.1:{port}", info.state_dir, references, schedule, opts
                )
            finally:
                if ray.is_initialized():
                    serve.shutdown()
                    ray.shutdown()
            report = analyse(
                outcomes,
                samples,
                events,
                schedule,
                warmup_s=warmup_s,
                min_span_s=min(60.0, 0.1 * opts.duration),
                max_growth_bytes=int(opts.max_growth_mb * MB),
            )
            report.update(config=config, notes=notes, samples=samples)
            if not report["passed"]:
                raise _KeepLogs
    except _KeepLogs:
        pass
    return report


# ---------------------------------------------------------------------- command line


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec soak`."""
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument(
        "--schedule",
        default=DEFAULT_SCHEDULE,
        help="busy clients: CONCURRENCY@START_FRACTION,... (fractions of --duration)",
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between replica samples"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each request, s")
    parser.add_argument(
        "--warmup",
        type=float,
        help="seconds before a replica's memory baseline (default min(120, duration/5))",
    )
    parser.add_argument(
        "--max-growth-mb",
        type=float,
        default=50.0,
        help="largest RSS growth of a replica after its warm-up, MB",
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
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
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
    cli = argparse.ArgumentParser(prog="python -m specdec.tools.soak", description=__doc__)
    add_cli_args(cli)
    sys.exit(main(cli.parse_args()))
