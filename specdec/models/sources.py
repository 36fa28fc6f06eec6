"""Where a model comes from, made a local folder before anything loads it.

A model setting (``draft_model``, ``target_model``) names one of:

- a local Hugging Face folder or a ``.gguf`` file (used where it is);
- ``bundled:draft`` / ``bundled:target``, the bundled pair (converted by specdec.models.bundled
  when loaded);
- a Hugging Face Hub id (``Qwen/Qwen2.5-Coder-1.5B-Instruct``), at the setting's revision
  (``draft_revision``, ``target_revision``: a branch, tag or commit; unset: ``main``),
  downloaded by huggingface_hub into its cache, so ``HF_TOKEN``, ``HF_HOME`` /
  ``HF_HUB_CACHE``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` (the cache alone) apply as they do
  for transformers;
- a URI of any filesystem fsspec knows (``s3://bucket/models/target``, ``gs://``, ``file://``;
  s3 and gs need ``s3fs`` / ``gcsfs`` installed), copied once into
  ``~/.cache/specdec/models/uri-...`` (``$SPECDEC_CACHE``).

fetch() turns each into a local location; loading then never touches the network. A
deployment fetches where it runs (each replica, the router); `specdec serve` on this machine
fetches first, with progress bars, so that replicas start from the local folders.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from specdec.errors import ModelLoadError

log = logging.getLogger(__name__)

# owner/name, as the Hub spells repository ids.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What transformers needs of a repository: config, weights, tokenizer, generation config, chat
# template. Other files (READMEs, ONNX or GGUF copies, training state) are not downloaded.
HUB_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py")
_COMPLETE = ".specdec-complete"


def is_remote(spec: str) -> bool:
    """Whether fetch() would download ``spec`` (a Hub id or a URI), not read it in place."""
    return _kind(spec) in ("hub", "uri")


def fetch(
    spec: str | os.PathLike, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> str:
    """A model setting as a location the loaders read offline: a Hub id downloaded (at
    ``revision``) into the Hub cache and its snapshot folder returned, a URI copied into the
    models cache; a local path, a ``.gguf`` file or ``bundled:...`` unchanged.

    Args:
        spec: the setting's value (``~`` already expanded by specdec.config).
        revision: a branch, tag or commit of a Hub id; None: ``main``. Refused for any other
            kind of spec.
        cache_dir: where downloads and copies go instead of the Hub cache and the models
            cache (a pod's model volume: specdec.tools.k8s).
    Raises:
        ModelLoadError: the repository, revision or URI does not exist, needs a token that
            ``HF_TOKEN`` does not hold, is not in the cache while ``HF_HUB_OFFLINE`` is set,
            or a revision is given for a spec that has none.
    """
    spec = str(spec)
    kind = _kind(spec)
    if revision is not None and kind != "hub":
        raise ModelLoadError(f"{spec!r}: a revision applies only to a Hugging Face Hub id")
    if kind == "hub":
        return _from_hub(spec, revision, cache_dir)
    if kind == "uri":
        return _from_uri(spec, cache_dir)
    return spec


def _kind(spec: str) -> str:
    if spec.startswith("bundled:"):
        return "bundled"
    if "://" in spec:
        return "uri"
    path = Path(spec)
    if path.exists() or path.suffix == ".gguf" or path.is_absolute() or spec.startswith("."):
        return "local"
    return "hub" if HUB_ID.fullmatch(spec) else "local"


def _from_hub(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision or 'main'}"
    try:
        return snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=list(HUB_PATTERNS)
        )
    except GatedRepoError as err:
        raise ModelLoadError(f"{at}: gated; set HF_TOKEN to a token with access") from err
    except RepositoryNotFoundError as err:
        raise ModelLoadError(
            f"{at}: no such repository on {_endpoint()}, or it is private and HF_TOKEN "
            "holds no token with access"
        ) from err
    except RevisionNotFoundError as err:
        raise ModelLoadError(f"{at}: no such revision") from err
    except LocalEntryNotFoundError as err:
        raise ModelLoadError(
            f"{at}: not in the Hugging Face cache, and downloads are off (HF_HUB_OFFLINE) or "
            f"{_endpoint()} cannot be reached: {err}"
        ) from err
    except (HfHubHTTPError, OSError) as err:
        raise ModelLoadError(f"{at}: download from {_endpoint()} failed: {err}") from err


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _from_uri(uri: str, cache_dir: str | os.PathLike | None) -> str:
    """Copies the folder at ``uri`` into the models cache once (a marker file says the copy is
    whole; a partial one is redone) and returns the local folder."""
    import fsspec

    from specdec.models.bundled import cache_root

    local = cache_root(cache_dir) / f"uri-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"
    if (local / _COMPLETE).exists():
        return str(local)
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.isdir(path):
            raise ModelLoadError(f"{uri}: no such folder")
        tmp = Path(tempfile.mkdtemp(prefix=f".{local.name}.", dir=local.parent))
        log.info("copying %s to %s", uri, local)
        fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
    except ModelLoadError:
        raise
    except (ImportError, ValueError) as err:  # fsspec: an unknown protocol, or its package
        raise ModelLoadError(f"{uri}: {err}") from err
    except OSError as err:
        raise ModelLoadError(f"{uri}: copy failed: {err}") from err
    (tmp / _COMPLETE).write_text(uri)
    shutil.rmtree(local, ignore_errors=True)
    tmp.rename(local)
    return str(local)
