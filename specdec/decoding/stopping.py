"""Stop rules applied to each block of committed tokens, and the text streamed so far.

A round commits a block of up to k + 1 tokens at once; generation must still stop exactly where
token-by-token decoding would: at an EOS or stop token (kept in ``token_ids``, left out of the
text), when a stop string completes (the text ends before it, ``token_ids`` end with the token
that completed it), at ``max_new_tokens``, or at the context limit. Everything is checked token
by token inside the block, so the result does not depend on how tokens were grouped in rounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from specdec.errors import InvalidRequestError

STOP = "stop"
LENGTH = "length"


@dataclasses.dataclass
class Delta:
    """What one block added: its kept tokens, their log-probabilities, and new safe text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


class StopChecker:
    """Accumulates the completion and applies the stop rules block by block.

    Detokenizes incrementally (tokenizers' DecodeStream: each token re-decodes only a few
    tokens before it), so a round costs O(block) however long the completion is; decoding the
    whole completion every round made a long stream's rounds O(n) each and its life O(n^2).
    The text grows only by characters that can no longer change: a token that ends inside a
    UTF-8 sequence adds nothing until the token that completes it. The text equals
    ``tokenizer.decode(token_ids)`` (special tokens skipped, no clean-up) at every step but
    for such an unfinished tail, which the finished text includes (as U+FFFD).

    Args:
        tokenizer: a fast tokenizer (one with a ``backend_tokenizer``); detokenizes the
            completion with special tokens skipped.
        max_new_tokens: completion tokens allowed, already capped by the context limit; reaching
            it ends with ``finish_reason="length"``.
        stop_token_ids: EOS ids and the request's stop token ids.
        stop: stop strings. The text is decoded with special tokens skipped, so a stop string
            that is exactly a special token's text ("<|im_start|>") stops at that token, as a
            stop token id does (same result: the token ends token_ids, the text ends before
            it).
    Raises:
        InvalidRequestError("stop"): a stop string that holds a special token's text beside
            other text (it could never match the decoded text).
        TypeError: the tokenizer has no fast (tokenizers) backend.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int,
        stop_token_ids: Iterable[int],
        stop: Sequence[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is None:
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer")
        self._stream = DecodeStream(skip_special_tokens=True)
        self.max_new_tokens = max_new_tokens
        specials = special_token_ids(tokenizer)
        self._stop_ids = frozenset(stop_token_ids) | {specials[s] for s in stop if s in specials}
        self._stop = tuple(s for s in stop if s not in specials)
        for s in self._stop:
            inside = next((t for t in specials if t in s), None)
            if inside is not None:
                raise InvalidRequestError(
                    "stop",
                    f"{s[:50]!r} contains the special token {inside!r}, which the text leaves "
                    "out; a stop string may be exactly one special token, or contain none",
                )
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.text = ""
        self._streamed = 0  # characters of text already handed out
        # len(text) once each leading token of token_ids was decoded; len(_ends) tokens make up
        # the text (a stop token is kept in token_ids but left out of the text).
        self._ends: list[int] = []
        self._unfinished = False  # the last decoded token left an incomplete character

    @property
    def remaining(self) -> int:
        """Tokens that may still be committed."""
        return self.max_new_tokens - len(self.token_ids)

    def append(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> Delta:
        """Commits a block, trimmed at the first stop; returns what it adds."""
        if self.finish_reason is not None:
            raise RuntimeError("append after the completion finished")
        block = list(token_ids[: self.remaining])
        stop_at = next((i for i, t in enumerate(block) if t in self._stop_ids), None)
        if stop_at is not None:
            block = block[: stop_at + 1]
        start = len(self.token_ids)
        self.token_ids.extend(block)
        self.logprobs.extend(logprobs[: len(block)])
        self._decode(block[: len(block) - (stop_at is not None)])
        cut = self._find_stop(start) if self._stop else None
        if cut is not None:
            stop_at = cut
        if stop_at is not None:
            self.finish_reason = STOP
        elif self.remaining == 0:
            self.finish_reason = LENGTH
        if self.finish_reason is not None and cut is None and self._unfinished:
            self.text = self._tokenizer.decode(
                self.token_ids[: len(self._ends)],
                skip_special_tokens=True,
                clean_up_tokenization_spaces=False,
            )
        return Delta(
            self.token_ids[start:], self.logprobs[start:], self._take_text(), self.finish_reason
        )

    def _decode(self, token_ids: list[int]) -> None:
        """Extends the text by token_ids, recording its length after each."""
        chunks = []
        length = len(self.text)
        for token_id in token_ids:
            chunk = self._stream.step(self._backend, token_id)
            self._unfinished = chunk is None
            if chunk:
                chunks.append(chunk)
                length += len(chunk)
            self._ends.append(length)
        self.text += "".join(chunks)

    def _find_stop(self, block_start: int) -> int | None:
        """Trims the completion at the earliest stop string completed in this block; returns
        the index of the token that completed it, or None."""
        before = self._ends[block_start - 1] if block_start else 0
        search_from = max(0, before - self._holdback)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        end = index + len(stop)
        # The shortest prefix of the completion whose text contains the whole stop string.
        last = next(n for n in range(block_start, len(self._ends)) if self._ends[n] >= end) + 1
        del self.token_ids[last:]
        del self.logprobs[last:]
        del self._ends[last:]
        self.text = self.text[:index]
        return last - 1

    def _take_text(self) -> str:
        """New text that can no longer change: held back is a possible stop-string prefix."""
        safe = len(self.text)
        if self.finish_reason is None:
            safe -= self._holdback
        if safe <= self._streamed:
            return ""
        delta = self.text[self._streamed : safe]
        self._streamed = safe
        return delta


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """{text: id} of the tokens that decoding with skip_special_tokens leaves out: the
    tokenizer's special tokens and its added tokens marked special."""
    specials = {
        token.content: token_id
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if token.special
    }
    for text in tokenizer.all_special_tokens:
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id >= 0:
            specials.setdefault(text, token_id)
    return specials
