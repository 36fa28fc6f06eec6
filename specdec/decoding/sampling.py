"""A request's sampling parameters, validated on the router side (no torch here).

The logits processing they drive, shared by the draft and the target, is
specdec.worker.sampling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

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
