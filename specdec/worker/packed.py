"""One forward over many sessions: the rows of every session packed for the linear layers,
attention per session over its own KV cache.

A decode forward of one session is mostly GEMMs over a handful of rows, so its cost is reading
the weights. Packing the rows of several sessions into one forward reads the weights once for
all of them (Orca's iteration-level batching, Yu et al. 2022, section 3.2; vLLM and SGLang run
ragged batches the same way). Only attention is per session: each session's new keys and values
are appended to its own cache and its rows attend over that cache alone, so caches of different
lengths are never padded or copied into a shared block.

Exactness. A packed row goes through exactly the arithmetic it would get alone:

- norms, rotary embeddings and activations work row by row;
- attention is specdec.device.exact_widths's row-wise attention, per session;
- the linear layers see more rows, which is where kernels round differently. Given the target's
  exact widths (specdec.device.calibration.results.ExactWidths), the packed rows run in forwards
  of those widths, the last padded with copies of its last row whose KV is cropped again, and the
  lm_head's rows are padded the same way. A row's logits then do not depend on which sessions
  share its forward, how many rows they bring, or where in the forward it sits.

The draft passes no exact widths: its numerics only steer which tokens are proposed.

Supported models: decoder-only transformers models laid out like Llama (embed_tokens, layers,
norm, rotary_emb; each layer an attention module that calls transformers' attention interface),
which covers Llama, Qwen2, Mistral without sliding windows and their relatives.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface, Cache

from specdec.device.calibration.results import ExactWidths
from specdec.device.exact_widths import row_wise_attention
from specdec.worker.kv_cache import SessionEntry

PACKED_ATTENTION = "specdec_packed_row_wise_sdpa"


@dataclasses.dataclass
class Segment:
    """One session's part of a packed forward.

    Attributes:
        entry: the session's cache entry; its cache is extended by ``token_ids`` (and its
            cached_ids with them). Its cache must already hold the prompt (prefills run alone).
        token_ids: the n >= 1 tokens to run, following the cached ones.
        num_logits: how many trailing positions of ``token_ids`` to return logits for (0..n).
    """

    entry: SessionEntry
    token_ids: list[int]
    num_logits: int


@dataclasses.dataclass
class _Run:
    """A contiguous run of one segment's rows inside one forward."""

    cache: Cache
    start: int  # first row in the forward
    length: int


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_runs: list[_Run] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for packed_forward: each run's new keys and values go into its session's
    cache, and its rows attend over that cache alone, row by row. Without ``packed_runs``
    (a single-session forward through the model's own forward), row_wise_attention itself.

    Args:
        query: [1, heads, rows, head_dim]; key, value: [1, kv_heads, rows, head_dim], the
            forward's new positions only (packed_forward passes no cache to the layers).
        packed_runs: where each session's rows sit in the forward, and its cache.
    Returns:
        ([1, rows, heads, head_dim] attention output, None), as transformers expects.
    """
    if packed_runs is None:
        return row_wise_attention(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for run in packed_runs:
        rows = slice(run.start, run.start + run.length)
        keys, values = run.cache.update(key[:, :, rows], value[:, :, rows], module.layer_idx)
        out, _ = row_wise_attention(module, query[:, :, rows], keys, values, None, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def supports_packing(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run packed forwards, or None when it can."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    missing = [
        name
        for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        if not hasattr(decoder, name)
    ]
    if decoder is None or missing:
        return f"{type(model).__name__} is not laid out like Llama (missing {missing})"
    if getattr(decoder, "has_sliding_layers", False):
        return f"{type(model).__name__} has sliding-window layers"
    return None


def prepare_packing(model: torch.nn.Module) -> None:
    """Readies a loaded model for packed_forward: packed_attention, which gives its own
    single-session forwards row-wise attention (specdec.device.exact_widths).

    Raises:
        ValueError: the model's architecture is not supported (supports_packing says why).
    """
    reason = supports_packing(model)
    if reason is not None:
        raise ValueError(f"packed forwards need a Llama-like model: {reason}")
    model.set_attn_implementation(PACKED_ATTENTION)


@torch.inference_mode()
def packed_forward(
    model: torch.nn.Module,
    segments: list[Segment],
    vocab_size: int,
    exact: ExactWidths | None = None,
) -> list[torch.Tensor]:
    """Runs every segment's tokens through the model, packed, and extends their caches.

    Args:
        model: a model that supports_packing, after prepare_packing.
        segments: the sessions to run, each session at most once.
        vocab_size: logits beyond it (the embedding's padding rows) are cut off.
        exact: the widths whose forwards give a row bitwise the same result; the packed rows
            run in forwards of these widths (padded), so a row's logits do not depend on its
            neighbours. None: one forward over all rows, unpadded.
    Returns:
        Per segment, [num_logits, vocab_size] logits of its trailing positions, in the model's
        dtype, on the CPU.
    """
    rows = [(index, token) for index, seg in enumerate(segments) for token in seg.token_ids]
    if not rows:
        return [torch.empty(0, vocab_size) for _ in segments]
    wanted = _logit_rows(segments)
    chunks = exact.chunks(len(rows)) if exact is not None else [(len(rows), len(rows))]
    logits: list[list[torch.Tensor]] = [[] for _ in segments]
    start = 0
    for real, width in chunks:
        chunk = rows[start : start + real]
        chunk += [chunk[-1]] * (width - real)  # padding: copies of the last row, cropped after
        keep = [i - start for i in range(start, start + real) if i in wanted]
        out = _forward_chunk(model, segments, chunk, keep, exact)
        for position, row in zip(keep, out):
            logits[chunk[position][0]].append(row[:vocab_size])
        last = segments[chunk[-1][0]].entry
        last.crop(len(last.cached_ids) - (width - real))
        start += real
    return [
        torch.stack(rows_of).cpu() if rows_of else torch.empty(0, vocab_size) for rows_of in logits
    ]


def decoder_hidden(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    **attention: object,
) -> torch.Tensor:
    """The final hidden states of a Llama-like decoder (supports_packing) over ``input_ids``
    ([B, n]) at ``position_ids`` ([B, n]), with no transformers cache: ``attention`` goes to
    each layer's attention function, which reads and writes the keys and values itself.

    Returns:
        [B, n, hidden] after the final norm.
    """
    hidden = decoder.embed_tokens(input_ids)
    rotary = decoder.rotary_emb(hidden, position_ids)
    for layer in decoder.layers:
        hidden = layer(
            hidden,
            attention_mask=None,
            position_embeddings=rotary,
            position_ids=position_ids,
            cache=None,
            use_cache=False,
            **attention,
        )
    return decoder.norm(hidden)


def _logit_rows(segments: list[Segment]) -> set[int]:
    """Indices, among all packed rows, of the rows whose logits are wanted."""
    wanted, end = set(), 0
    for seg in segments:
        end += len(seg.token_ids)
        wanted.update(range(end - seg.num_logits, end))
    return wanted


def _forward_chunk(
    model: torch.nn.Module,
    segments: list[Segment],
    chunk: list[tuple[int, int]],
    keep: list[int],
    exact: ExactWidths | None,
) -> torch.Tensor:
    """One forward over ``chunk`` ([(segment index, token)], grouped by segment); returns the
    final hidden rows ``keep`` through the lm_head, [len(keep), vocab] (lm_head rows padded
    to an exact width when ``exact`` is given)."""
    decoder = model.get_decoder()
    device = model.device
    runs, positions = [], []
    for index in dict.fromkeys(i for i, _ in chunk):  # segments in order of appearance
        entry = segments[index].entry
        tokens = [t for i, t in chunk if i == index]
        first = len(entry.cached_ids)
        runs.append(_Run(entry.cache, len(positions), len(tokens)))
        positions.extend(range(first, first + len(tokens)))
        entry.cached_ids.extend(tokens)
    input_ids = torch.tensor([[t for _, t in chunk]], dtype=torch.long, device=device)
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)
    hidden = decoder_hidden(decoder, input_ids, position_ids, packed_runs=runs)
    if not keep:
        return hidden.new_empty(0, 0)
    index = keep + [keep[-1]] * ((exact.width_for(len(keep)) if exact else len(keep)) - len(keep))
    selected = hidden[:, torch.tensor(index, device=device)]
    return model.get_output_embeddings()(selected)[0, : len(keep)]
