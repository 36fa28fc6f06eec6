"""Which GEMM a linear layer runs: one half of a start-up calibration candidate.

``F.linear`` computes x @ W^T. On CPUs the BLAS picks its code path by the shape, and for a
handful of rows that path is far from flat: one 2-core AVX-512 Xeon's float32 MLP projection of
Qwen2.5-1.5B (8960 x 1536) took 1.2 ms at 1-3 rows, 2.7 ms at 4, 7.0 ms at 13 and 4.3 ms at 16.
A verify forward is exactly such a handful of rows, so a CPU target's calibration
(specdec.device.calibration) also measures two other ways to compute the same product, and
keeps the fastest that stays exact (which widths give a row bitwise the same result is measured
with the chosen GEMM, like everything else). Each GEMM's name is its value of the ``gemm``
setting (specdec.config); a calibration candidate pairs one with a dtype
(specdec.device.calibration.candidates):

- ``plain``: F.linear.
- ``wm`` (weight-major, float32): W @ x^T for 2 .. WEIGHT_MAJOR_MAX_ROWS rows, F.linear
  otherwise. The Xeon above: 3.0-3.9 ms at every width 2-16.
- ``dnnl`` in float32: oneDNN's inner product on a weight reordered once into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what inductor's CPU
  freezing emits), for every call. On a 2-core AVX2 EPYC (`python -m specdec.bench.gemm_bench
  --layers 1`) the projection took 3.9 ms at 1 row and 6.3 ms at 13 against F.linear's 5.2 and
  16.6, every width 1-17 rounding a row the same way; the 151936-row lm_head took 112 ms at 13
  rows against 343-397 ms. The reordered weight replaces the plain one (same bytes), except
  where another module shares it (a tied lm_head keeps the embedding's and adds its reordered
  copy).
- ``dnnl`` in bfloat16: the same, where oneDNN has a bfloat16 inner product for the CPU
  (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; onednn_available says). F.linear's bfloat16 path reads
  the plain weight on every call. On a 2-core AVX-512 BF16 EPYC, one layer's MLP of
  Qwen2.5-1.5B (28 distinct layers in turn, so the weights come from memory) took 2.0 ms at 1-4
  rows and 2.5 ms at 13 against F.linear's 3.0 and 3.7, with bitwise the same outputs; a
  128-row prefill 14.6 ms against 18.2.
- ``bf16w`` (float32): float32 arithmetic on weights stored in bfloat16
  (specdec.device.bf16_weights, x86-64 with AVX2 and FMA), for a model whose every weight is a
  bfloat16 (a bundled model's are), so it is the float32 model reading half the bytes, and
  every width rounds a row the same way. Where oneDNN has no bfloat16 (an AVX2-only CPU) it
  is the cheapest exact way to run a few rows; the numbers are in that module.
"""

from __future__ import annotations

import collections
import functools

import torch
import torch.nn.functional as F

from specdec.device import bf16_weights

PLAIN = "plain"  # F.linear
WEIGHT_MAJOR = "wm"  # linear layers run W @ x^T
ONEDNN = "dnnl"  # linear layers run oneDNN on reordered weights
BF16_WEIGHTS = "bf16w"  # float32 linear layers on weights stored in bfloat16
PACKED = (ONEDNN, BF16_WEIGHTS)  # the GEMMs that replace the plain weight with their own copy
GEMMS = (PLAIN, WEIGHT_MAJOR, *PACKED)
WEIGHT_MAJOR_MAX_ROWS = 64  # wider calls (prefills) keep F.linear, which is as fast there


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU run oneDNN's reordered-weight linear in ``dtype``: CPU
    builds do in float32; bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which
    ``ONEDNN_MAX_CPU_ISA=AVX2`` hides. Tried once per process on a small weight."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")):
            return False
        weight = torch.ones(8, 16, dtype=dtype)
        return onednn_linear(weight[:2], onednn_reorder(weight, 2)).shape == (2, 8)
    except (AttributeError, RuntimeError):
        return False


def onednn_reorder(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout for calls of about ``rows_hint`` rows (an
    opaque tensor: only onednn_linear and ``to_dense()`` read it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) -> [..., out], with W as onednn_reorder returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class SwitchableLinear(torch.nn.Linear):
    """An nn.Linear whose product runs the GEMM ``gemm`` names: "plain" (F.linear), "wm" (2 ..
    WEIGHT_MAJOR_MAX_ROWS rows as (W @ x^T)^T), "dnnl" (oneDNN on ``packed``, the weight
    reordered) or "bf16w" (bf16_weights.linear on ``packed``, the weight in bfloat16 in the
    kernel's layout). Same parameters, same output shape [..., out_features]."""

    gemm = PLAIN
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm == ONEDNN:
            return onednn_linear(x, self.packed, self.bias)
        if self.gemm == BF16_WEIGHTS:
            return bf16_weights.linear(x, self.packed, self.out_features, self.bias)
        rows = x.numel() // x.shape[-1]
        if self.gemm != WEIGHT_MAJOR or not 1 < rows <= WEIGHT_MAJOR_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def use(self, gemm: str, rows_hint: int, shared: bool) -> None:
        """Switches to ``gemm``. Entering a PACKED GEMM makes its copy of the weight (reordered
        for calls of about ``rows_hint`` rows, or packed in bfloat16) and, unless the weight is
        ``shared`` with another module, frees the plain one; leaving it restores the plain
        weight bitwise (a reorder only moves values; a bfloat16 packing is only made of weights
        that are bfloat16 values)."""
        if self.packed is not None and gemm != self.gemm:
            self.weight.data = self.plain_weight()
            self.packed = None
        if gemm in PACKED and self.packed is None:
            weight = self.weight.detach()
            if gemm == ONEDNN:
                self.packed = onednn_reorder(weight, rows_hint)
            else:
                self.packed = bf16_weights.pack(weight)
            if not shared:
                self.weight.data = weight.new_empty(0)
        self.gemm = gemm

    def plain_weight(self) -> torch.Tensor:
        """The weight [out, in] in the model's dtype, rebuilt from ``packed`` if it was freed."""
        if self.packed is None or self.weight.numel():
            return self.weight.detach()
        if self.gemm == ONEDNN:
            return self.packed.to_dense()
        return bf16_weights.unpack(self.packed, self.out_features, self.in_features)


def set_gemm(model: torch.nn.Module, gemm: str, rows_hint: int = 1) -> None:
    """Runs the model's linear layers on ``gemm`` (one of GEMMS), in place.

    Any gemm but PLAIN first makes every plain nn.Linear a SwitchableLinear (same parameters);
    PLAIN never changes a class, so a model that never switched keeps plain nn.Linear layers (which
    dynamic int8 quantization recognises by type). Quantized and other Linear subclasses are
    left alone. A model in ONEDNN holds reordered weights, which cannot be deep-copied: switch
    back to PLAIN first.

    Args:
        rows_hint: the row count ONEDNN's reorder is tuned for (a target: k_max + 1).
    Raises:
        ValueError: an unknown gemm; ONEDNN in a dtype onednn_available refuses; BF16_WEIGHTS
            where bf16_weights.available() is False, on a model not in float32, or on one with
            a weight that is not all bfloat16 values (its name is given). The model is left as
            it was.
    """
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {list(GEMMS)}, got {gemm!r}")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if gemm == ONEDNN and not onednn_available(dtype):
        raise ValueError(
            f"{ONEDNN} in {dtype}: this torch build or CPU has no oneDNN {dtype} inner product"
        )
    if gemm == BF16_WEIGHTS:
        _check_bf16_weights(model, dtype)
    holders = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for module in model.modules():
        if gemm != PLAIN and type(module) is torch.nn.Linear:
            module.__class__ = SwitchableLinear
        if isinstance(module, SwitchableLinear):
            module.use(gemm, rows_hint, shared=holders[id(module.weight)] > 1)


def _check_bf16_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Raises ValueError unless BF16_WEIGHTS can run ``model`` without changing its output."""
    if dtype != torch.float32:
        raise ValueError(f"{BF16_WEIGHTS} runs a float32 model, this one is {dtype}")
    if not bf16_weights.available():
        raise ValueError(
            f"{BF16_WEIGHTS}: the bfloat16-weight kernel needs an x86-64 CPU with AVX2 and FMA "
            "and a C++ compiler to build it (the log says what failed)"
        )
    for name, module in model.named_modules():
        switched = isinstance(module, SwitchableLinear)
        if switched or type(module) is torch.nn.Linear:
            weight = module.plain_weight() if switched else module.weight.detach()
            if not bf16_weights.representable(weight):
                raise ValueError(
                    f"{BF16_WEIGHTS}: {name}.weight has values that are not bfloat16, so "
                    "storing it in bfloat16 would change the model"
                )
