"""Tiny random model pairs, built locally in seconds: for tests and for trying the service
without real weights (`specdec tiny-models`). Their output is gibberish, but every property of the
algorithm (exactness, stop rules, caches) holds for them as for real models."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a small draft model propose tokens that a large target verifies.",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time there was a tiny model that dreamed of being large.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
] * 20

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "Once upon a time",
    "for i in range(10):",
    "Speculative decoding lets",
    "import numpy as np",
    "x = 1\ny = 2\n",
    "a small draft model",
]


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a small corpus, with a chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_word_tokenizer(vocab_size: int = 32) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``vocab_size`` made-up words: small enough that a sampling test
    sees every token often."""
    words = [EOS] + [f"w{i}" for i in range(vocab_size - 1)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    layers: int = 2,
    hidden: int = 32,
    context_limit: int = 256,
    pad_vocab: int = 0,
    init_std: float = 0.15,
) -> LlamaForCausalLM:
    """A random Llama. ``pad_vocab`` extra embedding rows mimic Qwen's padded vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + pad_vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_limit,
        initializer_range=init_std,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def perturbed_copy(model: LlamaForCausalLM, *, seed: int, noise: float) -> LlamaForCausalLM:
    """The same weights plus Gaussian noise of relative size ``noise``: a draft that agrees with
    the target often but not always."""
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(
                torch.randn(param.shape, generator=generator) * noise * param.std().clamp(min=1e-3)
            )
    return copy


def save_pair(
    root: Path,
    *,
    noise: float = 0.3,
    context_limit: int = 256,
    pad_vocab: int = 0,
    seed: int = 0,
    vocab_size: int = 320,
    word_level: bool = False,
    dtype: str = "float32",
) -> tuple[Path, Path]:
    """Writes (draft_dir, target_dir) as Hugging Face directories, weights in ``dtype``
    ("bfloat16": stored like the bundled pair, so loading in float32 gives weights that are all
    bfloat16 values), and returns them."""
    tokenizer = build_word_tokenizer(vocab_size) if word_level else build_tokenizer(vocab_size)
    target = build_model(tokenizer, seed=seed, context_limit=context_limit, pad_vocab=pad_vocab)
    draft = perturbed_copy(target, seed=seed + 1, noise=noise)
    paths = root / "draft", root / "target"
    for model, path in zip((draft, target), paths):
        model.to(getattr(torch, dtype)).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths
