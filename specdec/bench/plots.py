"""The bench commands' figures, as PNG files: the load test's load, latency and replicas over
time, the sweep's throughput and latency per concurrency, and `specdec bench`'s speedup per
prompt.

Needs matplotlib (``pip install -e '.[bench]'``). ``python -m specdec.bench.plots IN.json
OUT.png`` redraws a saved load test report.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.bench.figures import PLAIN, TARGET_ONLY, PromptResult, first_speculative


def _pyplot():
    """matplotlib.pyplot on the Agg backend: files only, never a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path, dpi: int) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)


def plot_loadtest(report: Mapping, path: str) -> None:
    """`specdec loadtest`'s figure: three stacked panels sharing the time axis (seconds since
    the run's start).

    1. load: client concurrency (left axis) and completed requests per second, 5-s mean
       (right axis); red crosses mark seconds with errors.
    2. latency (seconds, log scale): per-second p50 and p95 of request latency and of TTFT.
    3. RUNNING replicas per deployment (from serve.status()).
    Dashed vertical lines mark stage boundaries.
    """
    plt = _pyplot()
    rows = report["per_second"]
    t = [r["t"] + 1 for r in rows]  # a record covers [t, t+1): draw it at its end
    fig, (load, latency, replicas) = plt.subplots(
        3, 1, sharex=True, figsize=(10, 8.5), height_ratios=(1, 1.2, 1)
    )
    load.step(t, [r["concurrency"] for r in rows], where="pre", color="C0", label="concurrency")
    load.set_ylabel("concurrent clients")
    rate = load.twinx()
    # Per-second counts of multi-second requests jump between 0 and 2x the rate: smooth them.
    rate.plot(
        t,
        _rolling_mean([r["completed"] for r in rows], 5),
        color="C1",
        lw=1,
        label="completed req/s (5 s mean)",
    )
    errors = [(x, sum(r["errors"].values())) for x, r in zip(t, rows) if r["errors"]]
    if errors:
        rate.plot(*zip(*errors), "rx", label="errors/s")
    rate.set_ylim(bottom=0)
    rate.set_ylabel("requests / s")
    _legend(load, rate)

    for key, q, style in (
        ("latency_s", "p50", "C0-"),
        ("latency_s", "p95", "C3-"),
        ("ttft_s", "p50", "C2--"),
        ("ttft_s", "p95", "C2:"),
    ):
        points = [(x, r[key][q]) for x, r in zip(t, rows) if r[key][q]]
        if points:
            latency.plot(
                *zip(*points),
                style,
                lw=1,
                label=f"{'latency' if key == 'latency_s' else 'TTFT'} {q}",
            )
    latency.set_yscale("log")
    latency.set_ylabel("seconds")
    latency.legend(loc="upper left", fontsize="small")

    names = sorted({name for r in rows for name in (r["replicas"] or {})})
    for i, name in enumerate(names):
        # Small offsets keep equal counts of different deployments from hiding each other.
        counts = [(r["replicas"] or {}).get(name, 0) + 0.04 * (i - 1) for r in rows]
        replicas.step(t, counts, where="post", lw=2, label=name)
    if names:
        top = max(max((r["replicas"] or {}).values(), default=1) for r in rows)
        replicas.set_ylim(-0.2, top + 0.6)
        replicas.set_yticks(range(0, top + 1))
        replicas.legend(loc="upper left", fontsize="small")
    else:
        replicas.text(
            0.5, 0.5, "replica counts not recorded", ha="center", transform=replicas.transAxes
        )
    replicas.set_ylabel("RUNNING replicas")
    replicas.set_xlabel("time since start (s)")

    for stage in report["stages"]:
        for ax in (load, latency, replicas):
            ax.axvline(stage["start_s"], color="grey", ls="--", lw=0.8)
        load.annotate(
            f"{stage['concurrency']}x",
            (stage["start_s"], 1.0),
            xytext=(3, 2),
            xycoords=("data", "axes fraction"),
            textcoords="offset points",
            fontsize="small",
            color="grey",
            va="bottom",
        )
    summary = report["summary"]
    p95 = summary["latency_s"]["p95"]
    fig.suptitle(
        f"specdec loadtest: {summary['completed']} requests, "
        f"{summary['error_count']} errors, latency p95 "
        f"{'-' if p95 is None else f'{p95:.2f} s'}"
    )
    _save(fig, path, dpi=110)


def plot_sweep(summary: Mapping[str, Any], path: str) -> None:
    """`specdec sweep`'s figure, two panels: aggregate tokens/s vs concurrency, and latency p95
    (seconds) vs concurrency, one line per mode."""
    plt = _pyplot()
    cells = summary["cells"]
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    concurrencies = sorted({c["concurrency"] for c in cells})
    fig, (rate, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        row = sorted((c for c in cells if c["mode"] == mode), key=lambda c: c["concurrency"])
        for ax, value in (
            (rate, lambda c: c["aggregate_tokens_per_s"]),
            (latency, lambda c: c["latency_s"]["p95"]),
        ):
            points = [(c["concurrency"], value(c)) for c in row if value(c) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
    for ax in (rate, latency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrent streams")
        ax.legend()
    rate.set_ylim(bottom=0)
    rate.set_ylabel("aggregate tokens / s")
    rate.set_title("Aggregate throughput per mode")
    latency.set_ylim(bottom=0)
    latency.set_ylabel("latency p95 (s)")
    latency.set_title("Request latency p95 per mode")
    _save(fig, path, dpi=120)


def plot_speedup(
    results: Sequence[PromptResult], summary: dict[str, dict[str, Any]], path: str
) -> None:
    """`specdec bench`'s figure: speedup per prompt (one bar per mode, over plain_generate when
    it ran, else over the service's k = 0) and acceptance per draft position."""
    plt = _pyplot()
    base = PLAIN if PLAIN in results[0].runs else TARGET_ONLY
    modes = [m for m in results[0].runs if m != base]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        speedups = [
            r.runs[mode].tokens_per_second / r.runs[base].tokens_per_second for r in results
        ]
        left.bar([x + i * width for x in range(len(results))], speedups, width, label=mode)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(
        [x + width * (len(modes) - 1) / 2 for x in range(len(results))],
        [r.prompt.id for r in results],
        rotation=60,
        ha="right",
        fontsize=7,
    )
    left.set_ylabel(f"speedup over {base} (tokens/s)")
    left.set_title(f"Speedup per prompt (baseline: {base})")
    left.legend()
    spec = first_speculative(summary)
    per_position = summary.get(spec, {}).get("acceptance_per_position") or []
    points = [(i + 1, a) for i, a in enumerate(per_position) if a is not None]
    if points:
        right.plot([p for p, _ in points], [a for _, a in points], marker="o")
    right.set_ylim(0, 1.05)
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance rate")
    right.set_title(f"Acceptance per draft position ({spec})")
    _save(fig, path, dpi=120)


def _rolling_mean(values: list[float], width: int) -> list[float]:
    """Centered mean over ``width`` points (fewer at the ends)."""
    half = width // 2
    return [
        sum(values[max(0, i - half) : i + half + 1]) / len(values[max(0, i - half) : i + half + 1])
        for i in range(len(values))
    ]


def _legend(*axes) -> None:
    handles, labels = [], []
    for ax in axes:
        ax_handles, ax_labels = ax.get_legend_handles_labels()
        handles += ax_handles
        labels += ax_labels
    axes[0].legend(handles, labels, loc="upper left", fontsize="small")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m specdec.bench.plots REPORT.json OUT.png")
    with open(sys.argv[1]) as report_file:
        plot_loadtest(json.load(report_file), sys.argv[2])
