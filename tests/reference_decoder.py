"""An independent reference for greedy exactness: transformers' own model, one token per forward.

specdec's verifier pads each decode forward to an exact width and computes attention one query
row at a time (docs/engine.md, "The exactness contract"). This decoder shares none of its code
(no sessions, packing, chunking, rebuilds or acceptance; of specdec only the linear layers'
kernel where a replica runs its own, load_reference): it loads the target with transformers,
feeds one real token per forward padded to a given width with copies of itself, lets
transformers' SDPA attend each row to its own causal prefix, crops the padding from a
DynamicCache, and takes the argmax of the real row. At width 1 it is exactly the forward that
transformers' ``generate`` runs, which test_exactness_contract checks too.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.device.gemm import set_gemm

_ATTENTION = "reference_one_row_at_a_time"


def _rows_on_their_prefix(module, query, key, value, attention_mask, **kwargs):
    """SDPA for a prefill as transformers runs it; after it, each query row alone over its own
    causal prefix (contiguous keys, no mask): what a lone decode position computes."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == kv_len:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows = [
        sdpa_attention_forward(
            module,
            query[:, :, j : j + 1].contiguous(),
            key[:, :, : kv_len - q_len + 1 + j].contiguous(),
            value[:, :, : kv_len - q_len + 1 + j].contiguous(),
            None,
            is_causal=False,
            **kwargs,
        )[0]
        for j in range(q_len)
    ]
    return torch.cat(rows, dim=1), None


AttentionInterface.register(_ATTENTION, _rows_on_their_prefix)


def load_reference(
    path, dtype: torch.dtype, gemm: str = "plain", rows_hint: int = 1
) -> torch.nn.Module:
    """The target as transformers loads it from ``path``, in ``dtype``, with the attention above.

    ``gemm`` (specdec.device.gemm.GEMMS) is the arithmetic of its linear layers, the one part
    taken from specdec: a replica on ``dnnl`` or ``bf16w`` computes each layer with that kernel
    (``rows_hint``: the row count its weights were laid out for, k_max + 1 for a target)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.set_attn_implementation(_ATTENTION)
    set_gemm(model, gemm, rows_hint)
    return model.eval()


@torch.inference_mode()
def greedy_reference(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    width: int,
    vocab_size: int,
    stop_ids: frozenset[int] = frozenset(),
) -> tuple[list[int], list[float]]:
    """Greedy decoding one token per forward.

    Args:
        model: from load_reference.
        prompt_ids: the prompt, prefilled in one forward (logits of its last position only).
        width: positions per decode forward (1 real, width - 1 copies of it, cropped after).
        vocab_size: logits past it (a padded embedding's rows) are never chosen.
        stop_ids: a token among them ends the output (it is included).
    Returns:
        (token ids, their float32 log-probabilities under the raw logits).
    """
    cache = DynamicCache(config=model.config)
    # As generate does: the prefill computes the last position's logits only (a 1-row lm_head).
    prompt = torch.tensor([prompt_ids])
    logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    tokens, logprobs = [], []
    while True:
        row = logits[:vocab_size].float()
        token = int(torch.argmax(row))
        tokens.append(token)
        logprobs.append(float(row[token] - torch.logsumexp(row.clone(), dim=0)))
        if len(tokens) == max_new_tokens or token in stop_ids:
            return tokens, logprobs
        inputs = torch.tensor([[token] * width])
        logits = model(inputs, cache=cache, use_cache=True).logits[0, 0]
        if width > 1:
            cache.crop(1 - width)


@torch.inference_mode()
def transformers_generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    vocab_size: int,
    stop_ids: frozenset[int],
) -> tuple[list[int], list[float]]:
    """transformers' own greedy ``generate`` of ``model`` (loaded as transformers loads it):
    (token ids, float32 log-probabilities of the raw logits over the tokenizer's
    ``vocab_size`` ids, as specdec reports them). A fresh generation config: plain greedy,
    none of the model's own defaults (Qwen's repetition penalty would change the argmax). A
    padded embedding's ids are suppressed, as specdec never emits them."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(stop_ids),
        pad_token_id=min(stop_ids),
        suppress_tokens=list(range(vocab_size, model.config.vocab_size)) or None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    rows = [logits[0, :vocab_size].float() for logits in out.logits]
    return tokens, [float(r[t] - torch.logsumexp(r.clone(), dim=0)) for t, r in zip(tokens, rows)]
