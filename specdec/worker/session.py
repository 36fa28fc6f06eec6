"""A model that runs over per-session KV caches: the part the proposer and verifier share."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from transformers import DynamicCache

from specdec.config import SpecdecConfig
from specdec.device.calibration.results import Calibration
from specdec.device.exact_widths import prompt_attention
from specdec.models.loading import LoadedModel
from specdec.v1 import worker_pb2
from specdec.worker.kv_cache import (
    ActiveSession,
    CacheBacking,
    GrowingCaches,
    SessionCacheStore,
    SessionEntry,
)

Request = TypeVar("Request")
Response = TypeVar("Response")


class Deferred:
    """run_batch's result for a call left to a later batch: the caller submits it again.

    DEFERRED: a prefill past the batch's prefill budget; nothing about its session changed.
    PREFILLING: a prompt longer than models.prefill_chunk_tokens whose next chunk this batch
    prefilled (chunked prefill); the session keeps the chunks done, and the call goes on from
    them when it is submitted again.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DEFERRED = Deferred("DEFERRED")
PREFILLING = Deferred("PREFILLING")


class SessionModel:
    """One model plus the LRU of its sessions' KV caches.

    Args:
        loaded: the model and tokenizer.
        config: its models.cache_capacity_bytes bounds the session LRU, in bytes of the storage
            its key and value tensors hold (specdec.worker.kv_cache.cache_nbytes), and
            models.cache_idle_s expires idle sessions.
        calibration: what the replica measured on its device at start-up
            (specdec.device.calibration), kept for reporting; None when not measured. Its
            prefill cost per token turns models.batch_prefill_s into ``prefill_budget``.
    Attributes:
        prefill_budget: prompt tokens a batch may prefill beyond its first prefill (None: no
            bound, when there is no calibration).
    """

    def __init__(
        self, loaded: LoadedModel, config: SpecdecConfig, calibration: Calibration | None = None
    ) -> None:
        self.loaded = loaded
        self.calibration = calibration
        self.context_limit = loaded.context_limit  # tokens a session may hold
        self.sessions = SessionCacheStore(
            config.models.cache_capacity_bytes,
            self.cache_backing(loaded, config),
            idle_s=config.models.cache_idle_s,
            prefill_chunk=config.models.prefill_chunk_tokens,
        )
        self.prefill_budget: int | None = None
        if calibration is not None:
            per_token = calibration.chosen.prefill_s_per_token
            self.prefill_budget = int(config.models.batch_prefill_s / max(per_token, 1e-9))

    @property
    def prefill_chunk(self) -> int:
        """models.prefill_chunk_tokens (0: every prompt in one forward), as the session store
        keeps it."""
        return self.sessions.prefill_chunk

    def cache_backing(self, loaded: LoadedModel, config: SpecdecConfig) -> CacheBacking:
        """Where the session caches come from: a transformers DynamicCache each (a static
        runner's subclass gives slots of its pool instead)."""
        return GrowingCaches(lambda: DynamicCache(config=loaded.model.config))

    @contextlib.contextmanager
    def session(self, tokens: worker_pb2.SessionTokens) -> Iterator[ActiveSession | None]:
        """Checks a session out for one call; yields None on a cache miss.

        The entry is stored back when the call succeeds and dropped when it raises, since its KV
        may then disagree with the ids it records; the next call rebuilds it.
        """
        with self.checked_out([tokens]) as (active,):
            yield active

    def run_batch(
        self,
        requests: list[Request],
        run_distinct: Callable[[list[Request]], list[Response]],
        check: Callable[[Request], None] = lambda request: None,
    ) -> list[Response | Exception]:
        """Runs a batch of calls, each request carrying its ``session`` (SessionTokens).

        A request that ``check`` (or the session tokens' own check) refuses gets its ValueError
        and changes nothing. Prefills (calls that start a session from its first token) past
        the batch's first one wait for a later batch once their prompt tokens would pass
        ``prefill_budget``, so that a burst of new prompts cannot stall the decode rows of
        every live session for all their prefills at once (cf. TGI's max_batch_prefill_tokens);
        a deferred session's later calls in the batch wait with it. The rest go to
        ``run_distinct`` in passes of distinct sessions, so a session named twice runs its
        later calls in later passes, in order.

        A failing row fails its own call, not its batch: when a pass of several sessions raises
        (any Exception: a forward error), each of its calls runs again alone (_run_alone), and
        only those that raise alone get their exception (a pass of one gets its error at once).
        The failed pass dropped the caches of all its sessions (checked_out), so a call that
        continues a session answers cache_miss on its second try and the router resends its
        whole sequence, which rebuilds the session exactly (specdec.worker.kv_cache); a prefill
        runs again from its prompt.

        ``run_distinct`` answers PREFILLING for a call whose prompt it prefilled a chunk of
        (prefill_chunks).

        Returns:
            Per request, in order: run_distinct's response for it, its ValueError, the
            exception its forward raised alone, DEFERRED or PREFILLING.
        """
        results: list = [None] * len(requests)
        checked = []
        for i, request in enumerate(requests):
            try:
                _check_tokens(request.session)
                check(request)
                checked.append(i)
            except ValueError as error:
                results[i] = error
        sessions = [requests[i].session for i in checked]
        deferred = _defer_prefills(sessions, self.prefill_budget, self.prefill_chunk)
        todo = [i for n, i in enumerate(checked) if n not in deferred]
        for n in deferred:
            results[checked[n]] = DEFERRED
        while todo:
            seen: set[str] = set()
            now = [i for i in todo if _first_sight(requests[i].session.session_id, seen)]
            try:
                responses = run_distinct([requests[i] for i in now])
            except Exception as error:  # noqa: BLE001 - a forward's error: rows tried alone
                responses = [error]
                if len(now) > 1:
                    responses = [_run_alone(requests[i], run_distinct) for i in now]
            for i, response in zip(now, responses):
                results[i] = response
            todo = [i for i in todo if i not in now]
        return results

    @contextlib.contextmanager
    def checked_out(
        self,
        tokens: list[worker_pb2.SessionTokens],
        assumed: list[list[int]] | None = None,
    ) -> Iterator[list[ActiveSession | None]]:
        """Checks several distinct sessions out for one batched call, as session() does one:
        None for each miss; every entry stored back on success, every one dropped on an error.
        ``assumed``: per session, tokens to run after its committed ones uncommitted
        (SessionCacheStore.checkout); None: none.
        """
        actives: list[ActiveSession | None] = []
        try:
            for one, extra in zip(tokens, assumed or [()] * len(tokens)):
                actives.append(self.sessions.checkout(one, extra))
            yield actives
        except BaseException:
            for active in actives:
                if active is not None:
                    self.sessions.abort(active)
            raise
        for active in actives:
            if active is not None:
                self.sessions.commit(active)

    def prefill_chunks(self, actives: list[ActiveSession | None]) -> list[bool]:
        """Chunked prefill (Agrawal et al. 2023, Sarathi; vLLM's and SGLang's chunked prefill):
        every session of ``actives`` with more than ``prefill_chunk`` prompt tokens left to
        prefill runs its next chunk of that many, alone; the others' rows then share the
        batch's forwards, and the chunked sessions' calls answer PREFILLING and come back
        with the next batch. Chunks start at multiples of ``prefill_chunk`` from the prompt's
        first token, so a prompt prefills in the same forwards every time and a rebuild
        replays them bitwise (SessionCacheStore.checkout keeps the whole chunks cached).

        Returns:
            Per session, True where it ran a chunk (None entries: False).
        """
        chunked = []
        for i, active in enumerate(actives):
            left = 0 if active is None else active.entry.prompt_left
            more = bool(self.prefill_chunk) and left > self.prefill_chunk
            if more and self.sessions.released(active.session_id):
                # Released mid-prefill: its commit would drop the chunk and the call would come
                # back PREFILLING from the first chunk forever. It ends as a miss instead.
                self.sessions.abort(active)
                actives[i], more = None, False
            if more:
                start = time.perf_counter()
                self.prefill_chunk_forward(active, active.pending[: self.prefill_chunk])
                active.entry.prefill_chunks_s += time.perf_counter() - start
            chunked.append(more)
        return chunked

    def prefill_chunk_forward(self, active: ActiveSession, token_ids: list[int]) -> None:
        """Runs one chunk of a prompt into the session's cache (the static runner's sides
        prefill into their slot instead)."""
        self.feed_prompt(active, token_ids, num_logits=1)

    def feed_prompt(
        self, active: ActiveSession, token_ids: list[int], num_logits: int
    ) -> torch.Tensor:
        """feed() of prompt tokens: after earlier chunks of the prompt, under one masked
        attention call per layer (specdec.device.exact_widths.prompt_attention)."""
        with prompt_attention():
            return self.feed(active, token_ids, num_logits)

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
        return self.feed_entry(active.entry, token_ids, num_logits)

    @torch.inference_mode()
    def feed_entry(
        self, entry: SessionEntry, token_ids: list[int], num_logits: int
    ) -> torch.Tensor:
        """feed() on a cache entry."""
        model = self.loaded.model
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
        output = model(
            input_ids=input_ids, cache=entry.cache, use_cache=True, logits_to_keep=num_logits
        )
        entry.cached_ids.extend(token_ids)
        return output.logits[0, -num_logits:, : self.loaded.vocab_size].cpu()

    def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        return worker_pb2.ReleaseResponse(released=self.sessions.release(request.session_id))

    def cache_stats(self) -> worker_pb2.CacheStats:
        return self.sessions.stats()


def answer_alone(run_batch: Callable[[list[Request]], list], request: Request) -> Response:
    """One call through a side's batch method (verify_batch, propose_batch) on its own: its
    response, after the chunks of a long prompt ran one batch each; raises its own error."""
    (response,) = run_batch([request])
    while response is PREFILLING:
        (response,) = run_batch([request])
    if isinstance(response, Exception):
        raise response
    return response


def _run_alone(request: Request, run_distinct: Callable[[list[Request]], list[Response]]):
    """``run_distinct`` over the one request: its response, or the Exception it raised."""
    try:
        (response,) = run_distinct([request])
    except Exception as error:  # noqa: BLE001 - the call's own failure, returned to it alone
        return error
    return response


def _check_tokens(tokens: worker_pb2.SessionTokens) -> None:
    """Raises ValueError for a call that carries no committed token at all."""
    if tokens.prefix_len == 0 and not tokens.new_token_ids:
        raise ValueError("session.new_token_ids must hold the prompt when prefix_len is 0")


def _defer_prefills(
    sessions: list[worker_pb2.SessionTokens], budget: int | None, chunk: int = 0
) -> set[int]:
    """Indices (into ``sessions``, in arrival order) of the calls to leave to a later batch:
    each prefill after the first whose prompt tokens (at most a ``chunk`` of them where
    prefill is chunked) would take the batch's prefill tokens past ``budget`` (None: no
    bound), and every later call of a session already deferred."""
    deferred: set[int] = set()
    waiting: set[str] = set()
    used = 0
    for i, tokens in enumerate(sessions):
        prefill = len(tokens.new_token_ids) if tokens.prefix_len == 0 else 0
        if chunk:
            prefill = min(prefill, chunk)
        over = budget is not None and used > 0 and used + prefill > budget
        if tokens.session_id in waiting or (prefill and over):
            deferred.add(i)
            waiting.add(tokens.session_id)
        else:
            used += prefill
    return deferred


def _first_sight(session_id: str, seen: set[str]) -> bool:
    """True the first time ``session_id`` is seen (and remembers it)."""
    if session_id in seen:
        return False
    seen.add(session_id)
    return True
