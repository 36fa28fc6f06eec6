"""float32 arithmetic on bfloat16-stored weights (specdec.device.bf16_weights, the
"bf16w" GEMM): width-invariant rows, the same model, and refusals that change nothing."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from specdec import SamplingParams, SpeculativeEngine
from specdec.device import bf16_weights
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.load import calibrate
from specdec.device.gemm import (
    BF16_WEIGHTS,
    ONEDNN,
    PLAIN,
    WEIGHT_MAJOR,
    SwitchableLinear,
    onednn_available,
    set_gemm,
)
from specdec.models.loading import load_model
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.skipif(
    not bf16_weights.available(),
    reason="the bfloat16-weight kernel needs x86-64 with AVX2 and FMA and a C++ compiler",
)

# (out, in): whole 16-value chunks and tails of both, a tied lm_head-like tall one
SHAPES = [(40, 48), (37, 50), (5, 7), (96, 320), (1000, 64)]


def _bf16_valued(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_is_the_one_row_result_bitwise_at_every_width(shape):
    out_features, in_features = shape
    packed, bias = bf16_weights.pack(_bf16_valued(*shape)), torch.randn(out_features)
    x = torch.randn(20, in_features)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return bf16_weights.linear(rows, packed, out_features, bias)

    alone = torch.cat([product(x[i : i + 1]) for i in range(20)])
    for width in range(1, 21):
        assert torch.equal(product(x[:width]), alone[:width]), width
    # leading dimensions are rows too
    batched = product(x.reshape(4, 5, in_features))
    assert batched.shape == (4, 5, out_features)
    assert torch.equal(batched.reshape(20, out_features), alone)


@pytest.mark.parametrize("shape", [(600, 320), (301, 1000)])
def test_a_call_of_many_rows_gives_each_row_its_one_row_result(shape):
    # From 33 rows the kernel goes over panels of blocks (several here, the last one partial)
    # instead of block by block; no row's result may change.
    out_features, in_features = shape
    packed, bias = bf16_weights.pack(_bf16_valued(*shape, seed=3)), torch.randn(out_features)
    x = torch.randn(133, in_features)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return bf16_weights.linear(rows, packed, out_features, bias)

    alone = torch.cat([product(row[None]) for row in x])
    for width in (32, 33, 70, 133):
        assert torch.equal(product(x[:width]), alone[:width]), width


@pytest.mark.parametrize("shape", SHAPES)
def test_it_computes_the_float32_product_of_the_widened_weight(shape):
    weight = _bf16_valued(*shape, seed=1)
    x = torch.randn(7, shape[1])
    # float32 rounding of a sum of in_features products, nothing coarser (bfloat16 activations
    # would be off by about 1e-2 relative)
    scale = (x.abs().double() @ weight.abs().double().t()).max()
    for bias in (torch.randn(shape[0]), None):
        exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        out = bf16_weights.linear(x, bf16_weights.pack(weight), shape[0], bias)
        assert out.dtype == torch.float32 and out.shape == (7, shape[0])
        assert (out.double() - exact).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize("shape", SHAPES)
def test_packing_is_lossless(shape):
    weight = _bf16_valued(*shape, seed=2)
    packed = bf16_weights.pack(weight.float())
    assert packed.dtype == torch.bfloat16 and packed.shape[2:] == (2, 16)
    assert torch.equal(bf16_weights.unpack(packed, *shape), weight.float())


def test_bad_operands_are_refused_with_the_reason():
    packed = bf16_weights.pack(_bf16_valued(8, 16))
    with pytest.raises(RuntimeError, match="input must be float32"):
        bf16_weights.linear(torch.randn(2, 16, dtype=torch.float64), packed, 8)
    with pytest.raises(RuntimeError, match="weight must be packed by bf16_weights.pack"):
        bf16_weights.linear(torch.randn(2, 16), _bf16_valued(8, 16), 8)
    with pytest.raises(RuntimeError, match="17 features, the packed weight takes 1 to 16"):
        bf16_weights.linear(torch.randn(2, 17), packed, 8)
    with pytest.raises(RuntimeError, match="holds 8 outputs, not 10"):
        bf16_weights.linear(torch.randn(2, 16), packed, 10)
    with pytest.raises(RuntimeError, match="bias must be float32 with 8 values"):
        bf16_weights.linear(torch.randn(2, 16), packed, 8, torch.randn(7))


def _model_with_tied_head() -> torch.nn.ModuleList:
    embedding = torch.nn.Embedding(40, 48)
    alone, tied = torch.nn.Linear(48, 48), torch.nn.Linear(48, 40, bias=False)
    tied.weight = embedding.weight
    model = torch.nn.ModuleList([embedding, alone, tied])
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    return model


def test_switching_stores_bfloat16_and_switching_back_restores_the_weight_bitwise():
    model = _model_with_tied_head()
    embedding, alone, tied = model
    weight = alone.weight.detach().clone()
    x = torch.randn(3, 48)
    expected = F.linear(x, weight, alone.bias)
    set_gemm(model, BF16_WEIGHTS)
    assert type(alone) is SwitchableLinear and alone.gemm == BF16_WEIGHTS
    assert alone.weight.numel() == 0 and alone.packed.dtype == torch.bfloat16  # half the bytes
    assert torch.equal(alone.plain_weight(), weight)
    assert tied.weight is embedding.weight and tied.packed.dtype == torch.bfloat16  # still tied
    torch.testing.assert_close(alone(x), expected)
    set_gemm(model, WEIGHT_MAJOR)  # leaving it for another GEMM restores the plain weight
    assert alone.packed is None and tied.packed is None
    set_gemm(model, PLAIN)
    assert torch.equal(alone.weight, weight) and alone.packed is None
    assert torch.equal(alone(x), expected)


def test_a_weight_that_is_not_bfloat16_is_refused_by_name_and_nothing_changes():
    model = _model_with_tied_head()
    with torch.no_grad():
        model[1].weight[0, 0] += 1e-4  # no longer a bfloat16 value
    with pytest.raises(ValueError, match=r"1\.weight has values that are not bfloat16"):
        set_gemm(model, BF16_WEIGHTS)
    assert type(model[1]) is torch.nn.Linear and type(model[2]) is torch.nn.Linear
    with pytest.raises(ValueError, match="runs a float32 model, this one is torch.bfloat16"):
        set_gemm(torch.nn.Sequential(torch.nn.Linear(16, 8)).bfloat16(), BF16_WEIGHTS)


def test_a_weight_reordered_by_onednn_is_checked_too():
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    model = _model_with_tied_head()
    with torch.no_grad():
        model[1].weight[0, 0] += 1e-4
    set_gemm(model, ONEDNN, rows_hint=4)  # frees the plain weight: the check reads the reorder
    with pytest.raises(ValueError, match=r"1\.weight has values that are not bfloat16"):
        set_gemm(model, BF16_WEIGHTS)
    assert model[1].gemm == ONEDNN


def test_calibration_skips_it_for_a_float32_checkpoint_and_refuses_it_configured(tiny_pair, caplog):
    loaded = load_model(str(tiny_pair[1]), dtype="float32")  # random float32 weights
    with caplog.at_level(logging.INFO, logger="specdec.device.calibration"):
        _, calibration = calibrate(
            loaded,
            "target",
            [Candidate("float32"), Candidate("float32", BF16_WEIGHTS)],
            max_speculative_tokens=2,
            automatic=True,
        )
    assert [str(c.candidate) for c in calibration.candidates] == ["float32"]
    assert "float32+bf16w: skipped" in caplog.text and "not bfloat16" in caplog.text
    with pytest.raises(ValueError, match="not bfloat16"):
        calibrate(
            loaded,
            "target",
            [Candidate("float32", BF16_WEIGHTS)],
            max_speculative_tokens=2,
            automatic=False,
        )


def test_a_bfloat16_checkpoint_runs_the_float32_model(tiny_pair_bf16):
    """On weights that are bfloat16 values, float32+bf16w is the float32 model: the same
    greedy tokens as plain float32 (the GEMMs sum in another order, so logprobs agree to
    float32 rounding, not bitwise). Its own exactness at every k: test_gemm's SWITCHED."""
    draft, target = tiny_pair_bf16
    plain = SpeculativeEngine.from_pretrained(draft, target, dtype="float32")
    switched = SpeculativeEngine.from_pretrained(draft, target, dtype="float32", gemm="bf16w")
    linears = [m for m in switched.target.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.gemm == BF16_WEIGHTS for m in linears)
    assert switched.transport.verifier.calibration.chosen.exact is not None
    params = SamplingParams(max_new_tokens=24)
    for prompt in PROMPTS[:4]:
        alone = switched.generate(prompt, params, 0)
        reference = plain.generate(prompt, params, 0)
        assert alone.token_ids == reference.token_ids
        torch.testing.assert_close(alone.logprobs, reference.logprobs, rtol=0, atol=1e-4)
