"""Target forwards whose numerics do not depend on k: the reason greedy output stays exact in
bfloat16.

Speculative decoding is exact only if the target's logits at a position are the same whether
that position is scored alone (target-only decoding) or inside a verify forward with k draft
tokens. In exact arithmetic they are; in floating point, kernels round differently for
different shapes, and in bfloat16 the logits are coarse (1/8 apart near 20), so the top two
tokens often tie or nearly tie and the argmax at a position could follow k. Measured on the
bundled Qwen pair: 2 of 12 HumanEval prompts diverged from target-only within 10 tokens.

Two things make every decode-time position see exactly the same arithmetic:

1. Fixed width (TargetVerifier): every decode forward runs the same number of positions,
   k_max + 1, real ones first, so each matmul has one shape and a row's result depends on that
   row alone.
2. Row-wise attention (this module): inside such a forward, position j attends to exactly its
   own causal prefix, as a single-query attention over keys [0, p_j], which is precisely the
   computation a lone position gets. A causal mask over a shared key block would instead give
   each row a different key length, and kernels tile the softmax and the value reduction by
   that length.

On CPUs with AMX (and on GPUs) a forward over 9 positions costs about what 1 costs, so this is
nearly free there; the per-row attention adds 28 x 9 small calls per forward (a few ms).

3. A measured width (calibrate_fixed_width): one shape is not enough when a kernel computes a
   row differently depending on where it sits in the call. On a 2-core AVX-512 CPU without
   bfloat16 hardware, the tiny test target's bfloat16 lm_head computed row 4 of a 9-row call
   unlike row 0 (OpenMP splits the rows between the two threads), while widths 10 to 14 were
   position-invariant. So the verifier measures, at start-up and on its own device and thread
   count, the smallest width >= k_max + 1 at which a position's logits are the same in every row
   of the call, and pads to it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ROW_WISE_ATTENTION = "specdec_row_wise_sdpa"
CALIBRATION_PREFIX_TOKENS = 16  # cache length the calibration forwards extend
log = logging.getLogger(__name__)


def row_wise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention computed one query position at a time when the forward
    extends a cache by a few positions; plain SDPA otherwise (a prefill or a rebuild, whose
    queries start at key 0 and whose single forward is the same whatever k is).

    Args:
        query: [1, heads, q_len, head_dim], the forward's new positions, in order.
        key, value: [1, kv_heads, kv_len, head_dim], the cache followed by the new positions.
        attention_mask: the model's mask; unused for row-wise rows, whose causal prefix is
            their whole key slice (batch size 1, no padding inside the sequence).
    Returns:
        ([1, q_len, heads, head_dim] attention output, None), as transformers expects.
    Raises:
        ValueError: a batch larger than 1 (the engine runs one session per forward).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or kv_len == q_len:  # one position, or no cache before the new positions
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(
            f"row-wise attention runs one sequence at a time, got a batch of {query.shape[0]}"
        )
    kwargs.pop("is_causal", None)
    rows = []
    for j in range(q_len):
        end = kv_len - (q_len - 1 - j)  # keys [0, end) are position j's causal prefix
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, j : j + 1],
            key[:, :, :end],
            value[:, :, :end],
            None,
            is_causal=False,
            **kwargs,
        )
        rows.append(out)
    return torch.cat(rows, dim=1), None


AttentionInterface.register(ROW_WISE_ATTENTION, row_wise_attention)


def use_row_wise_attention(model: torch.nn.Module) -> None:
    """Switches a loaded transformers model to row_wise_attention, in place."""
    model.set_attn_implementation(ROW_WISE_ATTENTION)


@dataclasses.dataclass(frozen=True)
class WidthCalibration:
    """What calibrate_fixed_width measured.

    Attributes:
        width: the chosen fixed width (positions per decode forward).
        invariant: whether ``width`` passed; False means no candidate did and ``width`` is the
            smallest candidate (greedy output may then depend on k on this device).
        tried: {width: passed} for every candidate measured, in order.
        seconds: wall time of the measurement.
    """

    width: int
    invariant: bool
    tried: dict[int, bool]
    seconds: float


def calibrate_fixed_width(
    model: torch.nn.Module,
    vocab_size: int,
    min_width: int,
    *,
    max_extra: int = 8,
    time_budget_s: float = 1.0,
    max_trials: int = 4096,
    seed: int = 0,
) -> WidthCalibration:
    """The smallest fixed width >= ``min_width`` whose decode forwards are position-invariant on
    this device: a token's logits are bitwise the same whatever row of the call it occupies, so
    a verify with k = width - 1 and target-only decoding padded to ``width`` agree.

    Two measurements per candidate width, both on this process's device and thread count:

    - every distinct linear layer (the GEMMs, where kernels split rows between threads and
      handle tail rows apart) is called on random rows and on the same rows permuted, until
      ``time_budget_s`` seconds or ``max_trials`` trials (at least one); a rounding difference
      flips a bfloat16 output in about one element in 10^4, so small layers need thousands of
      trials and a real vocabulary's lm_head fails at once;
    - one whole forward of ``width`` real tokens against the same tokens fed one per forward,
      each padded to ``width`` (attention, norms and the cache included).

    Args:
        model: a causal LM using row_wise_attention, on its device, in its serving dtype.
        vocab_size: tokens the whole-forward check may draw (the tokenizer's size).
        min_width: the smallest width allowed, k_max + 1.
        max_extra: candidates are min_width .. min_width + max_extra.
    Returns:
        WidthCalibration; its width is min_width when no candidate passes (logged as a warning).
    """
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    tried: dict[int, bool] = {}
    for width in range(min_width, min_width + max_extra + 1):
        tried[width] = _linears_invariant(
            model, width, generator, time_budget_s, max_trials
        ) and _forward_invariant(model, vocab_size, width, generator)
        if tried[width]:
            break
    invariant = any(tried.values())
    chosen = width if invariant else min_width
    result = WidthCalibration(chosen, invariant, tried, time.perf_counter() - start)
    if not invariant:
        log.warning("no position-invariant width in %s: greedy output may depend on k", tried)
    log.info("fixed width %d (measured %s in %.1f s)", chosen, tried, result.seconds)
    return result


@torch.inference_mode()
def _linears_invariant(
    model: torch.nn.Module,
    width: int,
    generator: torch.Generator,
    time_budget_s: float,
    max_trials: int,
) -> bool:
    layers: dict[tuple, torch.nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            layers.setdefault((tuple(module.weight.shape), module.weight.dtype), module)
    deadline = time.perf_counter() + time_budget_s
    for trial in range(max_trials):
        if trial and time.perf_counter() > deadline:
            break
        for layer in layers.values():
            weight = layer.weight
            rows = torch.randn(1, width, weight.shape[1], generator=generator)
            rows = rows.to(dtype=weight.dtype, device=weight.device)
            order = torch.randperm(width, generator=generator).to(weight.device)
            if not torch.equal(layer(rows)[:, order], layer(rows[:, order])):
                return False
    return True


@torch.inference_mode()
def _forward_invariant(
    model: torch.nn.Module, vocab_size: int, width: int, generator: torch.Generator
) -> bool:
    device = model.device
    prefix = torch.randint(vocab_size, (1, CALIBRATION_PREFIX_TOKENS), generator=generator)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix.to(device), cache=cache, use_cache=True, logits_to_keep=1)
    block = torch.randint(vocab_size, (width,), generator=generator).to(device)
    together = _logits(model, cache, block)
    for j in range(width):
        padded = block[j].repeat(width)  # the real token, then copies of it as padding
        _crop_to(cache, CALIBRATION_PREFIX_TOKENS + j)
        alone = _logits(model, cache, padded)[0]
        _crop_to(cache, CALIBRATION_PREFIX_TOKENS + j + 1)
        if not torch.equal(alone, together[j]):
            return False
    return True


def _logits(model: torch.nn.Module, cache: DynamicCache, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids), vocab] logits of one forward extending ``cache`` by ``ids``."""
    out = model(input_ids=ids[None], cache=cache, use_cache=True, logits_to_keep=len(ids))
    return out.logits[0]


def _crop_to(cache: DynamicCache, length: int) -> None:
    """Keeps the first ``length`` positions (transformers crops by a negative count)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)
