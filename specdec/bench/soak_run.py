"""One soak's run against the deployed service: the load on the schedule's clock, the monitor,
the faults as their gates open, and the model caches read after the load (see
specdec.bench.soak)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from specdec.bench.replicas import DRAFT, TARGET, serve_replicas
from specdec.bench.soak_faults import Faults
from specdec.bench.soak_load import Load, Outcome, request_plan
from specdec.bench.soak_memory import Monitor
from specdec.bench.soak_schedule import (
    DRAFT_BACK,
    DRAFT_KILLED,
    TARGET_HAS_TWO,
    TARGET_KILLED,
    Gate,
    Schedule,
    Timeline,
    gates,
)
from specdec.bench.soak_verdict import draft_recovery, scale_events, sessions_left
from specdec.config import APPLICATION


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
