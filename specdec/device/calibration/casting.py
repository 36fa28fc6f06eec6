"""A loaded model (float32 on a CPU, bfloat16 on a GPU: load.load_dtype) cast to each
candidate's dtype without a second copy in the loaded dtype, and the memory the losing
candidates held handed back to the OS."""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import gc

import torch

from specdec.models.loading import DTYPES, INT8, quantize_int8


def cast_model(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """A copy of ``model`` in ``dtype`` (int8: dynamically quantized, from a float32 model on a
    CPU): its floating parameters cast (float32, bfloat16, float16) or shared with ``model``
    (int8: quantization reads the float weights and packs its own), never a second set of
    weights in the model's own dtype; ``model`` itself where ``dtype`` is already its
    parameters' dtype.

    Buffers keep their loaded dtype, as transformers' ``from_pretrained(dtype=...)`` leaves
    them: ``Module.to`` would also round the rotary embedding's float32 ``inv_freq`` to
    bfloat16, which moved the bundled target's frequencies by up to 0.14% (0.80584 to 0.80469),
    a rotation error that grows with the position, and its bfloat16 log-probabilities by up to
    0.05 nats from transformers' own bfloat16 model (found by tests/reference_decoder.py).

    Measured need for the per-tensor cast: the bundled target's bfloat16 candidate peaked at 2x
    its float32 size (12.4 GB) through a whole-model deepcopy, and Ray's memory monitor killed
    the local cluster's Serve controller on a 24 GiB machine; now it peaks at 1.5x."""
    if dtype in DTYPES and DTYPES[dtype] == _parameter_dtype(model):
        return model
    quantize = dtype == INT8
    memo: dict[int, torch.Tensor] = {}
    for tensor in model.parameters():
        if tensor.is_floating_point():
            memo[id(tensor)] = tensor if quantize else _converted(tensor, DTYPES[dtype])
    copied = copy.deepcopy(model, memo)
    if quantize:
        quantize_int8(copied)
    return copied


def _parameter_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of ``model``'s first floating parameter (None without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``; a Parameter stays a Parameter (as Module.to leaves it)."""
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(tensor.detach().to(dtype), requires_grad=tensor.requires_grad)
    return tensor.to(dtype)


def return_freed_memory() -> None:
    """Hands the heap the losing candidates freed back to the OS (glibc's malloc_trim; a no-op
    elsewhere). glibc keeps freed chunks under its mmap threshold, which grows to 32 MiB as
    big tensors come and go, so a replica kept its calibration peak: measured on the bundled
    pair, the draft replica held 5.1 GB after choosing int8 and 1.6 GB after the trim, the
    target 8.5 GB and 7.5 GB; without it the bench's in-process baseline no longer fit beside
    the local cluster on a 24 GiB machine."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    gc.collect()
    trim(0)
