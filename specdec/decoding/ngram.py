"""Draft-free proposals: n-gram lookup in text already seen, made in the router.

A request's next tokens often repeat text it has already seen: a summary quotes its document,
code repeats its identifiers, an answer reuses the question's words. N-gram lookup (prompt
lookup decoding, Saxena 2023; vLLM's ``ngram``) finds the latest earlier occurrence of the last
n tokens, longest n first, and proposes the tokens that followed it. It costs no accelerator and
no call: a proposal is a few dictionary lookups.

Two indexes feed it:

- ``NgramIndex`` over one request's prompt and output (RequestNgrams keeps it current);
- optionally a ``SharedNgrams`` over recent completions of every request, bounded in bytes, the
  oldest forgotten first (SuffixDecoding, Oliaro et al. 2024, keeps a suffix tree over recent
  outputs; this keeps their n-grams). A request reads another's text only through it, and it
  exists only where the operator turns it on (SpeculationConfig.shared_ngram_bytes).

A proposal is deterministic, so as a draft distribution it is a point mass on each token; the
acceptance rule stays exact with q = 1 at the proposed token (specdec.worker.rejection).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specdec.config import SpeculationConfig

# Bytes one indexed token costs in a SharedNgrams, per n-gram length it is indexed under: its
# slot in the ring (8), a key tuple (56 + 8 n), its dict entry (about 100 with the table's
# slack) and its slot in the eviction ring (8). Measured with tracemalloc by
# tests/unit/test_ngram.py, which holds the bound.
BYTES_PER_TOKEN_PER_N = 220


class NgramIndex:
    """The latest occurrence of every n-gram (min_n <= n <= max_n) of one token sequence.

    ``table[ngram]`` is the position of the token that followed the n-gram's latest occurrence,
    so the n-gram that ends the sequence (whose next token is unknown) is never in it.

    Args:
        min_n, max_n: n-gram lengths, tokens (1 <= min_n <= max_n).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        _check_lengths(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        """Appends tokens, indexing every n-gram that each of them follows. O(len x n)."""
        tokens, table = self.tokens, self.table
        for token in token_ids:
            position = len(tokens)
            for n in range(self.min_n, min(self.max_n, position) + 1):
                table[tuple(tokens[position - n : position])] = position
            tokens.append(token)

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest occurrence of the longest n-gram ending
        ``context`` (the sequence being decoded; its last max_n tokens are read).

        Returns:
            (tokens, n): the proposal and the n-gram length it matched; ([], 0) without a match.
        """
        start, n = _longest_match(self.table, context, self.min_n, self.max_n)
        return (self.tokens[start : start + k], n) if n else ([], 0)


class RequestNgrams:
    """One request's n-gram lookup: its own prompt and output, then the shared index.

    Args:
        prompt_ids: the request's prompt.
        min_n, max_n: as NgramIndex.
        shared: the router's SharedNgrams, None where sharing is off.
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        min_n: int,
        max_n: int,
        shared: SharedNgrams | None = None,
    ) -> None:
        self._own = NgramIndex(min_n, max_n)
        self._own.extend(prompt_ids)
        self._shared = shared
        self._prompt_len = len(prompt_ids)

    def commit(self, token_ids: Sequence[int]) -> None:
        """Appends the tokens the target committed."""
        self._own.extend(token_ids)

    def propose(self, k: int, after: Sequence[int] = ()) -> tuple[list[int], int]:
        """(tokens, n): up to k tokens continuing the request's text followed by ``after``
        (tokens proposed but not yet verified, the draft model's in a mixed round), by the
        longest n-gram match in its own text, else in the shared index; ([], 0) where neither
        matches."""
        if k <= 0:
            return [], 0
        own = self._own.tokens
        context = [*own[-self._own.max_n :], *after] if after else own
        tokens, n = self._own.propose(context, k)
        if not tokens and self._shared is not None:
            tokens, n = self._shared.propose(context, k)
        return tokens, n

    def finish(self) -> None:
        """Offers the completion to the shared index (no-op where sharing is off)."""
        if self._shared is not None:
            self._shared.add(self._own.tokens[self._prompt_len :])


class SharedNgrams:
    """N-grams of recent completions of every request of a router, bounded in bytes.

    A ring of ``capacity_tokens`` tokens: a new completion overwrites the oldest tokens, and the
    n-grams whose continuation they held leave the index with them, so its memory stays within
    ``capacity_bytes`` (BYTES_PER_TOKEN_PER_N per token per n-gram length). N-grams never span
    two completions. Thread-safe.

    Args:
        capacity_bytes: the bound (> 0).
        min_n, max_n: as NgramIndex.
    Raises:
        ValueError: a bound too small for one token, or bad n-gram lengths.
    """

    def __init__(self, capacity_bytes: int, min_n: int, max_n: int) -> None:
        _check_lengths(min_n, max_n)
        per_token = BYTES_PER_TOKEN_PER_N * (max_n - min_n + 1)
        self.capacity_tokens = capacity_bytes // per_token
        if self.capacity_tokens < 1:
            raise ValueError(f"shared_ngram_bytes {capacity_bytes} holds no token ({per_token})")
        self.min_n, self.max_n = min_n, max_n
        self._ring: list[int] = [0] * self.capacity_tokens
        self._keys: list[tuple[tuple[int, ...], ...]] = [()] * self.capacity_tokens
        self._table: dict[tuple[int, ...], int] = {}
        self._written = 0  # tokens ever written; position p lives at p % capacity
        self._lock = threading.Lock()

    def add(self, token_ids: Sequence[int]) -> None:
        """Indexes one completion (its last capacity_tokens tokens), evicting the oldest."""
        token_ids = list(token_ids)[-self.capacity_tokens :]
        with self._lock:
            start = self._written
            for i, token in enumerate(token_ids):
                self._write(start + i, token, token_ids[max(i - self.max_n, 0) : i])

    def _write(self, position: int, token: int, before: list[int]) -> None:
        """Writes ``token`` at ``position`` and indexes the n-grams of ``before`` (the up to
        max_n tokens of its completion before it) that it follows."""
        slot = position % self.capacity_tokens
        for key in self._keys[slot]:  # the n-grams whose continuation this slot held
            if self._table.get(key) == position - self.capacity_tokens:
                del self._table[key]
        keys = tuple(tuple(before[-n:]) for n in range(self.min_n, len(before) + 1))
        for key in keys:
            self._table[key] = position
        self._ring[slot], self._keys[slot] = token, keys
        self._written = position + 1

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """As NgramIndex.propose, over the completions still held."""
        with self._lock:
            start, n = _longest_match(self._table, context, self.min_n, self.max_n)
            if not n:
                return [], 0
            end = min(start + k, self._written)
            return [self._ring[p % self.capacity_tokens] for p in range(start, end)], n

    def __len__(self) -> int:
        """N-grams indexed."""
        return len(self._table)


def _check_lengths(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")


def _longest_match(
    table: dict[tuple[int, ...], int], context: Sequence[int], min_n: int, max_n: int
) -> tuple[int, int]:
    """(position, n): where the continuation of the longest n-gram (max_n down to min_n)
    ending ``context`` starts in ``table``; (0, 0) without a match."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        start = table.get(tuple(context[-n:]))
        if start is not None:
            return start, n
    return 0, 0


def shared_ngrams(config: SpeculationConfig) -> SharedNgrams | None:
    """The router's (or engine's) SharedNgrams, sized by config.shared_ngram_bytes; None when
    that is 0 (sharing off)."""
    if config.shared_ngram_bytes == 0:
        return None
    return SharedNgrams(config.shared_ngram_bytes, config.ngram_min_n, config.ngram_max_n)
