"""The static runner's KV cache: one preallocated pool of slots per replica.

Each session holds one slot: ``slot_len`` positions of keys and values in every layer, written
in place by the forwards (specdec.worker.static.forward) and never copied, grown or cloned. A
crop is a length update (the session's ``cached_ids``); the positions past it are garbage the
attention mask hides. The pool is zero-initialised because masked keys are still multiplied
in: exp(-inf) is an exact 0, but 0 x NaN is NaN, so a slot's unused tail must hold finite values
from the start (afterwards it holds keys and values some forward computed, finite too).

One extra slot, ``scratch``, takes the writes of the rows that pad a batch to its bucket, so
padding never touches a session's slot (cf. vLLM's and nano-vllm's padded CUDA-graph batches
writing to a dummy block).

The byte bound is the same setting as the dynamic runner's (models.cache_capacity_bytes): the
pool is as many slots as fit in it, and the LRU store (specdec.worker.kv_cache.SessionCacheStore)
evicts the least recently used session when a new one finds no slot free.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from transformers import PretrainedConfig

from specdec.models.loading import text_config

CONTEXT_ROUNDING = 256  # a derived context limit is a multiple of this many tokens
# Slot lengths (the longest key length) are a multiple of this many positions: attention kernels
# want the mask's last dimension aligned (PyTorch's memory-efficient SDPA copies it otherwise).
SLOT_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """The shape of a slot pool.

    Attributes:
        num_layers, kv_heads, head_dim: the model's attention shape.
        dtype: the keys' and values' dtype (the model's).
        context_limit: tokens (prompt and output) a session may hold.
        num_slots: sessions the pool holds (the scratch slot not counted).
        width: the widest decode forward, in positions.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    context_limit: int
    num_slots: int
    width: int

    @property
    def bytes_per_token(self) -> int:
        """Key and value bytes of one position across all layers."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.kv_heads * self.head_dim * itemsize

    @property
    def slot_len(self) -> int:
        """Positions per slot: the context limit plus one forward's width (a forward's padding
        rows write past a session's last real position), rounded up to SLOT_ALIGNMENT."""
        return _round_up(self.context_limit + self.width, SLOT_ALIGNMENT)

    @property
    def slot_bytes(self) -> int:
        return self.bytes_per_token * self.slot_len

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool, the scratch slot included."""
        return self.slot_bytes * (self.num_slots + 1)


def attention_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a transformers model config."""
    text = text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def slot_layout(
    config: PretrainedConfig,
    dtype: torch.dtype,
    *,
    capacity_bytes: int,
    max_batch_size: int,
    width: int,
    max_model_len: int | None = None,
) -> SlotLayout:
    """Sizes a slot pool from the model's config alone (no weights needed).

    Args:
        config: the model's transformers config (its max_position_embeddings bounds the context).
        dtype: the dtype the model runs in.
        capacity_bytes: models.cache_capacity_bytes: the pool, scratch slot included, fits in it.
        max_batch_size: sessions one forward may hold: the pool needs at least that many slots.
        width: the widest decode forward, in positions (the target's k_max + 1).
        max_model_len: the context limit in tokens; None: the model's, lowered until
            max_batch_size slots and the scratch one fit in capacity_bytes, rounded down to a
            multiple of CONTEXT_ROUNDING.
    Raises:
        ValueError: naming max_model_len when it exceeds the model's limit, or
            cache_capacity_bytes when it cannot hold max_batch_size slots of that length.
    """
    num_layers, kv_heads, head_dim = attention_shape(config)
    model_limit = int(text_config(config).max_position_embeddings)
    per_token = SlotLayout(num_layers, kv_heads, head_dim, dtype, 1, 0, width).bytes_per_token
    if max_model_len is None:
        fitting = capacity_bytes // ((max_batch_size + 1) * per_token) - width - SLOT_ALIGNMENT
        max_model_len = min(model_limit, fitting // CONTEXT_ROUNDING * CONTEXT_ROUNDING)
        if max_model_len < CONTEXT_ROUNDING:
            max_model_len = min(model_limit, max(fitting, 0))
    elif max_model_len > model_limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_limit} tokens")
    slot_len = _round_up(max_model_len + width, SLOT_ALIGNMENT)
    num_slots = capacity_bytes // (slot_len * per_token) - 1
    if max_model_len < 1 or num_slots < max_batch_size:
        need = (max_batch_size + 1) * slot_len * per_token
        raise ValueError(
            f"cache_capacity_bytes {capacity_bytes} holds {max(num_slots, 0)} KV slots of "
            f"{max(max_model_len, 0)} tokens; max_batch_size {max_batch_size} needs "
            f"{max_batch_size} (and a scratch slot): raise it to {need} or lower max_model_len"
        )
    return SlotLayout(num_layers, kv_heads, head_dim, dtype, max_model_len, num_slots, width)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class SlotPool:
    """The preallocated keys and values of every slot, one pair of tensors per layer.

    Args:
        layout: the pool's shape (slot_layout).
        device: where the tensors live.
    Attributes:
        keys, values: per layer, [num_slots + 1, kv_heads, slot_len, head_dim] tensors, zeros
            at first.
        scratch: the index of the slot padding rows write to (num_slots).
    """

    def __init__(self, layout: SlotLayout, device: torch.device | str) -> None:
        self.layout = layout
        shape = (layout.num_slots + 1, layout.kv_heads, layout.slot_len, layout.head_dim)
        layers = range(layout.num_layers)
        self.keys = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in layers]
        self.values = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in layers]
        self.scratch = layout.num_slots


@dataclasses.dataclass
class SlotCache:
    """A session's cache in the static runner: the index of its slot. Its length is its entry's
    ``cached_ids`` (specdec.worker.kv_cache.SessionEntry), so a crop has nothing to do."""

    slot: int

    def crop(self, max_length: int) -> None:
        """Nothing to free: positions past the entry's length are masked out."""


class SlotAllocator:
    """The CacheBacking (specdec.worker.kv_cache) of a slot pool: a free list of slots.

    Args:
        layout: the pool's layout; every allocated slot counts its slot_bytes.
    """

    def __init__(self, layout: SlotLayout) -> None:
        self.layout = layout
        self._free = list(range(layout.num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    def allocate(self) -> SlotCache | None:
        with self._lock:
            return SlotCache(self._free.pop()) if self._free else None

    def nbytes(self, cache: SlotCache) -> int:
        return self.layout.slot_bytes

    def compact(self, cache: SlotCache) -> None:
        """A slot is fixed in size: nothing to compact."""

    def free(self, cache: SlotCache) -> None:
        with self._lock:
            if cache.slot in self._free:
                raise RuntimeError(f"slot {cache.slot} freed twice")
            self._free.append(cache.slot)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)
