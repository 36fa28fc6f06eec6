"""Milliseconds per linear-layer call by rows, for each GEMM path a verify forward could take.

    python -m specdec.tools.gemm_bench                      # Qwen2.5-1.5B's MLP projection
    python -m specdec.tools.gemm_bench --shape 1536x1536 --rows 1,2,13

A verify forward runs every linear layer on k + 1 rows. How the cost grows with the rows decides
what speculation can gain on a device, and on CPUs it depends on the path far more than on the
arithmetic: this prints, per row count, the float32 (or --dtype) call of

- ``F.linear``: what transformers runs (MKL's sgemm on a CPU);
- ``weight-major``: (W @ x^T)^T, the calibration candidate ``float32+wm`` (specdec.models.gemm);
- ``onednn-packed``: oneDNN's inner product on a weight reordered once for the call's row count
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what inductor's CPU
  freezing emits), skipped where this torch build lacks the ops.

and whether each path's rows equal F.linear's bitwise. The header names the CPU (model, ISA
flags, torch's kernel level, threads). A benchmark, never a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec.models.device import describe_device
from specdec.models.gemm import onednn_available, onednn_linear, onednn_reorder
from specdec.tools.args import run_standalone

DEFAULT_SHAPE = "8960x1536"  # Qwen2.5-1.5B's MLP up/gate projection: out x in features
DEFAULT_ROWS = "1,2,3,4,8,13,16,32"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m specdec.tools.gemm_bench`."""
    parser.add_argument("--shape", default=DEFAULT_SHAPE, help="OUTxIN features of the weight")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated row counts")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell")


def time_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Mean milliseconds of ``fn()`` over ``repeats`` calls, after two warm-up calls."""
    fn(), fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def paths(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """{path name: a call computing x @ weight^T, shape [rows, out]} for one row count."""
    calls = {
        "F.linear": lambda: F.linear(x, weight),
        "weight-major": lambda: torch.mm(weight, x.t()).t(),
    }
    if onednn_available():
        packed = onednn_reorder(weight, x.shape[0])
        calls["onednn-packed"] = lambda: onednn_linear(x, packed)
    return calls


def main(args: argparse.Namespace) -> int:
    """Prints the table (module docstring); returns 0.

    Raises:
        ValueError: a malformed --shape or --rows.
    """
    out_features, in_features = (int(n) for n in args.shape.lower().split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)
    print(f"# {describe_device('cpu')}; torch {torch.__version__}")
    print(
        f"# {args.dtype} weight {out_features} x {in_features}; ms per call, mean of "
        f"{args.repeats}; '=' marks rows bitwise equal to F.linear's"
    )
    header = None
    for count in rows:
        x = torch.randn(count, in_features, generator=generator).to(dtype)
        calls = paths(weight, x)
        if header is None:
            header = list(calls)
            print(f"{'rows':>5} " + " ".join(f"{name:>15}" for name in header))
        reference = calls["F.linear"]()
        cells = []
        for name in header:
            same = "=" if torch.equal(calls[name](), reference) else " "
            cells.append(f"{time_ms(calls[name], args.repeats):14.2f}{same}")
        print(f"{count:>5} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    run_standalone(add_cli_args, main, description=__doc__.splitlines()[0])
