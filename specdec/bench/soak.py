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
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import itertools
import json
import math
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

from specdec.config import APPLICATION

DRAFT, TARGET, ROUTER = "DraftModel", "TargetModel", "SpeculativeRouter"
DEPLOYMENTS = (DRAFT, TARGET, ROUTER)
MB = 1_000_000
KS: tuple[int | None, ...] = (0, 1, 3, None)  # None: num_speculative_tokens unset (adaptive)
NEW_TOKENS = (16, 32, 48, 64)
DEFAULT_SCHEDULE = "1@0,6@0.15,1@0.7"
# Fault times, as fractions of the load's duration.
KILL_TARGET_AT, KILL_DRAFT_AT, RESTART_DRAFT_AT = 0.30, 0.50, 0.60
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
        """Busy clients at schedule time ``t`` s (the last step's from its start on: the load
        stays on while the end waits for the scale-down)."""
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


# Gates of the schedule's clock: (fraction of the duration; the load's last step for FALL),
# in order. Names are what must be true to go on.
TARGET_HAS_TWO = "target has 2 RUNNING replicas"
TARGET_KILLED = "target replica kill done"
DRAFT_KILLED = "draft node kill done"
DRAFT_BACK = "draft drafting again, target at 2"
SCALED_DOWN = "target scaled down"


def gates(schedule: Schedule) -> list[tuple[float, str]]:
    """[(schedule time s, gate name)] of a soak, in order (see the module docstring)."""
    return [
        (schedule.at(KILL_TARGET_AT), TARGET_HAS_TWO),
        (schedule.at(KILL_DRAFT_AT), TARGET_KILLED),
        (schedule.at(RESTART_DRAFT_AT), DRAFT_KILLED),
        (schedule.fall_s, DRAFT_BACK),
        (schedule.duration_s, SCALED_DOWN),
    ]


@dataclasses.dataclass
class Gate:
    """A point of the schedule (``at``, s) where its clock holds until ``name`` is true.
    ``passed_s``: when it opened (load time); ``held_s``: how long it held; ``timed_out``:
    it opened after max_hold_s without being true."""

    at: float
    name: str
    passed_s: float | None = None
    held_s: float = 0.0
    timed_out: bool = False


class Timeline:
    """The schedule's clock: follows the load's clock, but holds at each gate until
    ``ready(name)`` says so, or for at most ``max_hold_s`` seconds per gate.

    ``tick(t, ready)`` -> the schedule time at load time ``t`` (called often, t increasing).
    """

    def __init__(self, gate_list: Iterable[tuple[float, str]], max_hold_s: float) -> None:
        self.gates = [Gate(at, name) for at, name in gate_list]
        self.max_hold_s = max_hold_s
        self.now = 0.0  # schedule time, s
        self._t = 0.0

    @property
    def held_s(self) -> float:
        return sum(g.held_s for g in self.gates)

    @property
    def holding(self) -> bool:
        """Whether the clock stands at a gate that has not opened: it holds just before it,
        so what starts at the gate's time (the load's fall) has not started yet."""
        gate = next((g for g in self.gates if g.passed_s is None), None)
        return gate is not None and self.now >= gate.at

    @property
    def load_time(self) -> float:
        """The schedule time the load follows: just before a gate while it holds there."""
        return self.now - 1e-6 if self.holding else self.now

    def tick(self, t: float, ready: Callable[[str], bool]) -> float:
        dt, self._t = max(0.0, t - self._t), t
        gate = next((g for g in self.gates if g.passed_s is None), None)
        if gate is None:
            self.now += dt
            return self.now
        if self.now < gate.at:
            self.now = min(gate.at, self.now + dt)
            if self.now < gate.at:
                return self.now
        else:
            gate.held_s += dt
        ok = ready(gate.name)
        if ok or gate.held_s >= self.max_hold_s:
            gate.passed_s, gate.timed_out = t, not ok
        return self.now


# ---------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One greedy request of the soak: prompt (index into specdec.models.tiny.PROMPTS), new
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
    """What one request did. ``code`` is the gRPC status name (CLIENT_<Exception> for a
    client-side failure, IN_FLIGHT while it runs);
    ``mismatch_at`` the first token index where the output left the reference (None: equal or
    failed); times in s since the load's start."""

    index: int
    spec: RequestSpec
    start_s: float
    end_s: float = float("nan")
    code: str = "IN_FLIGHT"
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


def scale_events(
    samples: Sequence[Mapping], rise_s: float | None, fall_s: float | None
) -> dict[str, dict]:
    """Per deployment: min/max RUNNING, its transitions, and when an autoscaling up (1 -> >= 2
    once the load rose, at ``rise_s``; 0 -> n is a recovery) and down (>= 2 -> 1 once it fell,
    at ``fall_s``, when no fault comes any more) was first seen (None: not seen, or the load
    never did)."""
    rise = math.inf if rise_s is None else rise_s
    fall = math.inf if fall_s is None else fall_s
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
                (t for t, a, b in moves if a == 1 and b >= 2 and rise <= t < fall), None
            ),
            "scaled_down_at": next(
                (t for t, a, b in moves if a >= 2 and b == 1 and t >= fall), None
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


def sessions_left(caches: Mapping[str, Mapping[str, Mapping]]) -> dict[str, int]:
    """{deployment: sessions its replicas still hold} from cache stats taken after the load."""
    return {
        name: sum(c["sessions"] for c in replicas.values()) for name, replicas in caches.items()
    }


def strandable_sessions(
    samples: Sequence[Mapping], outcomes: Sequence[Outcome], deployment: str, slack_s: float
) -> int:
    """How many sessions a change of ``deployment``'s RUNNING replicas may have stranded: the
    requests in flight around each change (between the two samples that show it, widened by
    ``slack_s`` seconds on each side), counted once per change.

    A session lives on the replica its id hashes to; when the replica set changes (scaling,
    a kill), a running request's next calls, its release included, may hash to another
    replica, which rebuilds the session, and the old entry stays behind until the LRU evicts it
    (soft state by design, bounded by cache_capacity_bytes). More sessions left than this
    bound means sessions that were never released: a leak.
    """
    sets = [
        (
            s["t"],
            frozenset(
                r["replica_id"]
                for r in s.get("replicas", ())
                if r["deployment"] == deployment and r["state"] == "RUNNING"
            ),
        )
        for s in samples
    ]
    windows = [(t0 - slack_s, t1 + slack_s) for (t0, a), (t1, b) in zip(sets, sets[1:]) if a != b]
    return sum(
        o.start_s <= hi and not o.end_s < lo  # a NaN end: still in flight
        for lo, hi in windows
        for o in outcomes
    )


def cache_check(caches: Mapping[str, Mapping], strandable: Mapping[str, int]) -> tuple[bool, str]:
    """(ok, detail): the draft and target were both asked after the load, and neither holds
    more sessions than replica changes can strand (see strandable_sessions)."""
    left = sessions_left(caches)
    asked = all(caches.get(name) for name in (DRAFT, TARGET))
    detail = "; ".join(
        f"{name}: {left[name]} sessions left "
        f"({sum(c['bytes'] for c in replicas.values())} bytes) on {len(replicas)} replicas, "
        f"<= {strandable.get(name, 0)} strandable; "
        f"{sum(c['rebuilds'] for c in replicas.values())} rebuilds"
        for name, replicas in caches.items()
    )
    ok = asked and all(n <= strandable.get(name, 0) for name, n in left.items())
    return ok, detail or "not asked"


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
        "target scaled up": (scale["scaled_up_at"] is not None, f"at {_at(scale['scaled_up_at'])}"),
        "target scaled down": (
            scale["scaled_down_at"] is not None,
            f"at {_at(scale['scaled_down_at'])}",
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
            f"RUNNING at {_at(recovery['replica_back_at'])}",
        ),
        "speculation resumed": (
            recovery["speculating_again_at"] is not None,
            f"first drafting request started at {_at(recovery['speculating_again_at'])}",
        ),
        "no session leaked": cache_check(report["caches"], report["strandable_sessions"]),
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
    phases: Mapping[str, float | None],
    caches: Mapping[str, Mapping[str, Mapping]],
    *,
    warmup_s: float,
    min_span_s: float,
    max_growth_bytes: int,
    sample_interval_s: float = 2.0,
) -> dict:
    """The soak's report (JSON-ready): requests, faults, phases ({"rise": s, "fall": s} of the
    load, None when never reached), scaling, draft recovery, caches ({deployment: {replica:
    {"sessions", "bytes", "evictions", "rebuilds"}}} after the load), strandable_sessions
    ({deployment: bound}, see strandable_sessions), memory, limits,
    problems (failed or mismatched requests, the first 100), checks and ``passed``."""
    report = {
        "requests": request_counts(outcomes),
        "faults": list(events),
        "phases": dict(phases),
        "scaling": scale_events(samples, phases.get("rise"), phases.get("fall")),
        "draft_recovery": draft_recovery(samples, events, outcomes),
        "caches": {name: dict(replicas) for name, replicas in caches.items()},
        "strandable_sessions": {
            name: strandable_sessions(samples, outcomes, name, sample_interval_s)
            for name in (DRAFT, TARGET)
        },
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
        f"specdec soak: dtype {cfg['dtype']}, {cfg['duration_s']:.0f} s of scheduled load "
        f"(clients {cfg['schedule']}), tiny pair; {cfg['machine']}; {cfg['date']}",
        f"load: {cfg.get('load_s', '-')} s with the gates' holds and the drain "
        f"(setup before it {cfg.get('setup_s', '-')} s); gates:",
        *(
            f"  {g['name']:<34} opened at {_at(g['passed_s'])}, held {g['held_s']:.0f} s"
            + (" (GAVE UP)" if g["timed_out"] else "")
            for g in report.get("gates", ())
        ),
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
    lines.append(
        "caches after the load: " + cache_check(report["caches"], report["strandable_sessions"])[1]
    )
    lines += _memory_table(report["memory"], report["limits"])
    lines.append("checks:")
    for name, c in report["checks"].items():
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {name}: {c['detail']}")
    lines.append(f"verdict: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)


def _memory_table(rows: Sequence[Mapping], limits: Mapping) -> list[str]:
    """The summary's memory lines: per replica, RSS (MB) @ t (s) first, at its baseline and
    at its end, its peak and growth from the baseline, and whether it was judged."""

    def point(p: Sequence[float] | None) -> str:
        return "-" if p is None else f"{p[1] / MB:.1f}@{p[0]:.0f}"

    lines = [
        f"memory (RSS MB@t s; baseline: first sample >= {limits['warmup_s']:.0f} s into the load "
        f"and the replica's life; judged over >= {limits['min_span_s']:.0f} s; "
        f"limit +{limits['max_growth_bytes'] / MB:.0f} MB):",
        f"  {'deployment':<18} {'pid':>7} {'born':>7} {'first':>13} {'baseline':>13} "
        f"{'end':>13} {'peak':>7} {'growth':>7}  judged",
    ]
    for r in rows:
        verdict = ("ok" if r["ok"] else "GREW") if r["judged"] else "no (too short)"
        lines.append(
            f"  {r['deployment']:<18} {r['pid']:>7} {r['born_s']:>7.0f} {point(r['first']):>13} "
            f"{point(r['baseline']):>13} {point(r['end']):>13} {_mb(r['peak_bytes']):>7} "
            f"{_mb(r['growth_bytes']):>7}  {verdict}"
        )
    return lines


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
    """Resident memory of ``pid`` in bytes (/proc/PID/statm), None when it is gone (or a
    zombie)."""
    if not pid:
        return None
    try:
        resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    # A killed replica that Serve still lists RUNNING is a zombie for a moment: 0 pages.
    return resident * os.sysconf("SC_PAGE_SIZE") or None


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


def cache_stats(deployment: str, probes: int = 200) -> dict[str, dict]:
    """{replica_id: {"sessions", "bytes", "evictions", "rebuilds"}} of every RUNNING replica
    of a model deployment, reached through session keys that hash to each (the deployments
    route by session, as tests/integration/test_serving.py does). Needs Serve connected."""
    from ray import serve

    want = sum(r["deployment"] == deployment and r["state"] == "RUNNING" for r in serve_replicas())
    stats: dict[str, dict] = {}
    for i in range(probes):
        if len(stats) >= want:
            break
        handle = serve.get_deployment_handle(deployment, APPLICATION).options(
            session_id=f"soak-probe-{i}"
        )
        replica = handle.replica_id.remote().result()
        if replica not in stats:
            c = handle.cache_stats.remote().result()
            stats[replica] = {
                "sessions": c.sessions,
                "bytes": c.bytes,
                "evictions": c.evictions,
                "rebuilds": c.rebuilds,
            }
    return stats


def settled_caches(wait_s: float = 20.0) -> dict[str, dict[str, dict]]:
    """cache_stats of the draft and target after the load, asked again for up to ``wait_s``
    seconds while a session is left (a release may still be on its way; a stranded session
    stays)."""
    deadline = time.monotonic() + wait_s
    while True:
        caches = {name: cache_stats(name) for name in (DRAFT, TARGET)}
        if not any(sessions_left(caches).values()) or time.monotonic() > deadline:
            return caches
        time.sleep(1.0)


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
        still running after ``timeout_s`` seconds (their requests stay IN_FLIGHT: failed)."""
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
            outcome = Outcome(index, self.plan[index % len(self.plan)], round(self.clock(), 3))
            self.outcomes.append(outcome)  # IN_FLIGHT until it ends: a hung one is counted
            self._call(outcome)

    def _call(self, outcome: Outcome) -> None:
        import grpc

        from specdec.client import build_request
        from specdec.models.tiny import PROMPTS

        spec = outcome.spec
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
            want = self.references[(spec.prompt_index, spec.max_new_tokens)]
            outcome.mismatch_at = first_difference(tokens, want)
            if stats is not None:
                outcome.rounds_without_draft = stats.rounds_without_draft
                outcome.draft_tokens = stats.draft_tokens
            outcome.code, outcome.tokens = "OK", len(tokens)  # last: other threads read it
        outcome.end_s = round(self.clock(), 3)


class Faults:
    """The soak's faults, each run in the background (``start``) so the load's clock never
    waits on one; ``events`` gets one record per fault: {"name", "t", "t_done", "ok", "what",
    ...} (``error`` when it failed)."""

    def __init__(self, state_dir: Path, clock: Callable[[], float]) -> None:
        self.state_dir, self.clock = state_dir, clock
        self.events: list[dict] = []
        self._threads: dict[str, threading.Thread] = {}

    def start(self, name: str, action: Callable[[], dict]) -> None:
        thread = threading.Thread(target=self._record, args=(name, action), daemon=True)
        self._threads[name] = thread
        thread.start()

    def done(self, name: str) -> bool:
        return name in self._threads and not self._threads[name].is_alive()

    def skip(self, name: str, why: str) -> None:
        t = round(self.clock(), 2)
        self.events.append({"name": name, "t": t, "t_done": t, "ok": False, "error": why})

    def join(self, timeout_s: float) -> None:
        for thread in self._threads.values():
            thread.join(timeout_s)

    def _record(self, name: str, action: Callable[[], dict]) -> None:
        event = {"name": name, "t": round(self.clock(), 2)}
        try:
            event.update(action(), ok=True)
        except Exception as err:  # noqa: BLE001 - a fault that did not happen fails a check
            event.update(ok=False, error=f"{type(err).__name__}: {err}")
        event["t_done"] = round(self.clock(), 2)
        self.events.append(event)

    @staticmethod
    def kill_target() -> dict:
        """ray.kill of the newest RUNNING TargetModel replica (the one scaling up added)."""
        import ray

        running = [
            r for r in serve_replicas() if r["deployment"] == TARGET and r["state"] == "RUNNING"
        ]
        if len(running) < 2:
            raise RuntimeError(f"TargetModel has {len(running)} RUNNING replicas, not 2")
        victim = max(running, key=lambda r: r["start_time_s"] or 0.0)
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        return {"what": f"replica {victim['replica_id']} (pid {victim['pid']})", **victim}

    def kill_draft(self) -> dict:
        from specdec.cluster.faults import kill_node

        before = [r["replica_id"] for r in serve_replicas() if r["deployment"] == DRAFT]
        pids = kill_node(self.state_dir, "draft")
        return {"what": f"{len(pids)} processes", "pids": pids, "draft_replicas": before}

    def restart_draft(self) -> dict:
        from specdec.cluster.faults import restart_node

        node = restart_node(self.state_dir, "draft")
        return {"what": f"node pid {node.pid} alive", "pid": node.pid}


class Runner:
    """Drives one soak against the deployed service: the load on the schedule's clock (see
    Timeline and ``gates``), the monitor, and the faults as their gates open."""

    def __init__(
        self,
        address: str,
        state_dir: Path,
        references: Mapping[tuple[int, int], Sequence[int]],
        schedule: Schedule,
        opts: argparse.Namespace,
    ) -> None:
        from specdec.models.tiny import PROMPTS

        t0 = time.monotonic()
        self.clock = lambda: time.monotonic() - t0
        self.schedule = schedule
        self.timeline = Timeline(gates(schedule), opts.max_hold)
        self.monitor = Monitor(self.clock, time.time(), opts.interval)
        plan = request_plan(len(PROMPTS), opts.seed)
        self.load = Load(address, plan, references, self.clock, opts.timeout)
        self.faults = Faults(state_dir, self.clock)
        self.phases: dict[str, float | None] = {"rise": None, "fall": None}
        self.timeout_s, self.interval_s = opts.timeout, opts.interval
        self.load_s: float | None = None
        self.caches: dict[str, dict[str, dict]] = {}

    def ready(self, gate: str) -> bool:
        """Whether ``gate`` may open now (from the latest sample, outcomes and faults)."""
        if gate == TARGET_HAS_TWO:
            latest = self.monitor.samples[-1:] or [{"running": {}}]
            return latest[0]["running"].get(TARGET, 0) >= 2
        if gate == TARGET_KILLED:
            return self.faults.done("kill_target_replica")
        if gate == DRAFT_KILLED:
            return self.faults.done("kill_draft_node")
        samples, events = list(self.monitor.samples), list(self.faults.events)
        if gate == DRAFT_BACK:  # and the killed target replica replaced, so it can scale down
            recovery = draft_recovery(samples, events, list(self.load.outcomes))
            return None not in recovery.values() and self.ready(TARGET_HAS_TWO)
        scaling = scale_events(samples, self.phases["rise"], self.phases["fall"])
        return scaling[TARGET]["scaled_down_at"] is not None

    def _open(self, gate: Gate) -> None:
        """The fault that follows ``gate`` (none after the last two)."""
        name, action = {
            TARGET_HAS_TWO: ("kill_target_replica", self.faults.kill_target),
            TARGET_KILLED: ("kill_draft_node", self.faults.kill_draft),
            DRAFT_KILLED: ("restart_draft_node", self.faults.restart_draft),
        }.get(gate.name, (None, None))
        if name is None:
            return
        killed = name != "restart_draft_node" or any(
            e["name"] == "kill_draft_node" and e["ok"] for e in self.faults.events
        )
        if gate.timed_out and name == "kill_target_replica":
            self.faults.skip(name, f"gave up after {gate.held_s:.0f} s: {gate.name} never held")
        elif not killed:
            self.faults.skip(name, "the draft node was not killed")
        else:
            self.faults.start(name, action)

    def _step(self, t: float) -> bool:
        """One tick of the schedule at load time ``t``; False once it is over."""
        opened = [g for g in self.timeline.gates if g.passed_s is not None]
        now = self.timeline.tick(t, self.ready)
        for gate in self.timeline.gates:
            if gate.passed_s is not None and gate not in opened:
                self._open(gate)
        concurrency = self.schedule.concurrency(self.timeline.load_time)
        if concurrency == self.schedule.peak and self.phases["rise"] is None:
            self.phases["rise"] = round(t, 2)
        falling = now >= self.schedule.fall_s and not self.timeline.holding
        if falling and self.phases["fall"] is None:
            self.phases["fall"] = round(t, 2)
        self.load.concurrency = concurrency
        return now < self.schedule.duration_s or self.timeline.gates[-1].passed_s is None

    def run(self) -> tuple[list[Outcome], list[dict], list[dict], list[str]]:
        """Runs the soak; returns (outcomes, samples, fault events, notes). Sets ``load_s``
        (the load's length with the gates' holds and the drain)."""
        self.monitor.start()
        self.load.start(self.schedule.peak)
        next_progress = 0.0
        while self._step(t := self.clock()):
            if t >= next_progress:
                next_progress += 30
                _progress(t, self.timeline.now, self.load, self.monitor)
            time.sleep(0.2)
        stuck = self.load.stop(self.timeout_s + 10)
        self.load_s = round(self.clock(), 1)
        notes = self._finish()
        if stuck:
            notes.append(f"{stuck} client threads did not finish within the request timeout")
        return self.load.outcomes, self.monitor.samples, self.faults.events, notes

    def _finish(self) -> list[str]:
        """After the load: the caches (``self.caches``), the last fault, a last sample; returns
        the notes (monitor errors, caches not readable)."""
        notes = []
        try:
            self.caches = settled_caches()
        except Exception as err:  # noqa: BLE001 - noted; the caches check then fails
            notes.append(f"cache stats unavailable: {type(err).__name__}: {err}")
        self.faults.join(120)
        time.sleep(self.interval_s)  # one more sample after the last request
        self.monitor.stop.set()
        self.monitor.join(30)
        return notes + [f"monitor: {e}" for e in self.monitor.errors[:20]]

    def gate_records(self) -> list[dict]:
        return [dataclasses.asdict(g) for g in self.timeline.gates]


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


def _progress(t: float, schedule_t: float, load: Load, monitor: Monitor) -> None:
    done = list(load.outcomes)
    failed = sum(o.code not in ("OK", "IN_FLIGHT") for o in done)
    running = monitor.samples[-1]["running"] if monitor.samples else {}
    print(
        f"[soak {t:5.0f} s, schedule {schedule_t:5.0f} s] clients {load.concurrency}, "
        f"requests {len(done)}, failed {failed}, replicas {running}",
        file=sys.stderr,
        flush=True,
    )


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
        "machine": _machine(),
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
    parser.add_argument(
        "--max-hold",
        type=float,
        default=300.0,
        help="longest wait of the schedule at one gate (e.g. for a second target replica), s",
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
    cli = argparse.ArgumentParser(prog="python -m specdec.bench.soak", description=__doc__)
    add_cli_args(cli)
    sys.exit(main(cli.parse_args()))
