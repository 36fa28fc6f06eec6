"""Which GEMM a linear layer runs for a few rows: a start-up calibration candidate.

``F.linear`` computes x @ W^T. On CPUs the BLAS picks its code path by the shape, and for a
handful of rows that path is far from flat: one 2-core AVX-512 Xeon's float32 MLP projection of
Qwen2.5-1.5B (8960 x 1536) took 1.2 ms at 1-3 rows, 2.7 ms at 4, 7.0 ms at 13 and 4.3 ms at 16,
while the same product computed weight-major, W @ x^T, took 3.0-3.9 ms at every width from 2 to
16 (its whole MLP: 20 ms against 11 ms at 13 rows). A verify forward is exactly such a handful of
rows, so the target's calibration measures both (specdec.models.calibration, the candidate
``float32+wm``) and keeps the faster one that stays exact: which widths give a row bitwise the
same result is measured with the chosen GEMM, like everything else.

One row (plain decoding, a GEMV either way) and wide calls (a prompt's prefill) always use
F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WEIGHT_MAJOR = "+wm"  # the suffix of a calibration candidate whose linear layers run W @ x^T
WEIGHT_MAJOR_MAX_ROWS = 64  # wider calls (prefills) keep F.linear, which is as fast there


class SwitchableLinear(torch.nn.Linear):
    """An nn.Linear that computes 2 .. WEIGHT_MAJOR_MAX_ROWS rows as (W @ x^T)^T while
    ``weight_major`` is set; same parameters, same output shape [..., out_features]."""

    weight_major = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not self.weight_major or not 1 < rows <= WEIGHT_MAJOR_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def set_weight_major(model: torch.nn.Module, enabled: bool) -> None:
    """Sets ``weight_major`` on the model's linear layers; enabling first makes every plain
    nn.Linear a SwitchableLinear (in place: the same parameters). Disabling never changes a
    class, so a model that never enabled it keeps plain nn.Linear layers (which dynamic int8
    quantization recognises by type). Quantized and other Linear subclasses are left alone."""
    for module in model.modules():
        if enabled and type(module) is torch.nn.Linear:
            module.__class__ = SwitchableLinear
        if isinstance(module, SwitchableLinear):
            module.weight_major = enabled


def split_candidate(candidate: str) -> tuple[str, bool]:
    """("float32", True) for "float32+wm": the dtype and whether the GEMMs are weight-major."""
    if candidate.endswith(WEIGHT_MAJOR):
        return candidate.removesuffix(WEIGHT_MAJOR), True
    return candidate, False
