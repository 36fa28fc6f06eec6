"""Half-precision targets and cheaper drafts: the fixed-width verify and the int8 draft."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.models.loading import load_model
from specdec.pairs.tiny import PROMPTS

GREEDY = SamplingParams(max_new_tokens=32)


@pytest.fixture(scope="module")
def bf16_engine(tiny_pair):
    draft, target = tiny_pair
    return SpeculativeEngine.from_pretrained(draft, target, dtype="bfloat16")


def test_half_precision_turns_the_fixed_width_on(bf16_engine, engine):
    assert bf16_engine.transport.verifier.fixed_width == bf16_engine.config.k_max + 1
    assert engine.transport.verifier.fixed_width is None  # float32: off unless asked


@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_fixed_width_makes_target_logits_independent_of_k(bf16_engine, k):
    # Bitwise equality of the logprobs: each position's logits come from a forward of the same
    # width whatever k is, so not even the last bit of bfloat16 rounding may differ.
    for prompt in PROMPTS:
        expected = bf16_engine.generate(prompt, GREEDY, 0)
        out = bf16_engine.generate(prompt, GREEDY, k)
        assert out.token_ids == expected.token_ids, (prompt, k)
        assert out.logprobs == expected.logprobs, (prompt, k)


def test_fixed_width_padding_never_stays_in_the_cache(bf16_engine):
    verifier = bf16_engine.transport.verifier
    seen = []
    original = verifier.verify

    def spy(request):
        response = original(request)
        entry = verifier.sessions._entries.get(request.session.session_id)
        if entry is not None:
            seen.append(
                (
                    len(entry.cached_ids),
                    request.session.prefix_len + len(request.session.new_token_ids),
                    response.num_accepted,
                )
            )
        return response

    verifier.verify = spy
    try:
        bf16_engine.generate(PROMPTS[0], GREEDY, 4)
    finally:
        del verifier.verify
    assert seen
    # The cache holds the committed tokens plus the accepted drafts, never the padding.
    assert all(cached == committed + accepted for cached, committed, accepted in seen)


def test_int8_draft_is_quantized_and_output_stays_exact(tiny_pair):
    draft, target = tiny_pair
    engine = SpeculativeEngine.from_pretrained(draft, target, draft_dtype="int8")
    quantized = torch.ao.nn.quantized.dynamic.Linear
    assert any(isinstance(m, quantized) for m in engine.draft.model.modules())
    assert not any(isinstance(m, quantized) for m in engine.target.model.modules())
    for prompt in PROMPTS[:4]:
        expected = engine.generate(prompt, GREEDY, 0)
        out = engine.generate(prompt, GREEDY, 4)
        assert out.token_ids == expected.token_ids
        assert out.stats.accepted_tokens > 0


def test_int8_on_a_gpu_is_refused(tiny_pair):
    from specdec import ModelLoadError

    with pytest.raises(ModelLoadError, match="int8 runs on the CPU only"):
        load_model(tiny_pair[0], dtype="int8", device="cuda")
