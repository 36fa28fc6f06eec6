"""The PhaseGate: draft and verify calls of a router's requests in alternating phases, never a
draft beside a verify; and the round loop's requests through it, exact."""

from __future__ import annotations

import asyncio

import pytest

from specdec import SamplingParams
from specdec.decoding.costs import CostModel
from specdec.decoding.phases import PhaseGate
from specdec.decoding.request import encode_prompt, prepare_request
from specdec.decoding.round_loop import RoundLoop
from specdec.models.tiny import PROMPTS


class _Calls:
    """Starts gated calls that run until released; records the order in which they entered."""

    def __init__(self, gate: PhaseGate) -> None:
        self.gate = gate
        self.entered: list[str] = []
        self._release: dict[str, asyncio.Event] = {}

    def start(self, name: str, side: str) -> asyncio.Task:
        self._release[name] = asyncio.Event()

        async def call():
            async with self.gate.call(side):
                self.entered.append(name)
                await self._release[name].wait()

        return asyncio.ensure_future(call())

    def release(self, *names: str) -> None:
        for name in names:
            self._release[name].set()


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_side_runs_together_and_the_other_waits_for_the_whole_phase():
    async def scenario():
        calls = _Calls(PhaseGate())
        tasks = [calls.start("d1", "draft"), calls.start("d2", "draft")]
        await _settle()
        assert calls.entered == ["d1", "d2"]
        tasks.append(calls.start("t1", "target"))
        await _settle()
        assert calls.entered == ["d1", "d2"]  # a verify never runs beside a draft
        calls.release("d1")
        await _settle()
        assert calls.entered == ["d1", "d2"] and calls.gate.phase == "draft"
        calls.release("d2")
        await _settle()
        assert calls.entered[-1] == "t1" and calls.gate.phase == "target"
        calls.release("t1")
        await asyncio.gather(*tasks)
        assert calls.gate.phase is None

    asyncio.run(scenario())


def test_a_waiting_side_is_not_starved_and_its_calls_enter_as_one_batch():
    async def scenario():
        calls = _Calls(PhaseGate())
        tasks = [calls.start("d1", "draft")]
        await _settle()
        tasks.append(calls.start("t1", "target"))
        await _settle()
        # A draft arriving after a verify waits: it runs in the next draft phase.
        tasks += [calls.start("d2", "draft"), calls.start("t2", "target")]
        await _settle()
        assert calls.entered == ["d1"]
        calls.release("d1")
        await _settle()
        assert calls.entered == ["d1", "t1", "t2"]  # both waiting verifies, together
        calls.release("t1", "t2")
        await _settle()
        assert calls.entered == ["d1", "t1", "t2", "d2"]
        calls.release("d2")
        await asyncio.gather(*tasks)
        assert calls.gate.phase is None

    asyncio.run(scenario())


def test_a_call_past_max_wait_runs_anyway():
    # A call stuck on a lost replica must not hold the other side longer than max_wait_s.
    async def scenario():
        calls = _Calls(PhaseGate(max_wait_s=0.05))
        stuck = calls.start("stuck", "draft")
        await _settle()
        waiting = calls.start("t1", "target")
        await _settle()
        assert calls.entered == ["stuck"]
        await asyncio.sleep(0.2)
        assert calls.entered == ["stuck", "t1"]
        calls.release("t1")
        await waiting
        calls.release("stuck")
        await stuck
        assert calls.gate.phase is None
        # The gate works as before after it.
        tasks = [calls.start("d2", "draft")]
        await _settle()
        tasks.append(calls.start("t2", "target"))
        await _settle()
        assert calls.entered[-1] == "d2"
        calls.release("d2", "t2")
        await asyncio.gather(*tasks)
        assert calls.entered[-1] == "t2" and calls.gate.phase is None

    asyncio.run(scenario())


def test_a_stuck_phase_is_taken_once_not_waited_for_every_call():
    # A draft call stuck on a lost pool: the first verify waits max_wait_s and takes the phase;
    # the verifies after it (the next rounds) enter at once, though the stuck call runs on.
    async def scenario():
        calls = _Calls(PhaseGate(max_wait_s=0.05))
        stuck = calls.start("stuck", "draft")
        await _settle()
        first = calls.start("t1", "target")
        await asyncio.sleep(0.2)
        assert calls.entered == ["stuck", "t1"] and calls.gate.phase == "target"
        calls.release("t1")
        await first
        second = calls.start("t2", "target")
        await _settle()
        assert calls.entered[-1] == "t2"  # no second wait of max_wait_s
        calls.release("t2")
        await second
        calls.release("stuck")
        await stuck
        assert calls.gate.phase is None

    asyncio.run(scenario())


def test_cancelled_calls_leave_no_state_behind():
    async def scenario():
        calls = _Calls(PhaseGate())
        running = calls.start("d1", "draft")
        await _settle()
        waiting = calls.start("t1", "target")
        await _settle()
        waiting.cancel()  # a client cancel while its verify waits for the phase
        await _settle()
        running.cancel()  # and one while its draft runs
        await _settle()
        assert calls.gate.phase is None
        task = calls.start("t2", "target")
        await _settle()
        assert calls.entered == ["d1", "t2"]
        calls.release("t2")
        await task

    asyncio.run(scenario())


def test_an_unknown_side_is_refused():
    async def scenario():
        async with PhaseGate().call("verify"):
            pass

    with pytest.raises(ValueError, match="side"):
        asyncio.run(scenario())


class _Overlaps:
    """Wraps the engine's transport: each call yields to the event loop while it runs (as a
    replica call does), and the largest number of calls of each side that ran at once and of
    draft calls running beside a verify are recorded."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.running = {"draft": 0, "target": 0}
        self.most = {"draft": 0, "target": 0}
        self.overlapped = 0

    async def _timed(self, side, call, request):
        self.running[side] += 1
        self.most[side] = max(self.most[side], self.running[side])
        self.overlapped += self.running["draft"] > 0 and self.running["target"] > 0
        try:
            await asyncio.sleep(0.002)
            return await call(request)
        finally:
            self.running[side] -= 1

    async def propose(self, request):
        return await self._timed("draft", self.inner.propose, request)

    async def verify(self, request):
        return await self._timed("target", self.inner.verify, request)

    async def release(self, session_id, sides=("draft", "target")):
        await self.inner.release(session_id, sides)


@pytest.mark.parametrize("gated", [False, True])
def test_concurrent_requests_through_the_gate_never_overlap_and_stay_exact(engine, gated):
    config = engine.config.speculation
    costs = CostModel(config)
    transport = _Overlaps(engine.transport)
    params = SamplingParams(max_new_tokens=24)
    gate = PhaseGate() if gated else None

    async def run_all():
        loops = []
        for i, prompt in enumerate(PROMPTS[:4]):
            request = prepare_request(
                encode_prompt(engine.tokenizer, prompt), params, engine.limits, 1 + i % 3
            )
            loops.append(RoundLoop(transport, engine.tokenizer, request, costs, config, None, gate))
        return await asyncio.gather(*(loop.complete() for loop in loops))

    completions = asyncio.run(run_all())
    if gated:
        assert transport.overlapped == 0
        assert transport.most["target"] > 1 and transport.most["draft"] > 1  # phases batch
        assert gate.phase is None
    else:  # the wrapper sees overlaps where nothing orders the calls
        assert transport.overlapped > 0
    for prompt, completion in zip(PROMPTS[:4], completions):
        alone = engine.generate(prompt, params, 0)
        assert completion.token_ids == alone.token_ids
