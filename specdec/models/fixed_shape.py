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
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ROW_WISE_ATTENTION = "specdec_row_wise_sdpa"


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
