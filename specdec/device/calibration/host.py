"""One measurement at a time on a host: replicas sharing a CPU's cores must not time each other's
load. A readers-writer lock among the host's processes (flock on one file in the temp folder)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_at_a_time(device: str | torch.device) -> Iterator[None]:
    """Holds the host-wide lock exclusively while a CPU replica measures: replicas sharing the
    cores (a local cluster) measured each other's load otherwise, and the bundled target picked
    bfloat16 in one run and float32 in the next on the same machine. GPUs measure on their own
    device."""
    with _host_lock(device, exclusive=True):
        yield


@contextlib.contextmanager
def while_none_measures(device: str | torch.device) -> Iterator[None]:
    """Holds the host-wide lock shared while a CPU replica loads its model and checks a stored
    calibration: several may do that at once, but not while one measures (one_at_a_time).
    Measured need: the bundled draft's int8 step timed 0.29 s (0.04 s alone) while the
    target loaded beside it, and the draft replica chose bfloat16 (0.10 s a step)."""
    with _host_lock(device, exclusive=False):
        yield


@contextlib.contextmanager
def _host_lock(device: str | torch.device, *, exclusive: bool) -> Iterator[None]:
    """flock on one file in the temp folder: a readers-writer lock among this host's
    processes (a no-op for GPUs and where fcntl is missing)."""
    if torch.device(device).type != "cpu":
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path = os.path.join(tempfile.gettempdir(), "specdec-calibration.lock")
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
