"""Honest memory: the session caches' byte bound holds for the storage their tensors really hold.

transformers' DynamicCache.crop slices, so a cropped key or value tensor is a view that keeps the
dropped rows allocated. The store must count that storage (or copy the tensor to storage of its
own size) so that ``CacheStats.bytes`` is what is really held and stays under the capacity.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from transformers import DynamicCache

from specdec import SamplingParams, SpeculativeEngine
from specdec.engine import LocalTransport
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2
from specdec.worker.kv_cache import (
    COMPACT_WASTE_FRACTION,
    ActiveSession,
    GrowingCaches,
    SessionCacheStore,
    SessionEntry,
    cache_nbytes,
    compact_cache,
)

SESSIONS = 1000
HEADS, HEAD_DIM, LAYERS = 2, 8, 2


def _real_bytes(caches) -> int:
    """Bytes of the distinct storages behind the caches' key and value tensors: an independent
    count of the memory they hold, whatever views the tensors are."""
    storages = {}
    for cache in caches:
        for layer in cache.layers:
            for tensor in (layer.keys, layer.values):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _store_real_bytes(store: SessionCacheStore) -> int:
    return _real_bytes(entry.cache for entry in store._entries.values())


def _filled_cache(tokens: int, seed: int = 0) -> DynamicCache:
    """A float32 cache of ``tokens`` positions over LAYERS layers, grown as a forward grows it."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(LAYERS):
        keys, values = torch.randn(2, 1, HEADS, tokens, HEAD_DIM, generator=generator)
        cache.update(keys, values, layer)
    return cache


def _tensor_bytes(cache: DynamicCache) -> int:
    """What the store counted before: the sizes of the tensors, not of their storage."""
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )


def _commit(store: SessionCacheStore, session_id: str, cache: DynamicCache, tokens: int) -> None:
    entry = SessionEntry(cache=cache, cached_ids=list(range(tokens)), committed=[0])
    store.commit(ActiveSession(session_id, entry, [0], []))


def test_crop_keeps_the_dropped_rows_allocated_and_they_are_counted():
    """The bug: after a crop, the store counted the tensors' sizes while their storage stayed."""
    row = HEADS * HEAD_DIM * 4  # bytes of one position of one float32 tensor
    cache = _filled_cache(40)
    entry = SessionEntry(cache=cache, cached_ids=list(range(40)))
    entry.crop(36)  # e.g. three rejected drafts and one padding row
    assert _tensor_bytes(cache) == 2 * LAYERS * 36 * row
    assert _real_bytes([cache]) == 2 * LAYERS * 40 * row  # a view keeps all 40 rows
    assert cache_nbytes(cache) == _real_bytes([cache])


def test_commit_copies_a_mostly_wasted_storage_and_keeps_the_values():
    cache = _filled_cache(40, seed=1)
    expected = [(la.keys[..., :8, :].clone(), la.values[..., :8, :].clone()) for la in cache.layers]
    old_storages = {layer.keys.untyped_storage().data_ptr() for layer in cache.layers}
    SessionEntry(cache=cache, cached_ids=list(range(40))).crop(8)
    store = SessionCacheStore(10**6, GrowingCaches(DynamicCache))
    _commit(store, "s", cache, 8)
    assert store.stats().bytes == _tensor_bytes(cache) == _real_bytes([cache])
    for layer, (keys, values) in zip(cache.layers, expected):
        assert layer.keys.untyped_storage().data_ptr() not in old_storages
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_commit_leaves_a_slightly_wasted_storage_and_counts_all_of_it():
    """A long session loses a sliver to one round's rows: copying it every round would cost as
    much as the forward's own torch.cat, so it stays, counted whole."""
    cache = _filled_cache(100, seed=2)
    SessionEntry(cache=cache, cached_ids=list(range(100))).crop(96)
    assert COMPACT_WASTE_FRACTION >= (100 - 96) / 96
    storages = [layer.keys.untyped_storage().data_ptr() for layer in cache.layers]
    store = SessionCacheStore(10**6, GrowingCaches(DynamicCache))
    _commit(store, "s", cache, 96)
    assert [layer.keys.untyped_storage().data_ptr() for layer in cache.layers] == storages
    assert store.stats().bytes == _real_bytes([cache]) > _tensor_bytes(cache)


def test_a_cache_cropped_to_nothing_holds_nothing():
    cache = _filled_cache(12, seed=3)
    SessionEntry(cache=cache, cached_ids=list(range(12))).crop(0)  # a prompt prefilled again
    held = _real_bytes([cache])
    assert cache_nbytes(cache) == held > 0 == _tensor_bytes(cache)
    assert compact_cache(cache) == held
    assert cache_nbytes(cache) == _real_bytes([cache]) == 0


def test_a_storage_behind_two_tensors_counts_once_and_is_not_copied():
    cache = _filled_cache(20, seed=4)
    shared = cache.layers[0].keys.untyped_storage()
    cache.layers[1].keys = cache.layers[0].keys[..., :5, :]  # as layers that share KV would
    assert compact_cache(cache, max_waste=0.0) == 0  # copying the view would duplicate its rows
    assert cache.layers[1].keys.untyped_storage().data_ptr() == shared.data_ptr()
    assert cache_nbytes(cache) == _real_bytes([cache]) == 3 * shared.nbytes()


def test_the_bound_is_enforced_on_real_bytes():
    """Three sessions whose tensors fit the capacity but whose storages do not: the least
    recently used one is evicted."""
    per_session = _real_bytes([_filled_cache(100)])
    store = SessionCacheStore(3 * per_session - 1, GrowingCaches(DynamicCache))
    for name in "abc":
        cache = _filled_cache(100)
        SessionEntry(cache=cache, cached_ids=list(range(100))).crop(97)
        _commit(store, name, cache, 97)
    stats = store.stats()
    assert 3 * _tensor_bytes(cache) <= stats.capacity_bytes
    assert stats.sessions == 2 and stats.evictions == 1
    assert stats.bytes == _store_real_bytes(store) <= stats.capacity_bytes


class _CheckingTransport(LocalTransport):
    """Checks both stores after every call; defers releases so that sessions pile up and the
    capacity evicts (``release_now`` releases them)."""

    def __init__(self, proposer, verifier) -> None:
        super().__init__(proposer, verifier)
        self.deferred: list[tuple] = []
        self.calls = 0

    async def propose(self, request):
        response = await super().propose(request)
        self.check()
        return response

    async def verify(self, request):
        response = await super().verify(request)
        self.check()
        return response

    async def release(self, session_id: str, sides=("draft", "target")) -> None:
        self.deferred.append((session_id, sides))

    async def release_now(self) -> None:
        for session_id, sides in self.deferred:
            await super().release(session_id, sides)

    def check(self) -> None:
        self.calls += 1
        for side in (self.proposer, self.verifier):
            stats, real = side.cache_stats(), _store_real_bytes(side.sessions)
            assert stats.bytes <= stats.capacity_bytes
            assert real == stats.bytes, (type(side).__name__, real, stats.bytes)


@pytest.fixture(scope="module")
def small_cache_engine(engine):
    """The tiny pair with room for about a dozen short sessions per side."""
    calibrations = {
        "draft": engine.transport.proposer.calibration,
        "target": engine.transport.verifier.calibration,
    }
    return SpeculativeEngine(
        engine.draft, engine.target, calibrations=calibrations, cache_capacity_bytes=48 * 1024
    )


def test_a_thousand_short_sessions_stay_under_the_bound_and_leave_nothing(
    small_cache_engine, engine
):
    built = small_cache_engine
    transport = _CheckingTransport(built.transport.proposer, built.transport.verifier)
    built.transport = transport
    greedy = {p: engine.generate(p, SamplingParams(max_new_tokens=8), 0).token_ids for p in PROMPTS}
    plans = itertools.cycle(itertools.product(PROMPTS, [1, 2, 4, 8, "auto"], [0.0, 1.0]))
    for i, (prompt, k, temperature) in zip(range(SESSIONS), plans):
        params = SamplingParams(max_new_tokens=8, temperature=temperature, seed=i)
        out = built.generate(prompt, params, k)
        if temperature == 0:
            assert out.token_ids == greedy[prompt]  # compaction never changes what is computed
    assert transport.calls >= 2 * SESSIONS  # a propose and a verify at least, each checked
    for side in (transport.proposer, transport.verifier):
        assert side.cache_stats().evictions > 0
    asyncio.run(transport.release_now())
    for side in (transport.proposer, transport.verifier):
        stats = side.cache_stats()
        assert (stats.sessions, stats.bytes) == (0, 0)
        assert _store_real_bytes(side.sessions) == 0


class _Clock:
    """A settable clock for SessionCacheStore's idle expiry."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sessions_idle_past_idle_s_expire_and_their_next_call_rebuilds():
    """A stranded session (its release went to another replica) frees its memory after idle_s,
    while a session used within idle_s stays; the expired one's next call misses."""
    clock = _Clock()
    store = SessionCacheStore(10**6, GrowingCaches(DynamicCache), idle_s=100, clock=clock)
    _commit(store, "stranded", _filled_cache(30, seed=5), 30)
    _commit(store, "live", _filled_cache(20, seed=6), 20)
    clock.now = 60
    live = _filled_cache(21, seed=7)
    _commit(store, "live", live, 21)
    clock.now = 100
    assert store.expire() == 0  # idle exactly idle_s: kept
    clock.now = 100.5
    assert store.expire() == 1
    stats = store.stats()
    assert (stats.sessions, stats.bytes) == (1, _real_bytes([live]))
    tokens = worker_pb2.SessionTokens(session_id="stranded", prefix_len=1, new_token_ids=[3])
    assert store.checkout(tokens) is None and store.stats().rebuilds == 1
    assert store.expirations == 1


def test_a_commit_expires_idle_sessions_too_and_idle_s_0_never_expires():
    clock = _Clock()
    expiring = SessionCacheStore(10**6, GrowingCaches(DynamicCache), idle_s=10, clock=clock)
    keeping = SessionCacheStore(10**6, GrowingCaches(DynamicCache), clock=clock)
    for store in (expiring, keeping):
        _commit(store, "old", _filled_cache(8), 8)
    clock.now = 1e6
    for store in (expiring, keeping):
        _commit(store, "new", _filled_cache(8), 8)
    assert expiring.stats().sessions == 1 and keeping.stats().sessions == 2
    assert keeping.expire() == 0


def test_a_negative_idle_s_is_refused():
    with pytest.raises(ValueError, match="idle_s"):
        SessionCacheStore(10**6, GrowingCaches(DynamicCache), idle_s=-1)
