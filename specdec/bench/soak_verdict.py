"""The soak's verdict: from the requests' outcomes, the monitor's samples, the fault events and
the caches after the load, its report (counts, scaling, the draft's recovery, stranded
sessions, memory), the checks, and the printed summary. Pure: no cluster needed.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence

from specdec.bench.replicas import DEPLOYMENTS, DRAFT, TARGET
from specdec.bench.soak_load import Outcome
from specdec.bench.soak_memory import MB, memory_lines, memory_rows


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
        "problems": [o.record() for o in outcomes if o.code != "OK" or o.mismatch_at is not None][
            :100
        ],
    }
    report["checks"] = checks(report)
    report["passed"] = all(c["ok"] for c in report["checks"].values())
    return report


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
    lines += memory_lines(report["memory"], report["limits"])
    lines.append("checks:")
    for name, c in report["checks"].items():
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {name}: {c['detail']}")
    lines.append(f"verdict: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)
