"""Target forwards whose numerics do not depend on k: the reason greedy output stays exact in
bfloat16.

Speculative decoding is exact only if the target's logits at a position are the same whether
that position is scored alone (target-only decoding) or inside a verify forward with k draft
tokens. In exact arithmetic they are; in floating point, kernels round differently for
different shapes, and in bfloat16 the logits are coarse (1/8 apart near 20), so the top two
tokens often tie or nearly tie and the argmax at a position could follow k. Measured on the
bundled Qwen pair: 2 of 12 HumanEval prompts diverged from target-only within 10 tokens.

Three things make every decode-time position see exactly the same arithmetic, in any dtype:

1. Exact widths (measure_exact_width_sets, chosen by specdec.device.calibration): a GEMM kernel
   picks its code path by the number of rows, so a row's result can depend on how many rows
   share the call (one 2-core AVX-512 CPU's float32 GEMM rounds a 1-row call one way, 2-15 rows
   another, 16 or more a third) and even on where the row sits (the tiny test target's
   bfloat16 lm_head computed the middle row of odd-width calls apart, OpenMP splitting the rows
   between two threads). The replica measures which widths agree bitwise and the verifier pads
   every decode forward to one of them, real rows first and copies of the last one after.
2. Row-wise attention (this module): inside such a forward, position j attends to exactly its
   own causal prefix, as a single-query attention over keys [0, p_j], which is precisely the
   computation a lone position gets. A causal mask over a shared key block would instead give
   each row a different key length, and kernels tile the softmax and the value reduction by
   that length.
3. Replayed rebuilds (TargetVerifier): a session rebuilt from its token ids runs the prompt as
   the prefill forwards it was (one, or its chunks: SessionModel.prefill_chunks), then the rest
   in exact widths, so its cache is bitwise the uninterrupted session's. A prompt's rows only
   ever run in those same forwards, so they need no row-wise attention: a chunk that extends
   the cache runs one masked SDPA call (prompt_attention), as the first chunk does.

On CPUs with AMX (and on GPUs) a forward over 13 positions costs about what 1 costs, so the
padding is nearly free there; the per-row attention adds 28 x 13 small calls per forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ROW_WISE_ATTENTION = "specdec_row_wise_sdpa"
CALIBRATION_PREFIX_TOKENS = 16  # cache length the calibration forwards extend
_PROMPT_ROWS = contextvars.ContextVar("specdec_prompt_rows", default=False)
# How often one layer shape computed by another GEMM path in bfloat16 changes a row's logits,
# per use of the shape, output feature and square root of in_features (the accumulator's
# rounding error grows with it). Measured on an AVX-512 BF16 EPYC with the bundled target: its
# 56 (256, 1536) layers computed row by row in 3-row forwards changed 21 of 30 3-row pieces'
# logits, 0.40 per row, 7.1e-7 per unit; random rows through single layers, 1-row against
# 2-row calls, gave 3-4e-6 (bundled) and 1.5-8e-6 (tiny target), before the logits absorb some.
HALF_PRECISION_SPLIT_RATE = 5e-7
HALF_PRECISION_MISMATCHES = 10.0  # expected differences a split set must show: misses e^-10


def row_wise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention computed one query position at a time, unmasked, whenever
    the forward extends a cache (a lone position too: SDPA given a mask may take another kernel
    than SDPA given none); plain SDPA for a prefill, whose queries start at key 0 and whose
    single forward is the same whatever k is.

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
    if kv_len == q_len:  # a prefill: no cache before the new positions
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _PROMPT_ROWS.get():  # a later chunk of a prefill (prompt_attention)
        # Bottom-right causal: row j sees the cache and the chunk's rows up to j. The model
        # passes no mask here, and SDPA's is_causal would align the triangle top-left.
        kwargs.pop("is_causal", None)
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
        causal = causal.tril(kv_len - q_len)[None, None]
        return sdpa_attention_forward(module, query, key, value, causal, is_causal=False, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(
            f"row-wise attention runs one sequence at a time, got a batch of {query.shape[0]}"
        )
    kwargs.pop("is_causal", None)
    rows = []
    for j in range(q_len):
        end = kv_len - (q_len - 1 - j)  # keys [0, end) are position j's causal prefix
        # Contiguous copies: the kernel's reduction rounds by the memory layout too, and a
        # prefix view of a longer block is laid out unlike the same keys at the end of a call.
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, j : j + 1].contiguous(),
            key[:, :, :end].contiguous(),
            value[:, :, :end].contiguous(),
            None,
            is_causal=False,
            **kwargs,
        )
        rows.append(out)
    return torch.cat(rows, dim=1), None


AttentionInterface.register(ROW_WISE_ATTENTION, row_wise_attention)


@contextlib.contextmanager
def prompt_attention() -> Iterator[None]:
    """Within it (on this thread), row_wise_attention runs a forward that extends a cache as
    one SDPA call under the model's causal mask, as it runs a prefill: for the later chunks of
    a chunked prefill, whose prompt rows always run in the same forwards (so their results
    need not match a lone row's), and where a loop over hundreds of rows, each copying its key
    prefix, cost 3x the whole prompt's prefill (1,024 tokens of the bundled target on a 2-core
    EPYC: 30.7 s in two chunks against 10.7 s in one)."""
    token = _PROMPT_ROWS.set(True)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def use_row_wise_attention(model: torch.nn.Module) -> None:
    """Switches a loaded transformers model to row_wise_attention, in place."""
    model.set_attn_implementation(ROW_WISE_ATTENTION)


def measure_exact_width_sets(
    model: torch.nn.Module,
    max_width: int,
    *,
    generator: torch.Generator,
    elements: int = 500_000,
    max_trials: int = 2048,
    widths: Sequence[int] | None = None,
) -> list[list[int]]:
    """Groups the widths 1 .. max_width (or only ``widths``) by the bitwise result their
    forwards give a row.

    Every distinct linear layer (the GEMMs, where kernels pick a code path by the number of rows
    and split rows between threads) is called on the same random rows at every width; two
    widths share an exact-width set when every row they share came out bitwise equal, in every
    trial. A width whose rows also change when the rows are permuted within the call (a row's
    result depends on where it sits) belongs to no set. Each layer gets enough trials to compare
    about ``elements`` outputs per width (at most ``max_trials``, at least one): a rounding
    difference flips a bfloat16 output in about one element in 10^4, so a small layer needs
    thousands of trials while a real vocabulary's lm_head shows it in one. The count is fixed
    by sizes, not by time, so a busy machine measures as much as an idle one.

    Args:
        model: a causal LM in its serving dtype, on its device.
        max_width: the widest forward measured, in positions.
        generator: the source of the random rows.
    Returns:
        Exact-width sets as ascending lists of widths, in order of their smallest width.
    """
    layers: dict[tuple, torch.nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            # By features, not weight.shape: a "+dnnl" layer's plain weight may be freed.
            key = (module.out_features, module.in_features, module.weight.dtype)
            layers.setdefault(key, module)
    widths = sorted(widths) if widths is not None else range(1, max_width + 1)
    max_width = max(widths)
    same = {(a, b): True for a in widths for b in widths if a < b}
    invariant = dict.fromkeys(widths, True)
    for layer in layers.values():
        trials = min(max_trials, max(1, -(-elements // (layer.out_features * max_width))))
        for _ in range(trials):
            _compare_widths(layer, widths, generator, same, invariant)
    sets: list[list[int]] = []
    for width in (w for w in widths if invariant[w]):
        home = next((s for s in sets if all(same[(m, width)] for m in s)), None)
        if home is None:
            sets.append([width])
        else:
            home.append(width)
    return sets


@torch.inference_mode()
def _compare_widths(
    layer: torch.nn.Linear,
    widths: Sequence[int],
    generator: torch.Generator,
    same: dict[tuple[int, int], bool],
    invariant: dict[int, bool],
) -> None:
    """One trial of measure_exact_width_sets on one layer; clears the flags it disproves."""
    weight = layer.weight
    rows = torch.randn(1, max(widths), layer.in_features, generator=generator)
    rows = rows.to(dtype=weight.dtype, device=weight.device)
    outputs = {}
    for width in widths:
        outputs[width] = layer(rows[:, :width])
        if invariant[width] and width > 1:
            order = torch.randperm(width, generator=generator).to(weight.device)
            moved = layer(rows[:, :width][:, order])
            invariant[width] = torch.equal(outputs[width][:, order], moved)
    for (a, b), still in same.items():
        if still:
            same[(a, b)] = torch.equal(outputs[a], outputs[b][:, :a])


@torch.inference_mode()
def whole_forward_exact(
    model: torch.nn.Module,
    vocab_size: int,
    widths: tuple[int, ...],
    generator: torch.Generator,
    *,
    elements: int = 200_000,
    max_trials: int = 64,
    rows_per_width: int = 0,
) -> bool:
    """Whether whole forwards (attention, norms and the cache included) agree across
    ``widths``: a block of max(widths) random tokens in one forward against the same tokens fed
    in random-length pieces, each padded to the smallest width of ``widths`` that holds it with
    copies of its last token, the padding cropped from the cache as the verifier does (one
    width alone: each token on its own, padded); every logit compared bitwise. Repeats with new
    blocks and splits until about ``elements`` logits were compared (at most ``max_trials``,
    at least one trial).

    Trial t's first piece is exactly the t-th narrower width of the set (cycling, smallest
    first), so even a single trial compares the smallest width with the widest: a random split
    of a (1, 2) set into one 2-token piece compared nothing (the bundled bfloat16 target
    passed that way on an AVX-512 BF16 EPYC, where its 1-row forward differs).

    Then, with ``rows_per_width``, every narrower width w compares at least that many rows
    computed in forwards of w rows: blocks cut into pieces of w tokens (half_precision_rows
    sizes it, since a half-precision set split shows in few outputs).
    """
    device = model.device
    prefix = torch.randint(vocab_size, (1, CALIBRATION_PREFIX_TOKENS), generator=generator)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix.to(device), cache=cache, use_cache=True, logits_to_keep=1)
    widest, narrower = max(widths), sorted(widths)[:-1]

    def block() -> torch.Tensor:
        return torch.randint(vocab_size, (widest,), generator=generator).to(device)

    for trial in range(min(max_trials, max(1, -(-elements // (vocab_size * widest))))):

        def random_piece(start: int, trial: int = trial) -> int:
            # A random split, so rows move to other places and other widths of the set.
            real = int(torch.randint(1, widest - start + 1, (1,), generator=generator))
            if start == 0 and narrower:
                real = narrower[trial % len(narrower)]
            return 1 if len(widths) == 1 else real  # one width: each token alone, padded

        if not _split_agrees(model, cache, block(), widths, random_piece):
            return False
    for width in narrower:
        for _ in range(-(-rows_per_width // (width * (widest // width)))):
            if not _split_agrees(
                model, cache, block(), widths, lambda start, w=width: min(w, widest - start)
            ):
                return False
    return True


def half_precision_rows(
    model: torch.nn.Module, mismatches: float = HALF_PRECISION_MISMATCHES
) -> int:
    """Rows each narrower width of a half-precision exact-width set must compute in
    whole_forward_exact (rows_per_width) for a set that two GEMM paths split to show, on
    average, ``mismatches`` differing outputs in the linear layer least likely to show one (a
    split in that layer alone would then go unseen with probability about exp(-mismatches)).

    A half-precision output keeps 8 (bfloat16) or 11 (float16) bits of the float32
    accumulator, so two paths whose accumulators differ in the last float32 bits give different
    outputs only near a rounding boundary, and a row's logits change with probability about
    1 - exp(-HALF_PRECISION_SPLIT_RATE x uses x out_features x sqrt(in_features)). The tiny
    test target would need tens of thousands of rows (its layers have 16 to 64 outputs and 32
    or 64 inputs); the bundled Qwen2.5 1.5B target needs 36.
    """
    shapes = Counter(
        (module.out_features, module.in_features)
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
    )
    per_row = min(
        uses * outputs * HALF_PRECISION_SPLIT_RATE * math.sqrt(inputs)
        for (outputs, inputs), uses in shapes.items()
    )
    return math.ceil(mismatches / per_row)


def _split_agrees(
    model: torch.nn.Module,
    cache: DynamicCache,
    block: torch.Tensor,
    widths: tuple[int, ...],
    piece: Callable[[int], int],
) -> bool:
    """Whether ``block`` ([n] token ids, extending ``cache``'s calibration prefix) gets bitwise
    the same logits in one forward as in consecutive pieces of piece(start) tokens, each padded
    to the narrowest of ``widths`` that holds it. Leaves ``cache`` at the prefix when it does."""
    together = _logits(model, cache, block)
    _crop_to(cache, CALIBRATION_PREFIX_TOKENS)
    start = 0
    while start < len(block):
        real = piece(start)
        width = min(w for w in widths if w >= real)
        chunk = block[start : start + real]
        padded = torch.cat([chunk, chunk[-1:].repeat(width - real)])
        apart = _logits(model, cache, padded)[:real]
        _crop_to(cache, CALIBRATION_PREFIX_TOKENS + start + real)
        if not torch.equal(apart, together[start : start + real]):
            return False
        start += real
    _crop_to(cache, CALIBRATION_PREFIX_TOKENS)
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
