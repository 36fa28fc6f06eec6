"""A half-precision tiny target whose exact widths form several sets (issue 46, item 2).

The tiny target's own bfloat16 calibration keeps a single exact width: its layers are too small
for a split set to show within the calibration's check (half_precision_rows), so every forward
pads to one width. These helpers load it with every linear layer replaced by WidthSetLinear,
whose rows are computed one at a time (so within a set a row never depends on the call's width,
by construction) and scaled by an amount that depends on which set the call's row count falls
in (so a row computed at a width of another set comes out different, in most of its outputs).
The calibration then measures those sets and keeps one of several widths, and the verifier's
padding, chunking and replayed rebuilds run through the multi-width code in bfloat16, where a
row sent to the wrong set would change the logits for certain rather than once in thousands.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specdec import SpeculativeEngine

# Each set's first width: {1..4}, {5..10}, {11..}. The verifier's widest forward is 17 rows.
SET_STARTS = (1, 5, 11)
SET_SCALE = 1 / 64  # set s scales its outputs by 1 + s / 64: bfloat16 keeps 8 bits, so most move
# The rows each narrower width checks in the calibration's whole-model check. WidthSetLinear has
# no rounding split to find (each row is its own call), so the estimate half_precision_rows
# makes for real GEMMs, tens of thousands of rows for the tiny shapes, does not apply.
CHECK_ROWS = 4
# Outputs each width compares in the linear-layer measurement (its default, 500,000, is sized to
# catch a rounding split that flips one bfloat16 output in 10^4): the sets here differ in most
# outputs, and the row-at-a-time layers made the default's thousands of trials cost seconds.
MEASURE_ELEMENTS = 2_000
WIDTH_SETS_ENV = "SPECDEC_TEST_WIDTH_SETS"  # a replica's target path (install_from_environment)
SITE = Path(__file__).resolve().parent / "width_set_site"


def set_of(rows: int) -> int:
    """The index in SET_STARTS of the set a call of ``rows`` rows belongs to."""
    return bisect.bisect_right(SET_STARTS, rows) - 1


class WidthSetLinear(torch.nn.Linear):
    """nn.Linear computed one row at a time, its output scaled by the set of the call's row
    count (SET_STARTS, SET_SCALE). Made by changing a loaded layer's class (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        # A fresh copy of each row: the same row at another offset reads the same aligned memory.
        out = torch.cat(
            [F.linear(flat[i : i + 1].clone(), self.weight, self.bias) for i in range(rows)]
        )
        which = set_of(rows)
        if which:
            out = (out.float() * (1 + which * SET_SCALE)).to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def use_width_sets(model: torch.nn.Module) -> None:
    """Makes every plain nn.Linear of ``model`` a WidthSetLinear, in place."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = WidthSetLinear


def _patches(target: str | Path) -> list[tuple[object, str, object]]:
    """(module, name, value) replacements by which load_calibrated gives the model at
    ``target`` WidthSetLinear layers before it calibrates, the linear-layer measurement compares
    MEASURE_ELEMENTS outputs a width and the half-precision check CHECK_ROWS rows."""
    from specdec.device.calibration import load, measure

    loading, measuring = load.load_model, measure.measure_exact_width_sets

    def load_model(spec, *args, **kwargs):
        loaded = loading(spec, *args, **kwargs)
        if Path(spec) == Path(target):
            use_width_sets(loaded.model)
        return loaded

    def measure_sets(model, max_width, **kwargs):
        return measuring(model, max_width, **{**kwargs, "elements": MEASURE_ELEMENTS})

    return [
        (load, "load_model", load_model),
        (measure, "measure_exact_width_sets", measure_sets),
        (measure, "half_precision_rows", lambda m: CHECK_ROWS),
    ]


@contextlib.contextmanager
def width_set_targets(target: Path):
    """While open, this process loads ``target`` with WidthSetLinear layers (_patches)."""
    with pytest.MonkeyPatch.context() as patch:
        for module, name, value in _patches(target):
            patch.setattr(module, name, value)
        yield


def install_from_environment() -> None:
    """For a replica process (tests/width_set_site/sitecustomize.py): loads the model that
    $SPECDEC_TEST_WIDTH_SETS names with WidthSetLinear layers, for the rest of the process."""
    target = os.environ.get(WIDTH_SETS_ENV)
    if target:
        for module, name, value in _patches(target):
            setattr(module, name, value)


def service_env(target: Path, calibrations: Path) -> dict[str, str]:
    """TargetModel replica environment variables (tests/integration/conftest.py's target_env)
    that serve ``target`` with WidthSetLinear layers, its replicas sharing a calibration folder
    of their own (the plain tiny target's calibration has the same key)."""
    from specdec.device.calibration_cache import CACHE_ENV

    return {
        "PYTHONPATH": os.pathsep.join([str(SITE), str(SITE.parent)]),
        WIDTH_SETS_ENV: str(target),
        CACHE_ENV: str(calibrations),
    }


def width_set_engine(draft: Path, target: Path, **settings) -> SpeculativeEngine:
    """The tiny pair in bfloat16 with a WidthSetLinear target, calibrated afresh (no calibration
    cache: a stored calibration of the plain tiny target has the same key)."""
    with width_set_targets(target):
        return SpeculativeEngine.from_pretrained(
            draft, target, dtype="bfloat16", calibration_cache="", **settings
        )
