"""Milliseconds per linear-layer call by rows, for each GEMM path a verify forward could take.

    python -m specdec.bench.gemm_bench                      # Qwen2.5-1.5B's MLP projection
    python -m specdec.bench.gemm_bench --shape 1536x1536 --rows 1,2,13

A verify forward runs every linear layer on k + 1 rows. How the cost grows with the rows decides
what speculation can gain on a device, and on CPUs it depends on the path far more than on the
arithmetic: this prints, per row count, the float32 (or --dtype) call of

- ``F.linear``: what transformers runs (MKL's sgemm on a CPU);
- ``weight-major``: (W @ x^T)^T, the calibration's GEMM ``wm`` (specdec.device.gemm);
- ``onednn-packed``: oneDNN's inner product on a weight reordered once for the call's row count
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what inductor's CPU
  freezing emits), skipped where this torch build lacks the ops;
- ``bf16-weights``: float32 arithmetic on the weight stored in bfloat16 (the GEMM ``bf16w``,
  specdec.device.bf16_weights), for a float32 weight where that kernel is available.

and whether each path's rows equal F.linear's bitwise. The weights are bfloat16 values (as in a
bundled checkpoint), and ``--layers`` distinct ones are called in turn, so that, as in a forward,
they come from memory rather than from a cache that holds one layer. The header names the CPU
(model, ISA flags, torch's kernel level, threads). A benchmark, never a test: nothing here
asserts a time.

    python -m specdec.bench.gemm_bench --shape 8960x1536 --rows 1,4,8,17 --layers 28
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec.device import bf16_weights
from specdec.device.gemm import onednn_available, onednn_linear, onednn_reorder
from specdec.device.hardware import describe_device
from specdec.tools.args import run_standalone

DEFAULT_SHAPE = "8960x1536"  # Qwen2.5-1.5B's MLP up/gate projection: out x in features
DEFAULT_ROWS = "1,2,3,4,8,13,16,32"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m specdec.bench.gemm_bench`."""
    parser.add_argument("--shape", default=DEFAULT_SHAPE, help="OUTxIN features of the weight")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated row counts")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="dtype of the weights and the input",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell")
    parser.add_argument(
        "--layers", type=int, default=8, help="distinct weights called in turn (one per call)"
    )


def time_ms(fn: Callable[[int], torch.Tensor], repeats: int, layers: int) -> float:
    """Mean milliseconds of ``fn(i)`` over ``repeats`` calls, i cycling over ``layers``, after
    a warm-up call per layer."""
    for i in range(layers):
        fn(i)
    start = time.perf_counter()
    for call in range(repeats):
        fn(call % layers)
    return (time.perf_counter() - start) / repeats * 1e3


def paths(weights: list[torch.Tensor], x: torch.Tensor) -> dict[str, Callable[[int], torch.Tensor]]:
    """{path name: a call computing x @ weights[i]^T, shape [rows, out], given i} for one row
    count."""
    calls = {
        "F.linear": lambda i: F.linear(x, weights[i]),
        "weight-major": lambda i: torch.mm(weights[i], x.t()).t(),
    }
    if onednn_available(x.dtype):
        packed = [onednn_reorder(w, x.shape[0]) for w in weights]
        calls["onednn-packed"] = lambda i: onednn_linear(x, packed[i])
    if x.dtype == torch.float32 and bf16_weights.available():
        halves = [bf16_weights.pack(w) for w in weights]
        out_features = weights[0].shape[0]
        calls["bf16-weights"] = lambda i: bf16_weights.linear(x, halves[i], out_features)
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
    shape = (out_features, in_features)
    weights = [
        (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16).to(dtype)
        for _ in range(args.layers)
    ]
    print(f"# {describe_device('cpu')}; torch {torch.__version__}")
    print(
        f"# {args.dtype} weights {out_features} x {in_features}, {args.layers} in turn; ms per "
        f"call, mean of {args.repeats}; '=' marks rows bitwise equal to F.linear's"
    )
    header = None
    for count in rows:
        x = torch.randn(count, in_features, generator=generator).to(dtype)
        calls = paths(weights, x)
        if header is None:
            header = list(calls)
            print(f"{'rows':>5} " + " ".join(f"{name:>15}" for name in header))
        reference = calls["F.linear"](0)
        cells = []
        for name in header:
            same = "=" if torch.equal(calls[name](0), reference) else " "
            cells.append(f"{time_ms(calls[name], args.repeats, args.layers):14.2f}{same}")
        print(f"{count:>5} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    run_standalone(add_cli_args, main, description=__doc__.splitlines()[0])
