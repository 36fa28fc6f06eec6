"""The candidates a calibration measures: each a dtype and a GEMM (the ``dtype`` and ``gemm``
settings, specdec.config), in the order that decides ties."""

from __future__ import annotations

import dataclasses

import torch

from specdec.config import AUTO, DTYPE_GEMMS, PLAIN
from specdec.device import bf16_weights
from specdec.device.gemm import BF16_WEIGHTS, ONEDNN, WEIGHT_MAJOR, onednn_available
from specdec.models.loading import INT8


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A dtype ("float32", "bfloat16", "float16", "int8") and the GEMM its linear layers run
    (specdec.device.gemm.GEMMS: "plain", "wm", "dnnl", "bf16w")."""

    dtype: str
    gemm: str = PLAIN

    def __str__(self) -> str:
        """The display form the protos and the calibration cache hold: "float32" (plain) or
        "float32+dnnl"."""
        return self.dtype if self.gemm == PLAIN else f"{self.dtype}+{self.gemm}"

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """The candidate whose display form is ``text``."""
        dtype, _, gemm = text.partition("+")
        return cls(dtype, gemm or PLAIN)


def onednn_candidates(dtype: str) -> list[Candidate]:
    """[Candidate(dtype, "dnnl")] where onednn_available(dtype), else []."""
    return [Candidate(dtype, ONEDNN)] if onednn_available(getattr(torch, dtype)) else []


def bf16_weights_candidates() -> list[Candidate]:
    """[Candidate("float32", "bf16w")] where bf16_weights.available(), else []. A model with
    weights that are not all bfloat16 values still refuses it (set_gemm), which calibration
    reports as skipped."""
    return [Candidate("float32", BF16_WEIGHTS)] if bf16_weights.available() else []


def candidates(role: str, device: str | torch.device) -> list[Candidate]:
    """The candidates ``dtype: auto`` tries, in order: float32 and bfloat16 (a CPU), bfloat16
    and float16 (a GPU); on a CPU also each with oneDNN's reordered weights ("dnnl"; where
    onednn_available says the build and CPU have it) and float32 on bfloat16-stored weights
    ("bf16w", where bf16_weights.available(); a model with weights that are not bfloat16 values
    skips it), a target also float32 with weight-major GEMMs ("wm"), a draft also int8 (its
    output never depends on the draft's numerics).

    The order matters twice: the first candidate is the default that a later one must beat by
    CHOICE_MARGIN, and a candidate measured after a much faster one is cut short
    (SLOWER_CUTOFF), so the likely winner of each dtype comes first: a target's float32 "dnnl"
    (the 2-core AVX2 EPYC: bundled target 37 s per typical request against plain float32's
    72 s; every width exact; the AVX-512 BF16 EPYC: a bfloat16 MLP 1.5x F.linear's speed, gemm
    module), then "bf16w" (the same float32 products at half the weight bytes). A draft's come
    last: int8 quantization finds the Linear layers by type, which the other GEMMs change."""
    if torch.device(device).type != "cpu":
        return [Candidate("bfloat16"), Candidate("float16")]
    float32, bfloat16 = onednn_candidates("float32"), onednn_candidates("bfloat16")
    bf16w = bf16_weights_candidates()
    if role == "draft":
        plain = [Candidate("float32"), Candidate(INT8), Candidate("bfloat16")]
        return [*plain, *float32, *bfloat16, *bf16w]
    return [
        *float32,
        *bf16w,
        Candidate("float32"),
        Candidate("float32", WEIGHT_MAJOR),
        *bfloat16,
        Candidate("bfloat16"),
    ]


def configured(dtype: str, gemm: str, role: str, device: str | torch.device) -> list[Candidate]:
    """The candidates of a side's ``dtype`` and ``gemm`` settings (specdec.config.ModelConfig,
    valid together; ``gemm`` resolved, see gemm_for): both fixed, that one candidate; both
    ``auto``, candidates(role, device); one ``auto``, those of candidates(role, device) that
    match the other (a dtype none of them has: its plain GEMM)."""
    if AUTO not in (dtype, gemm):
        return [Candidate(dtype, gemm)]
    every = candidates(role, device)
    if dtype == AUTO:
        return [c for c in every if gemm in (AUTO, c.gemm)]
    if dtype not in DTYPE_GEMMS:
        raise ValueError(f"unknown dtype {dtype!r}")
    return [c for c in every if c.dtype == dtype] or [Candidate(dtype)]
