"""The static runner's forward: a batch of sessions, each a fixed number of positions, over
their KV slots, in shapes that depend only on the batch bucket, the width and the key length.

A forward takes ``input_ids`` and ``positions`` of shape [B, W] and ``slot_ids`` [B]. Each
layer's new keys and values are written into the sessions' slots at their positions
(index_put_, in place), then every row attends over the first ``key_len`` positions of its slot
under a mask that lets position p see keys 0..p: one masked SDPA call per layer for the whole
batch, instead of the dynamic runner's per-row calls (specdec.device.exact_widths). Nothing
inside reads a tensor on the host, so the same code runs eagerly, under
``torch.compile(fullgraph=True)`` and inside a CUDA graph (specdec.worker.static.graphs).

Grouped-query attention folds the query heads of each key/value head into extra query rows
([B, kv_heads, group x W, head_dim]), so the keys and values are never repeated per head.

The greedy outcome of a verify (greedy_outcome) and the draft's next token (draft_next) are
computed here too, on the device: a verify returns [B, W] token ids and log-probabilities and
[B] accepted counts, a draft step [B] tokens and confidences, so a call syncs with the host once.

Supported models: the Llama-like decoders specdec.worker.packed.supports_packing accepts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specdec.models.loading import text_config
from specdec.worker.packed import decoder_hidden
from specdec.worker.static.slots import SlotPool

STATIC_ATTENTION = "specdec_static_slots"
LOGIT_ALIGNMENT = 32  # float32 logits rows padded to a multiple of this many (128 bytes)


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    slot_pool: SlotPool,
    slot_ids: torch.Tensor,
    slot_positions: torch.Tensor,
    key_mask: torch.Tensor,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over KV slots, registered with transformers' AttentionInterface.

    Args:
        query: [B, heads, W, head_dim]; key, value: [B, kv_heads, W, head_dim], the forward's
            new positions.
        attention_mask: unused (key_mask replaces it).
        slot_pool: the pool whose layer ``module.layer_idx`` is read and written.
        slot_ids: [B] slot index of each row (the scratch slot for padding rows).
        slot_positions: [B, W] position of each new key and value in its slot.
        key_mask: [B, 1, group x W, key_len] bool, True where a row may attend a key, its
            rows folded as the query's (static_forward builds it once for every layer).
    Returns:
        ([B, W, heads, head_dim] attention output, None), as transformers expects.
    """
    keys, values = slot_pool.keys[module.layer_idx], slot_pool.values[module.layer_idx]
    batch, kv_heads, width, head_dim = key.shape
    heads = torch.arange(kv_heads, device=key.device)
    where = (slot_ids[:, None, None], heads[None, :, None], slot_positions[:, None, :])
    keys.index_put_(where, key)
    values.index_put_(where, value)
    key_len = key_mask.shape[-1]
    past_keys = keys[:, :, :key_len].index_select(0, slot_ids)
    past_values = values[:, :, :key_len].index_select(0, slot_ids)
    group = query.shape[1] // kv_heads
    folded = query.reshape(batch, kv_heads, group * width, head_dim)
    out = F.scaled_dot_product_attention(
        folded, past_keys, past_values, attn_mask=key_mask, scale=scaling
    )
    out = out.reshape(batch, kv_heads * group, width, head_dim)
    return out.transpose(1, 2), None


AttentionInterface.register(STATIC_ATTENTION, slot_attention)


def static_forward(
    model: torch.nn.Module,
    pool: SlotPool,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_ids: torch.Tensor,
    key_len: int,
    last_rows: int | None = None,
) -> torch.Tensor:
    """One forward of B sessions x W positions over their slots; writes their keys and values.

    Args:
        model: a Llama-like causal LM whose attention implementation is STATIC_ATTENTION.
        pool: its slot pool.
        input_ids: [B, W] token ids (long).
        positions: [B, W] positions of those tokens in their sessions (long); a position must
            be below ``key_len``, and below the pool's slot_len.
        slot_ids: [B] slot of each session (long).
        key_len: how many leading positions of each slot the rows attend over (a Python int:
            part of the shape).
        last_rows: run the lm_head on only the last this many positions (None: all): a long
            prefill needs the logits of a few.
    Returns:
        [B, W, vocab] logits (the lm_head's rows, padding included; W = last_rows when
        given), in the model's dtype.
    """
    batch, width = input_ids.shape
    key_positions = torch.arange(key_len, device=input_ids.device)
    key_mask = key_positions[None, None, :] <= positions[:, :, None]  # [B, W, key_len]
    # The query heads of a key/value head are folded into rows (slot_attention): the mask
    # repeats per head of the group, built once here rather than in every layer.
    group = text_config(model.config).num_attention_heads // pool.layout.kv_heads
    key_mask = key_mask[:, None].expand(batch, group, width, key_len)
    key_mask = key_mask.reshape(batch, 1, group * width, key_len)
    hidden = decoder_hidden(
        model.get_decoder(),
        input_ids,
        positions,
        slot_pool=pool,
        slot_ids=slot_ids,
        slot_positions=positions,
        key_mask=key_mask,
    )
    if last_rows is not None:
        hidden = hidden[:, -last_rows:]
    return model.get_output_embeddings()(hidden)


def aligned_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V] logits as contiguous float32 rows of the first ``vocab_size`` columns, padded
    with -inf to a multiple of LOGIT_ALIGNMENT: every row then starts at the same alignment, so
    a vectorised reduction over it (logsumexp, argmax) rounds it the same wherever it sits."""
    padded = math.ceil(vocab_size / LOGIT_ALIGNMENT) * LOGIT_ALIGNMENT
    rows = logits[..., :vocab_size].float()
    return F.pad(rows, (0, padded - vocab_size), value=-math.inf)


def greedy_outcome(
    logits: torch.Tensor, first: torch.Tensor, drafts: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a verify forward, on the device (Leviathan et al. 2023, greedy
    case: a draft token is kept while it equals the target's argmax).

    Args:
        logits: [B, W, V] logits of the forward.
        first: [B] the row whose logits score the first draft token (the last committed
            token's row).
        drafts: [B, W - 1] draft token ids, -1 past each session's k (never accepted).
        vocab_size: the tokenizer's vocabulary (logits past it are embedding padding).
    Returns:
        tokens: [B, W] the target's argmax from row ``first`` on (rows past W - 1 repeat the
            last), log_probs: [B, W] their log-probabilities (float32, under the raw
            distribution), accepted: [B] how many leading drafts equal those tokens. A session
            emits tokens[:accepted + 1] with log_probs[:accepted + 1].
    """
    rows = aligned_logits(logits, vocab_size)
    top = rows.argmax(-1)
    log_probs = rows.gather(-1, top[..., None])[..., 0] - torch.logsumexp(rows, -1)
    width = logits.shape[1]
    index = (first[:, None] + torch.arange(width, device=first.device)[None]).clamp(max=width - 1)
    tokens, log_probs = top.gather(1, index), log_probs.gather(1, index)
    accepted = (drafts == tokens[:, :-1]).long().cumprod(1).sum(1)
    return tokens, log_probs, accepted


def draft_next(
    logits: torch.Tensor, last: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's greedy next token after row ``last`` of each session, on the device.

    Args:
        logits: [B, W, V] logits of a draft forward.
        last: [B] the row of each session's last real token.
    Returns:
        tokens: [B] argmax ids (long); confidences: [B] their softmax probabilities at
            temperature 1 (float32), which the confidence stop multiplies.
    """
    picked = logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
    rows = aligned_logits(picked, vocab_size)
    tokens = rows.argmax(-1)
    confidences = torch.exp(rows.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(rows, -1))
    return tokens, confidences
