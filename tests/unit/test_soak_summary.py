"""The soak's pure parts: its schedule, request mix and verdict, on made-up samples and
outcomes (no cluster; tests/integration/test_soak.py runs the real thing)."""

from __future__ import annotations

import pytest

from specdec.bench import soak_load, soak_schedule, soak_verdict
from specdec.bench.replicas import DEPLOYMENTS, DRAFT, ROUTER, TARGET
from specdec.bench.soak_load import Outcome, RequestSpec
from specdec.bench.soak_memory import MB

DURATION = 100.0  # faults at 30, 50, 60 s; default schedule: 6 clients from 15 s, 1 from 70 s


def test_default_schedule_rises_before_the_faults_and_falls_after():
    schedule = soak_schedule.parse_schedule(soak_schedule.DEFAULT_SCHEDULE, DURATION)
    times = (0, 14.9, 15, 69.9, 70, 99.9, 100)
    assert [schedule.concurrency(t) for t in times] == [1, 1, 6, 6, 1, 1, 1]
    assert (schedule.peak, schedule.rise_s, schedule.fall_s) == (6, 15.0, 70.0)
    assert schedule.describe() == soak_schedule.DEFAULT_SCHEDULE


@pytest.mark.parametrize(
    "text, message",
    [
        ("6", "not CONCURRENCY@FRACTION"),
        ("1@0.1,6@0.2,1@0.7", "first step must start at 0"),
        ("1@0,6@0.5,6@0.4,1@0.7", "must increase"),
        ("1@0,6@0.15,1@1", "must increase and stay below 1"),
        ("0@0,6@0.15,1@0.7", "at least 1 client"),
        ("1@0,6@0.35,1@0.7", "rise to its peak before 30%"),
        ("6@0,1@0.7", "rise to its peak"),
        ("1@0,6@0.15,1@0.55", "fall after the draft restart"),
        ("1@0,6@0.15", "fall after"),
    ],
)
def test_bad_schedule_is_refused_saying_why(text, message):
    with pytest.raises(ValueError, match=message):
        soak_schedule.parse_schedule(text, DURATION)


def test_zero_duration_is_refused():
    with pytest.raises(ValueError, match="duration"):
        soak_schedule.parse_schedule(soak_schedule.DEFAULT_SCHEDULE, 0)


def test_request_plan_covers_every_kind_once_in_a_fixed_order():
    plan = soak_load.request_plan(8)
    assert len(plan) == len(set(plan)) == 8 * len(soak_load.NEW_TOKENS) * len(soak_load.KS) * 2
    assert plan == soak_load.request_plan(8) != soak_load.request_plan(8, seed=1)
    first = plan[:32]  # the first minutes already mix every k and both modes
    assert {s.k for s in first} == set(soak_load.KS) and {s.stream for s in first} == {False, True}


def test_first_difference():
    assert soak_load.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert soak_load.first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert soak_load.first_difference([1, 2], [1, 2, 3]) == 2


def _tick_through(timeline, ready, start, until, step=0.5):
    """Ticks every ``step`` s of load time from ``start`` to ``until``: {t: schedule time}."""
    ticks = [start + i * step for i in range(int((until - start) / step) + 1)]
    return {t: timeline.tick(t, ready) for t in ticks}


def test_timeline_follows_the_clock_and_holds_at_a_gate_until_ready():
    timeline = soak_schedule.Timeline([(10.0, "a"), (20.0, "b")], max_hold_s=100)
    readiness = {"a": False, "b": True}
    asked = []

    def ready(name):
        asked.append(name)
        return readiness[name]

    trace = _tick_through(timeline, ready, 0, 14)
    assert trace[9.5] == 9.5 and trace[10] == trace[14] == 10.0  # held at "a"
    assert set(asked) == {"a"}  # nothing asked before the gate, "b" not before "a"
    readiness["a"] = True
    trace = _tick_through(timeline, ready, 14.5, 40)
    gate_a, gate_b = timeline.gates
    assert (gate_a.passed_s, gate_a.timed_out, gate_a.held_s) == (14.5, False, 4.5)
    assert trace[15] == 10.5  # schedule time = load time - the hold
    assert trace[24.5] == 20.0 and trace[25] == 20.5  # b was ready at once: no hold
    assert (gate_b.passed_s, gate_b.held_s) == (24.5, 0)
    assert timeline.held_s == 4.5


def test_the_load_does_not_fall_while_the_clock_holds_at_the_fall():
    schedule = soak_schedule.parse_schedule(soak_schedule.DEFAULT_SCHEDULE, DURATION)
    timeline = soak_schedule.Timeline(soak_schedule.gates(schedule), max_hold_s=100)
    ready = {name: True for _, name in soak_schedule.gates(schedule)} | {
        soak_schedule.DRAFT_BACK: False
    }
    _tick_through(timeline, ready.get, 0, 80)
    assert timeline.holding and timeline.now == schedule.fall_s == 70
    assert schedule.concurrency(timeline.load_time) == 6  # still the peak
    ready[soak_schedule.DRAFT_BACK] = True
    timeline.tick(80.5, ready.get)
    assert not timeline.holding and schedule.concurrency(timeline.load_time) == 1
    _tick_through(timeline, ready.get, 81, 200)
    assert timeline.now == 189.5 and [g.held_s for g in timeline.gates] == [0, 0, 0, 10.5, 0]


def test_timeline_gives_up_after_max_hold():
    timeline = soak_schedule.Timeline([(5.0, "never")], max_hold_s=3)
    trace = _tick_through(timeline, lambda name: False, 0, 12)
    gate = timeline.gates[0]
    assert (gate.timed_out, gate.passed_s, gate.held_s) == (True, 8.0, 3.0)
    assert trace[12] == 9.0  # schedule time = load time - the hold


def test_gates_come_in_the_faults_order():
    schedule = soak_schedule.parse_schedule(soak_schedule.DEFAULT_SCHEDULE, DURATION)
    assert soak_schedule.gates(schedule) == [
        (30.0, soak_schedule.TARGET_HAS_TWO),
        (50.0, soak_schedule.TARGET_KILLED),
        (60.0, soak_schedule.DRAFT_KILLED),
        (70.0, soak_schedule.DRAFT_BACK),
        (100.0, soak_schedule.SCALED_DOWN),
    ]


# ---------------------------------------------------------------------- a made-up run


def _replica(deployment, rid, rss, born=-30.0, state="RUNNING"):
    return dict(
        deployment=deployment,
        replica_id=rid,
        pid=hash(rid) % 10000,
        state=state,
        born_s=born,
        rss_bytes=rss if state == "RUNNING" else None,
    )


def _samples(target_growth=0):
    """Target t1 all along (growing linearly by ``target_growth`` over 100 s); a second target
    from 20 s (t2, killed at 30 s; t3 from 32 s) until the scale-down at 72 s; the draft node
    dies at 50 s (d1 pending) and a new draft replica d2 runs from 64 s."""
    out = []
    for t in map(float, range(0, 101, 2)):
        replicas = [
            _replica(TARGET, "t1", 500 * MB + target_growth * t / 100),
            _replica(ROUTER, "r1", 400 * MB),
        ]
        if 20 <= t < 30:
            replicas.append(_replica(TARGET, "t2", 480 * MB, born=16.0))
        elif 32 <= t < 72:
            replicas.append(_replica(TARGET, "t3", 480 * MB, born=31.0))
        if t < 50:
            replicas.append(_replica(DRAFT, "d1", 300 * MB))
        elif t < 64:
            replicas.append(_replica(DRAFT, "d1", None, state="PENDING_ALLOCATION"))
        else:
            replicas.append(_replica(DRAFT, "d2", 300 * MB, born=62.0))
        running = dict.fromkeys(DEPLOYMENTS, 0)
        for r in replicas:
            running[r["deployment"]] += r["state"] == "RUNNING"
        out.append({"t": t, "running": running, "replicas": replicas})
    return out


PHASES = {"rise": 15.0, "fall": 70.0}  # the load's 6 clients came at 15 s and went at 70 s
EVENTS = [
    {"name": "kill_target_replica", "t": 30.0, "t_done": 30.1, "ok": True, "what": "t2"},
    {"name": "kill_draft_node", "t": 50.0, "t_done": 50.2, "ok": True, "draft_replicas": ["d1"]},
    {"name": "restart_draft_node", "t": 60.0, "t_done": 63.0, "ok": True},
]


def _outcomes(**changes):
    base = [
        Outcome(
            index=i,
            spec=RequestSpec(i % 8, 16, k, i % 2 == 1),
            start_s=i,
            end_s=i + 0.5,
            code="OK",
            tokens=16,
        )
        for i, k in enumerate([0, 1, 3, None] * 25)
    ]
    base[52].rounds_without_draft = 4  # ran during the draft's absence
    base[70].draft_tokens = 12  # drafting again after the restart
    for index, fields in changes.items():
        for name, value in fields.items():
            setattr(base[int(index)], name, value)
    return base


def _caches(**left):
    """Draft d2 and targets t1, t3 after the load: empty, unless ``left`` (replica: sessions)."""

    def one(rid):
        n = left.get(rid, 0)
        return {"sessions": n, "bytes": 256 * n, "evictions": 0, "rebuilds": 3}

    return {DRAFT: {"d2": one("d2")}, TARGET: {"t1": one("t1"), "t3": one("t3")}}


def _analyse(outcomes=None, samples=None, events=EVENTS, caches=None):
    return soak_verdict.analyse(
        _outcomes() if outcomes is None else outcomes,
        _samples() if samples is None else samples,
        events,
        PHASES,
        _caches() if caches is None else caches,
        warmup_s=20.0,
        min_span_s=10.0,
        max_growth_bytes=50 * MB,
    )


def test_a_clean_run_passes_every_check():
    report = _analyse()
    assert report["passed"], report["checks"]
    scaling = report["scaling"]
    assert scaling[TARGET]["scaled_up_at"] == 20.0  # not the return after the kill at 32 s
    assert scaling[TARGET]["scaled_down_at"] == 72.0
    assert (scaling[TARGET]["min"], scaling[TARGET]["max"]) == (1, 2)
    assert (scaling[DRAFT]["min"], scaling[DRAFT]["scaled_up_at"]) == (0, None)
    assert report["draft_recovery"] == {"replica_back_at": 64.0, "speculating_again_at": 70.0}
    requests = report["requests"]
    assert requests["sent"] == requests["ok"] == 100 and requests["failed"] == 0
    assert requests["by_k"] == {"k=0": 25, "k=1": 25, "k=3": 25, "k=auto": 25}
    assert requests["by_mode"] == {"unary": 50, "stream": 50}
    memory = {r["replica_id"]: r for r in report["memory"]}
    # t1 was born before the load: its baseline is at the warm-up; t3 (born at 31 s) 20 s
    # after its birth; t2 died before its warm-up ended, so it is reported but not judged.
    assert memory["t1"]["baseline"][0] == 20.0 and memory["t1"]["end"][0] == 100.0
    assert memory["t3"]["baseline"][0] == 52.0 and memory["t3"]["judged"]
    assert memory["t2"]["baseline"] is None and not memory["t2"]["judged"]
    assert memory["d2"]["baseline"][0] == 82.0 and memory["d2"]["judged"]
    assert all(r["ok"] for r in report["memory"])
    summary = soak_verdict.format_summary({**report, "config": _config()})
    assert "verdict: PASS" in summary and "FAIL" not in summary
    assert "100 sent, 100 OK, 0 failed" in summary


def _config():
    return dict(dtype="float32", duration_s=DURATION, schedule="1@0", machine="cpu", date="d")


def _failed(report):
    return {name for name, c in report["checks"].items() if not c["ok"]}


def test_a_failed_request_and_a_changed_output_fail_the_run():
    outcomes = _outcomes(**{"3": dict(code="UNAVAILABLE"), "4": dict(mismatch_at=7)})
    report = _analyse(outcomes)
    assert _failed(report) == {"no failed requests", "greedy outputs equal the reference"}
    assert report["requests"]["by_code"] == {"OK": 99, "UNAVAILABLE": 1}
    assert [p["index"] for p in report["problems"]] == [3, 4]
    hung = _analyse(_outcomes(**{"9": dict(code="IN_FLIGHT")}))  # never answered
    assert _failed(hung) == {"no failed requests"} and hung["requests"]["failed"] == 1
    assert "verdict: FAIL" in soak_verdict.format_summary({**report, "config": _config()})


def test_memory_growth_past_the_limit_fails_and_before_the_warmup_does_not_count():
    assert _failed(_analyse(samples=_samples(target_growth=49 * MB))) == set()
    grown = _analyse(samples=_samples(target_growth=80 * MB))  # 64 MB from 20 s to 100 s
    assert _failed(grown) == {"replica memory flat"}
    row = next(r for r in grown["memory"] if r["replica_id"] == "t1")
    assert row["growth_bytes"] == 64 * MB and not row["ok"]
    early = _samples()  # a big step before the warm-up ends is start-up, not growth
    for sample in early[:5]:
        sample["replicas"][0]["rss_bytes"] -= 200 * MB  # t1
    assert _failed(_analyse(samples=early)) == set()


def test_no_scale_down_after_the_load_fell_fails():
    samples = _samples()
    for sample in samples:  # the target keeps 2 replicas to the end
        if sample["t"] >= 72:
            sample["running"][TARGET] = 2
    assert _failed(_analyse(samples=samples)) == {"target scaled down"}


def test_a_load_that_never_fell_cannot_show_a_scale_down():
    report = _analyse()
    never = soak_verdict.scale_events(_samples(), rise_s=15.0, fall_s=None)
    assert never[TARGET]["scaled_down_at"] is None
    assert never[TARGET]["scaled_up_at"] == report["scaling"][TARGET]["scaled_up_at"] == 20.0
    assert (
        soak_verdict.scale_events(_samples(), rise_s=None, fall_s=None)[TARGET]["scaled_up_at"]
        is None
    )


def test_faults_that_did_not_happen_fail_their_checks():
    events = [
        {**EVENTS[0], "ok": False, "error": "RuntimeError: never 2 RUNNING"},
        {**EVENTS[1], "ok": False, "error": "RuntimeError: survived"},
    ]
    report = _analyse(events=events)
    assert _failed(report) == {
        "target replica killed",
        "draft node killed",
        "draft node restarted",
        "draft replica back",
        "speculation resumed",
    }
    assert report["checks"]["draft node restarted"]["detail"] == "never ran"


def test_a_draft_that_never_comes_back_or_never_drafts_again_fails():
    samples = _samples()
    for sample in samples:
        if sample["t"] >= 64:  # only the old replica's name: nothing new ran
            sample["replicas"] = [r for r in sample["replicas"] if r["deployment"] != DRAFT]
    outcomes = _outcomes(**{"70": dict(draft_tokens=0)})
    assert _failed(_analyse(outcomes, samples)) == {"draft replica back", "speculation resumed"}


def test_sessions_left_beyond_what_replica_changes_strand_are_a_leak():
    # Target changes at 20, 30, 32, 72 s and draft changes at 50, 64 s, each seen between two
    # samples 2 s apart and widened by 2 s: 7 one-per-second requests in flight around each.
    samples, outcomes = _samples(), _outcomes()
    assert soak_verdict.strandable_sessions(samples, outcomes, TARGET, slack_s=2.0) == 4 * 7
    assert soak_verdict.strandable_sessions(samples, outcomes, DRAFT, slack_s=2.0) == 2 * 7
    assert soak_verdict.strandable_sessions(samples, outcomes, ROUTER, slack_s=2.0) == 0
    report = _analyse(caches=_caches(t3=20, d2=14))  # orphans of rerouted sessions: allowed
    assert _failed(report) == set()
    assert report["strandable_sessions"] == {DRAFT: 14, TARGET: 28}
    detail = report["checks"]["no session leaked"]["detail"]
    assert detail.startswith("DraftModel: 14 sessions left (3584 bytes) on 1 replicas, <= 14")
    assert "TargetModel: 20 sessions left (5120 bytes) on 2 replicas, <= 28 strandable" in detail
    assert _failed(_analyse(caches=_caches(t1=20, t3=9))) == {"no session leaked"}
    assert _failed(_analyse(caches={TARGET: _caches()[TARGET]})) == {"no session leaked"}


def test_a_request_still_in_flight_counts_as_strandable():
    outcomes = _outcomes(**{"40": dict(end_s=float("nan"))})  # started at 40 s, never ended
    samples, before = (
        _samples(),
        soak_verdict.strandable_sessions(_samples(), _outcomes(), DRAFT, 2.0),
    )
    assert soak_verdict.strandable_sessions(samples, outcomes, DRAFT, slack_s=2.0) == before + 2


def test_nothing_degraded_means_the_draft_kill_was_not_felt():
    outcomes = _outcomes(**{"52": dict(rounds_without_draft=0)})
    assert _failed(_analyse(outcomes)) == {"ran without the draft"}
