"""What every bench command's report shares: percentiles, the machine it ran on, and the JSON
file (the command line, the machine, the settings, then the command's own sections).

Light at module level: the full machine line (``machine``) imports torch inside the call, for
the commands that load models anyway; ``cpu_line`` is the torch-free one.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def percentiles(values: Sequence[float | None], qs: Sequence[int]) -> dict[str, float | None]:
    """{"p50": ...} by linear interpolation (numpy's default), rounded to 6 decimals; None and
    NaN values are left out; None for no values."""
    ordered = sorted(v for v in values if v is not None and not math.isnan(v))
    out: dict[str, float | None] = {}
    for q in qs:
        if not ordered:
            out[f"p{q}"] = None
            continue
        pos = (len(ordered) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 6)
    return out


def machine(device: str = "cpu") -> str:
    """One line naming this machine: the device (specdec.device.hardware.describe_device: CPU
    model, ISA flags, torch kernel level, threads; or the GPU), cores, memory, torch, Python.
    Imports torch."""
    import torch

    from specdec.device.hardware import describe_device

    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    return (
        f"{describe_device(device)}; {os.cpu_count()} cores{memory}; torch {torch.__version__}; "
        f"Python {platform.python_version()}"
    )


def cpu_line() -> str:
    """One line naming this machine without torch: the CPU model (/proc/cpuinfo), cores and
    Python."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def run_record(command: str, machine: str, config: Mapping, **sections: Any) -> dict[str, Any]:
    """A run's JSON body: {"command", "machine", "config", then ``sections`` in order}."""
    return {"command": command, "machine": machine, "config": config, **sections}


def write_json(
    path: str | os.PathLike, report: Mapping, default: Callable[[Any], Any] | None = None
) -> None:
    """Writes ``report`` to ``path`` as JSON, indented by 1 (``default``: json's, for values
    JSON has no type for)."""
    Path(path).write_text(json.dumps(report, indent=1, default=default))
