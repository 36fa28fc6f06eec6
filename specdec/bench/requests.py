"""One request to the service, sent and timed as a client sees it: the per-request record of
`specdec sweep`, `specdec loadtest` and `specdec soak`, and the two ways to fill it (a blocking
client for threads, grpc.aio for an event loop).

A command keeps its own context beside the record (which stage, cell or plan entry the request
was) by extending RequestRecord, and names the fields its JSON writes in its own ``record()``.
Times are seconds on the clock the command passes in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import grpc

OK = "OK"
# The gRPC code of a request refused by backpressure: it never ran, and may be retried later.
REFUSED = "RESOURCE_EXHAUSTED"


@dataclasses.dataclass(kw_only=True)
class RequestRecord:
    """One request as the client saw it.

    Attributes:
        start_s, end_s: when it was sent and when its last message (or its error) came; end_s
            is NaN while it runs.
        ttft_s: time to first token, s (None: no token came, or not measured).
        tokens: completion tokens received; token_ids: their ids (None when not kept).
        code: the gRPC status code name ("OK" once it completed).
        details: the error's details (gRPC's, possibly None) when it failed.
        cut: cancelled by the end of the run, not failed.
        draft_tokens, accepted_tokens, draft_time_s, rounds_without_draft: from the request's
            final SpeculationStats (0 when none came).
    """

    start_s: float
    end_s: float = math.nan
    ttft_s: float | None = None
    tokens: int = 0
    token_ids: list[int] | None = None
    code: str = OK
    details: str | None = ""
    cut: bool = False
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_time_s: float = 0.0
    rounds_without_draft: int = 0

    @property
    def ok(self) -> bool:
        return self.code == OK

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    def take_stats(self, stats: Any) -> None:
        """Copies what the record keeps of a specdec.v1 SpeculationStats (None: nothing)."""
        if stats is not None:
            self.draft_tokens, self.accepted_tokens = stats.draft_tokens, stats.accepted_tokens
            self.draft_time_s = stats.draft_time_s
            self.rounds_without_draft = stats.rounds_without_draft


def send(
    client, request, record: RequestRecord, *, stream: bool, clock: Callable[[], float]
) -> None:
    """Sends ``request`` with ``client`` (a specdec.client.SpecdecClient), filling ``record``,
    whose ``start_s`` the caller set on ``clock``.

    Streaming: TTFT at the first message that carries tokens, the stats of the last message
    that has them. Unary: the server's TTFT and stats. A gRPC error is recorded (code,
    details), with the tokens that came before it, not raised; ``code`` becomes "OK" last, after
    the tokens and stats, so another thread that sees it sees them too.
    """
    ids: list[int] = []
    stats = None
    try:
        if stream:
            for message in client.generate_stream(request):
                if message.token_ids and record.ttft_s is None:
                    record.ttft_s = clock() - record.start_s
                ids.extend(message.token_ids)
                if message.HasField("stats"):
                    stats = message.stats
        else:
            response = client.generate(request)
            ids, stats = list(response.token_ids), response.stats
            record.ttft_s = stats.ttft_s
    except grpc.RpcError as err:
        record.code, record.details = err.code().name, err.details()
        code = record.code
    else:
        code = OK
    record.token_ids, record.tokens = ids, len(ids)
    record.take_stats(stats)
    record.code = code
    record.end_s = clock()


async def send_async(
    stub,
    request,
    record: RequestRecord,
    *,
    stream: bool,
    metadata: Sequence[tuple[str, str]],
    timeout_s: float,
    clock: Callable[[], float],
    on_tokens: Callable[[float, int], None],
) -> list[int]:
    """Sends ``request`` through ``stub`` (a grpc.aio SpeculativeDecodingStub), filling
    ``record`` (``start_s`` set by the caller on ``clock``); returns the token ids received.

    Streaming: TTFT at the first message's arrival; unary: the server's TTFT.
    ``on_tokens(t, n)`` is told of every ``n`` tokens received at time ``t``. A gRPC error is
    recorded, not raised; a cancel of the calling task (the end of a run) cancels the call and
    marks the record ``cut`` (code CANCELLED) instead of propagating.
    """
    method = stub.GenerateStream if stream else stub.Generate
    call = method(request, metadata=metadata, timeout=timeout_s)
    ids: list[int] = []
    try:
        if stream:
            async for message in call:
                now = clock()
                if record.ttft_s is None:
                    record.ttft_s = now - record.start_s
                record.tokens += len(message.token_ids)
                on_tokens(now, len(message.token_ids))
                ids.extend(message.token_ids)
        else:
            response = await call
            record.ttft_s, record.tokens = response.stats.ttft_s, len(response.token_ids)
            on_tokens(clock(), record.tokens)
            ids.extend(response.token_ids)
    except grpc.aio.AioRpcError as err:
        record.code = err.code().name
    except asyncio.CancelledError:  # only the end of the run cancels
        call.cancel()
        record.code, record.cut = "CANCELLED", True
    record.end_s = clock()
    return ids
