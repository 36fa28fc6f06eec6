"""Loading the draft and target models with transformers, offline, and checking they fit together.

A model is named by a local Hugging Face directory, a model id already in the local Hugging Face
cache, or a ``.gguf`` file (transformers dequantizes it on load). Nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
)

from specdec.errors import ModelLoadError
from specdec.models.sources import fetch, is_remote

if TYPE_CHECKING:  # transformers' modeling takes seconds to import; the router needs none of it
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "int8": float32 weights quantized after loading (see quantize_int8); meant for draft models.
INT8 = "int8"


@dataclasses.dataclass
class LoadedModel:
    """A causal LM with its tokenizer.

    Attributes:
        vocab_size: ids the tokenizer can produce. A model whose embedding is padded past it (Qwen's
            152064 rows for 151936 ids) has the extra logits cut off, so padding ids are never
            proposed or emitted.
        context_limit: positions the model supports, in tokens.
        eos_token_ids: ids that end generation (tokenizer EOS and the generation config's).
    """

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    context_limit: int
    eos_token_ids: frozenset[int]

    @property
    def device(self) -> torch.device:
        return self.model.device


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained should look: a directory or cached id, plus an optional GGUF file."""

    location: str
    gguf_file: str | None = None

    @classmethod
    def parse(cls, spec: str | os.PathLike) -> ModelSource:
        path = Path(spec).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelLoadError(f"GGUF file not found: {path}")
            return cls(str(path.parent), path.name)
        if path.exists():
            return cls(str(path))
        return cls(str(spec))

    def kwargs(self) -> dict:
        kw: dict = {"local_files_only": True}
        if self.gguf_file:
            kw["gguf_file"] = self.gguf_file
        return kw


def load_tokenizer(spec: str | os.PathLike, revision: str | None = None) -> PreTrainedTokenizerBase:
    """Loads a model's tokenizer (a Hub id or URI fetched first: specdec.models.sources.fetch).

    Raises:
        ModelLoadError: the model cannot be fetched, or its folder holds no tokenizer.
    """
    source = ModelSource.parse(_resolve_bundled(fetch(spec, revision), "bfloat16"))
    try:
        return AutoTokenizer.from_pretrained(source.location, **source.kwargs())
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load tokenizer {spec!r} from {source.location}: {err}"
        ) from err


# generation_config.json fields an OpenAI request's unset fields take (generation_defaults), and
# those specdec has no equivalent of (logged, not applied: each would change the target's
# distribution, which speculative decoding reproduces exactly).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens")
_UNSUPPORTED_DEFAULT_FIELDS = ("repetition_penalty", "min_p", "typical_p", "no_repeat_ngram_size")


def generation_defaults(
    spec: str | os.PathLike, revision: str | None = None
) -> dict[str, float | int]:
    """The sampling defaults a model's ``generation_config.json`` sets: its temperature, top_p,
    top_k and max_new_tokens where set (transformers' own defaults are unset), as vLLM's
    ``--generation-config auto`` reads them; ``do_sample`` is ignored, as vLLM does. A field
    specdec cannot apply (repetition_penalty, min_p, ...) is logged and left out. No file, or
    one transformers cannot read: {} (logged).

    Args:
        spec, revision: as load_tokenizer.
    """
    source = ModelSource.parse(_resolve_bundled(fetch(spec, revision), "bfloat16"))
    try:
        config = GenerationConfig.from_pretrained(source.location, **source.kwargs())
    except (OSError, ValueError) as err:
        log.info("no generation defaults for %s (%s)", spec, err)
        return {}
    ignored = [f for f in _UNSUPPORTED_DEFAULT_FIELDS if getattr(config, f, None) is not None]
    if ignored:
        log.warning("%s: generation_config sets %s, which specdec does not apply", spec, ignored)
    return {
        name: getattr(config, name)
        for name in SAMPLING_DEFAULT_FIELDS
        if getattr(config, name, None) is not None
    }


def load_model(
    spec: str | os.PathLike,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> LoadedModel:
    """Loads a causal LM and its tokenizer, in eval mode; the files are fetched first
    (specdec.models.sources.fetch), then read offline.

    Args:
        spec: local directory, path to a ``.gguf`` file, ``bundled:draft`` / ``bundled:target``
            (the bundled pair, converted on first use: specdec.models.bundled), a Hugging Face
            Hub id or a folder's URI. The LoadedModel's name is the Hub id or URI, else the
            folder loaded.
        dtype: "float32", "bfloat16", "float16", or "int8" (CPU only: every Linear layer
            dynamically quantized to int8, see quantize_int8; for draft models).
        device: "cpu", "cuda", "cuda:N".
        revision: a Hub id's branch, tag or commit (None: main).
    Raises:
        ModelLoadError: cannot be fetched or read, unknown dtype, int8 on a GPU, or a vocabulary
            the tokenizer exceeds.
    """
    if dtype not in DTYPES and dtype != INT8:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES) + [INT8]}, got {dtype!r}")
    if dtype == INT8 and torch.device(device).type != "cpu":
        raise ModelLoadError(f"dtype int8 runs on the CPU only, got device {device!r}")
    name = str(spec) if is_remote(str(spec)) else None
    spec = _resolve_bundled(fetch(spec, revision), dtype)
    source = ModelSource.parse(spec)
    tokenizer = load_tokenizer(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.location, dtype=DTYPES.get(dtype, torch.float32), **source.kwargs()
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load model {name or spec!r} from {source.location}: {err}"
        ) from err
    model.to(device).eval()
    vocab_size = len(tokenizer)
    embedding_rows = model.get_output_embeddings().weight.shape[0]
    if embedding_rows < vocab_size:
        raise ModelLoadError(
            f"model {spec!r} has {embedding_rows} output rows but its tokenizer "
            f"has {vocab_size} ids"
        )
    if dtype == INT8:
        quantize_int8(model)
    return LoadedModel(
        name=name or str(spec),
        model=model,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        context_limit=_context_limit(model),
        eos_token_ids=_eos_ids(model, tokenizer),
    )


def load_model_pair(
    draft_spec: str | os.PathLike,
    target_spec: str | os.PathLike,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    draft_dtype: str | None = None,
) -> tuple[LoadedModel, LoadedModel]:
    """Loads (draft, target) and checks that they share a tokenizer (see check_same_tokenizer).

    ``draft_dtype`` (default: ``dtype``) may differ: the draft only steers proposals, so a
    cheaper draft (e.g. "int8") never changes what is emitted, only how much is accepted.
    """
    target = load_model(target_spec, dtype=dtype, device=device)
    draft = load_model(draft_spec, dtype=draft_dtype or dtype, device=device)
    check_same_tokenizer(draft.tokenizer, target.tokenizer)
    return draft, target


def check_same_tokenizer(draft: PreTrainedTokenizerBase, target: PreTrainedTokenizerBase) -> None:
    """Raises ModelLoadError unless both tokenizers map every token string to the same id.

    Speculative decoding compares token ids across the two models, so a draft whose tokenizer
    differs would silently propose the wrong tokens.
    """
    draft_vocab, target_vocab = draft.get_vocab(), target.get_vocab()
    if draft_vocab == target_vocab:
        return
    if len(draft_vocab) != len(target_vocab):
        detail = f"{len(draft_vocab)} vs {len(target_vocab)} ids"
    else:
        token = next(t for t, i in draft_vocab.items() if target_vocab.get(t) != i)
        detail = f"token {token!r} is id {draft_vocab[token]} vs {target_vocab.get(token)}"
    raise ModelLoadError(f"draft and target must share a tokenizer; they differ: {detail}")


def read_chat_template(template: str) -> str:
    """The chat_template setting's template: the text of the file it names (``~`` expanded),
    or the setting itself when it is a template (holds ``{{`` or ``{%``).

    Raises:
        ModelLoadError: neither a template nor a readable file.
    """
    if "{{" in template or "{%" in template:
        return template
    path = Path(template).expanduser()
    try:
        return path.read_text()
    except OSError as err:
        raise ModelLoadError(
            f"chat_template: neither a Jinja template nor a readable file: {err}"
        ) from err


def _resolve_bundled(spec: str | os.PathLike, dtype: str) -> str | os.PathLike:
    from specdec.models import bundled  # only bundled specs need it

    return bundled.resolve(spec, dtype) if str(spec).startswith(bundled.SPEC_PREFIX) else spec


def quantize_int8(model: PreTrainedModel) -> None:
    """Replaces every nn.Linear by a dynamically quantized one, in place (CPU, fbgemm).

    Weights become int8 with one scale per output channel; activations are quantized per call.
    A decode step on a CPU is bound by reading the weights, so this halves the bytes read
    against bfloat16: the 0.5B Qwen draft step drops from ~90 ms to ~40 ms on 2 cores. The
    model's distribution shifts slightly, which costs some acceptance and never exactness.
    (torch.ao.quantization is deprecated in favour of torchao, whose int8 CPU path is only fast
    under torch.compile; the eager fbgemm kernels are still the fastest here.)
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(
            model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's part of a config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _context_limit(model: PreTrainedModel) -> int:
    limit = getattr(text_config(model.config), "max_position_embeddings", None)
    if not limit:
        raise ModelLoadError(f"{type(model).__name__} does not declare max_position_embeddings")
    return int(limit)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)
