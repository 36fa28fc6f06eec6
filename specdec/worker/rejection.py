"""The speculative acceptance rule: which draft tokens the target keeps, and the token it adds.

Greedy: accept draft tokens while they equal the target's argmax, then emit the target's argmax
at the first mismatch (or after the last draft token: the bonus token). The output is the target's
greedy output, token for token.

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
section 2.3 and appendix A.1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", algorithm 2): draft token x_i, drawn from q_i, is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the replacement is drawn from
norm(max(0, p_i - q_i)); when all k are accepted the bonus token is drawn from p_k. Each emitted
token is then distributed exactly as p, for any q.
"""

from __future__ import annotations

import torch

from specdec.worker.sampling import sample


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification.

    Args:
        draft_ids: [k] int64 draft tokens.
        target_logits: [k + 1, V] target logits at the positions predicting each draft token and
            the one after the last.
    Returns:
        (number of accepted draft tokens in 0..k, the target's argmax after them).
    """
    target_ids = target_logits.argmax(dim=-1)
    num_accepted = _leading_true(draft_ids == target_ids[:-1])
    return num_accepted, int(target_ids[num_accepted])


def verify_sampled(
    draft_ids: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling by rejection (Leviathan et al. 2023, algorithm 1).

    Args:
        draft_ids: [k] int64 draft tokens; draft_ids[i] was drawn from q[i].
        q: [k, V] float32 draft distributions the tokens were drawn from.
        p: [k + 1, V] float32 target distributions after temperature / top-k / top-p.
        generator: source of the k acceptance draws and the final draw.
    Returns:
        (number of accepted draft tokens in 0..k, the correction or bonus token).
    """
    k = draft_ids.shape[0]
    uniforms = torch.rand(k, generator=generator)
    rows = torch.arange(k)
    # u < p(x) / q(x), written without the division so q(x) = 0 cannot produce NaN.
    accepted = uniforms * q[rows, draft_ids] < p[rows, draft_ids]
    num_accepted = _leading_true(accepted)
    final = residual_distribution(p[num_accepted], q[num_accepted]) if num_accepted < k else p[k]
    return num_accepted, sample(final, generator)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after rejecting a draft token.

    Args:
        p, q: [V] target and draft distributions.
    Returns:
        [V] distribution. When p == q (up to rounding) the residual has no mass; a rejection then
        has probability zero, and p is returned so the draw stays well defined.
    """
    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum()
    if mass <= 1e-12:
        return p
    return residual / mass


def _leading_true(mask: torch.Tensor) -> int:
    """Length of the run of True at the start of a [k] bool tensor."""
    if mask.numel() == 0:
        return 0
    return int(torch.cumprod(mask.to(torch.int64), dim=0).sum())
