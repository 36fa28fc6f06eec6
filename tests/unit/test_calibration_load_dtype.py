"""The dtype a model is loaded in for its calibration (specdec.device.calibration.load): float32
on a CPU, as before; on a GPU the first half dtype, the other a cast of it, so that no float32
copy of the weights exists there. No GPU is needed: load_model is replaced by one that records
what it was asked for and loads on the CPU."""

from __future__ import annotations

import pytest
import torch

from specdec.device.calibration import casting, load
from specdec.device.calibration.candidates import Candidate, configured
from specdec.device.calibration.load import load_calibrated, load_dtype
from specdec.models.loading import load_model


class _Asked(Exception):
    """Stops load_calibrated once load_model was asked for a model."""


@pytest.fixture
def requests(monkeypatch):
    """[(dtype, device)] load_calibrated asked load_model for; each model loads on the CPU."""
    asked = []

    def recording(spec, *, dtype, device, revision=None):
        asked.append((dtype, device))
        return load_model(spec, dtype=dtype, device="cpu", revision=revision)

    monkeypatch.setattr(load, "load_model", recording)
    return asked


@pytest.fixture
def casts(monkeypatch):
    """[(source model's parameter dtypes, the cast model)] of every cast_model call."""
    made, real = [], casting.cast_model

    def recording(model, dtype):
        cast = real(model, dtype)
        made.append(({p.dtype for p in model.parameters()}, cast))
        return cast

    monkeypatch.setattr(load, "cast_model", recording)
    return made


def test_the_load_dtype_by_device_and_candidates():
    gpu = configured("auto", "auto", "target", "cuda")
    assert gpu == [Candidate("bfloat16"), Candidate("float16")]
    assert load_dtype(gpu, "cuda") == load_dtype(gpu, "cuda:1") == "bfloat16"
    assert load_dtype(gpu[::-1], "cuda") == "float16"  # the first half dtype, whichever it is
    for role in ("draft", "target"):  # a CPU's several dtypes are casts of float32, as before
        assert load_dtype(configured("auto", "auto", role, "cpu"), "cpu") == "float32"
    assert load_dtype([Candidate("float16")], "cuda") == "float16"
    assert load_dtype([Candidate("bfloat16")], "cpu") == "bfloat16"
    assert load_dtype([Candidate("float32"), Candidate("int8")], "cpu") == "float32"


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        ("cuda", "auto", "bfloat16"),
        ("cuda:0", "auto", "bfloat16"),
        ("cpu", "auto", "float32"),
        ("cuda", "float16", "float16"),
        ("cpu", "bfloat16", "bfloat16"),
    ],
)
def test_load_calibrated_asks_load_model_for_the_load_dtype(
    tiny_pair, monkeypatch, device, dtype, expected
):
    asked = []

    def stop(spec, *, dtype, device, revision=None):
        asked.append((dtype, device))
        raise _Asked

    monkeypatch.setattr(load, "load_model", stop)
    with pytest.raises(_Asked):
        load_calibrated(str(tiny_pair[1]), "target", dtype, device=device, max_speculative_tokens=2)
    assert asked == [(expected, device)]


def test_on_a_gpu_float16_is_a_cast_of_the_bfloat16_load_and_nothing_is_float32(
    tiny_pair_bf16, requests, casts
):
    """dtype auto with device cuda (the model itself runs on the CPU here): the model is loaded
    in bfloat16, the float16 candidate is cast from it and equals a direct float16 load of the
    bfloat16-stored weights bitwise, and no model of the calibration holds a float32 weight."""
    loaded, calibration = load_calibrated(
        str(tiny_pair_bf16[0]), "draft", "auto", device="cuda", max_speculative_tokens=2
    )
    assert requests == [("bfloat16", "cuda")]
    assert [c.candidate for c in calibration.candidates] == [
        Candidate("bfloat16"),
        Candidate("float16"),
    ]
    sources = [source for source, _ in casts]
    assert sources and all(source == {torch.bfloat16} for source in sources)
    (half,) = [cast for _, cast in casts if cast.dtype == torch.float16]
    direct = load_model(tiny_pair_bf16[0], dtype="float16").model.state_dict()
    for name, tensor in half.state_dict().items():
        assert tensor.dtype == direct[name].dtype and torch.equal(tensor, direct[name]), name
    for model in [loaded.model, *(cast for _, cast in casts)]:
        assert torch.float32 not in {p.dtype for p in model.parameters()}
    assert loaded.model.dtype == getattr(torch, calibration.candidate.dtype)
