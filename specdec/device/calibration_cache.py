"""Calibrations kept on disk, so that a replica starting again on the same kind of device skips
the minutes of measurement (cf. TensorRT's timing cache, Triton's autotuning cache).

What a calibration finds is a property of the model's architecture on a device: forward cost by
width and the widths whose rows agree bitwise depend on the layer shapes, the dtype and the
kernels that run them, not on the weights' values. The key therefore holds the architecture
(the model config), the settings that shape the measurement (role, candidates, k_max,
exact widths on or off, the batch size a target's widths are priced for), the device as
describe_device words it (CPU model, ISA flags, the kernel level PyTorch dispatches to,
oneDNN's ISA cap, threads), the torch and transformers versions, the build of specdec's own
bfloat16-weight kernel where the "bf16w" GEMM is a candidate's (its library name hashes the
source), the measurement's constants and FORMAT. Anything else that changes what a measurement
means must bump FORMAT, and so must a change to the key's or the entry's layout (_to_json:
candidates in their display form, "float32+dnnl", as FORMAT 2 wrote them).

A reused calibration still checks its exact widths on the loaded model before it is trusted
(specdec.device.calibration.load.load_calibrated): exactness is the product, timings only a
choice.

Measured on the bundled target (2-core AVX2 EPYC): a measurement took 122 s in process and
281 s inside a local cluster; reusing one takes its whole-model check, about 5 s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from specdec.device import bf16_weights
from specdec.device.calibration import choice, measure, results
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.results import Calibration, DtypeMeasurement, ExactWidths
from specdec.device.gemm import BF16_WEIGHTS
from specdec.device.hardware import describe_device

log = logging.getLogger(__name__)

CACHE_ENV = "SPECDEC_CALIBRATION_CACHE"
DEFAULT_DIR = "~/.cache/specdec/calibration"
FORMAT = 2  # bump when what a calibration measures, or how, changes
# The measurement's own settings go into the key too, so changing one never reuses old results:
# {name in the key: (module, constant)}. The names are the key's (FORMAT 2's), not the
# constants': PRICED_ACCEPTANCES keeps its old name there.
_SETTINGS = {
    "CACHE_TOKENS": (results, "CACHE_TOKENS"),
    "PREFILL_TOKENS": (measure, "PREFILL_TOKENS"),
    "TYPICAL_PROMPT_TOKENS": (choice, "TYPICAL_PROMPT_TOKENS"),
    "TYPICAL_NEW_TOKENS": (choice, "TYPICAL_NEW_TOKENS"),
    "CLASS_ACCEPTANCES": (choice, "PRICED_ACCEPTANCES"),
    "DRAFT_WIDTHS": (measure, "DRAFT_WIDTHS"),
    "EXTRA_WIDTHS": (measure, "EXTRA_WIDTHS"),
    "SLOWER_CUTOFF": (choice, "SLOWER_CUTOFF"),
    "CHOICE_MARGIN": (choice, "CHOICE_MARGIN"),
    "PREFILL_MARGIN": (choice, "PREFILL_MARGIN"),
    "TIMING_REPEATS": (measure, "TIMING_REPEATS"),
}


class CalibrationCache:
    """A folder of calibrations, one JSON file per key (written atomically, so replicas
    starting together on one host never read half a file).

    Errors never reach the replica: an unreadable or stale entry is measured again, and a
    folder that cannot be written only loses the reuse (both logged)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(os.path.expandvars(os.fspath(directory))).expanduser()

    @classmethod
    def configured(cls, setting: str | None) -> CalibrationCache | None:
        """The cache a ``models.calibration_cache`` setting names: None (the setting unset)
        means ``$SPECDEC_CALIBRATION_CACHE``, else DEFAULT_DIR; an empty string turns it off."""
        directory = os.environ.get(CACHE_ENV, DEFAULT_DIR) if setting is None else setting
        return cls(directory) if directory else None

    def key(
        self,
        model: torch.nn.Module,
        role: str,
        candidates: list[Candidate],
        *,
        device: str | torch.device,
        max_speculative_tokens: int,
        exact_widths: bool,
        max_batch_size: int = 1,
    ) -> str:
        """The hex SHA-256 naming what decides a calibration of ``model`` (see the module)."""
        architecture = {
            name: value
            for name, value in model.config.to_dict().items()
            if not name.startswith("_") and name != "transformers_version"
        }
        fields = {
            "format": FORMAT,
            "settings": {
                name: getattr(module, constant) for name, (module, constant) in _SETTINGS.items()
            },
            "architecture": [type(model).__name__, architecture],
            "role": role,
            "dtypes": [str(c) for c in candidates],
            "max_speculative_tokens": max_speculative_tokens,
            "exact_widths": exact_widths,
            "max_batch_size": max_batch_size,
            "device": describe_device(device),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kernels": [bf16_weights.library_name()]
            if any(c.gemm == BF16_WEIGHTS for c in candidates)
            else [],
        }
        text = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> Calibration | None:
        """The calibration stored under ``key``; None when there is none or it is unreadable."""
        path = self._path(key)
        try:
            return _from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring the unreadable calibration %s: %s", path, err)
            return None

    def save(self, key: str, calibration: Calibration) -> None:
        """Stores ``calibration`` under ``key`` (replacing what was there)."""
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.directory, prefix=".tmp-", suffix=".json", delete=False
            ) as handle:
                json.dump(_to_json(calibration), handle)
            os.replace(handle.name, path)
        except OSError as err:
            log.warning("cannot keep the calibration in %s: %s", self.directory, err)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"


def _to_json(calibration: Calibration) -> dict[str, Any]:
    """``calibration`` as FORMAT 2 stores it: dataclasses.asdict's layout, with each candidate
    in its display form (str(Candidate)) under "dtype"."""

    def entry(fields: dict[str, Any], candidate: Candidate) -> dict[str, Any]:
        return {
            "dtype" if name == "candidate" else name: str(candidate)
            if name == "candidate"
            else value
            for name, value in fields.items()
        }

    data = entry(dataclasses.asdict(calibration), calibration.candidate)
    data["candidates"] = [
        entry(fields, measured.candidate)
        for fields, measured in zip(data["candidates"], calibration.candidates)
    ]
    return data


def _from_json(data: dict[str, Any]) -> Calibration:
    candidates = []
    for candidate in data["candidates"]:
        exact = candidate["exact"]
        candidates.append(
            DtypeMeasurement(
                candidate=Candidate.parse(candidate["dtype"]),
                forward_s=tuple(candidate["forward_s"]),
                prefill_s_per_token=float(candidate["prefill_s_per_token"]),
                exact=ExactWidths(tuple(exact["widths"]), tuple(exact["forward_s"]))
                if exact
                else None,
                predicted_s=float(candidate["predicted_s"]),
                cache_tokens=int(candidate["cache_tokens"]),
            )
        )
    chosen = Candidate.parse(data["dtype"])
    if not any(measured.candidate == chosen for measured in candidates):
        raise ValueError(f"the chosen dtype {data['dtype']!r} is not among the candidates")
    return Calibration(
        device=data["device"],
        candidate=chosen,
        automatic=bool(data["automatic"]),
        candidates=tuple(candidates),
        seconds=float(data["seconds"]),
    )
