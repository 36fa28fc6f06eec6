"""Honest memory on the real cluster: cancelled streams leave no cache behind, on any replica."""

from __future__ import annotations

import time

import grpc
import pytest
from serve_state import cache_stats_per_replica as _cache_stats_per_replica

from specdec.client import build_request
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.integration
SIDES = ("DraftModel", "TargetModel")
STREAMS = 20


def _held() -> dict[str, list[tuple[int, int, int]]]:
    """{deployment: [(sessions, bytes, capacity_bytes) of each replica]}."""
    return {
        d: [
            (s.sessions, s.bytes, s.capacity_bytes) for _, s in _cache_stats_per_replica(d).values()
        ]
        for d in SIDES
    }


def _all_sides_hold(held: dict[str, list[tuple[int, int, int]]]) -> bool:
    return all(sum(sessions for sessions, _, _ in held[d]) for d in SIDES)


def _empty(held: dict[str, list[tuple[int, int, int]]]) -> bool:
    return all(held[d] and all(s[:2] == (0, 0) for s in held[d]) for d in SIDES)


def test_twenty_cancelled_streams_leave_every_cache_empty(served):
    client, _ = served
    streams = [
        client.generate_stream(
            build_request(
                PROMPTS[i % len(PROMPTS)], max_new_tokens=200, num_speculative_tokens=1 + i % 4
            )
        )
        for i in range(STREAMS)
    ]
    firsts = [next(stream) for stream in streams]
    assert all(first.token_ids for first in firsts)
    # A first token comes from the target's prefill; where draft and target share cores
    # (concurrent_prefill false) no draft starts while another prompt is still prefilling, so
    # the drafts begin only after the last of the 20 first tokens. Wait for them, not longer.
    deadline = time.monotonic() + 30
    while not _all_sides_hold(during := _held()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for stream in streams:
        stream.cancel()
    for side, replicas in during.items():
        assert sum(sessions for sessions, _, _ in replicas) > 0, (side, during)
        assert all(held <= capacity for _, held, capacity in replicas), during
    for stream in streams:
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 30
    while not _empty(held := _held()):
        assert time.monotonic() < deadline, f"caches still held: {held}"
        time.sleep(0.2)
