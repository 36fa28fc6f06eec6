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
    k_max = bf16_engine.config.speculation.max_speculative_tokens
    verifier = bf16_engine.transport.verifier
    # The width is measured on this device: the smallest position-invariant one >= k_max + 1.
    assert verifier.calibration.invariant
    assert verifier.fixed_width == verifier.calibration.width >= k_max + 1
    assert engine.transport.verifier.fixed_width is None  # float32: off unless asked
    assert engine.transport.verifier.calibration is None


class _MiddleRowApart(torch.nn.Module):
    """A linear layer whose kernel computes the middle row of an odd-width call its own way, as
    a two-thread GEMM on some CPUs does (found on the tiny target's bfloat16 lm_head)."""

    def __init__(self, inner: torch.nn.Linear, apart=lambda width: width % 2 == 1) -> None:
        super().__init__()
        self.inner, self.apart = inner, apart
        self.weight = inner.weight

    def forward(self, x):
        out = self.inner(x)
        width = x.shape[-2]
        if self.apart(width):
            out = out.clone()
            out[..., width // 2, :] += 1.0
        return out


def _calibrate(tiny_pair, apart, min_width):
    from specdec.models.fixed_shape import calibrate_fixed_width, use_row_wise_attention

    loaded = load_model(str(tiny_pair[1]), dtype="bfloat16")
    loaded.model.lm_head = _MiddleRowApart(loaded.model.lm_head, apart)
    use_row_wise_attention(loaded.model)
    return calibrate_fixed_width(loaded.model, loaded.vocab_size, min_width, time_budget_s=0.1)


def test_calibration_skips_widths_whose_rows_depend_on_their_position(tiny_pair):
    calibration = _calibrate(tiny_pair, lambda width: width % 2 == 1, 9)
    assert calibration.tried == {9: False, 10: True}
    assert calibration.width == 10 and calibration.invariant


def test_calibration_without_an_invariant_width_says_so(tiny_pair):
    calibration = _calibrate(tiny_pair, lambda width: True, 5)
    assert not calibration.invariant
    assert calibration.width == 5
    assert list(calibration.tried) == list(range(5, 14)) and not any(calibration.tried.values())


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
