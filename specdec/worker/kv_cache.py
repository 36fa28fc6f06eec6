"""Per-session KV caches held by a draft or target replica: soft state, bounded in bytes.

Each entry records the token ids its KV covers and the committed length the router last
confirmed. A call names the committed prefix length it assumes (``prefix_len``) and the tokens
committed since; when the entry is missing or covers a different committed length (evicted, the
replica restarted, the session was served elsewhere), the call is a *miss* and the router resends
the whole sequence. Committed sequences only grow, so a committed length identifies the prefix
exactly, and the rebuilt cache gives the same output as the lost one.

Bytes are the storages the key and value tensors really hold, not their sizes: transformers'
``DynamicCache.crop`` slices, so after the verifier crops rejected drafts and the padding of an
exact-width forward a tensor is a view over a longer storage. ``commit`` copies such a tensor to
storage of its own size when the waste exceeds ``COMPACT_WASTE_FRACTION`` of what it keeps, and
counts the rest as held (the next forward's ``torch.cat`` frees it anyway).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import Cache

from specdec.v1 import worker_pb2

RELEASED_MEMORY = 65_536  # released session ids remembered
# A cropped tensor is copied to storage of its own size when the storage it leaves unused exceeds
# this fraction of what it keeps. The copy then costs at most 1 / fraction times the waste (one
# round's rejected and padding rows), so long sessions, whose waste is a sliver, are never copied:
# copying a whole 2,000-token cache of the 28-layer bfloat16 target (55 MiB) took 9.4 ms on one
# CPU core, as long as the torch.cat of a forward, where a 32-token one took 0.15 ms.
COMPACT_WASTE_FRACTION = 0.25


@dataclasses.dataclass
class SessionEntry:
    """One session's cache: ``cache`` holds the KV of ``cached_ids`` (in order)."""

    cache: Cache
    cached_ids: list[int] = dataclasses.field(default_factory=list)
    committed: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    prompt_len: int = 0  # leading committed tokens that are the prompt (its prefill's width)
    prefill_chunks_s: float = 0.0  # seconds of the prompt's chunks run ahead of its last one
    last_used_s: float = 0.0  # the store's clock at the last commit
    in_flight: bool = False  # checked out by a call that has not ended

    @property
    def prompt_left(self) -> int:
        """Prompt tokens the cache does not hold yet (its prefill's, or its chunks', rest)."""
        return max(self.prompt_len - len(self.cached_ids), 0)

    def crop(self, length: int) -> None:
        """Drops KV beyond the first ``length`` cached tokens."""
        excess = len(self.cached_ids) - length
        if excess > 0:
            self.cache.crop(-excess)
            del self.cached_ids[length:]


@dataclasses.dataclass
class ActiveSession:
    """A session checked out for one call.

    ``committed`` is the whole committed sequence; ``pending`` the committed tokens whose KV the
    cache does not hold yet (at least one, so the call gets the logits after the last token).
    """

    session_id: str
    entry: SessionEntry
    committed: list[int]
    pending: list[int]


class CacheBacking(Protocol):
    """Where a store's caches come from and what they hold: GrowingCaches (a transformers cache
    per session, as large as it has grown) or specdec.worker.static.slots.SlotAllocator (a slot
    of a preallocated pool per session)."""

    def allocate(self) -> Cache | None:
        """A new, empty cache; None when none is free (the store then evicts and asks again)."""

    def nbytes(self, cache: Cache) -> int:
        """Bytes the cache holds."""

    def compact(self, cache: Cache) -> None:
        """Frees what the cache holds beyond its tokens, keeping its outputs unchanged."""

    def free(self, cache: Cache) -> None:
        """Takes back a cache no entry uses any more."""


class GrowingCaches:
    """CacheBacking of transformers caches that grow with their session (DynamicCache): bytes
    are the storages they hold (cache_nbytes), compacted after crops (compact_cache).

    Args:
        new_cache: makes an empty cache.
    """

    def __init__(self, new_cache: Callable[[], Cache]) -> None:
        self._new_cache = new_cache

    def allocate(self) -> Cache:
        return self._new_cache()

    def nbytes(self, cache: Cache) -> int:
        return cache_nbytes(cache)

    def compact(self, cache: Cache) -> None:
        compact_cache(cache)

    def free(self, cache: Cache) -> None:
        """Nothing to do: the garbage collector takes the tensors."""


class SessionCacheStore:
    """LRU of session caches bounded in bytes: the storages their key and value tensors hold.

    Between calls, the stored entries hold at most ``capacity_bytes`` of key and value storage
    (cache_nbytes), and stats() reports that figure. A call in flight grows its own entry by the
    tokens it feeds until its commit, which compacts the entry (compact_cache) and evicts least
    recently used entries, this one too when it alone exceeds the capacity, unless it holds a
    prompt between its chunks (dropped, its call would start the prompt again forever).

    An entry not committed for ``idle_s`` seconds is dropped by the next commit or expire(): a
    session whose release never reached this replica (the replica set changed under a running
    request, so its later calls and its release went to another replica; a router died) would
    otherwise hold memory until the LRU reached it. A live session that was idle that long
    (a stalled client) misses and is rebuilt: slower, never wrong.

    Thread-safe for calls of different sessions; calls of one session must not overlap (the round
    loop never overlaps them).

    The caches come from ``backing`` (CacheBacking). A cache goes back to it when its entry
    leaves the store while no call has it checked out, or when the call that has it ends
    without storing it (released meanwhile, or the call failed): a slot is never reused under
    a forward that still writes it. When the backing has no cache free, checkout evicts least
    recently used entries that no call has checked out until it has one.

    A prompt prefills as its first call ran it, so that a rebuild replays it bitwise: in one
    forward, or with chunked prefill (``prefill_chunk`` tokens, SessionModel.prefill_chunks)
    in chunks from its first token. A cache that holds part of a prompt keeps only its whole
    chunks (with no chunking: nothing).

    Raises:
        ValueError: capacity_bytes <= 0, idle_s < 0 or prefill_chunk < 0.
    """

    def __init__(
        self,
        capacity_bytes: int,
        backing: CacheBacking,
        idle_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        prefill_chunk: int = 0,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if idle_s < 0:
            raise ValueError(f"idle_s must be >= 0 (0: never expire), got {idle_s}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: no chunks), got {prefill_chunk}")
        self.capacity_bytes = capacity_bytes
        self.prefill_chunk = prefill_chunk
        self.idle_s, self._clock = idle_s, clock
        self._backing = backing
        self._entries: collections.OrderedDict[str, SessionEntry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        # Released sessions, so that a call still computing when its request was cancelled
        # cannot store the entry back after the release (session ids are never reused).
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.evictions = 0
        self.rebuilds = 0
        self.expirations = 0

    def checkout(
        self, session: worker_pb2.SessionTokens, assumed: Sequence[int] = ()
    ) -> ActiveSession | None:
        """Resolves a call's session; ``None`` when the entry cannot continue it (a miss).

        With ``prefix_len == 0`` the call carries the whole sequence and never misses.
        ``assumed``: tokens the call runs after the committed ones without committing them (a
        pipelined draft's, ProposeRequest.assumed_token_ids): they join ``pending`` where the
        cache lacks them, and stay in the cache only as uncommitted tokens do.
        """
        new_ids = list(session.new_token_ids)
        if session.prefix_len == 0 and not new_ids:
            raise ValueError("a call must carry at least one committed token")
        with self._lock:
            entry = self._entries.get(session.session_id)
            hit = entry is not None and len(entry.committed) == session.prefix_len
            if hit or (entry is not None and session.prefix_len == 0):
                # Marked under the lock that found it: a release or an expiry between the two
                # (the replica's event loop runs them while this runs on its compute thread)
                # would otherwise give its cache back, and a slot of the static runner's pool
                # would go to another session while this call writes it.
                entry.in_flight = True
        if session.prefix_len == 0:
            if entry is None:
                # Without a prompt_len, the first call's sequence is taken as the prompt.
                entry = SessionEntry(cache=self._allocate(), prompt_len=len(new_ids))
            committed = new_ids
        elif hit:
            committed = entry.committed + new_ids
        else:
            self.rebuilds += 1  # the router resends the whole sequence and this replica rebuilds
            return None
        # Cached positions below the old committed length are committed tokens; only the tail
        # (draft tokens fed in the last call) can disagree with the new sequence.
        start = min(len(entry.committed), len(entry.cached_ids)) if session.prefix_len else 0
        target = [*committed, *assumed]
        keep = min(_common_prefix(entry.cached_ids, target, start), len(target) - 1)
        if session.prompt_len:
            entry.prompt_len = session.prompt_len
        if keep < entry.prompt_len:
            # A partly cached prompt goes on from its last whole chunk, as it first ran.
            keep = keep - keep % self.prefill_chunk if self.prefill_chunk else 0
        entry.crop(keep)
        entry.committed = committed
        entry.in_flight = True
        return ActiveSession(session.session_id, entry, committed, target[keep:])

    def commit(self, active: ActiveSession) -> None:
        """Stores the entry back as most recently used and evicts others past capacity."""
        entry = active.entry
        self._backing.compact(entry.cache)
        size = self._backing.nbytes(entry.cache)
        with self._lock:
            # What the store holds for the session: this entry (still in flight, so kept) or
            # one a rebuild replaced (its cache goes back).
            self._remove_locked(active.session_id)
            entry.in_flight = False
            if active.session_id in self._released:
                self._backing.free(entry.cache)
                return
            entry.nbytes, entry.last_used_s = size, self._clock()
            self._entries[active.session_id] = entry
            self._bytes += size
            while self._bytes > self.capacity_bytes and self._entries:
                oldest = next(iter(self._entries))
                if oldest == active.session_id and len(entry.cached_ids) < entry.prompt_len:
                    # A prompt between its chunks, alone past capacity: dropped here, its call
                    # would prefill its first chunks again forever. It stays until its prompt
                    # is prefilled (its next calls then miss and rebuild, as before chunking).
                    break
                self._remove_locked(oldest)
                self.evictions += 1
            self._expire_locked()

    def abort(self, active: ActiveSession) -> None:
        """Ends a call that failed: its entry is dropped (its cache may disagree with the ids it
        records) and the next call of the session rebuilds it."""
        with self._lock:
            if self._entries.get(active.session_id) is active.entry:
                self._remove_locked(active.session_id)
                self.evictions += 1
            active.entry.in_flight = False
            self._backing.free(active.entry.cache)

    def _allocate(self) -> Cache:
        """A cache from the backing, evicting least recently used entries that are not checked
        out while it has none free.

        Raises:
            RuntimeError: every cache is held by a call in flight (a batch larger than the
                backing's capacity in sessions).
        """
        while (cache := self._backing.allocate()) is None:
            with self._lock:
                idle = next((s for s, e in self._entries.items() if not e.in_flight), None)
                if idle is None:
                    raise RuntimeError("every session cache is held by a call in flight")
                self._remove_locked(idle)
                self.evictions += 1
        return cache

    def _remove_locked(self, session_id: str) -> SessionEntry | None:
        """Takes a session's entry out of the store (None when it holds none) and gives its
        cache back to the backing, unless a call still has it checked out (that call gives it
        back when it ends without storing it)."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            if not entry.in_flight:
                self._backing.free(entry.cache)
        return entry

    def expire(self) -> int:
        """Drops the entries idle for more than ``idle_s`` seconds (none when idle_s is 0);
        returns how many. Cheap: the LRU order is commit order, so only expired entries are
        visited."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        if not self.idle_s:
            return 0
        horizon, dropped = self._clock() - self.idle_s, 0
        while self._entries:
            session_id, oldest = next(iter(self._entries.items()))
            if oldest.last_used_s >= horizon:
                break
            self._remove_locked(session_id)
            dropped += 1
        self.expirations += dropped
        return dropped

    def release(self, session_id: str) -> bool:
        """Drops a session for good; False when it was not held."""
        with self._lock:
            self._released[session_id] = None
            if len(self._released) > RELEASED_MEMORY:
                self._released.popitem(last=False)
            entry = self._remove_locked(session_id)
        return entry is not None

    def released(self, session_id: str) -> bool:
        """Whether the session was released (a call still in flight must not go on)."""
        with self._lock:
            return session_id in self._released

    def evict(self, session_id: str) -> bool:
        """Drops a session as if capacity had forced it out: its next call misses and rebuilds."""
        with self._lock:
            entry = self._remove_locked(session_id)
            if entry is not None:
                self.evictions += 1
        return entry is not None

    def stats(self) -> worker_pb2.CacheStats:
        with self._lock:
            return worker_pb2.CacheStats(
                sessions=len(self._entries),
                bytes=self._bytes,
                capacity_bytes=self.capacity_bytes,
                evictions=self.evictions,
                rebuilds=self.rebuilds,
            )


def cache_nbytes(cache: Cache) -> int:
    """Bytes of the storages behind a transformers cache's key and value tensors.

    A view counts its whole storage (a cropped tensor keeps the rows it dropped allocated), and a
    storage behind several tensors counts once.
    """
    return sum(storage.nbytes() for storage, _ in _storages(cache).values())


def compact_cache(cache: Cache, max_waste: float = COMPACT_WASTE_FRACTION) -> int:
    """Copies each key or value tensor whose storage leaves unused more than ``max_waste`` times
    the tensor's own bytes to storage of its own size; returns the bytes the cache stops holding.

    The copy has the same values, so the cache's outputs do not change. A storage behind several
    tensors (KV shared between layers) is left alone, since copying them would duplicate it.
    """
    freed = 0
    for storage, uses in _storages(cache).values():
        if len(uses) != 1:
            continue
        layer, name, tensor = uses[0]
        kept = tensor.numel() * tensor.element_size()
        if storage.nbytes() - kept > max_waste * kept:
            setattr(layer, name, tensor.clone(memory_format=torch.contiguous_format))
            freed += storage.nbytes() - kept
    return freed


def _storages(cache: Cache) -> dict[tuple[torch.device, int], tuple[torch.UntypedStorage, list]]:
    """The distinct storages behind the cache's key and value tensors, keyed by device and
    address, each with its (layer, attribute name, tensor) uses."""
    found: dict[tuple[torch.device, int], tuple[torch.UntypedStorage, list]] = {}
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue  # empty storages share address 0 and hold nothing
            key = (storage.device, storage.data_ptr())
            found.setdefault(key, (storage, []))[1].append((layer, name, tensor))
    return found


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, given that the first ``start`` items agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
