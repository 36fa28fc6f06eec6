"""The soak's memory sampling: a thread that samples Serve's replicas and each replica process's
resident memory (``/proc/PID/statm``), and the growth of each replica from its baseline.

Memory is in bytes; MB (10^6 bytes) in the printed lines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from specdec.bench.replicas import DEPLOYMENTS, serve_replicas

MB = 1_000_000


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.1f}"


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


def memory_lines(rows: Sequence[Mapping], limits: Mapping) -> list[str]:
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
