"""The router's readiness decision and health Watch (deployments/health.py), with fake replicas."""

from __future__ import annotations

import asyncio
import json

import pytest

from specdec.deployments.health import ModelInfoCache, ReplicaCounts, readiness, watch
from specdec.v1 import worker_pb2

TARGET = worker_pb2.ReplicaInfo(name="target", context_limit=256)
DRAFT = worker_pb2.ReplicaInfo(name="draft", context_limit=256)


class FakeDeployment:
    """model_info of a deployment: answers `info` once `up`, after `delay_s`; raises while down."""

    def __init__(self, info: worker_pb2.ReplicaInfo, up: bool = True, delay_s: float = 0.0) -> None:
        self.info, self.up, self.delay_s, self.calls = info, up, delay_s, 0

    async def model_info(self) -> worker_pb2.ReplicaInfo:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if not self.up:
            raise ConnectionError("no replica")
        return self.info


def _cache(draft: FakeDeployment, target: FakeDeployment, timeout_s: float = 5.0):
    return ModelInfoCache({"draft": draft.model_info, "target": target.model_info}, timeout_s)


def test_not_ready_until_the_target_answers_then_ready():
    async def main():
        draft, target = FakeDeployment(DRAFT), FakeDeployment(TARGET, up=False)
        cache = _cache(draft, target)
        ready, reason = await readiness(cache, probe_s=0.2)
        assert not ready and "target" in reason
        target.up = True
        assert await readiness(cache, probe_s=0.2) == (True, "ready")
        target.up = False  # the info is kept: a known target stays ready (no counts given)
        assert (await readiness(cache, probe_s=0.2))[0]

    asyncio.run(main())


class FakeController:
    """Serve's running-replica counts: `counts` (or raises `error`), counting the calls."""

    def __init__(self, **counts: int) -> None:
        self.counts, self.error, self.calls = dict(counts), None, 0

    def __call__(self) -> dict[str, int]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return dict(self.counts)


def test_readiness_follows_the_running_target_replicas_and_degrades_without_drafts():
    """A target that answered once is not enough: with no target replica running the router
    is not ready; with no draft replica running it is ready but degraded."""

    async def main():
        cache = _cache(FakeDeployment(DRAFT), FakeDeployment(TARGET))
        controller = FakeController(draft=1, target=1)
        clock = [0.0]
        replicas = ReplicaCounts(controller, max_age_s=1.0, clock=lambda: clock[0])
        assert await readiness(cache, replicas, probe_s=0.5) == (True, "ready")
        controller.counts["target"] = 0
        clock[0] += 2.0  # the counts are stale: this probe starts a refresh ...
        await readiness(cache, replicas, probe_s=0.5)
        await asyncio.sleep(0.1)  # ... which the next one reads
        assert await readiness(cache, replicas, probe_s=0.5) == (
            False,
            "not ready: no target replica is running",
        )
        controller.counts.update(target=2, draft=0)
        clock[0] += 2.0
        await readiness(cache, replicas, probe_s=0.5)
        await asyncio.sleep(0.1)
        assert await readiness(cache, replicas, probe_s=0.5) == (
            True,
            "ready, degraded: no draft replica is running",
        )

    asyncio.run(main())


def test_replica_counts_refresh_at_most_every_max_age_and_keep_the_last_on_failure():
    async def main():
        controller = FakeController(draft=1, target=1)
        clock = [0.0]
        replicas = ReplicaCounts(controller, max_age_s=1.0, clock=lambda: clock[0])
        assert await replicas.get(0.5) == {"draft": 1, "target": 1}
        for _ in range(5):  # fresh: answered from the last refresh, no new controller call
            await replicas.get(0.5)
        assert controller.calls == 1
        controller.error = ConnectionError("controller gone")
        clock[0] += 2.0
        assert await replicas.get(0.5) == {"draft": 1, "target": 1}
        await asyncio.sleep(0.1)
        assert controller.calls == 2
        assert await replicas.get(0.5) == {"draft": 1, "target": 1}  # the failure kept them

    asyncio.run(main())


def test_the_first_counts_are_waited_for_at_most_wait_s():
    """A controller that does not answer leaves the counts unknown (None), not a hung probe."""

    async def main():
        import threading

        release = threading.Event()

        def slow():
            release.wait(5)
            return {"target": 1}

        replicas = ReplicaCounts(slow)
        assert await replicas.get(0.2) is None  # returned while the count was still blocked
        release.set()
        await asyncio.sleep(0.1)
        assert await replicas.get(0.2) == {"target": 1}

    asyncio.run(main())


def test_a_draft_that_is_down_leaves_the_router_ready_but_degraded():
    async def main():
        draft, target = FakeDeployment(DRAFT, up=False), FakeDeployment(TARGET)
        cache = _cache(draft, target)
        ready, reason = await readiness(cache, probe_s=0.2)
        assert ready and "degraded" in reason and "draft" in reason
        draft.up = True
        await readiness(cache, probe_s=0.2)  # starts the draft's fetch again
        await asyncio.sleep(0.05)
        assert await readiness(cache, probe_s=0.2) == (True, "ready")
        assert cache.known("draft") == DRAFT

    asyncio.run(main())


def test_a_slow_target_is_waited_for_probe_s_only_and_probes_share_one_fetch():
    async def main():
        target = FakeDeployment(TARGET, delay_s=0.5)
        cache = _cache(FakeDeployment(DRAFT), target)
        loop = asyncio.get_running_loop()
        start = loop.time()
        answers = await asyncio.gather(*(readiness(cache, probe_s=0.1) for _ in range(5)))
        assert loop.time() - start < 0.4
        assert all(not ready for ready, _ in answers)
        await asyncio.sleep(0.6)  # the shared fetch finished in the background
        assert (await readiness(cache, probe_s=0.1))[0]
        assert target.calls == 1

    asyncio.run(main())


def test_get_raises_after_its_wait_and_retries_a_failed_fetch():
    async def main():
        target = FakeDeployment(TARGET, up=False)
        cache = _cache(FakeDeployment(DRAFT), target, timeout_s=0.2)
        with pytest.raises(ConnectionError):
            await cache.get("target")
        target.up, target.delay_s = True, 1.0
        with pytest.raises(asyncio.TimeoutError):  # the fetch itself times out after 0.2 s
            await cache.get("target", wait_s=5.0)
        target.delay_s = 0.0
        assert await cache.get("target") == TARGET
        assert target.calls == 3

    asyncio.run(main())


def test_watch_yields_the_status_then_only_changes_until_max_s():
    async def main():
        statuses = iter(["NOT_SERVING", "NOT_SERVING", "SERVING", "SERVING", "SERVING"])

        async def check():
            return next(statuses, "SERVING")

        seen = [s async for s in watch(check, poll_s=0.01, max_s=0.2)]
        assert seen == ["NOT_SERVING", "SERVING"]

    asyncio.run(main())


def test_watch_stays_open_between_changes_until_the_consumer_stops():
    async def main():
        checks = 0

        async def check():
            nonlocal checks
            checks += 1
            return "SERVING"

        stream = watch(check, poll_s=0.01, max_s=60)
        assert await anext(stream) == "SERVING"
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.2)
        assert not pending.done() and checks > 5  # still polling, nothing new to say
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await stream.aclose()

    asyncio.run(main())


def test_http_ready_is_200_or_503_with_the_reason_and_health_always_200():
    from specdec.deployments.http_health import HealthRoutes

    class FakeRouter(HealthRoutes):
        def __init__(self, answer):
            self.answer = answer

        async def readiness(self):
            return self.answer

    async def main():
        for answer, status in (((True, "ready"), 200), ((False, "not ready: x"), 503)):
            router = FakeRouter(answer)
            response = await router.ready_endpoint()
            assert response.status_code == status
            assert json.loads(response.body) == {"ready": answer[0], "reason": answer[1]}
            assert (await router.health_endpoint()).status_code == 200

    asyncio.run(main())
