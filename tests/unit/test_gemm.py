"""Weight-major GEMMs (specdec.models.gemm): a calibration candidate that must stay exact."""

from __future__ import annotations

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.models.calibration import calibrate, candidate_dtypes
from specdec.models.gemm import SwitchableLinear, set_weight_major, split_candidate
from specdec.models.loading import load_model
from specdec.pairs.tiny import PROMPTS


def test_weight_major_linear_computes_the_same_product():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40)
    model = torch.nn.Sequential(layer)
    inputs = {w: torch.randn(1, w, 48) for w in (1, 3, 16, 100)}
    plain = {w: layer(x) for w, x in inputs.items()}
    set_weight_major(model, True)
    assert type(layer) is SwitchableLinear and layer.weight_major
    for width, x in inputs.items():
        out = layer(x)
        assert out.shape == plain[width].shape == (1, width, 40)
        torch.testing.assert_close(out, plain[width], rtol=1e-5, atol=1e-5)
    set_weight_major(model, False)
    for width, x in inputs.items():
        assert torch.equal(layer(x), plain[width])  # F.linear again, bitwise


def test_disabling_never_swaps_a_plain_linear():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    set_weight_major(model, False)
    assert type(model[0]) is torch.nn.Linear  # int8 quantization finds it by type


def test_candidates_name_dtype_and_gemm():
    assert split_candidate("float32+wm") == ("float32", True)
    assert split_candidate("bfloat16") == ("bfloat16", False)
    assert "float32+wm" in candidate_dtypes("target", "cpu")
    assert "float32+wm" not in candidate_dtypes("draft", "cpu")


@pytest.fixture(scope="module")
def weight_major_target(tiny_pair):
    """The tiny target calibrated as the weight-major candidate alone."""
    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    return calibrate(loaded, "target", ["float32+wm"], max_speculative_tokens=4, automatic=False)


def test_weight_major_target_has_measured_exact_widths(weight_major_target):
    loaded, calibration = weight_major_target
    assert calibration.dtype == "float32+wm" and calibration.chosen.exact is not None
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is SwitchableLinear and m.weight_major for m in linears)


def test_weight_major_speculation_equals_its_target_alone(tiny_pair, weight_major_target):
    """Greedy exactness with the chosen GEMM: any k gives the target-alone tokens, bitwise."""
    loaded, calibration = weight_major_target
    draft = load_model(str(tiny_pair[0]), dtype="float32")
    engine = SpeculativeEngine(
        draft, loaded, max_speculative_tokens=4, calibrations={"target": calibration}
    )
    params = SamplingParams(max_new_tokens=24)
    for prompt in PROMPTS[:4]:
        alone = engine.generate(prompt, params, 0)
        for k in (1, 4, "auto"):
            out = engine.generate(prompt, params, k)
            assert out.token_ids == alone.token_ids
            assert out.logprobs == alone.logprobs


def test_a_later_candidate_needs_a_clear_margin_to_be_chosen():
    from specdec.models.calibration import CHOICE_MARGIN, DtypeMeasurement, _choose

    def candidate(name, seconds):
        return DtypeMeasurement(name, (1.0,), 0.01, None, seconds), name

    first = candidate("float32", 20.0)
    near = candidate("float32+wm", 20.0 / (1 + CHOICE_MARGIN) + 0.01)
    clear = candidate("bfloat16", 20.0 / (1 + CHOICE_MARGIN) - 0.01)
    assert _choose([first, near])[1] == "float32"  # noise-sized gains keep the first
    assert _choose([first, near, clear])[1] == "bfloat16"
    assert _choose([near, first])[1] == "float32+wm"
