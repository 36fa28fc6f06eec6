"""A broken replica leaves rotation: the compute watchdog, injected faults, and a failing row
that fails its own call, not its batch (specdec.worker.compute_health, specdec.worker.faults,
SessionModel.run_batch)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import types
from collections.abc import Callable

import pytest

from specdec import SamplingParams, SpeculativeEngine
from specdec.deployments.failures import retryable
from specdec.errors import ComputeUnhealthy
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2
from specdec.worker.compute_health import ComputeWatchdog, forward_error
from specdec.worker.faults import InjectedFault, install_faults

NEW_TOKENS = 12


def _clock() -> tuple[list[float], Callable[[], float]]:
    """(now, clock): a clock that reads now[0], in seconds, which the test moves."""
    now = [100.0]
    return now, lambda: now[0]


def test_a_batch_running_past_the_bound_is_stuck_until_it_ends():
    now, clock = _clock()
    watchdog = ComputeWatchdog(stuck_after_s=30, max_failures=3, clock=clock)
    watchdog.check()  # idle: healthy
    watchdog.started()
    now[0] += 30
    watchdog.check()  # at the bound: still healthy
    now[0] += 0.5
    with pytest.raises(ComputeUnhealthy, match=r"stuck: its batch has run 30.5 s.*stuck_forward_s"):
        watchdog.check()
    watchdog.ended()  # a slow batch that did end: healthy again
    watchdog.check()


def test_consecutive_failed_batches_fail_the_check_and_a_good_batch_resets_the_count():
    watchdog = ComputeWatchdog(stuck_after_s=30, max_failures=3, clock=_clock()[1])
    for _ in range(2):
        watchdog.started()
        watchdog.ended(RuntimeError("CUDA error: an illegal memory access"))
    watchdog.check()  # two in a row: below the bound
    watchdog.started()
    watchdog.ended()
    assert watchdog.failures == 0
    for _ in range(3):
        watchdog.started()
        watchdog.ended(RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(ComputeUnhealthy, match=r"3 batches in a row.*illegal memory access"):
        watchdog.check()


def test_only_forward_errors_count_and_a_refusal_is_retried_by_the_router():
    good = worker_pb2.VerifyResponse()
    assert forward_error([good, ValueError("q must hold 2 rows"), None]) is None
    error = RuntimeError("device lost")
    assert forward_error([good, ValueError("bad"), error]) is error
    assert retryable(ComputeUnhealthy("compute thread stuck"))
    assert not retryable(error)


def _replica(watchdog: ComputeWatchdog) -> tuple[types.SimpleNamespace, list[str]]:
    """A stand-in for a ModelReplica's state around ``watchdog``, and the counters it bumps."""
    bumped: list[str] = []

    def counter(name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(inc=lambda: bumped.append(name))

    metrics = types.SimpleNamespace(refused=counter("refused"), failed_batches=counter("failed"))
    sessions = types.SimpleNamespace(expire=lambda: 0)
    replica = types.SimpleNamespace(
        _watchdog=watchdog, _metrics=metrics, side=types.SimpleNamespace(sessions=sessions)
    )
    return replica, bumped


def test_a_broken_replica_fails_its_health_check_and_refuses_calls_before_they_queue():
    from specdec.deployments.model_replica import ModelReplica

    replica, bumped = _replica(ComputeWatchdog(stuck_after_s=30, max_failures=1))
    asyncio.run(ModelReplica.check_health(replica))  # healthy

    async def batched(item):
        raise AssertionError("a refused call must not queue for a batch")

    job = concurrent.futures.Future()
    job.set_result([worker_pb2.VerifyResponse(), RuntimeError("CUDA error: device lost")])
    replica._watchdog.started()
    ModelReplica._batch_ended(replica, job)  # a batch with a forward error
    with pytest.raises(ComputeUnhealthy, match="1 batches in a row.*device lost"):
        asyncio.run(ModelReplica.check_health(replica))
    with pytest.raises(ComputeUnhealthy):
        asyncio.run(ModelReplica._batched(replica, batched, "request"))
    assert bumped == ["failed", "refused"]


@pytest.mark.parametrize("stuck_after_s, max_failures", [(0, 3), (-1, 3), (30, 0)])
def test_watchdog_bounds_are_checked(stuck_after_s, max_failures):
    with pytest.raises(ValueError):
        ComputeWatchdog(stuck_after_s, max_failures)


@pytest.fixture(scope="module")
def built(tiny_pair):
    draft, target = tiny_pair
    return SpeculativeEngine.from_pretrained(draft, target)


@pytest.fixture
def faults(tmp_path, built):
    """fault(side, text): writes the fault file of ``side`` ("target" or "draft"), whose
    model is hooked for this test only."""
    sides = {"target": built.transport.verifier, "draft": built.transport.proposer}
    hooks = [install_faults(s.loaded.model, name, str(tmp_path)) for name, s in sides.items()]

    def fault(side: str, text: str) -> None:
        (tmp_path / side).write_text(text)

    yield fault
    for hook in hooks:
        hook.remove()


def test_no_fault_folder_hooks_nothing(built, monkeypatch):
    monkeypatch.delenv("SPECDEC_FAULT_DIR", raising=False)
    assert install_faults(built.transport.verifier.loaded.model, "target") is None


def _prefill(session_id: str, token_ids: list[int]) -> worker_pb2.VerifyRequest:
    tokens = worker_pb2.SessionTokens(session_id=session_id, new_token_ids=token_ids)
    return worker_pb2.VerifyRequest(session=tokens, sampling=worker_pb2.SamplingConfig())


def _unused_token(built, prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """A token id (below the tokenizer's size) that no prompt or output here holds."""
    used = {t for ids in prompts + outputs for t in ids}
    return next(t for t in range(3, len(built.target.tokenizer)) if t not in used)


async def _together(built, prompts, k) -> list:
    """Greedy requests awaited together (their calls share batched forwards): per prompt its
    token ids, or the exception that ended it."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    runs = [built.agenerate(p, params, k) for p in prompts]
    outcomes = await asyncio.gather(*runs, return_exceptions=True)
    return [o if isinstance(o, BaseException) else o.token_ids for o in outcomes]


def test_a_failing_row_fails_its_own_request_and_the_others_stay_exact(built, faults):
    verifier = built.transport.verifier
    encode = built.target.tokenizer.encode
    prompts = [encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    alone = [built.generate(p, params, 0).token_ids for p in prompts]
    token = _unused_token(built, prompts, alone)
    faults("target", f"raise-token {token}")
    rebuilds = verifier.sessions.rebuilds

    async def run() -> list:
        # Three streams decode in step (k = 0: one verify a round each, batched together);
        # the poisoned prompt's prefill joins their next batch of decode rows.
        streams = [built.generate_stream(p, params, 0) for p in prompts]
        firsts = [list((await anext(s)).token_ids) for s in streams]

        async def rest(stream, tokens):
            async for delta in stream:
                tokens += delta.token_ids
            return tokens

        poisoned = built.agenerate(prompts[0] + [token], params, 0)
        runs = [rest(s, f) for s, f in zip(streams, firsts)] + [poisoned]
        return await asyncio.gather(*runs, return_exceptions=True)

    # That batch's forward raises, its calls run again alone, and only the poisoned one fails;
    # the others' caches were dropped with the failed forward, so they miss and are rebuilt
    # from their token ids, still exact.
    outcomes = asyncio.run(run())
    assert isinstance(outcomes[-1], InjectedFault) and f"token {token}" in str(outcomes[-1])
    assert outcomes[:-1] == alone
    assert verifier.sessions.rebuilds == rebuilds + len(prompts)


def test_a_failing_draft_row_fails_its_own_propose_and_its_request_goes_on(built, faults):
    proposer = built.transport.proposer
    encode = built.target.tokenizer.encode
    prompts = [encode(p) for p in PROMPTS[:3]]
    alone = [
        built.generate(p, SamplingParams(max_new_tokens=NEW_TOKENS), 0).token_ids for p in prompts
    ]
    token = _unused_token(built, prompts, alone)
    faults("draft", f"raise-token {token}")

    def propose(session_id: str, token_ids: list[int]) -> worker_pb2.ProposeRequest:
        return worker_pb2.ProposeRequest(
            session=_prefill(session_id, token_ids).session, num_speculative_tokens=3
        )

    batch = [propose(f"draft-{i}", p) for i, p in enumerate(prompts)]
    responses = proposer.propose_batch(batch + [propose("draft-poisoned", prompts[0] + [token])])
    assert isinstance(responses[-1], InjectedFault)
    assert [len(r.token_ids) for r in responses[:-1]] == [3, 3, 3]  # prefills run again alone
    # Through the round loop: the poisoned request's draft fails, and it goes on with the
    # target alone (a failed propose degrades, specdec.decoding.degrade), exact as the others.
    poisoned = [prompts[1] + [token]]
    expected = alone + [
        built.generate(poisoned[0], SamplingParams(max_new_tokens=NEW_TOKENS), 0).token_ids
    ]
    assert asyncio.run(_together(built, prompts + poisoned, 2)) == expected


def test_a_sticky_device_error_fails_every_row(built, faults):
    verifier = built.transport.verifier
    encode = built.target.tokenizer.encode
    faults("target", "raise")
    requests = [_prefill(f"sticky-{i}", encode(p)) for i, p in enumerate(PROMPTS[:3])]
    responses = verifier.verify_batch(requests)
    assert all(isinstance(r, InjectedFault) for r in responses)
    assert forward_error(responses) is responses[0]
    stored = verifier.sessions._entries
    assert not any(f"sticky-{i}" in stored for i in range(3))  # nothing half-written is kept


def test_a_hung_forward_holds_its_thread_until_the_fault_is_lifted(built, faults):
    verifier = built.transport.verifier
    faults("target", "hang")
    now, clock = _clock()
    watchdog = ComputeWatchdog(stuck_after_s=5, max_failures=3, clock=clock)
    watchdog.started()
    request = _prefill("hung", built.target.tokenizer.encode(PROMPTS[0]))
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(verifier.verify(request)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not outcome
    now[0] += 6  # the replica's health check, a few seconds later
    with pytest.raises(ComputeUnhealthy, match="stuck"):
        watchdog.check()
    faults("target", "")
    thread.join(timeout=30)
    watchdog.ended()
    watchdog.check()
    assert len(outcome[0].token_ids) == 1
