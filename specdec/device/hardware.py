"""What hardware a process runs on, in words: benchmarks print it and replicas report it, since
every cost and every rounding behaviour specdec measures is a property of the device."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

# The instruction-set flags that decide which CPU kernels PyTorch and oneDNN pick.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, platform.processor() elsewhere)."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache
def cpu_isa_flags() -> tuple[str, ...]:
    """The ISA_FLAGS this CPU advertises, in ISA_FLAGS order (empty when unknown)."""
    flags: set[str] = set()
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    return tuple(flag for flag in ISA_FLAGS if flag in flags)


def describe_device(device: str | torch.device = "cpu") -> str:
    """One line naming the device: for a CPU its model, ISA flags, the kernel level PyTorch
    dispatches to (``ATEN_CPU_CAPABILITY`` may lower it) and the thread count; for a GPU its
    name.

    Example: ``cpu: Intel(R) Xeon(R) Processor [avx2 fma avx512f avx512bw avx512_vnni];
    torch kernels AVX512; 2 threads``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return str(device)
    flags = " ".join(cpu_isa_flags()) or "flags unknown"
    capability = torch.backends.cpu.get_cpu_capability()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    capped = f"; oneDNN ISA capped at {onednn}" if onednn else ""
    return (
        f"cpu: {cpu_model()} [{flags}]; torch kernels {capability}{capped}; "
        f"{torch.get_num_threads()} threads"
    )


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
