"""The logits processing shared by the draft and target models, and the request's draws.

The target's distribution ``p`` and the draft's distribution ``q`` are shaped by the same request
parameters (temperature, top-k, top-p; specdec.decoding.sampling.SamplingParams), so that
speculative sampling reproduces the distribution a target-only sampler with those parameters
would draw from (Leviathan et al. 2023, section 2.3).
"""

from __future__ import annotations

import hashlib

import torch


def processed_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """The sampling distribution after temperature, top-k and top-p.

    Args:
        logits: [..., V] raw next-token logits.
        temperature: > 0 (greedy decoding never calls this).
    Returns:
        [..., V] float32 probabilities summing to 1 over the last axis; tokens removed by top-k or
        top-p have probability exactly 0.
    """
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Mass strictly before each token: a token is kept while that mass is below top_p, so the
        # most likely token always survives.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def truncate_top_n(probs: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps the top_n most likely tokens of each row and renormalises.

    Speculative sampling stays exact for any draft distribution q, so the draft may sample from
    this truncated q as long as it reports it; a sparse q is cheap to send to the target.

    Args:
        probs: [rows, V] probabilities.
        top_n: kept tokens per row; 0 or >= V keeps the whole row (still returned sparse).
    Returns:
        (token_ids [rows, N] int64, probs [rows, N] float32), each row summing to 1.
    """
    vocab = probs.shape[-1]
    width = vocab if top_n <= 0 or top_n >= vocab else top_n
    values, ids = torch.topk(probs, width, dim=-1)
    return ids, values / values.sum(dim=-1, keepdim=True)


def sparse_to_dense(token_ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, N] sparse rows -> [rows, vocab_size] dense float32 distributions."""
    dense = torch.zeros(token_ids.shape[0], vocab_size, dtype=torch.float32)
    return dense.scatter_(1, token_ids.long(), probs.float())


def request_generator(seed: int, stream: str, position: int) -> torch.Generator:
    """A CPU generator keyed by (request seed, stream, committed position).

    Keying the draws by position rather than by call order makes them independent of which
    replica serves a call and of cache rebuilds: the same seed gives the same output even when a
    session moves between replicas. ``stream`` separates the draft's draws from the target's.
    """
    digest = hashlib.blake2b(f"{seed}:{stream}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id drawn from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
