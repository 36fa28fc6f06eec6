"""The bench's memory check for its in-process modes (specdec.bench.inprocess.fits_in_memory):
it must leave the headroom Ray's memory monitor keeps, or loading a mode's models beside a local
cluster makes Ray kill the Serve controller and the replicas."""

from __future__ import annotations

import json

import pytest

from specdec.bench import inprocess

GIB = 2**30


@pytest.fixture
def meminfo(monkeypatch):
    """Sets what /proc/meminfo reports: meminfo(total_gib, available_gib)."""

    def set_meminfo(total_gib: float, available_gib: float) -> None:
        fields = {"MemTotal": int(total_gib * GIB), "MemAvailable": int(available_gib * GIB)}
        monkeypatch.setattr(inprocess, "_meminfo_bytes", lambda: fields)

    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    return set_meminfo


def _model_dir(tmp_path, stored_bytes: int, dtype: str = "bfloat16"):
    """A model directory whose weights take ``stored_bytes`` on disk in ``dtype`` (sparse)."""
    tmp_path.joinpath("config.json").write_text(json.dumps({"torch_dtype": dtype}))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(stored_bytes)
    return str(tmp_path)


def test_the_cpu_memory_available_leaves_ray_monitors_headroom(meminfo, monkeypatch):
    meminfo(total_gib=24, available_gib=4)
    assert inprocess.memory_available("cpu") == pytest.approx(4 * GIB - 0.05 * 24 * GIB, abs=1)
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")
    assert inprocess.memory_available("cpu") == pytest.approx(4 * GIB - 0.1 * 24 * GIB, abs=1)
    meminfo(total_gib=24, available_gib=0.5)
    assert inprocess.memory_available("cpu") == 0


def test_a_mode_that_would_set_off_rays_memory_monitor_is_skipped(meminfo, tmp_path, capsys):
    """What happened on a 24 GiB CPU node: the bundled draft in int8 loads as float32, about
    2 GB with its margin 2.6 GB, when 3.5 GiB were available; Ray kills workers below 1.2."""
    draft = _model_dir(tmp_path, stored_bytes=GIB)  # bfloat16 on disk: 2 GiB in float32
    meminfo(total_gib=23.5, available_gib=3.5)
    assert not inprocess.fits_in_memory("hf_assisted", [(draft, "int8")], "cpu")
    assert "hf_assisted skipped: its models need about 2.6 GiB, 2.3 GiB available" in (
        capsys.readouterr().err
    )
    meminfo(total_gib=23.5, available_gib=4.0)
    assert inprocess.fits_in_memory("hf_assisted", [(draft, "int8")], "cpu")


def test_meminfo_is_read_in_bytes():
    fields = inprocess._meminfo_bytes()
    if not fields:
        pytest.skip("no /proc/meminfo here")
    assert 0 < fields["MemAvailable"] <= fields["MemTotal"]
    assert fields["MemTotal"] > 2**20  # bytes, not kB
