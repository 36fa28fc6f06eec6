"""SpeculativeEngine: the draft, the target and the round loop in one process."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any

import torch

from specdec.config import SpecdecConfig, SpeculationConfig
from specdec.decoding.costs import CostModel, CostPrior
from specdec.decoding.degrade import DraftAvailability
from specdec.decoding.ngram import shared_ngrams
from specdec.decoding.phases import SIDES
from specdec.decoding.request import AUTO, ModelLimits, encode_prompt, prepare_request
from specdec.decoding.round_loop import Completion, RoundLoop
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stopping import Delta
from specdec.device.calibration.load import load_calibrated
from specdec.device.calibration.results import Calibration
from specdec.device.calibration_cache import CalibrationCache
from specdec.models.loading import LoadedModel, check_same_tokenizer
from specdec.v1 import worker_pb2
from specdec.worker.info import replica_info
from specdec.worker.proposer import DraftProposer
from specdec.worker.session import Deferred
from specdec.worker.static.sides import proposer_class, verifier_class
from specdec.worker.verifier import TargetVerifier


class LoopBatcher:
    """Runs the calls that concurrent requests make in one turn of the event loop as one
    batch: the in-process counterpart of a model replica's serve.batch.

    Args:
        run_batch: the side's batch method (DraftProposer.propose_batch or
            TargetVerifier.verify_batch): requests -> per request a response, its
            ValueError, or DEFERRED or PREFILLING (submitted again with the next batch).

    Calling it with a request returns that request's response or raises its error. The
    batch runs on the event loop's thread, as the unbatched calls did; one event loop at a
    time (each generate() runs its own).
    """

    def __init__(self, run_batch: Callable[[list], list]) -> None:
        self._run_batch = run_batch
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._flush_loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, request: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(loop, request, future)
        return await future

    def _submit(self, loop: asyncio.AbstractEventLoop, request: Any, future: asyncio.Future):
        if self._flush_loop is not loop:
            # A flush scheduled on a loop that closed before running it never comes: its
            # calls were cancelled with that loop.
            self._pending = [p for p in self._pending if p[1].get_loop() is loop]
            loop.call_soon(self._flush)
            self._flush_loop = loop
        self._pending.append((request, future))

    def _flush(self) -> None:
        loop, self._flush_loop = self._flush_loop, None
        batch = [(r, f) for r, f in self._pending if not f.done()]
        self._pending = []
        if not batch:
            return
        try:
            results = self._run_batch([request for request, _ in batch])
        except Exception as error:  # the whole batch failed: each call raises it
            results = [error] * len(batch)
        for (request, future), result in zip(batch, results):
            if isinstance(result, Deferred):
                self._submit(loop, request, future)
            elif isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


class LocalTransport:
    """The round loop's transport for a draft and target living in this process; the calls
    of requests running concurrently on one event loop share batches (LoopBatcher)."""

    def __init__(self, proposer: DraftProposer, verifier: TargetVerifier) -> None:
        self.proposer = proposer
        self.verifier = verifier
        # Looked up per batch, so that a replaced side (or a test's spy) is the one called.
        self._propose = LoopBatcher(lambda requests: self.proposer.propose_batch(requests))
        self._verify = LoopBatcher(lambda requests: self.verifier.verify_batch(requests))

    async def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        return await self._propose(request)

    async def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        return await self._verify(request)

    async def release(self, session_id: str, sides: Collection[str] = SIDES) -> None:
        request = worker_pb2.ReleaseRequest(session_id=session_id)
        if "draft" in sides:
            self.proposer.release(request)
        if "target" in sides:
            self.verifier.release(request)


class SpeculativeEngine:
    """Lossless speculative decoding in one process.

    Greedy output equals the target model's greedy output token for token; sampled output follows
    the target's distribution under the request's temperature / top-k / top-p (the acceptance rule
    is in specdec.worker.rejection).

    Args:
        draft, target: loaded models sharing a tokenizer (ModelLoadError otherwise).
        config: the settings (specdec.config): a SpecdecConfig, its SpeculationConfig alone, or
            None for the defaults. The engine reads ``speculation``, the cache bound and
            ``exact_widths``; the other model settings are what from_pretrained loads.
        **settings: flat settings replacing the config's (max_speculative_tokens, draft_top_n,
            dynamic_draft_length, concurrent_prefill, cache_capacity_bytes,
            exact_widths, ...), parsed once into ``self.config``.
    Raises:
        ConfigError naming an unknown or invalid setting; ModelLoadError.
    """

    def __init__(
        self,
        draft: LoadedModel,
        target: LoadedModel,
        config: SpeculationConfig | SpecdecConfig | None = None,
        *,
        calibrations: dict[str, Calibration] | None = None,
        **settings: Any,
    ) -> None:
        check_same_tokenizer(draft.tokenizer, target.tokenizer)
        self.config = SpecdecConfig.of(config, **settings)
        self.draft, self.target = draft, target
        self.tokenizer = target.tokenizer
        calibrations = calibrations or {}
        self.transport = LocalTransport(
            proposer_class(self.config)(draft, self.config, calibrations.get("draft")),
            verifier_class(self.config)(target, self.config, calibrations.get("target")),
        )
        # What each side's replica would report (its model and cost table), so that the
        # limits and the cost prior are built as the router builds them.
        draft_info = replica_info(self.transport.proposer, self.config)
        target_info = replica_info(self.transport.verifier, self.config)
        self.limits = ModelLimits.of(target_info, draft_info, self.config.speculation)
        self.costs = CostModel(self.config.speculation)
        self.shared_ngrams = shared_ngrams(self.config.speculation)
        # Without a probe: once a failed draft's retry delay has passed, the next propose is
        # the check (the draft lives in this process).
        self.draft_availability = DraftAvailability(self.config.service.draft_retry_s)
        prior = CostPrior.of(target_info.costs, draft_info.costs, self.config)
        if prior is not None:
            self.costs.set_prior(prior)

    @classmethod
    def from_pretrained(
        cls,
        draft_model: str | os.PathLike,
        target_model: str | os.PathLike,
        config: SpeculationConfig | SpecdecConfig | None = None,
        **settings: Any,
    ) -> SpeculativeEngine:
        """Loads both models offline (specdec.device.calibration.load.load_calibrated; the
        constructor checks that they share a tokenizer) in the config's ``dtype``,
        ``draft_dtype`` (e.g. "int8": a CPU draft about twice as fast; "auto": the fastest
        measured on this device) and ``device``, and builds the engine; ``config`` and
        ``settings`` as for the engine.
        """
        if isinstance(settings.get("device"), torch.device):
            settings["device"] = str(settings["device"])
        config = SpecdecConfig.of(
            config,
            draft_model=os.fspath(draft_model),
            target_model=os.fspath(target_model),
            **settings,
        )
        models = config.models
        loaded, calibrations = {}, {}
        for side in ("target", "draft"):
            spec, dtype = models.for_side(side)
            loaded[side], calibrations[side] = load_calibrated(
                spec,
                side,
                dtype,
                gemm=models.gemm_for(side),
                device=models.device,
                max_speculative_tokens=config.speculation.max_speculative_tokens,
                exact_widths=models.measures_exact_widths(),
                max_batch_size=models.max_batch_size,
                cache=CalibrationCache.configured(models.calibration_cache),
                revision=models.revision_for(side),
            )
        return cls(loaded["draft"], loaded["target"], config, calibrations=calibrations)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        num_speculative_tokens: int | str = AUTO,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        proposer: str | None = None,
    ) -> Completion:
        """Generates one completion.

        Args:
            prompt: text, or token ids; or pass chat ``messages`` instead.
            params: sampling and stop parameters (defaults: greedy, 64 new tokens).
            num_speculative_tokens: k per round, an int in [0, k_max] (0 = target only), or
                "auto" to choose k each round from measured acceptance and costs.
            proposer: who proposes each round's tokens, one of specdec.config.PROPOSERS; None
                takes the engine's ``speculation.proposer``.
        Returns:
            Completion: token_ids, text, finish_reason ("stop" | "length"), logprobs (target
            log-probabilities of token_ids), prompt_tokens and stats.
        Raises:
            InvalidRequestError (a ValueError) naming the invalid field.
        """
        request = self.agenerate(
            prompt, params, num_speculative_tokens, messages=messages, proposer=proposer
        )
        return asyncio.run(request)

    async def agenerate(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        num_speculative_tokens: int | str = AUTO,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        proposer: str | None = None,
    ) -> Completion:
        """generate() as a coroutine. Requests awaited together (asyncio.gather) share
        batched draft and verify forwards (TargetVerifier.verify_batch,
        DraftProposer.propose_batch), and each one's output is the one it gets alone: greedy
        token for token; sampled with a fixed k, token for token for the same seed (target
        rows run in exact widths, and a sampled request drafts alone); sampled with k auto, in
        distribution (each round's k then depends on the load). Raises as generate()."""
        loop = self._round_loop(prompt, params, num_speculative_tokens, messages, proposer)
        return await loop.complete()

    async def generate_stream(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        num_speculative_tokens: int | str = AUTO,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        proposer: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Like generate, yielding one Delta per round (text deltas concatenate to the text)."""
        loop = self._round_loop(prompt, params, num_speculative_tokens, messages, proposer)
        async with contextlib.aclosing(loop.run()) as deltas:
            async for delta in deltas:
                yield delta

    def _round_loop(self, prompt, params, num_speculative_tokens, messages, proposer) -> RoundLoop:
        prompt_ids = encode_prompt(self.tokenizer, prompt, messages)
        request = prepare_request(
            prompt_ids,
            params or SamplingParams(),
            self.limits,
            num_speculative_tokens,
            proposer=proposer,
            default_proposer=self.config.speculation.proposer,
        )
        return RoundLoop(
            self.transport,
            self.tokenizer,
            request,
            self.costs,
            self.config.speculation,
            self.draft_availability,
            shared_ngrams=self.shared_ngrams,
        )
