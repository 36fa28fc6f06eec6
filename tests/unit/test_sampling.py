"""Logits processing and request parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from specdec import InvalidRequestError, SamplingParams
from specdec.worker.sampling import (
    processed_probs,
    request_generator,
    sparse_to_dense,
    truncate_top_n,
)


def test_temperature_one_is_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(processed_probs(logits, 1.0), torch.softmax(logits, -1))


def test_top_k_keeps_k_most_likely_and_renormalises():
    probs = processed_probs(torch.tensor([0.0, 3.0, 1.0, 2.0]), 1.0, top_k=2)
    expected = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    assert torch.allclose(probs, torch.tensor([0.0, expected[0], 0.0, expected[1]]))


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = processed_probs(probs.log(), 1.0, top_p=0.8)
    assert torch.allclose(out, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    # The most likely token always survives, however small top_p is.
    assert torch.allclose(
        processed_probs(probs.log(), 1.0, top_p=0.01), torch.tensor([1.0, 0, 0, 0])
    )


def test_truncate_top_n_is_sparse_and_normalised():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    ids, values = truncate_top_n(probs, 2)
    assert ids.tolist() == [[1, 3]]
    assert torch.allclose(values, torch.tensor([[4 / 7, 3 / 7]]))
    dense = sparse_to_dense(ids, values, 4)
    assert torch.allclose(dense, torch.tensor([[0, 4 / 7, 0, 3 / 7]]))


def test_request_generator_is_keyed_by_seed_stream_and_position():
    def draw(*key) -> list[float]:
        return torch.rand(4, generator=request_generator(*key)).tolist()

    assert draw(7, "draft", 10) == draw(7, "draft", 10)
    assert (
        len(
            {
                tuple(draw(*key))
                for key in [(7, "draft", 10), (8, "draft", 10), (7, "target", 10), (7, "draft", 11)]
            }
        )
        == 4
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("max_new_tokens", 0),
        ("max_new_tokens", -3),
        ("seed", -1),
        ("stop", [""]),
        ("stop_token_ids", [-2]),
    ],
)
def test_invalid_parameters_raise_value_error_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert isinstance(err.value, ValueError)
    assert err.value.field == field and str(err.value).startswith(field)
