"""Sampling parameters and the logits processing shared by the draft and target models.

The target's distribution ``p`` and the draft's distribution ``q`` are shaped by the same request
parameters (temperature, top-k, top-p), so that speculative sampling reproduces the distribution a
target-only sampler with those parameters would draw from (Leviathan et al. 2023, section 2.3).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import torch

from specdec.errors import InvalidRequestError

DEFAULT_MAX_NEW_TOKENS = 64
# Temperatures below this are greedy decoding, the limit of sampling as the temperature goes
# to 0. Dividing logits by a far smaller one overflows (1e-40 is subnormal in float32: the
# logits become inf and softmax NaN); above it a float32 logit gap of 1e-4 already scales to a
# factor of e**-10 between the top two tokens, so nothing but exact ties changes.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_new_tokens: completion tokens to generate at most (>= 1).
        temperature: 0 selects greedy decoding (argmax); > 0 divides the logits before softmax.
            Values below GREEDY_BELOW_TEMPERATURE (1e-5) are stored as 0: greedy.
        top_k: keep the k most likely tokens before sampling; 0 disables.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 disables.
        seed: seeds every random draw of the request; ``None`` picks a fresh random seed.
        stop: stop strings; the output text ends before the first occurrence of any of them.
        stop_token_ids: token ids that end generation, in addition to the tokenizer's EOS ids.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        self.validate()
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raises InvalidRequestError (a ValueError) naming the first invalid field."""
        _check(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            "max_new_tokens",
            f"must be an integer >= 1, got {self.max_new_tokens!r}",
        )
        _check(
            _is_real(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            f"must be an integer >= 0, got {self.top_k!r}",
        )
        _check(
            _is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**64),
            "seed",
            f"must be an integer in [0, 2**64), got {self.seed!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop strings must be non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop token ids must be integers >= 0",
        )


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)


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
