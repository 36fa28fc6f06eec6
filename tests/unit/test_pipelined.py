"""Pipelined drafting (SpeculationConfig.pipelined_drafting; issue 42, item 1): while the target
verifies a round, the draft drafts the next as if the round is accepted whole.

Greedy output equals the target alone's on every path: hits (the next round's tokens taken from
the pipelined draft, no draft call on its path), misses (rolled back), batches, a draft cache
lost mid-request, a draft that fails. The sampled distribution is tested in
test_sampling_exactness.py (test_pipelined_sampling_matches_target_only_sampling)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from specdec import SamplingParams
from specdec.config import SpecdecConfig, SpeculationConfig
from specdec.decoding.acceptance import AcceptanceEstimator, mean_expected_tokens
from specdec.decoding.costs import CostModel, CostPrior
from specdec.decoding.degrade import DraftAvailability
from specdec.decoding.k_policy import KController
from specdec.decoding.request import encode_prompt, prepare_request
from specdec.decoding.round_loop import RoundLoop
from specdec.errors import ConfigError
from specdec.models.tiny import PROMPTS

NEW_TOKENS = 40
SLACK = 2  # accepted tokens, over all prompts (test_pipelined_rounds_give_...)


class _Counting:
    """The engine's transport, counting the draft's calls: plain proposes, and pipelined ones
    (those with assumed tokens); ``fail`` and ``miss`` select pipelined calls (by number, from
    0) that raise, or answer cache_miss without reaching the draft."""

    def __init__(self, inner, fail=lambda n: False, miss=lambda n: False) -> None:
        self.inner, self.fail, self.miss = inner, fail, miss
        self.plain = self.ahead = 0

    async def propose(self, request):
        from specdec.v1 import worker_pb2

        if not request.assumed_token_ids:
            self.plain += 1
            return await self.inner.propose(request)
        n, self.ahead = self.ahead, self.ahead + 1
        if self.fail(n):
            raise RuntimeError(f"pipelined draft call {n} failed")
        if self.miss(n):
            return worker_pb2.ProposeResponse(cache_miss=True)
        return await self.inner.propose(request)

    async def verify(self, request):
        return await self.inner.verify(request)

    async def release(self, session_id, sides=("draft", "target")):
        await self.inner.release(session_id, sides)


def _loop(engine, transport, prompt, k, pipelined=True, breaker=None):
    request = prepare_request(
        encode_prompt(engine.tokenizer, prompt),
        SamplingParams(max_new_tokens=NEW_TOKENS),
        engine.limits,
        k,
    )
    config = dataclasses.replace(engine.config.speculation, pipelined_drafting=pipelined)
    return RoundLoop(transport, engine.tokenizer, request, engine.costs, config, breaker)


def _run(engine, transport, prompt, k, **options):
    loop = _loop(engine, transport, prompt, k, **options)
    return asyncio.run(asyncio.wait_for(loop.complete(), 120))  # a liveness bound


@pytest.fixture(scope="module")
def target_alone(engine):
    return {p: engine.generate(p, SamplingParams(max_new_tokens=NEW_TOKENS), 0) for p in PROMPTS}


@pytest.mark.parametrize("k", [1, 3])
def test_pipelined_rounds_give_the_target_alone_output_and_skip_their_draft_call(
    engine, target_alone, k
):
    """Each hit is a decode round that made no draft call of its own: the plain proposes are
    the prefill and the rounds that missed.

    A hit's tokens are the draft's greedy continuation of the committed tokens, as a plain
    propose's are, so they are accepted as often: the accepted tokens of all prompts equal
    those without pipelining, up to SLACK (the draft runs the same tokens in feeds of other
    widths, whose rounding could flip a rare argmax on some CPU; no output depends on it).
    Tokens taken from the wrong place, or after a bonus token that was not the guess, are
    rejected far more often."""
    overlapped = accepted = plain_accepted = 0
    for prompt in PROMPTS:
        transport = _Counting(engine.transport)
        completion = _run(engine, transport, prompt, k)
        stats = completion.stats
        assert completion.token_ids == target_alone[prompt].token_ids
        assert completion.logprobs == pytest.approx(target_alone[prompt].logprobs, abs=1e-5)
        drafting = stats.drafting_rounds - stats.ngram_rounds
        assert transport.plain == 1 + drafting - stats.overlapped_rounds
        assert transport.ahead >= stats.overlapped_rounds
        overlapped += stats.overlapped_rounds
        accepted += stats.accepted_tokens
        plain = _run(engine, _Counting(engine.transport), prompt, k, pipelined=False)
        plain_accepted += plain.stats.accepted_tokens
    assert overlapped > len(PROMPTS)  # the tiny draft agrees often: rounds must hit
    assert abs(accepted - plain_accepted) <= SLACK, (accepted, plain_accepted)


def test_off_no_call_assumes_tokens(engine, target_alone):
    transport = _Counting(engine.transport)
    completion = _run(engine, transport, PROMPTS[0], 3, pipelined=False)
    assert completion.token_ids == target_alone[PROMPTS[0]].token_ids
    assert transport.ahead == 0 and completion.stats.overlapped_rounds == 0
    assert completion.stats.wasted_draft_tokens == 0


def test_misses_and_failed_pipelined_calls_still_give_the_target_alone_output(engine, target_alone):
    """A pipelined call that misses the draft's cache, or fails, is dropped: the next round
    proposes (and, after a miss, rebuilds) as without pipelining. A failure tells the breaker,
    as any draft call's does."""
    prompt = PROMPTS[1]
    missing = _Counting(engine.transport, miss=lambda n: n % 2 == 0)
    completion = _run(engine, missing, prompt, 3)
    assert completion.token_ids == target_alone[prompt].token_ids
    assert missing.ahead > 1
    failing = _Counting(engine.transport, fail=lambda n: n == 1)
    breaker = DraftAvailability(retry_s=3600.0)
    completion = _run(engine, failing, prompt, 3, breaker=breaker)
    assert completion.token_ids == target_alone[prompt].token_ids
    assert breaker.down and completion.stats.rounds_without_draft > 0


def test_batched_pipelined_requests_give_the_target_alone_output(engine, target_alone):
    """Requests in flight together: their pipelined drafts and verifies share batches."""

    async def together():
        transport = _Counting(engine.transport)
        loops = [_loop(engine, transport, prompt, 3) for prompt in PROMPTS]
        return await asyncio.gather(*(loop.complete() for loop in loops))

    completions = asyncio.run(asyncio.wait_for(together(), 240))
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.token_ids == target_alone[prompt].token_ids
    assert sum(c.stats.overlapped_rounds for c in completions) > 0


def test_pipelined_drafting_and_alternating_phases_are_refused_together():
    with pytest.raises(ConfigError, match="^pipelined_drafting: "):
        SpecdecConfig.of(pipelined_drafting=True, alternate_phases=True)


def _controller(pipelined: bool, rate: float):
    """A KController at fixed costs: a flat 13 ms verify, a draft step a third of it."""
    config = SpeculationConfig(
        max_speculative_tokens=8, dynamic_draft_length=False, pipelined_drafting=pipelined
    )
    prior = CostPrior(verify_s=[0.013] * 9, draft_step_s=0.004, catchup_s=0.004)
    return KController(CostModel(config, prior), config, acceptance=AcceptanceEstimator(rate))


@pytest.mark.parametrize("rate", [0.5, 0.8, 0.95])
def test_the_controller_prices_a_round_with_its_chance_to_skip_the_draft(rate):
    """With pipelined drafting a round of k costs its draft only when the round before it
    missed: about 1 - rate^(k + 1) of the time. So it predicts more tokens per second, priced
    as that expectation."""
    sequential, pipelined = _controller(False, rate), _controller(True, rate)
    plain, ahead = sequential.choose(limit=100), pipelined.choose(limit=100)
    assert ahead.tokens_per_s > plain.tokens_per_s
    k = ahead.k
    costs = pipelined.costs
    hit = pipelined.acceptance.rate ** (k + 1)
    full, free = costs.round_seconds(k), costs.draft_free_round_seconds(k)
    expected = mean_expected_tokens([pipelined.acceptance.rate], k) / (full - hit * (full - free))
    assert ahead.tokens_per_s == pytest.approx(expected)
