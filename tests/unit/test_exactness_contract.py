"""The exactness contract (docs/engine.md, "The exactness contract") against references that
share no code with specdec's decoding: transformers' ``generate`` and tests/reference_decoder.py.

On the tiny pair, 200 greedy tokens a prompt, with plain GEMMs in float32 (24 prompts) and in
bfloat16 (12, whose row-wise reference is the slower):

- every path (k = 0, k auto, a batch of every prompt at k = 4) gives the reference decoder's
  tokens and bitwise its log-probabilities, the reference run at the replica's own width for a
  lone row (ExactWidths.width_for(1), which this replica measured);
- the reference at width 1 is transformers' ``generate`` bit for bit (float32), so where a
  replica's exact widths include 1 every path equals ``generate``;
- with ``exact_widths: false`` the k = 0 path is ``generate`` bit for bit.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from reference_decoder import greedy_reference, load_reference, transformers_generate
from transformers import AutoModelForCausalLM

from specdec import SamplingParams, SpeculativeEngine
from specdec.models.tiny import CORPUS, PROMPTS

NEW_TOKENS = 200
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS)


def _prompts(count: int = 24) -> list[str]:
    """The tiny pair's prompts, then word salads of its corpus (seeded), up to ``count``."""
    words = sorted({w for line in CORPUS for w in line.split()})
    rng = random.Random(46)
    extra = [" ".join(rng.choices(words, k=rng.randint(2, 12))) for _ in range(count)]
    return (PROMPTS + extra)[:count]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def case(request, tiny_pair, tiny_pair_bf16):
    """(engine, reference model, its width, dtype name): the engine in ``dtype`` with plain
    GEMMs (calibrated: it measured its own exact widths), the target loaded again by
    transformers in the same dtype."""
    dtype = request.param
    draft, target = tiny_pair if dtype == "float32" else tiny_pair_bf16
    engine = SpeculativeEngine.from_pretrained(draft, target, dtype=dtype, gemm="plain")
    width = engine.transport.verifier.exact.width_for(1)
    return engine, load_reference(target, getattr(torch, dtype)), width, dtype


def _reference(engine, model, prompt, width):
    ids = engine.tokenizer(prompt).input_ids
    stop = frozenset({engine.tokenizer.eos_token_id})
    return greedy_reference(
        model, ids, NEW_TOKENS, width=width, vocab_size=engine.limits.vocab_size, stop_ids=stop
    )


def test_every_path_equals_the_reference_decoder_at_the_replicas_width(case):
    engine, model, width, dtype = case
    prompts = _prompts(24 if dtype == "float32" else 12)

    async def batched():
        return await asyncio.gather(*(engine.agenerate(p, GREEDY, 4) for p in prompts))

    # k auto alone on the first 8 prompts: its rounds are the batch's, priced differently.
    outputs = {
        0: [engine.generate(p, GREEDY, 0) for p in prompts],
        "auto": [engine.generate(p, GREEDY, "auto") for p in prompts[:8]],
        "batch, k 4": asyncio.run(batched()),
    }
    for i, prompt in enumerate(prompts):
        tokens, logprobs = _reference(engine, model, prompt, width)
        for path, outs in outputs.items():
            if i < len(outs):
                assert outs[i].token_ids == tokens, (prompt, path)
                assert outs[i].logprobs == logprobs, (prompt, path)
    for path in ("auto", "batch, k 4"):  # the speculative paths did accept drafts
        assert sum(out.stats.accepted_tokens for out in outputs[path]) > 0, path
    assert sum(len(out.token_ids) for out in outputs[0]) >= len(prompts) * NEW_TOKENS // 2


def test_the_reference_at_width_one_and_unpadded_k0_are_transformers_generate(tiny_pair):
    """float32: ``generate`` on a third load of the target (transformers' own attention) equals
    the reference decoder at width 1 and the engine's k = 0 with ``exact_widths: false``.
    The target's padded embedding rows are suppressed in ``generate`` (transformers_generate)."""
    draft, target = tiny_pair
    plain = SpeculativeEngine.from_pretrained(draft, target, dtype="float32", exact_widths=False)
    stock = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reference = load_reference(target, torch.float32)
    stops = frozenset({plain.tokenizer.eos_token_id})
    for prompt in _prompts(12):
        ids = plain.tokenizer(prompt).input_ids
        expected = transformers_generate(
            stock, ids, NEW_TOKENS, vocab_size=plain.limits.vocab_size, stop_ids=stops
        )
        assert _reference(plain, reference, prompt, 1) == expected, prompt
        out = plain.generate(prompt, GREEDY, 0)
        assert (out.token_ids, out.logprobs) == expected, prompt
