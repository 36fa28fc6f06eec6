"""Models in real shapes with random weights: what a GPU check measures without downloading a
model (step costs depend on the shapes and the dtype, not on the weights).

The shapes are the ``config.json`` files in ``specdec/models/shapes/`` (their sources are in
that folder's README): the bundled pair as specdec converts it, and Qwen2.5-Coder-14B-Instruct,
the target a GPU deployment is sized for. A model is built on the meta device, materialised
directly on the target device in the target dtype and initialised there, so a 14B model in
bfloat16 (29.5 GB) never has a float32 or host copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from specdec.models.loading import DTYPES
from specdec.models.tiny import EOS

SHAPES_DIR = Path(__file__).with_name("shapes")
TARGET_14B = "qwen2.5-coder-14b-instruct"
BUNDLED_DRAFT = "qwen2.5-coder-0.5b-instruct"
BUNDLED_TARGET = "qwen2.5-coder-1.5b-instruct"
# A toy shape keeps the architecture (Qwen2: GQA, QKV bias, RoPE) at a size a CPU runs in
# milliseconds, for smoke runs of code written for the real shapes.
TOY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def shape_names() -> list[str]:
    """The shipped shapes, e.g. ``qwen2.5-coder-14b-instruct``."""
    return sorted(path.stem for path in SHAPES_DIR.glob("*.json"))


def load_shape(name: str, *, toy: bool = False) -> PretrainedConfig:
    """The transformers config of shipped shape ``name``; ``toy``: the same architecture shrunk
    to TOY's sizes (two layers, 64 wide, a 512-token vocabulary).

    Raises:
        ValueError: no shape of that name (the message lists them).
    """
    path = SHAPES_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no shape {name!r}; shipped: {shape_names()}")
    values = json.loads(path.read_text())
    values.pop("layer_types", None)  # derived from num_hidden_layers, which TOY changes
    if toy:
        values.update(TOY)
    return AutoConfig.for_model(**values)


def random_model(
    config: PretrainedConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "bfloat16",
    seed: int = 0,
    never_emit: Iterable[int] = (),
) -> PreTrainedModel:
    """A causal LM of ``config``'s shape with random weights (transformers' own initialisation:
    normal(0, initializer_range) matrices, unit norms, RoPE frequencies), in eval mode.

    Args:
        config: e.g. load_shape(TARGET_14B).
        device: where the weights are allocated and initialised; "meta" allocates nothing
            (shapes and parameter counts only).
        dtype: "float32", "bfloat16" or "float16".
        seed: seeds the initialisation (same seed, device and dtype: same weights).
        never_emit: token ids whose output-embedding rows are zeroed: their logit is exactly 0
            while the largest of a random model's ~10^5 logits is far above it, so greedy
            decoding never stops early on an end-of-sequence id.
    Raises:
        ValueError: an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    device = torch.device(device)
    if device.type != "meta":
        model.to_empty(device=device)
        torch.manual_seed(seed)  # seeds CUDA's generators too
        with torch.no_grad():
            model.init_weights()
            weight = model.get_output_embeddings().weight
            rows = sorted(i for i in set(never_emit) if 0 <= i < weight.shape[0])
            if rows:
                weight[rows] = 0
    return model.eval()


def parameter_count(model: PreTrainedModel) -> int:
    """Parameters of ``model``, a tied embedding counted once."""
    return sum(p.numel() for p in model.parameters())


def byte_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids, built without training: id 0
    is its end-of-sequence token, then the 256 byte symbols, then merges of two symbols, then
    of three, until the size is reached. It loads back as the tokenizer class of the model's
    config (Qwen2's rebuilds a BPE from the vocabulary and merges), so it is a BPE.

    Raises:
        ValueError: ``vocab_size`` below 258 (the end token, the bytes and one merge).
    """
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be at least 258, got {vocab_size}")
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {EOS: 0} | {symbol: i + 1 for i, symbol in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    pieces = symbols
    while len(vocab) < vocab_size:
        longer = []
        for head in pieces:
            for tail in symbols:
                if len(vocab) == vocab_size:
                    break
                vocab[head + tail] = len(vocab)
                merges.append((head, tail))
                longer.append(head + tail)
        pieces = longer
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)


def save_random(
    config: PretrainedConfig,
    path: Path,
    *,
    vocab_size: int,
    device: str | torch.device = "cpu",
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """Writes a loadable model directory at ``path``: random weights of ``config``'s shape
    (safetensors, ``dtype``) and a byte_tokenizer of ``vocab_size`` ids; no end-of-sequence id
    (the tokenizer's, the config's) is ever emitted (random_model's never_emit). Returns
    ``path``.

    The weights are built on ``device`` (a GPU builds a 1.5B model in a second) and written
    from there; nothing is held twice.
    """
    tokenizer = byte_tokenizer(vocab_size)
    eos = {tokenizer.eos_token_id, *end_ids(config)}
    model = random_model(config, device=device, dtype=dtype, seed=seed, never_emit=eos)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path


def save_random_pair(
    root: Path,
    draft: PretrainedConfig,
    target: PretrainedConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "bfloat16",
) -> tuple[Path, Path]:
    """(draft_dir, target_dir) under ``root``: save_random of each, sharing one tokenizer as
    large as the smaller vocabulary (a pair must share a tokenizer)."""
    vocab = min(draft.vocab_size, target.vocab_size)
    return (
        save_random(draft, root / "draft", vocab_size=vocab, device=device, dtype=dtype, seed=1),
        save_random(target, root / "target", vocab_size=vocab, device=device, dtype=dtype),
    )


def end_ids(config: PretrainedConfig) -> list[int]:
    """The end-of-sequence ids ``config`` names (none, one or several)."""
    value = config.eos_token_id
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
