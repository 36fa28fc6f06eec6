"""How a model replica sizes its batches (specdec.deployments.batching)."""

from __future__ import annotations

import pytest

from specdec.deployments.batching import ACTIVE_FLOOR_S, BatchSizer


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lone_session_never_waits():
    sizer = BatchSizer(8, 0.25, clock=_Clock())
    assert sizer.next_batch() == (1, 0.0)
    sizer.observe(["a"], batch_s=0.5)
    assert sizer.next_batch() == (1, 0.0)


def test_active_sessions_size_the_batch_and_the_wait_follows_the_last_batch():
    clock = _Clock()
    sizer = BatchSizer(8, 0.25, clock=clock)
    sizer.observe(["a"], batch_s=0.4)
    sizer.observe(["b"], batch_s=0.4)  # the two streams alternate: one session per batch
    assert sizer.next_batch() == (2, pytest.approx(0.1))  # wait for the other one's call
    sizer.observe([f"s{i}" for i in range(10)], batch_s=0.8)
    assert sizer.next_batch() == (8, pytest.approx(0.2))  # capped at max_batch_size


def test_released_and_idle_sessions_stop_counting():
    clock = _Clock()
    sizer = BatchSizer(8, 0.25, clock=clock)
    sizer.observe(["a", "b", "c"], batch_s=0.1)
    sizer.release("b")
    assert sizer.active() == 2
    clock.now += ACTIVE_FLOOR_S / 2  # within the window: still active
    assert sizer.active() == 2
    clock.now += ACTIVE_FLOOR_S  # past max(floor, 4 x 0.1 s) since their last call
    assert sizer.active() == 0 and sizer.next_batch() == (1, 0.0)


def test_a_zero_fraction_never_waits():
    sizer = BatchSizer(8, 0.0, clock=_Clock())
    sizer.observe(["a", "b"], batch_s=1.0)
    assert sizer.next_batch() == (2, 0.0)


def test_a_deferred_call_joins_the_next_batch_with_its_arrival_time():
    # ModelReplica._batched: the batch answered DEFERRED (a prefill past its budget) twice;
    # the call is submitted again each time, as the same (arrival, request), and returns the
    # response of the batch that ran it.
    import asyncio

    from specdec.deployments.model_replica import ModelReplica
    from specdec.worker.session import DEFERRED

    answers, seen = [DEFERRED, DEFERRED, "response"], []

    async def batched(item):
        seen.append(item)
        return answers[len(seen) - 1]

    replica = _replica(batches_running=1)  # a batch runs: the call queues for the next
    request = _request("s")
    result = asyncio.run(ModelReplica._batched(replica, batched, request))
    assert result == "response"
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2] and seen[0][1] is request


def _request(session_id):
    import types

    return types.SimpleNamespace(session=types.SimpleNamespace(session_id=session_id))


def _replica(batches_running=0, active=()):
    """A stand-in ModelReplica for _batched: a healthy watchdog, a sizer that saw ``active``
    sessions, and a _compute_batch that answers "alone"."""
    import types

    from specdec.worker.compute_health import ComputeWatchdog

    sizer = BatchSizer(max_batch_size=8, wait_fraction=0.5)
    sizer.observe(active, 0.01)
    ran = []

    async def compute_batch(method, fn, arrivals):
        ran.append((method, arrivals))
        return ["alone"] * len(arrivals)

    return types.SimpleNamespace(
        _watchdog=ComputeWatchdog(300, 3),
        _direct=types.SimpleNamespace(called=lambda session_id: None),
        _batches_running=batches_running,
        _sizer=sizer,
        _alone=("verify", None),
        _compute_batch=compute_batch,
        ran=ran,
    )


@pytest.mark.parametrize(
    "batches_running, active, alone",
    [(0, (), True), (0, ("s",), True), (0, ("s", "t"), False), (1, ("s",), False)],
)
def test_a_call_runs_alone_only_when_nothing_else_could_share_its_batch(
    batches_running, active, alone
):
    """No batch running and at most one session active lately: the call runs as a batch of
    one at once; otherwise it queues in serve.batch to share a batch."""
    import asyncio

    from specdec.deployments.model_replica import ModelReplica

    queued = []

    async def batched(item):
        queued.append(item)
        return "batched"

    replica = _replica(batches_running, active)
    result = asyncio.run(ModelReplica._batched(replica, batched, _request("s")))
    assert result == ("alone" if alone else "batched")
    assert len(replica.ran) == int(alone) and len(queued) == int(not alone)
