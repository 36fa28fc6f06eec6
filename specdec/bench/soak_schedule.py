"""The soak's schedule: how many clients are busy when, when the faults come, and the gates where
its clock holds until what comes next can mean something (see specdec.bench.soak).

Times are seconds: ``t`` of the load's clock, schedule time of the schedule's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

DEFAULT_SCHEDULE = "1@0,6@0.15,1@0.7"


# Fault times, as fractions of the load's duration.
KILL_TARGET_AT, KILL_DRAFT_AT, RESTART_DRAFT_AT = 0.30, 0.50, 0.60


_STEP = re.compile(r"^(\d+)@(\d*\.?\d+)$")


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
