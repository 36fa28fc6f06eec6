"""The soak's load: its request mix (every prompt of specdec.models.tiny, 16..64 new tokens, k 0,
1, 3 or adaptive, unary or streaming, in a fixed shuffled cycle), each request's outcome, and the
client threads that send them; every output is checked against the reference.

Times are seconds since the load's start.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specdec.bench.requests import RequestRecord, send
from specdec.config import APPLICATION

KS: tuple[int | None, ...] = (0, 1, 3, None)  # None: num_speculative_tokens unset (adaptive)


NEW_TOKENS = (16, 32, 48, 64)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One greedy request of the soak: prompt (index into specdec.models.tiny.PROMPTS), new
    tokens, speculative tokens (None: adaptive) and unary or streaming."""

    prompt_index: int
    max_new_tokens: int
    k: int | None
    stream: bool

    @property
    def k_label(self) -> str:
        return "auto" if self.k is None else str(self.k)


def request_plan(n_prompts: int, seed: int = 0) -> list[RequestSpec]:
    """Every (prompt, NEW_TOKENS, KS, unary/stream) combination once, in a shuffled order that
    the clients cycle through (so every kind runs in every phase)."""
    specs = [
        RequestSpec(p, n, k, stream)
        for p in range(n_prompts)
        for n in NEW_TOKENS
        for k in KS
        for stream in (False, True)
    ]
    random.Random(seed).shuffle(specs)
    return specs


@dataclasses.dataclass(kw_only=True)
class Outcome(RequestRecord):
    """What one request did (specdec.bench.requests.RequestRecord; times in s since the load's
    start): its place in the load (``index``) and its spec. ``code`` is the gRPC status name
    (CLIENT_<Exception> for a client-side failure, IN_FLIGHT while it runs); ``mismatch_at``
    the first token index where the output left the reference (None: equal or failed)."""

    index: int
    spec: RequestSpec
    code: str = "IN_FLIGHT"
    mismatch_at: int | None = None

    def record(self) -> dict[str, Any]:
        """JSON-ready fields (a failed request's tokens are not counted)."""
        return {
            "index": self.index,
            "spec": dataclasses.asdict(self.spec),
            "start_s": self.start_s,
            "end_s": self.end_s,
            "code": self.code,
            "details": self.details,
            "tokens": self.tokens if self.ok else 0,
            "mismatch_at": self.mismatch_at,
            "rounds_without_draft": self.rounds_without_draft,
            "draft_tokens": self.draft_tokens,
        }


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first token where ``got`` and ``want`` differ (length counts); None if
    equal."""
    if list(got) == list(want):
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


class Load:
    """Client threads that cycle through ``plan``; thread ``slot`` sends only while
    ``slot < concurrency``. Every outcome is checked against ``references``."""

    def __init__(
        self,
        address: str,
        plan: Sequence[RequestSpec],
        references: Mapping[tuple[int, int], Sequence[int]],
        clock: Callable[[], float],
        timeout_s: float,
    ) -> None:
        from specdec.client import SpecdecClient

        self.client = SpecdecClient(address, APPLICATION, timeout_s=timeout_s)
        self.plan, self.references, self.clock = plan, references, clock
        self.concurrency = 0
        self.outcomes: list[Outcome] = []
        self._next = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, slots: int) -> None:
        for slot in range(slots):
            thread = threading.Thread(target=self._worker, args=(slot,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float) -> int:
        """Lets every client finish its request, then ends; returns how many threads were
        still running after ``timeout_s`` seconds (their requests stay IN_FLIGHT: failed)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.client.close()
        return sum(t.is_alive() for t in self._threads)

    def _worker(self, slot: int) -> None:
        while not self._stop.is_set():
            if slot >= self.concurrency:
                self._stop.wait(0.1)
                continue
            index = next(self._next)
            spec = self.plan[index % len(self.plan)]
            outcome = Outcome(index=index, spec=spec, start_s=round(self.clock(), 3))
            self.outcomes.append(outcome)  # IN_FLIGHT until it ends: a hung one is counted
            self._call(outcome)

    def _call(self, outcome: Outcome) -> None:
        from specdec.client import build_request
        from specdec.models.tiny import PROMPTS

        spec = outcome.spec
        request = build_request(
            PROMPTS[spec.prompt_index],
            max_new_tokens=spec.max_new_tokens,
            num_speculative_tokens=spec.k,
        )
        try:  # the final message (or the response) carries the request's stats
            send(self.client, request, outcome, stream=spec.stream, clock=self.clock)
        except Exception as err:  # noqa: BLE001 - a client-side failure is a failed request
            outcome.code, outcome.details = f"CLIENT_{type(err).__name__}", str(err)
        if outcome.ok:
            want = self.references[(spec.prompt_index, spec.max_new_tokens)]
            outcome.mismatch_at = first_difference(outcome.token_ids, want)
        else:
            outcome.details = str(outcome.details)
        outcome.end_s = round(self.clock(), 3)
