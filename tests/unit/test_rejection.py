"""The acceptance rule on synthetic distributions: exactness with many samples, and power."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.worker import rejection
from specdec.worker.rejection import residual_distribution, verify_greedy, verify_sampled

V = 6


def _logits_with_argmax(ids):
    logits = torch.zeros(len(ids), V)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


@pytest.mark.parametrize(
    "draft, target, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted: bonus token
        ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # mismatch at position 1: target's token there
        ([1, 2, 3], [0, 2, 3, 4], (0, 0)),  # first rejected
        ([], [2], (0, 2)),  # k = 0: a plain decode step
    ],
)
def test_greedy_accepts_while_draft_equals_target_argmax(draft, target, expected):
    assert (
        verify_greedy(torch.tensor(draft, dtype=torch.long), _logits_with_argmax(target))
        == expected
    )


def _random_dist(generator, rows):
    return torch.softmax(torch.randn(rows, V, generator=generator) * 1.5, dim=-1)


def _first_token_counts(p, q, n, seed):
    """Runs k = 2 verification n times with draft tokens drawn from q; counts the first emitted
    token (the accepted draft token or the replacement)."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros(V)
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=generator).flatten()
        accepted, token = verify_sampled(drafts, q, p, generator)
        counts[int(drafts[0]) if accepted > 0 else token] += 1
    return counts


def test_sampled_tokens_follow_the_target_distribution_and_a_broken_residual_is_caught(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    p, q = _random_dist(generator, 3), _random_dist(generator, 2)
    n = 20_000
    good = _first_token_counts(p, q, n, seed=1)
    assert stats.chisquare(good, _expected(p[0], n)).pvalue > 1e-3

    # The classic bug: resampling from p instead of norm(max(0, p - q)) after a rejection.
    monkeypatch.setattr(rejection, "residual_distribution", lambda p_row, q_row: p_row)
    broken = _first_token_counts(p, q, n, seed=1)
    assert stats.chisquare(broken, _expected(p[0], n)).pvalue < 1e-6


def test_bonus_token_is_drawn_from_the_last_target_row():
    p = torch.tensor([[0.0, 1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0, 0, 0, 0]])
    accepted, token = verify_sampled(torch.tensor([1]), q, p, torch.Generator().manual_seed(0))
    assert (accepted, token) == (1, 5)


def test_residual_is_normalised_positive_part_and_falls_back_to_p_when_empty():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p.clone()), p)


def test_a_token_the_target_excludes_is_always_rejected():
    p = torch.tensor([[0.0, 0.0, 1.0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    q = torch.tensor([[0.0, 1.0, 0, 0, 0, 0]])
    for seed in range(20):
        assert verify_sampled(torch.tensor([1]), q, p, torch.Generator().manual_seed(seed)) == (
            0,
            2,
        )


def _expected(probs, n):
    expected = probs.double().numpy()
    return expected / expected.sum() * n
