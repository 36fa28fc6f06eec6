"""Calibrations reused from disk (specdec.device.calibration_cache): a hit skips the measurement
but never the exactness check, and anything that decides a calibration is in its key."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.device import bf16_weights, calibration_cache
from specdec.device.calibration import host, load, measure
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.load import load_calibrated
from specdec.device.calibration_cache import CACHE_ENV, DEFAULT_DIR, CalibrationCache
from specdec.device.exact_widths import ROW_WISE_ATTENTION
from specdec.models.loading import load_model
from specdec.models.tiny import save_pair
from specdec.v1 import specdec_pb2


def _load(path, cache, role="target", dtype="float32", k=3):
    return load_calibrated(
        str(path), role, dtype, max_speculative_tokens=k, exact_widths=True, cache=cache
    )


@pytest.fixture
def measurements(monkeypatch):
    """How many times calibrate() measured."""
    real, calls = load.calibrate, []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(load, "calibrate", counted)
    return calls


def test_a_stored_calibration_is_reused_as_measured(tiny_pair, tmp_path, measurements):
    cache = CalibrationCache(tmp_path)
    measured_model, measured = _load(tiny_pair[1], cache)
    reused_model, reused = _load(tiny_pair[1], cache)
    assert measurements == ["target"]
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert reused.reused and not measured.reused
    assert dataclasses.replace(reused, reused=False) == measured
    assert reused.chosen.exact is not None
    assert reused_model.model.config._attn_implementation == ROW_WISE_ATTENTION
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.inference_mode():
        expected = measured_model.model(input_ids=ids).logits
        assert torch.equal(reused_model.model(input_ids=ids).logits, expected)
    message = specdec_pb2.DeviceCalibration()
    reused.to_proto(message)
    assert message.reused and message.dtype == "float32"
    # the entry on disk keeps FORMAT 2's layout: candidates in their display form
    (entry,) = tmp_path.glob("*.json")
    stored = json.loads(entry.read_text())
    assert stored["dtype"] == "float32" and [c["dtype"] for c in stored["candidates"]] == [
        "float32"
    ]
    (chosen,) = [c for c in message.candidates if c.dtype == message.dtype]
    assert chosen.prefill_s_per_token == reused.chosen.prefill_s_per_token > 0


def test_a_replica_that_waited_for_the_lock_reuses_what_the_other_stored(
    tiny_pair, tmp_path, measurements, monkeypatch
):
    """Two replicas of one model start together: the second finds no entry, waits while the
    first measures and stores one, and then reuses it instead of measuring again."""
    cache = CalibrationCache(tmp_path)
    _, first = _load(tiny_pair[1], CalibrationCache(tmp_path / "elsewhere"))
    key = cache.key(
        load_model(str(tiny_pair[1]), dtype="float32").model,
        "target",
        [Candidate("float32")],
        device="cpu",
        max_speculative_tokens=3,
        exact_widths=True,
    )
    real_lock = load.one_at_a_time

    @contextlib.contextmanager
    def other_replica_measures_meanwhile(device):
        with real_lock(device):
            cache.save(key, first)  # what the replica holding the lock stored before releasing
            yield

    monkeypatch.setattr(load, "one_at_a_time", other_replica_measures_meanwhile)
    measurements.clear()
    _, second = _load(tiny_pair[1], cache)
    assert measurements == []
    assert second.reused and dataclasses.replace(second, reused=False) == first


def test_a_replica_loads_beside_others_but_never_while_one_measures(tmp_path, monkeypatch):
    """Loading a model and checking a stored calibration take the cores for seconds: replicas
    may do it together (a shared hold of the host's lock), but only once no replica on the host
    is measuring (an exclusive hold), whose timings it would otherwise slow."""
    monkeypatch.setattr(host.tempfile, "gettempdir", lambda: str(tmp_path))
    loaded = threading.Event()

    def load_model_meanwhile() -> None:
        with host.while_none_measures("cpu"):
            loaded.set()

    with host.while_none_measures("cpu"):
        other = threading.Thread(target=load_model_meanwhile)
        other.start()
        assert loaded.wait(10), "a second load waited for the first"
    other.join()
    loaded.clear()
    with host.one_at_a_time("cpu"):
        other = threading.Thread(target=load_model_meanwhile)
        other.start()
        assert not loaded.wait(0.5), "a load ran while a replica measured"
    assert loaded.wait(10)
    other.join()


def test_an_automatic_choice_is_reused_in_its_dtype(tiny_pair, tmp_path, measurements):
    cache = CalibrationCache(tmp_path)
    _, measured = _load(tiny_pair[0], cache, role="draft", dtype="auto")
    model, reused = _load(tiny_pair[0], cache, role="draft", dtype="auto")
    assert measurements == ["draft"] and reused.candidate == measured.candidate
    assert len(measured.candidates) > 1 and reused.candidates == measured.candidates
    if reused.candidate.dtype == "int8":
        assert not any(isinstance(m, torch.nn.Linear) for m in model.model.model.modules())
    else:
        assert model.model.dtype == getattr(torch, reused.candidate.dtype)


def test_a_failed_exactness_check_measures_again(tiny_pair, tmp_path, measurements, monkeypatch):
    cache = CalibrationCache(tmp_path)
    _load(tiny_pair[1], cache)
    monkeypatch.setattr(load, "whole_forward_exact", lambda *args, **kwargs: False)
    _, again = _load(tiny_pair[1], cache)
    assert measurements == ["target", "target"] and not again.reused


def test_an_unreadable_entry_is_measured_again_and_replaced(tiny_pair, tmp_path, measurements):
    cache = CalibrationCache(tmp_path)
    _load(tiny_pair[1], cache)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text('{"dtype": "float32", "candidates": [')
    _, again = _load(tiny_pair[1], cache)
    assert measurements == ["target", "target"] and not again.reused
    _, third = _load(tiny_pair[1], cache)
    assert third.reused and measurements == ["target", "target"]


def test_a_folder_that_cannot_be_written_only_loses_the_reuse(tiny_pair, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        _, result = _load(tiny_pair[1], CalibrationCache(blocker / "calibration"))
    assert not result.reused and "cannot keep the calibration" in caplog.text


def test_the_key_holds_what_decides_a_calibration(tiny_pair, tmp_path, monkeypatch):
    cache = CalibrationCache(tmp_path)
    model = load_model(str(tiny_pair[1])).model

    def key(**changes):
        settings = {"role": "target", "dtypes": ["float32"], "max_speculative_tokens": 3}
        settings["dtypes"] = [Candidate.parse(c) for c in changes.pop("dtypes", settings["dtypes"])]
        settings.update(changes)
        return cache.key(
            model, settings.pop("role"), settings.pop("dtypes"), device="cpu",
            exact_widths=True, **settings,
        )  # fmt: skip

    base = key()
    changed = [
        key(role="draft"),
        key(dtypes=["bfloat16"]),
        key(max_speculative_tokens=4),
        key(max_batch_size=8),  # the widths are priced for batches of up to 8 sessions
    ]
    assert len({base, *changed}) == 5
    # Other weights, same architecture: the same calibration (costs and roundings follow shapes).
    other_dir = save_pair(tmp_path / "other", noise=0.05, pad_vocab=7, seed=5)[1]
    assert cache.key(
        load_model(str(other_dir)).model, "target", [Candidate("float32")], device="cpu",
        max_speculative_tokens=3, exact_widths=True,
    ) == base  # fmt: skip
    wider = save_pair(tmp_path / "wide", noise=0.05, pad_vocab=8)[1]
    assert cache.key(
        load_model(str(wider)).model, "target", [Candidate("float32")], device="cpu",
        max_speculative_tokens=3, exact_widths=True,
    ) != base  # fmt: skip
    monkeypatch.setattr(measure, "TIMING_REPEATS", measure.TIMING_REPEATS + 1)
    assert key() != base
    monkeypatch.undo()
    assert key() == base
    monkeypatch.setattr(calibration_cache, "describe_device", lambda device: "another cpu")
    assert key() != base
    monkeypatch.undo()
    # specdec's own kernel: a changed source is another build, measured anew
    with_bf16w = key(dtypes=["float32", "float32+bf16w"])
    monkeypatch.setattr(bf16_weights, "library_name", lambda: "specdec_bf16w_another")
    assert key(dtypes=["float32", "float32+bf16w"]) != with_bf16w
    assert key() == base  # only where the candidate is tried


def test_the_setting_names_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert CalibrationCache.configured(None).directory == tmp_path
    assert CalibrationCache.configured("") is None
    monkeypatch.setenv(CACHE_ENV, "")
    assert CalibrationCache.configured(None) is None
    monkeypatch.delenv(CACHE_ENV)
    assert CalibrationCache.configured(None).directory.name == "calibration"
    assert str(CalibrationCache.configured(None).directory).endswith(DEFAULT_DIR[1:])


def test_an_engine_from_a_reused_calibration_stays_exact(tiny_pair, tmp_path, measurements):
    settings = {"dtype": "float32", "calibration_cache": str(tmp_path)}
    first = SpeculativeEngine.from_pretrained(*tiny_pair, **settings)
    second = SpeculativeEngine.from_pretrained(*tiny_pair, **settings)
    assert measurements == ["target", "draft"]
    prompt = [5, 17, 42, 9]
    target_only = first.generate(prompt, num_speculative_tokens=0)
    for k in (3, "auto"):
        out = second.generate(prompt, num_speculative_tokens=k)
        assert out.token_ids == target_only.token_ids
        assert out.logprobs == target_only.logprobs


def test_the_key_names_the_measurements_constants_as_format_2_did():
    """Entries stored before the calibration was split into modules keep their keys: the same
    constant names (PRICED_ACCEPTANCES under its old name) and candidates in their display form."""
    assert list(calibration_cache._SETTINGS) == [
        "CACHE_TOKENS",
        "PREFILL_TOKENS",
        "TYPICAL_PROMPT_TOKENS",
        "TYPICAL_NEW_TOKENS",
        "CLASS_ACCEPTANCES",
        "DRAFT_WIDTHS",
        "EXTRA_WIDTHS",
        "SLOWER_CUTOFF",
        "CHOICE_MARGIN",
        "PREFILL_MARGIN",
        "TIMING_REPEATS",
    ]
    assert calibration_cache.FORMAT == 2
