"""A model that runs over per-session KV caches: the part the proposer and verifier share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from specdec.config import SpecdecConfig
from specdec.models.calibration import Calibration
from specdec.models.kv_cache import ActiveSession, SessionCacheStore
from specdec.models.loading import LoadedModel
from specdec.v1 import worker_pb2


class SessionModel:
    """One model plus the LRU of its sessions' KV caches.

    Args:
        loaded: the model and tokenizer.
        config: its models.cache_capacity_bytes bounds the session LRU, in bytes of the storage
            its key and value tensors hold (specdec.models.kv_cache.cache_nbytes), and
            models.cache_idle_s expires idle sessions.
        calibration: what the replica measured on its device at start-up
            (specdec.models.calibration), kept for reporting; None when not measured.
    """

    def __init__(
        self, loaded: LoadedModel, config: SpecdecConfig, calibration: Calibration | None = None
    ) -> None:
        self.loaded = loaded
        self.calibration = calibration
        self.sessions = SessionCacheStore(
            config.models.cache_capacity_bytes,
            lambda: DynamicCache(config=loaded.model.config),
            idle_s=config.models.cache_idle_s,
        )

    @contextlib.contextmanager
    def session(self, tokens: worker_pb2.SessionTokens) -> Iterator[ActiveSession | None]:
        """Checks a session out for one call; yields None on a cache miss.

        The entry is stored back when the call succeeds and dropped when it raises, since its KV
        may then disagree with the ids it records; the next call rebuilds it.
        """
        active = self.sessions.checkout(tokens)
        if active is None:
            yield None
            return
        try:
            yield active
        except BaseException:
            self.sessions.evict(tokens.session_id)
            raise
        self.sessions.commit(active)

    @torch.inference_mode()
    def feed(self, active: ActiveSession, token_ids: list[int], num_logits: int) -> torch.Tensor:
        """Appends tokens to the session's KV cache.

        Args:
            token_ids: the n tokens to run through the model, following the cached ones.
            num_logits: how many trailing positions to return logits for (1..n).
        Returns:
            [num_logits, vocab_size] logits (padding rows beyond the tokenizer cut off), in the
            model's dtype, on the CPU.
        """
        model = self.loaded.model
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
        output = model(
            input_ids=input_ids, cache=active.entry.cache, use_cache=True, logits_to_keep=num_logits
        )
        active.entry.cached_ids.extend(token_ids)
        return output.logits[0, -num_logits:, : self.loaded.vocab_size].cpu()

    def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        return worker_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))

    def cache_stats(self) -> worker_pb2.CacheStats:
        return self.sessions.stats()
