"""Weight-major and oneDNN GEMMs (specdec.device.gemm): calibration candidates that must stay
exact."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.device.calibration.candidates import (
    Candidate,
    bf16_weights_candidates,
    candidates,
    onednn_candidates,
)
from specdec.device.calibration.load import calibrate
from specdec.device.calibration.results import DtypeMeasurement
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

GEMMS = [WEIGHT_MAJOR, ONEDNN] if onednn_available() else [WEIGHT_MAJOR]
# Every GEMM candidate this build and CPU run: bfloat16+dnnl needs oneDNN's bfloat16 kernels,
# float32+bf16w the bfloat16-weight kernel (and weights that are bfloat16 values)
SWITCHED = (
    [Candidate("float32", g) for g in GEMMS]
    + (onednn_candidates("bfloat16") if onednn_available(torch.bfloat16) else [])
    + bf16_weights_candidates()
)


@pytest.mark.parametrize("candidate", SWITCHED, ids=str)
def test_a_switched_linear_computes_the_same_product(candidate):
    gemm = candidate.gemm
    dtype = getattr(torch, candidate.dtype)
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40).to(torch.bfloat16).to(dtype)  # bfloat16 values: bf16w
    model = torch.nn.Sequential(layer)
    inputs = {w: torch.randn(1, w, 48, dtype=dtype) for w in (1, 3, 16, 100)}
    plain = {w: layer(x) for w, x in inputs.items()}
    weight = layer.weight.detach().clone()
    set_gemm(model, gemm, rows_hint=5)
    assert type(layer) is SwitchableLinear and layer.gemm == gemm
    for width, x in inputs.items():
        out = layer(x)
        assert out.shape == plain[width].shape == (1, width, 40) and out.dtype == dtype
        # bfloat16 keeps 8 bits of mantissa: one rounding step apart at most (float32+bf16w
        # multiplies float32 activations by the same weights: float32 rounding)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, plain[width], rtol=tolerance, atol=tolerance)
    set_gemm(model, PLAIN)
    assert torch.equal(layer.weight, weight)  # a reorder or a bfloat16 copy is undone bitwise
    for width, x in inputs.items():
        assert torch.equal(layer(x), plain[width])  # F.linear again, bitwise


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
def test_onednn_frees_a_plain_weight_unless_another_module_shares_it():
    embedding = torch.nn.Embedding(40, 48)
    alone, tied = torch.nn.Linear(48, 48), torch.nn.Linear(48, 40, bias=False)
    tied.weight = embedding.weight
    model = torch.nn.ModuleList([embedding, alone, tied])
    set_gemm(model, ONEDNN, rows_hint=4)
    assert alone.weight.numel() == 0 and alone.packed is not None  # the reorder replaces it
    assert tied.weight is embedding.weight and tied.weight.shape == (40, 48)  # still tied
    x = torch.randn(3, 48)
    torch.testing.assert_close(tied(x), x @ embedding.weight.t(), rtol=1e-5, atol=1e-5)
    set_gemm(model, WEIGHT_MAJOR)
    assert alone.packed is None and alone.weight.shape == (48, 48)


def test_an_unknown_gemm_is_refused():
    with pytest.raises(ValueError, match="gemm must be"):
        set_gemm(torch.nn.Sequential(torch.nn.Linear(2, 2)), "blas")


def test_disabling_never_swaps_a_plain_linear():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    set_gemm(model, PLAIN)
    assert type(model[0]) is torch.nn.Linear  # int8 quantization finds it by type


def test_candidates_name_dtype_and_gemm():
    assert Candidate.parse("float32+wm") == Candidate("float32", WEIGHT_MAJOR)
    assert Candidate.parse("float32+dnnl") == Candidate("float32", ONEDNN)
    assert Candidate.parse("bfloat16") == Candidate("bfloat16", PLAIN)
    target, draft = candidates("target", "cpu"), candidates("draft", "cpu")
    weight_major = Candidate("float32", WEIGHT_MAJOR)
    assert weight_major in target and weight_major not in draft
    assert Candidate.parse("bfloat16+dnnl") == Candidate("bfloat16", ONEDNN)
    for base in ("float32", "bfloat16"):
        candidate = Candidate(base, ONEDNN)
        available = onednn_available(getattr(torch, base))
        assert (candidate in target) == (candidate in draft) == available
        if available:  # after int8's cast; before the plain GEMM of its dtype, which it cuts
            assert draft.index(candidate) > draft.index(Candidate("int8"))
            assert target.index(candidate) < target.index(Candidate(base))
    assert not any(c.gemm == ONEDNN for c in candidates("target", "cuda"))
    # the display form (protos, calibration cache) is the old combined setting
    for candidate in [*target, *draft]:
        assert Candidate.parse(str(candidate)) == candidate
    assert str(weight_major) == "float32+wm" and str(Candidate("int8")) == "int8"


def test_onednn_bfloat16_is_not_offered_where_the_cpu_lacks_it():
    """ONEDNN_MAX_CPU_ISA=AVX2 hides oneDNN's bfloat16 kernels (an AVX2-only CPU has none):
    bfloat16+dnnl is then no candidate, and set_gemm refuses it by name."""
    code = (
        "import torch\n"
        "from specdec.device.calibration.candidates import candidates\n"
        "from specdec.device.gemm import onednn_available, set_gemm\n"
        "assert not onednn_available(torch.bfloat16)\n"
        "tried = [str(c) for c in candidates('target', 'cpu')]\n"
        "assert 'bfloat16+dnnl' not in tried\n"
        "print(tried)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8)).bfloat16()\n"
        "try:\n"
        "    set_gemm(model, 'dnnl')\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "dnnl in torch.bfloat16" in done.stdout and "no oneDNN" in done.stdout
    # the bfloat16-weight kernel is AVX2 code of its own: an AVX2-only CPU keeps it
    assert ("'float32+bf16w'" in done.stdout) == bool(bf16_weights_candidates())


@pytest.fixture(scope="module", params=SWITCHED, ids=str)
def switched_target(request):
    """The tiny target calibrated as one GEMM candidate alone (float32+bf16w: stored in
    bfloat16, as it needs)."""
    candidate = request.param
    bf16w = candidate.gemm == BF16_WEIGHTS
    pair = request.getfixturevalue("tiny_pair_bf16" if bf16w else "tiny_pair")
    loaded = load_model(str(pair[1]), dtype=candidate.dtype)
    return calibrate(loaded, "target", [request.param], max_speculative_tokens=4, automatic=False)


def test_a_switched_target_has_measured_exact_widths(switched_target):
    loaded, calibration = switched_target
    gemm = calibration.candidate.gemm
    assert gemm != PLAIN and calibration.chosen.exact is not None
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is SwitchableLinear and m.gemm == gemm for m in linears)


def test_a_switched_target_speculates_exactly(tiny_pair, switched_target):
    """Greedy exactness with the chosen GEMM: any k gives the target-alone tokens, bitwise."""
    loaded, calibration = switched_target
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
    from specdec.device.calibration.choice import CHOICE_MARGIN, choose

    def candidate(name, seconds):
        return DtypeMeasurement(Candidate.parse(name), (1.0,), 0.01, None, seconds), name

    first = candidate("float32", 20.0)
    near = candidate("float32+wm", 20.0 / (1 + CHOICE_MARGIN) + 0.01)
    clear = candidate("bfloat16", 20.0 / (1 + CHOICE_MARGIN) - 0.01)
    assert choose([first, near])[1] == "float32"  # noise-sized gains keep the first
    assert choose([first, near, clear])[1] == "bfloat16"
    assert choose([near, first])[1] == "float32+wm"
