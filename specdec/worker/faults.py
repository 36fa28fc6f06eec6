"""Test-only fault injection into a replica's forwards: off unless $SPECDEC_FAULT_DIR is set.

The tests of replica health (tests/unit/test_compute_faults.py,
tests/integration/test_replica_health.py) need a forward that raises or hangs on one chosen
replica, or for one chosen row. When the environment variable ``SPECDEC_FAULT_DIR`` names a
folder at replica start, the replica hooks its model's input embedding (every forward path,
plain, packed or static, embeds its token ids first) and, before each forward, reads the file
``<folder>/<name>`` (``name``: the replica's Serve id; a test that holds the model names it
itself). Its content selects the fault:

- ``raise``: the forward raises RuntimeError (every forward while the file says so: a sticky
  device error);
- ``hang``: the forward sleeps until the file says something else (a hung device);
- ``raise-token N``: a forward whose input holds token id N raises (a row that fails alone).

No file, or any other content: the forward runs normally. Without the variable nothing is hooked
and forwards pay nothing. Never set it in production.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

FAULT_DIR_ENV = "SPECDEC_FAULT_DIR"
HANG_POLL_S = 0.05  # how often a hung forward looks whether its file still says "hang"


class InjectedFault(RuntimeError):
    """The error an injected ``raise`` or ``raise-token`` fault raises."""


def install_faults(
    model: torch.nn.Module, name: str, folder: str | None = None
) -> torch.utils.hooks.RemovableHandle | None:
    """Hooks ``model``'s input embedding to obey ``<folder>/<name>`` before each forward.

    Args:
        model: a transformers model (get_input_embeddings()).
        name: the file's name in the folder (the replica's id).
        folder: the fault folder; None: $SPECDEC_FAULT_DIR.
    Returns:
        The hook's handle (remove() unhooks it), or None when no folder is set (nothing hooked).
    """
    folder = folder if folder is not None else os.environ.get(FAULT_DIR_ENV)
    if not folder:
        return None
    path = Path(folder) / name

    def before_forward(module: torch.nn.Module, args: tuple) -> None:
        fault = _read(path)
        if fault == "raise":
            raise InjectedFault(f"injected forward fault on {name}")
        if fault.startswith("raise-token "):
            token = int(fault.split()[1])
            if args and bool((args[0] == token).any()):  # args[0]: the input ids
                raise InjectedFault(f"injected forward fault on {name}: token {token}")
        while fault == "hang":
            time.sleep(HANG_POLL_S)
            fault = _read(path)

    return model.get_input_embeddings().register_forward_pre_hook(before_forward)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
