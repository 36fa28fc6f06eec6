"""Degrade, never fail: a failing draft side costs speed, never answers (issue 13, item 1).

The breaker (specdec.decoding.degrade.DraftAvailability) on a fake clock, then whole requests on
the tiny in-process pair whose draft fails on chosen calls: the output equals the target alone,
the stats count the rounds that ran without the draft, and speculation resumes after the check.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from specdec import SamplingParams
from specdec.decoding.costs import CostModel, CostPrior
from specdec.decoding.degrade import DraftAvailability
from specdec.decoding.request import encode_prompt, prepare_request
from specdec.decoding.round_loop import RoundLoop
from specdec.models.tiny import PROMPTS

K = 3
NEW_TOKENS = 40


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _DraftDown(RuntimeError):
    pass


def test_breaker_backs_off_while_checks_fail_and_resets_on_success():
    clock, changes = _Clock(), []
    breaker = DraftAvailability(1.0, on_change=changes.append, max_retry_s=4.0, clock=clock)
    assert breaker.available()
    breaker.failed(_DraftDown("node died"))
    breaker.failed(_DraftDown("same incident"))  # calls in flight: no second back-off
    assert changes == [False] and breaker.retry_delay_s == 1.0
    assert not breaker.available()
    clock.now += 1.0
    assert breaker.available()  # without a probe, the next propose is the check
    assert changes == [False, True]
    for expected in (2.0, 4.0, 4.0):  # each check that fails doubles the wait, up to 4 s
        breaker.failed(_DraftDown("still down"))
        assert breaker.retry_delay_s == expected and breaker.down
        clock.now += expected - 0.01
        assert not breaker.available()
        clock.now += 0.01
        assert breaker.available()
    breaker.succeeded()
    breaker.failed(_DraftDown("a new incident"))
    assert breaker.retry_delay_s == 1.0


def test_breaker_checks_with_its_probe_in_the_background():
    clock, answers = _Clock(), []

    async def probe() -> None:
        if not answers.pop(0):
            raise _DraftDown("no draft replica")

    async def run() -> list[bool]:
        breaker = DraftAvailability(1.0, probe=probe, clock=clock)
        breaker.failed(_DraftDown("node died"))
        seen = []
        answers.extend([False, True])
        for step_s in (1.0, 0.0, 1.0, 1.0, 0.0):
            clock.now += step_s
            seen.append(breaker.available())  # a due check starts the probe, answers False
            await asyncio.sleep(0)  # the probe runs
            await asyncio.sleep(0)
        return seen

    # Checks at t+1 (fails: the wait doubles to 2 s) and t+3 (answers); the draft is then back.
    assert asyncio.run(run()) == [False, False, False, False, True]
    assert answers == []


class _FlakyDraft:
    """The engine's transport whose draft raises on the calls ``fail`` selects (by call number,
    0 = the draft's prefill)."""

    def __init__(self, inner, fail) -> None:
        self.inner = inner
        self.fail = fail
        self.draft_calls = 0
        self.released: list[tuple[str, ...]] = []  # the sides of each release

    async def propose(self, request):
        call = self.draft_calls
        self.draft_calls += 1
        if self.fail(call):
            raise _DraftDown(f"draft call {call} failed")
        return await self.inner.propose(request)

    async def verify(self, request):
        return await self.inner.verify(request)

    async def release(self, session_id, sides=("draft", "target")):
        self.released.append(tuple(sides))
        await self.inner.release(session_id, sides)


class _FixedCosts(CostModel):
    """Costs at which drafting always pays (a flat verify, a nearly free draft step), whatever
    the rounds measure: under ``auto`` the draft model is then asked every round it is up.
    The session's engine prices at what every earlier test measured, so there whether ``auto``
    drafts at all, and how often, depends on the tests run before."""

    def __init__(self, config) -> None:
        k_max = config.max_speculative_tokens
        super().__init__(config, CostPrior(verify_s=[0.01] * (k_max + 1), draft_step_s=1e-4))

    def observe(self, k, timing) -> None:
        pass


def _run(engine, transport, prompt, k, breaker, config=None, **loop_args):
    request = prepare_request(
        encode_prompt(engine.tokenizer, prompt),
        SamplingParams(max_new_tokens=NEW_TOKENS),
        engine.limits,
        k,
    )
    config = config or engine.config.speculation
    costs = _FixedCosts(engine.config.speculation) if k == "auto" else engine.costs
    loop = RoundLoop(transport, engine.tokenizer, request, costs, config, breaker, **loop_args)
    # A liveness bound, not a timing: a round that waited on a call that never answers would
    # hang the test.
    return asyncio.run(asyncio.wait_for(loop.complete(), 120))


@pytest.fixture(scope="module")
def target_alone(engine):
    return {p: engine.generate(p, SamplingParams(max_new_tokens=NEW_TOKENS), 0) for p in PROMPTS}


@pytest.mark.parametrize("k", [K, "auto"])
@pytest.mark.parametrize(
    "failing",
    [
        pytest.param(lambda call: True, id="draft-never-answers"),
        pytest.param(lambda call: call == 0, id="prefill-fails"),
        pytest.param(lambda call: call in (2, 3), id="rounds-2-3-fail"),
    ],
)
def test_a_failing_draft_gives_the_target_alone_output(engine, target_alone, failing, k):
    # A long retry: once down, the draft stays down for the rest of the request.
    for prompt in PROMPTS[:3]:
        transport = _FlakyDraft(engine.transport, failing)
        breaker = DraftAvailability(retry_s=3600.0)
        completion = _run(engine, transport, prompt, k, breaker)
        alone = target_alone[prompt]
        assert completion.token_ids == alone.token_ids
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        stats = completion.stats
        assert breaker.down and breaker.failures == 1
        model_drafted = stats.draft_tokens - stats.ngram_draft_tokens
        if failing(0):  # the draft never prefilled: the draft model drafted nothing
            assert model_drafted == 0
        assert stats.rounds_without_draft > 0
        model_rounds = stats.drafting_rounds - stats.ngram_rounds
        assert stats.rounds_without_draft + model_rounds <= stats.decode_rounds


@pytest.mark.parametrize(
    "failing",
    [
        pytest.param(lambda call: True, id="draft-never-answers"),
        pytest.param(lambda call: call >= 2, id="fails-mid-request"),
    ],
)
def test_without_the_draft_rounds_run_on_ngram_lookup(engine, failing):
    """A text that repeats itself keeps speculating on n-gram proposals while the draft is
    down, a round whose draft call fails included, with the target alone's output.

    At a fixed k the stand-in proposes every match whole, so what lookup accepts depends on the
    text alone. Under ``auto`` each proposal is priced (_FixedCosts: the draft is asked until
    it fails) at this request's acceptance, so there only the fallback to lookup (not to
    k = 0) is asserted."""
    prompt = "one two three four five six one two three four five six one two"
    alone = engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS), 0)
    for k in (K, "auto"):
        breaker = DraftAvailability(retry_s=3600.0)
        completion = _run(engine, _FlakyDraft(engine.transport, failing), prompt, k, breaker)
        assert completion.token_ids == alone.token_ids
        stats = completion.stats
        assert breaker.down and stats.rounds_without_draft > 0
        assert stats.ngram_rounds > 0
        if k == K:
            assert stats.ngram_accepted_tokens > 0
            assert stats.decode_rounds < alone.stats.decode_rounds


def test_speculation_resumes_once_the_draft_answers_again(engine, target_alone):
    prompt = PROMPTS[0]
    transport = _FlakyDraft(engine.transport, lambda call: call == 1)
    clock = _Clock()
    breaker = DraftAvailability(retry_s=1.0, clock=clock)
    first = _run(engine, transport, prompt, K, breaker)
    assert first.token_ids == target_alone[prompt].token_ids
    assert breaker.down and first.stats.rounds_without_draft > 0
    clock.now += 1.0
    again = _run(engine, transport, prompt, K, breaker)
    assert again.token_ids == target_alone[prompt].token_ids
    assert not breaker.down
    assert again.stats.rounds_without_draft == 0 and again.stats.draft_tokens > 0


def test_a_target_only_request_never_calls_the_draft(engine, target_alone):
    prompt = PROMPTS[1]
    transport = _FlakyDraft(engine.transport, lambda call: True)
    breaker = DraftAvailability()
    completion = _run(engine, transport, prompt, 0, breaker)
    assert completion.token_ids == target_alone[prompt].token_ids
    assert transport.draft_calls == 0 and not breaker.down
    assert completion.stats.rounds_without_draft == 0
    assert transport.released == [("target",)]  # not even a release reaches the draft side
    _run(engine, transport, prompt, K, breaker)
    assert transport.released[-1] == ("target", "draft")


class _SilentDraft(_FlakyDraft):
    """A draft that never answers a call carrying the whole sequence (a dead pool whose calls
    Serve queues), and answers the others."""

    def __init__(self, inner) -> None:
        super().__init__(inner, lambda call: False)

    async def propose(self, request):
        if request.session.prefix_len == 0:
            self.draft_calls += 1
            await asyncio.Event().wait()
        return await super().propose(request)


def test_a_round_waits_for_the_drafts_first_call_at_most_draft_wait_s(engine, target_alone):
    """With the draft prefilled after the first token (concurrent_prefill off, the local
    config), the first drafting round's call carries the prompt: a draft that never answers
    it holds that round draft_wait_s, and the request goes on without the draft (the call
    runs on in the background until the request ends)."""
    prompt = PROMPTS[2]
    transport = _SilentDraft(engine.transport)
    config = dataclasses.replace(engine.config.speculation, concurrent_prefill=False)
    completion = _run(engine, transport, prompt, K, DraftAvailability(), config, draft_wait_s=0.05)
    assert completion.token_ids == target_alone[prompt].token_ids
    assert transport.draft_calls == 1  # one first call, never answered, never repeated
    assert completion.stats.rounds_without_draft > 0
    assert completion.stats.draft_tokens == completion.stats.ngram_draft_tokens


class _Handle:
    """A Serve deployment handle whose release calls answer at once, or never (a draft pool
    without replicas, where Serve queues the call)."""

    def __init__(self, name, answers) -> None:
        self.deployment_name, self.answers, self.received = name, answers, []
        self.release = self

    def options(self, **kwargs):
        return self

    def remote(self, request):
        self.received.append(request.session_id)
        future = asyncio.get_running_loop().create_future()
        if self.answers:
            future.set_result(None)
        return future


def test_a_finished_request_never_waits_for_the_draft_sides_release():
    """With the draft pool gone, a release sent to it is queued until a draft replica exists:
    the request's end must not wait for it (it waited call_timeout_s, 120 s as shipped)."""
    from specdec.config import ServiceConfig
    from specdec.deployments.transport import HandleTransport

    draft, target = _Handle("DraftModel", answers=False), _Handle("TargetModel", answers=True)
    transport = HandleTransport(
        draft, target, "s1", ServiceConfig(call_timeout_s=60, unavailable_after_s=90)
    )

    async def release():
        await asyncio.wait_for(transport.release("s1", ("target", "draft")), timeout=5)

    asyncio.run(release())
    assert target.received == ["s1"] and draft.received == ["s1"]  # sent, not waited for
