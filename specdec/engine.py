"""SpeculativeEngine: the draft, the target and the round loop in one process."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from specdec.decoding.controller import CostModel
from specdec.decoding.request import AUTO, ModelLimits, encode_prompt, prepare_request
from specdec.decoding.round_loop import Completion, LoopConfig, RoundLoop
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stopping import Delta
from specdec.models.loading import LoadedModel, check_same_tokenizer, load_model_pair
from specdec.models.proposer import DraftProposer
from specdec.models.session import DEFAULT_CACHE_CAPACITY_BYTES
from specdec.models.verifier import TargetVerifier, fixed_width_for
from specdec.v1 import worker_pb2

DEFAULT_MAX_SPECULATIVE_TOKENS = 8
DEFAULT_DRAFT_TOP_N = 64


class LocalTransport:
    """The round loop's transport for a draft and target living in this process."""

    def __init__(self, proposer: DraftProposer, verifier: TargetVerifier) -> None:
        self.proposer = proposer
        self.verifier = verifier

    async def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        return self.proposer.propose(request)

    async def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        return self.verifier.verify(request)

    async def release(self, session_id: str) -> None:
        request = worker_pb2.ReleaseRequest(session_id=session_id)
        self.proposer.release(request)
        self.verifier.release(request)


class SpeculativeEngine:
    """Lossless speculative decoding in one process.

    Greedy output equals the target model's greedy output token for token; sampled output follows
    the target's distribution under the request's temperature / top-k / top-p (the acceptance rule
    is in specdec.decoding.rejection).

    Args:
        draft, target: loaded models sharing a tokenizer (ModelLoadError otherwise).
        max_speculative_tokens: k_max, the largest k a request may ask for.
        cache_capacity_bytes: per-model bound of the session KV caches, in bytes.
        draft_top_n: the draft samples from its top-N tokens (0 = the whole vocabulary).
        fixed_shape_verify: run every target decode forward at width k_max + 1 so that greedy
            output cannot depend on k through rounding (TargetVerifier); None = on in half
            precision.
        dynamic_draft_length: adaptive rounds draft up to k_max tokens and stop on the draft's
            confidence (specdec.decoding.round_loop.LoopConfig).
    """

    def __init__(
        self,
        draft: LoadedModel,
        target: LoadedModel,
        *,
        max_speculative_tokens: int = DEFAULT_MAX_SPECULATIVE_TOKENS,
        cache_capacity_bytes: int = DEFAULT_CACHE_CAPACITY_BYTES,
        draft_top_n: int = DEFAULT_DRAFT_TOP_N,
        fixed_shape_verify: bool | None = None,
        dynamic_draft_length: bool = True,
    ) -> None:
        check_same_tokenizer(draft.tokenizer, target.tokenizer)
        self.draft, self.target = draft, target
        self.tokenizer = target.tokenizer
        width = fixed_width_for(target, max_speculative_tokens, fixed_shape_verify)
        self.transport = LocalTransport(
            DraftProposer(draft, cache_capacity_bytes),
            TargetVerifier(target, cache_capacity_bytes, width),
        )
        self.limits = ModelLimits(
            vocab_size=target.vocab_size,
            context_limit=min(draft.context_limit, target.context_limit),
            max_speculative_tokens=max_speculative_tokens,
            eos_token_ids=target.eos_token_ids,
        )
        self.config = LoopConfig(
            k_max=max_speculative_tokens,
            draft_top_n=draft_top_n,
            dynamic_draft_length=dynamic_draft_length,
        )
        self.costs = CostModel(max_speculative_tokens)

    @classmethod
    def from_pretrained(
        cls,
        draft_model: str | os.PathLike,
        target_model: str | os.PathLike,
        *,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        draft_dtype: str | None = None,
        **kwargs: Any,
    ) -> SpeculativeEngine:
        """Loads both models offline (see specdec.models.load_model_pair) and builds the engine.

        ``draft_dtype`` defaults to ``dtype``; "int8" makes a CPU draft about twice as fast.
        """
        draft, target = load_model_pair(
            draft_model, target_model, dtype=dtype, device=device, draft_dtype=draft_dtype
        )
        return cls(draft, target, **kwargs)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        num_speculative_tokens: int | str = AUTO,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
    ) -> Completion:
        """Generates one completion.

        Args:
            prompt: text, or token ids; or pass chat ``messages`` instead.
            params: sampling and stop parameters (defaults: greedy, 64 new tokens).
            num_speculative_tokens: k per round, an int in [0, k_max] (0 = target only), or
                "auto" to choose k each round from measured acceptance and costs.
        Returns:
            Completion: token_ids, text, finish_reason ("stop" | "length"), logprobs (target
            log-probabilities of token_ids), prompt_tokens and stats.
        Raises:
            InvalidRequestError (a ValueError) naming the invalid field.
        """

        async def collect() -> Completion:
            loop = self._round_loop(prompt, params, num_speculative_tokens, messages)
            async with contextlib.aclosing(loop.run()) as deltas:
                async for _ in deltas:
                    pass
            return loop.completion

        return asyncio.run(collect())

    async def generate_stream(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        num_speculative_tokens: int | str = AUTO,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
    ) -> AsyncIterator[Delta]:
        """Like generate, yielding one Delta per round (text deltas concatenate to the text)."""
        loop = self._round_loop(prompt, params, num_speculative_tokens, messages)
        async with contextlib.aclosing(loop.run()) as deltas:
            async for delta in deltas:
                yield delta

    def _round_loop(self, prompt, params, num_speculative_tokens, messages) -> RoundLoop:
        prompt_ids = encode_prompt(self.tokenizer, prompt, messages)
        request = prepare_request(
            prompt_ids, params or SamplingParams(), self.limits, num_speculative_tokens
        )
        return RoundLoop(self.transport, self.tokenizer, request, self.costs, self.config)
