"""float32 arithmetic on bfloat16-stored weights: the kernel of the "+bf16w" GEMM.

A one-row linear layer on a CPU is bound by reading its weight, and a verify of a few rows is
still close to that; float32 weights cost twice bfloat16's bytes, while bfloat16 arithmetic
rounds every activation and, without AVX-512 BF16 or AMX, is emulated and compute-bound from
two rows on (a 13-row bfloat16 forward of the bundled target cost ten times a one-row one on
the 2-core AVX2 EPYC). This kernel (csrc/bf16_weights.cpp) reads bfloat16 weights, widens
them exactly and multiplies in float32, so on a model whose checkpoint is bfloat16 (every
bundled model: they are stored in bfloat16 and float32 is an exact upcast) it computes the
float32 model at half the weight bytes. Each output element is one dot product in a fixed
order whatever the call's row count, so every width rounds a row the same way.

The weight is packed once (pack()): pairs of output rows interleaved in 16-value chunks, so each
thread reads one sequential stream, and each pass over a pair widens its weights once for up to
4 activation rows.

Measured on the 2-core AVX-512 BF16 EPYC emulating the AVX2-only one (``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 python -m specdec.bench.gemm_bench --shape 8960x1536 --rows
1,2,3,4,5,8,17 --layers 28``, then ``--shape 1536x8960``: 28 distinct weights in turn, so they
come from memory), milliseconds per call at 1 / 2 / 4 / 8 / 17 rows of Qwen2.5-1.5B's MLP
projections, 8960 x 1536 and 1536 x 8960: this kernel 0.57 / 0.57 / 0.57 / 1.07 / 2.38 and 0.43
/ 0.46 / 0.64 / 1.07 / 2.46; oneDNN float32 on reordered weights (``float32+dnnl``) 1.26 / 1.46
/ 1.58 / 1.51 / 2.38 and 0.93 / 1.06 / 1.54 / 1.78 / 2.69. Before packing (four separate weight
rows per tile) the kernel took 0.66 / 0.80 at 1 / 4 rows of the first. The host's memory
bandwidth moves by up to 1.8x from minute to minute, so compare columns of one run. bfloat16
``F.linear`` (timed apart) took 0.52-0.70 at one row but 1.8-2.1 at 4 and 7.3-8.3 at 17.

From 33 rows (a prefill) the kernel goes over panels of blocks that stay in cache while every
row passes, instead of block by block (csrc/bf16_weights.cpp, kPanelMinRows): the arithmetic of
every output is unchanged, bit for bit, and a 700-token prefill of the bundled target in
``float32+bf16w`` took 21-25 s instead of 30-43 s on the 2-core AVX2-only EPYC (three forwards
each in two processes per kernel, alternating).

The extension is compiled on first use (torch.utils.cpp_extension: a C++ compiler and ninja,
15-50 s on 2 cores) into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)
under a name that includes a hash of the source and the torch version; later processes load
the built library directly. ``python -m specdec.device.bf16_weights`` builds it ahead (``make
install`` does).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "bf16_weights.cpp"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
CHUNK = 16  # k values per step of the kernel's inner loop
PAIR = 2  # output rows per packed block


def library_name() -> str:
    """The extension's name: specdec_bf16w_ and a hash of the source, the torch version and
    the compiler flags, so that a changed kernel is built (and measured) anew."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__} {CFLAGS}".encode())
    return f"specdec_bf16w_{digest.hexdigest()[:12]}"


def _build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
    return Path(root).expanduser() / name


@functools.cache
def load() -> None:
    """Registers torch.ops.specdec.linear_bf16w, building the extension if this source and torch
    version have no built library yet.

    Raises:
        RuntimeError, OSError, ImportError: the build failed (no compiler, no ninja) or the
            library would not load; the message says which.
    """
    name = library_name()
    library = _build_dir(name) / f"{name}.so"
    if library.exists():
        # Loading the built file directly skips cpp_extension's build lock, which a process
        # killed while holding it would leave behind for every later one to wait on.
        torch.ops.load_library(str(library))
        return
    from torch.utils import cpp_extension

    start = time.perf_counter()
    log.info("building the bfloat16-weight kernel %s (once per source and torch version)", name)
    library.parent.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(library.parent),
        is_python_module=False,
        verbose=False,
    )
    log.info("built %s in %.1f s", library, time.perf_counter() - start)


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: an x86-64 CPU with AVX2 and FMA (whatever
    ``ATEN_CPU_CAPABILITY`` says: the kernel is its own code) and an extension that builds and
    loads. Checked once per process; a failure is logged with its reason."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        load()
    except (RuntimeError, OSError, ImportError) as err:
        log.warning("bfloat16-weight kernel unavailable: %s", err)
        return False
    return bool(torch.ops.specdec.bf16w_cpu_supported())


def representable(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 ``weight`` is a bfloat16, so that storing it in
    bfloat16 loses nothing."""
    return torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``weight`` [out, in] (bfloat16 values): a bfloat16 tensor
    [ceil(out / 2), ceil(in / 16), 2, 16] holding each pair of output rows as one stream of
    16-value chunks, zero-padded (the padding adds exact zeros to every sum, whatever the
    width). Lossless for a weight of bfloat16 values (representable)."""
    out_features, in_features = weight.shape
    padded = torch.nn.functional.pad(
        weight.detach().to(torch.bfloat16),
        (0, -in_features % CHUNK, 0, out_features % PAIR),
    )
    rows, cols = padded.shape
    return padded.reshape(rows // PAIR, PAIR, cols // CHUNK, CHUNK).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight [out_features, in_features] in float32 that pack() packed."""
    blocks, chunks = packed.shape[:2]
    plain = packed.transpose(1, 2).reshape(blocks * PAIR, chunks * CHUNK)
    return plain[:out_features, :in_features].float().contiguous()


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] (float32) @ weight^T (+ bias) -> [..., out_features] (float32), with the
    weight [out_features, in] given as pack(weight) and ``bias`` [out_features] in float32;
    every row of x gives bitwise the same result whatever the row count. load() must have
    succeeded (available()).

    Raises:
        RuntimeError: operands of the wrong dtype, a weight not from pack(), or sizes that do
            not match (the message names which).
    """
    return torch.ops.specdec.linear_bf16w(x, packed, out_features, bias)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if available() else 1)
