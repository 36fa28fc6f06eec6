"""What the round loop tells the controller and the replicas, on the tiny in-process pair: the
draft's catch-up apart from its steps, rebuilt rounds flagged, prompt_len on every call."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from specdec import SamplingParams
from specdec.decoding.costs import CATCHUP_STEADY_TOKENS, CostModel, RoundTiming
from specdec.decoding.k_policy import KController
from specdec.decoding.request import encode_prompt, prepare_request
from specdec.decoding.round_loop import RoundLoop
from specdec.models.tiny import PROMPTS

K = 3
DRAFT_MISS_CALL = 3  # the draft's prefill, round 1, then round 2 finds its cache gone
TARGET_MISS_CALL = 4  # the target's prefill, rounds 1 and 2, then round 3


class _Wrapped:
    """A transport that passes every call to ``inner`` (the engine's); the wrappers below record
    or change what they need and release through it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def release(self, session_id, sides=("draft", "target")):
        await self.inner.release(session_id, sides)


class _Recording(_Wrapped):
    """Wraps the engine's transport: records each call and drops a side's session cache before
    its n-th call, as an LRU eviction or a replica restart would."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls: dict[str, list] = {"draft": [], "target": []}

    async def propose(self, request):
        self._before("draft", request, self.inner.proposer, DRAFT_MISS_CALL)
        response = await self.inner.propose(request)
        self.calls["draft"][-1]["response"] = response
        return response

    async def verify(self, request):
        self._before("target", request, self.inner.verifier, TARGET_MISS_CALL)
        return await self.inner.verify(request)

    def _before(self, side, request, model, miss_call) -> None:
        session = request.session
        self.calls[side].append(
            {
                "prefix_len": session.prefix_len,
                "prompt_len": session.prompt_len,
                "new_tokens": len(session.new_token_ids),
            }
        )
        if len(self.calls[side]) == miss_call:
            model.sessions.evict(session.session_id)


class _SpyCosts(CostModel):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.rounds: list[tuple[int, RoundTiming]] = []

    def observe(self, k: int, timing: RoundTiming) -> None:
        self.rounds.append((k, timing))
        super().observe(k, timing)


@pytest.fixture(scope="module")
def recorded(engine):
    """One fixed-k request through a recording transport: (transport, costs, prompt length)."""
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[0])
    params = SamplingParams(max_new_tokens=40)
    request = prepare_request(prompt_ids, params, engine.limits, K)
    transport = _Recording(engine.transport)
    costs = _SpyCosts(engine.config.speculation)
    loop = RoundLoop(transport, engine.tokenizer, request, costs, engine.config.speculation)
    asyncio.run(loop.complete())
    assert len(costs.rounds) >= 4, "the request ended before the rebuilt rounds"
    return transport, costs, len(prompt_ids)


def test_every_call_carries_the_prompt_length(recorded):
    transport, _, prompt_len = recorded
    calls = transport.calls["draft"] + transport.calls["target"]
    assert [c["prompt_len"] for c in calls] == [prompt_len] * len(calls)


def test_rounds_that_resent_the_sequence_are_flagged_as_rebuilds(recorded):
    _, costs, _ = recorded
    flags = [(t.draft_rebuilt, t.target_rebuilt) for _, t in costs.rounds]
    # Round 2 resent the draft's sequence, round 3 the target's; no other round rebuilt.
    expected = [(False, False)] * len(flags)
    expected[1], expected[2] = (True, False), (False, True)
    assert flags == expected


def test_the_draft_reports_its_catchup_apart_from_its_steps(recorded):
    transport, costs, prompt_len = recorded
    prefill = transport.calls["draft"][0]
    # k = 0: all catch-up, of the whole sequence the call carried (the prompt, and the first
    # token when the target's prefill committed it before the draft's call started).
    assert prefill["prefix_len"] == 0 and prefill["new_tokens"] >= prompt_len
    assert prefill["response"].catchup_tokens == prefill["new_tokens"]
    assert prefill["response"].catchup_s == prefill["response"].compute_s
    rebuilt = transport.calls["draft"][DRAFT_MISS_CALL]  # the resend after the miss
    assert rebuilt["prefix_len"] == 0
    assert [k for k, _ in costs.rounds[:4]] == [K] * 4
    for i, (k, timing) in enumerate(costs.rounds):
        if k == 0:  # the last round, capped by max_new_tokens: no draft call
            assert timing.catchup_tokens == 0 and timing.draft_s == 0.0
            continue
        assert 0 < timing.catchup_s <= timing.draft_s
        if i == 1:  # the rebuilt draft fed the whole committed sequence
            assert timing.catchup_tokens == rebuilt["new_tokens"] > CATCHUP_STEADY_TOKENS
        else:  # last round's last accepted token and the bonus, or the correction alone
            assert 1 <= timing.catchup_tokens <= CATCHUP_STEADY_TOKENS


def test_a_request_counts_in_flight_while_it_runs_and_not_after(engine):
    seen = []

    class _Counting(_SpyCosts):
        def observe(self, k, timing):
            seen.append(self.traffic.in_flight)
            super().observe(k, timing)

    costs = _Counting(engine.config.speculation)
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[0])
    request = prepare_request(prompt_ids, SamplingParams(max_new_tokens=6), engine.limits, K)
    loop = RoundLoop(engine.transport, engine.tokenizer, request, costs, engine.config.speculation)
    asyncio.run(loop.complete())
    assert seen and set(seen) == {1}
    assert costs.traffic.in_flight == 0


class _Rounds(_Wrapped):
    """Wraps the engine's transport: pairs each round's proposal with its verify's answer."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.rounds: list[tuple] = []  # (ProposeResponse, VerifyResponse)
        self._proposal = None

    async def propose(self, request):
        response = await self.inner.propose(request)
        if request.num_speculative_tokens:
            self._proposal = response
        return response

    async def verify(self, request):
        response = await self.inner.verify(request)
        if request.draft_token_ids:
            self.rounds.append((self._proposal, response))
        return response


def test_the_drafts_confidences_reach_the_controllers_calibration(engine):
    transport = _Rounds(engine.transport)
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[1])
    request = prepare_request(prompt_ids, SamplingParams(max_new_tokens=24), engine.limits, K)
    costs = CostModel(engine.config.speculation)
    loop = RoundLoop(transport, engine.tokenizer, request, costs, engine.config.speculation)
    asyncio.run(loop.complete())
    assert len(transport.rounds) >= 3
    expected = []
    for proposal, verified in transport.rounds:
        assert len(proposal.confidences) == len(proposal.token_ids)
        assert all(0 < p <= 1 for p in proposal.confidences)
        # The tokens up to the round's first rejection have an outcome; later ones none.
        expected += list(proposal.confidences)[: verified.num_accepted + 1]
    observed = [p for p, _ in loop._controller.confidence._tokens]
    assert observed == pytest.approx(expected, rel=1e-6)


def test_the_draft_lag_counts_only_tokens_the_drafts_cache_lacks(engine, monkeypatch):
    # After a round the draft's cache holds its accepted tokens but the last drafted one, so it
    # lacks at most CATCHUP_STEADY_TOKENS (the last draft token and the bonus). Counted from
    # its last call instead, a fully accepted round of K looked like a lag of K + 1: a prefill
    # to price (KController.choose).
    lags = []
    choose = KController.choose

    def spy(self, limit, draft_lag=0):
        lags.append(draft_lag)
        return choose(self, limit, draft_lag)

    monkeypatch.setattr(KController, "choose", spy)
    transport = _Rounds(engine.transport)
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[1])
    request = prepare_request(prompt_ids, SamplingParams(max_new_tokens=40), engine.limits, K)
    costs = CostModel(engine.config.speculation)
    asyncio.run(
        RoundLoop(transport, engine.tokenizer, request, costs, engine.config.speculation).complete()
    )
    full = [v.num_accepted == K for _, v in transport.rounds[:-1]]
    assert any(full), "no fully accepted round to test on"
    # lags[0] is the first round's (the draft's prefill runs apart); every later round follows
    # a speculative one.
    assert lags[1:] and max(lags[1:]) <= CATCHUP_STEADY_TOKENS, lags


class _FirstTokenAt(_Wrapped):
    """Wraps the engine's transport: another request (counted on ``costs``) waits for its first
    token until this request's ``release_after``-th verify; records the k of each proposal."""

    def __init__(self, inner, costs: CostModel, release_after: int) -> None:
        super().__init__(inner)
        self.costs, self.release_after = costs, release_after
        self.verifies = 0
        self.proposals: list[tuple[int, int]] = []  # (verifies so far, k asked)
        costs.traffic.prefill_started()

    async def propose(self, request):
        self.proposals.append((self.verifies, request.num_speculative_tokens))
        return await self.inner.propose(request)

    async def verify(self, request):
        response = await self.inner.verify(request)
        self.verifies += 1
        if self.verifies == self.release_after:
            self.costs.traffic.prefill_ended()
        return response


@pytest.mark.parametrize("concurrent_prefill", [False, True])
def test_no_draft_starts_beside_another_requests_prefill_where_they_share_cores(
    engine, concurrent_prefill
):
    """concurrent_prefill false: the draft's first call (its prefill) waits until no other
    request waits for its first token; true (separate devices): it starts at once."""
    config = dataclasses.replace(engine.config.speculation, concurrent_prefill=concurrent_prefill)
    costs = CostModel(config)
    transport = _FirstTokenAt(engine.transport, costs, release_after=4)
    prompt_ids = encode_prompt(engine.tokenizer, PROMPTS[1])
    request = prepare_request(prompt_ids, SamplingParams(max_new_tokens=24), engine.limits, K)
    completion = asyncio.run(
        RoundLoop(transport, engine.tokenizer, request, costs, config).complete()
    )
    drafting = [verifies for verifies, k in transport.proposals if k > 0]
    assert drafting, "the request never drafted"
    if concurrent_prefill:
        assert transport.proposals[0][1] == 0  # the draft's prefill, beside the target's
        assert drafting[0] == 1  # the first round
    else:
        assert drafting[0] == 4  # the first round after the other's first token
    assert costs.traffic.prefills_pending == 0
    alone = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=24), 0)
    assert completion.token_ids == alone.token_ids
