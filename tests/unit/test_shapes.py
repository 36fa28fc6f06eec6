"""Random-weight models in the shipped real shapes (specdec.models.shapes)."""

from __future__ import annotations

import pytest
import torch

from specdec.models import shapes
from specdec.models.loading import load_model


def test_the_14b_target_has_qwen2_5_14b_s_shape_and_parameter_count_on_the_meta_device():
    config = shapes.load_shape(shapes.TARGET_14B)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        48,
        5120,
        13824,
    )
    assert (config.num_attention_heads, config.num_key_value_heads) == (40, 8)
    assert config.vocab_size == 152064 and not config.tie_word_embeddings
    model = shapes.random_model(config, device="meta", dtype="bfloat16")
    params = shapes.parameter_count(model)
    assert 14.6e9 < params < 14.9e9, params  # the model card's 14.7B
    assert next(model.parameters()).device.type == "meta"
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "name, layers, billions",
    [(shapes.BUNDLED_DRAFT, 24, (0.6, 0.65)), (shapes.BUNDLED_TARGET, 28, (1.7, 1.8))],
)
def test_the_bundled_pair_shapes_are_the_converted_pair_s(name, layers, billions):
    # Converted from GGUF with an output matrix of its own (untied): 136M or 233M parameters
    # more than the upstream cards' tied 0.49B and 1.54B.
    config = shapes.load_shape(name)
    assert config.num_hidden_layers == layers and config.vocab_size == 151936
    params = shapes.parameter_count(shapes.random_model(config, device="meta"))
    assert billions[0] * 1e9 < params < billions[1] * 1e9, params


def test_a_random_model_is_initialised_on_its_device_in_its_dtype_and_is_reproducible():
    config = shapes.load_shape(shapes.BUNDLED_TARGET, toy=True)
    first = shapes.random_model(config, dtype="float32", seed=3)
    again = shapes.random_model(config, dtype="float32", seed=3)
    other = shapes.random_model(config, dtype="float32", seed=4)
    weight = first.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == torch.float32 and weight.device.type == "cpu"
    assert 0.015 < weight.std().item() < 0.025  # initializer_range 0.02, not to_empty's garbage
    assert torch.equal(first.model.norm.weight, torch.ones_like(first.model.norm.weight))
    assert torch.isfinite(first.model.rotary_emb.inv_freq).all()
    assert torch.equal(weight, again.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(weight, other.model.layers[0].self_attn.q_proj.weight)


def test_never_emitted_ids_have_a_zero_output_row_and_greedy_decoding_skips_them():
    config = shapes.load_shape(shapes.BUNDLED_DRAFT, toy=True)
    model = shapes.random_model(config, dtype="float32", never_emit=[0, 5, 10**9])
    head = model.get_output_embeddings().weight
    assert not head[0].any() and not head[5].any() and head[1].any()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[7, 8, 9]]), max_new_tokens=20, do_sample=False, eos_token_id=None
        )
    assert not {0, 5} & set(out[0, 3:].tolist())


def test_a_saved_random_pair_loads_as_a_pair_sharing_a_tokenizer(tmp_path):
    draft = shapes.load_shape(shapes.BUNDLED_DRAFT, toy=True)
    target = shapes.load_shape(shapes.TARGET_14B, toy=True)
    target.vocab_size = 600  # a padded embedding, as the 14B's 152064 rows past 151936 ids
    draft_dir, target_dir = shapes.save_random_pair(tmp_path, draft, target, dtype="float32")
    loaded = load_model(target_dir)
    assert loaded.vocab_size == 512  # the smaller vocabulary
    assert loaded.model.get_output_embeddings().weight.shape[0] == 600
    assert loaded.eos_token_ids == {0}
    assert load_model(draft_dir).tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    # It loads back as Qwen2's tokenizer class, which rebuilds the BPE: text round-trips.
    ids = loaded.tokenizer("def add(a, b):").input_ids
    assert ids and loaded.tokenizer.decode(ids) == "def add(a, b):"


def test_a_byte_tokenizer_has_exactly_the_size_asked_for():
    tokenizer = shapes.byte_tokenizer(70_000)  # past the 65,536 two-byte merges
    assert len(tokenizer) == 70_000 and tokenizer.eos_token_id == 0
    assert tokenizer.decode(tokenizer("héllo wörld").input_ids) == "héllo wörld"
    with pytest.raises(ValueError, match="258"):
        shapes.byte_tokenizer(100)


def test_an_unknown_shape_or_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=shapes.TARGET_14B):
        shapes.load_shape("qwen-70b")
    with pytest.raises(ValueError, match="bfloat16"):
        shapes.random_model(shapes.load_shape(shapes.BUNDLED_DRAFT, toy=True), dtype="int4")
