"""Simulated device costs: GPU timescales on a machine without a GPU (issue 42, item 3).

A replica with ``models.simulated_costs`` set still runs its real (tiny or bundled) model for the
tokens, so every output stays exact, but holds each forward until the wall time a cost table
gives for that forward's rows: the real Ray orchestration, batching and overlap then run at the
pace of, say, a 14B target and a 0.5B draft on an H100, and can be measured on a CPU.

The table is a JSON file:

    {"label": "what it simulates", "source": "where its numbers come from",
     "target": {"forward_s": [s1, s2, ...], "prefill_s_per_token": p},
     "draft":  {"forward_s": [...], "prefill_s_per_token": p}}

``forward_s[r - 1]`` is the seconds of one forward over r rows (every session's rows of a packed
forward, padding included); past the end each further row adds ``prefill_s_per_token``. A
forward is held from the moment its input ids are embedded until its final norm has run, so its
real compute counts towards the simulated time instead of adding to it (as a GPU's kernels run
while the host prepares the next launch); a real forward slower than the table is not held.

The replica reports the table's costs (not its real calibration's) to the router, which prices
k with them, and labels them: ReplicaInfo.simulated_costs, ModelInfo.simulated_costs. Every figure
measured under a simulation must carry that label.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path

import torch

from specdec.device.calibration.results import Calibration, ExactWidths
from specdec.errors import ConfigError

FIELD = "simulated_costs"  # the setting, as ConfigError names it


@dataclasses.dataclass(frozen=True)
class SideCosts:
    """One side's simulated forward costs.

    Attributes:
        forward_s: forward_s[r - 1] = seconds of one forward over r rows (r >= 1).
        prefill_s_per_token: seconds each row past the end of forward_s adds.
    """

    forward_s: tuple[float, ...]
    prefill_s_per_token: float

    def seconds(self, rows: int) -> float:
        """Simulated seconds of one forward over ``rows`` rows (>= 1)."""
        table = self.forward_s
        if rows <= len(table):
            return table[max(rows, 1) - 1]
        return table[-1] + (rows - len(table)) * self.prefill_s_per_token

    def calibration(self, real: Calibration) -> Calibration:
        """``real`` with its chosen candidate's costs replaced by this table's (at the same
        widths; the exact widths themselves kept, since the real model still computes), as the
        only candidate: what the replica reports for the router to price rounds with."""
        chosen = real.chosen
        forward_s = tuple(self.seconds(w) for w in range(1, len(chosen.forward_s) + 1))
        exact = chosen.exact
        if exact is not None:
            exact = ExactWidths(exact.widths, forward_s)
        measured = dataclasses.replace(
            chosen,
            forward_s=forward_s,
            prefill_s_per_token=self.prefill_s_per_token,
            exact=exact,
        )
        return dataclasses.replace(real, candidates=(measured,))


@dataclasses.dataclass(frozen=True)
class SimulatedCosts:
    """A simulated device cost table (the module docstring gives its JSON).

    Attributes:
        label: what it simulates, shown beside every figure measured under it.
        source: where its numbers come from (a GPU run, or how they were estimated).
        sides: "draft" and "target" -> SideCosts.
    """

    label: str
    source: str
    sides: dict[str, SideCosts]

    @classmethod
    def load(cls, path: str | Path) -> SimulatedCosts:
        """Reads and checks a table.

        Raises:
            ConfigError: the file is missing or not JSON, or a field is missing or invalid; the
                message names the setting (simulated_costs) and the table's field.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(FIELD, f"cannot read a cost table from {path}: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(FIELD, f"{path} must hold a JSON object")
        label = data.get("label")
        if not isinstance(label, str) or not label.strip():
            raise ConfigError(FIELD, f"{path}: 'label' must be a non-empty string")
        sides = {side: _side(data, side, path) for side in ("draft", "target")}
        return cls(label, str(data.get("source", "")), sides)


def _side(data: dict, side: str, path: str | Path) -> SideCosts:
    where = f"{path}: '{side}'"
    entry = data.get(side)
    if not isinstance(entry, dict):
        raise ConfigError(
            FIELD, f"{where} must be an object with 'forward_s' and 'prefill_s_per_token'"
        )
    forward_s = entry.get("forward_s")
    if not isinstance(forward_s, list) or not forward_s or not all(map(_seconds, forward_s)):
        raise ConfigError(FIELD, f"{where}.forward_s must be a non-empty list of seconds > 0")
    per_token = entry.get("prefill_s_per_token")
    if not _seconds(per_token):
        raise ConfigError(
            FIELD, f"{where}.prefill_s_per_token must be seconds > 0, got {per_token!r}"
        )
    return SideCosts(tuple(float(s) for s in forward_s), float(per_token))


def _seconds(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


class ForwardHold:
    """Holds every forward of ``model`` until ``costs`` says it ends (the module docstring).

    Hooks the input embedding (every forward path embeds its token ids first: its start and
    its rows) and the decoder's final norm (the end of its layers), and sleeps there until
    start + costs.seconds(rows). The hooks run on the thread that runs the forward.

    Args:
        model: a transformers decoder model (get_input_embeddings(), get_decoder().norm).
        costs: this side's simulated costs.
    Raises:
        ValueError: the model's decoder has no final ``norm`` to hold at.
    """

    def __init__(self, model: torch.nn.Module, costs: SideCosts) -> None:
        norm = getattr(model.get_decoder(), "norm", None)
        if norm is None:
            raise ValueError(
                f"models.{FIELD} needs a decoder with a final norm: {type(model).__name__}"
            )
        self.costs = costs
        self.held = self.forwards = 0  # forwards held, and all forwards seen
        self._local = threading.local()
        self._handles = [
            model.get_input_embeddings().register_forward_pre_hook(self._started),
            norm.register_forward_hook(self._ended),
        ]

    def remove(self) -> None:
        """Unhooks the model: its forwards run at their own pace again."""
        for handle in self._handles:
            handle.remove()

    def _started(self, module: torch.nn.Module, args: tuple) -> None:
        self._local.start = time.perf_counter(), int(args[0].numel())

    def _ended(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        started = getattr(self._local, "start", None)
        if started is None:
            return
        self._local.start = None
        start, rows = started
        self.forwards += 1
        wait_s = start + self.costs.seconds(rows) - time.perf_counter()
        if wait_s > 0:
            self.held += 1
            time.sleep(wait_s)
