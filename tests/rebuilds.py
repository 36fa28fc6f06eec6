"""Running a request while its sessions are evicted every round, for the rebuild-exactness tests."""

from __future__ import annotations

import asyncio


def stream_evicting(engine, prompt, params, k, evict_sides) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of one request on ``engine`` (a SpeculativeEngine), evicting every
    session of each of ``evict_sides`` (its proposer and/or verifier) after every round, as an
    LRU eviction, a replica restart or a rerouted call would: each later call then misses and
    rebuilds its cache from the full token ids."""

    async def run():
        tokens, logprobs = [], []
        async for delta in engine.generate_stream(prompt, params, k):
            tokens += delta.token_ids
            logprobs += delta.logprobs
            for side in evict_sides:
                for session in list(side.sessions._entries):
                    side.sessions.evict(session)
        return tokens, logprobs

    return asyncio.run(run())
