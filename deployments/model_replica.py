"""What draft and target deployments share: one model, its session caches, one compute thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

from specdec.config import SpecdecConfig
from specdec.deployments.batching import BatchSizer
from specdec.deployments.direct import DirectServer
from specdec.deployments.logs import route_specdec_logs
from specdec.deployments.metrics import ReplicaMetrics
from specdec.device.calibration.load import load_calibrated
from specdec.device.calibration_cache import CalibrationCache
from specdec.device.cost_prior import cost_table
from specdec.device.simulated import ForwardHold, SimulatedCosts
from specdec.errors import ComputeUnhealthy
from specdec.v1 import worker_pb2
from specdec.worker.compute_health import ComputeWatchdog, forward_error
from specdec.worker.faults import FAULT_DIR_ENV, install_faults
from specdec.worker.info import replica_info
from specdec.worker.session import DEFERRED, PREFILLING, Deferred, SessionModel

log = logging.getLogger("ray.serve")

# Session affinity: calls carrying the same session_id go to the same replica while the replica
# set is stable; when it changes, the replica that misses answers cache_miss and rebuilds.
CONSISTENT_HASH_ROUTER = {
    "request_router_class": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    "request_router_kwargs": {"num_virtual_nodes": 100, "num_fallback_replicas": 2},
}


class ModelReplica:
    """Loads one model (offline) and serves calls on it from a single compute thread.

    Model calls are serialised: concurrent forwards on one device only contend, and the event
    loop stays free for health checks, releases and the transport while a forward runs.

    The health check exercises the compute path through a watchdog over the compute thread's
    batches (specdec.worker.compute_health): a batch running past models.stuck_forward_s, or
    models.max_forward_failures batches in a row whose forwards raised, fail it, so that Serve
    replaces the replica; meanwhile the replica refuses new calls (ComputeUnhealthy, which the
    router retries on another replica).

    Args:
        side_cls: DraftProposer or TargetVerifier, built as side_cls(loaded model, config).
        side: "draft" or "target": which of config.models' model and dtype to load.
        config: the application's settings (specdec.config), parsed once by build_app.
    """

    def __init__(self, side_cls: type[SessionModel], side: str, config: SpecdecConfig) -> None:
        route_specdec_logs()  # the calibration's measurements
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="model"
        )
        model, self._dtype = config.models.for_side(side)
        device = config.models.device
        # Loading runs on the compute thread too: OpenMP keeps a thread team per thread that
        # starts parallel work, and a second, idle team made every CPU forward ~1.5x slower
        # (int8 draft step 36 -> 54 ms, measured).
        loaded, self.calibration = self._executor.submit(
            load_calibrated,
            model,
            side,
            self._dtype,
            gemm=config.models.gemm_for(side),
            device=device,
            max_speculative_tokens=config.speculation.max_speculative_tokens,
            exact_widths=config.models.measures_exact_widths(),
            max_batch_size=config.models.max_batch_size,
            cache=CalibrationCache.configured(config.models.calibration_cache),
            revision=config.models.revision_for(side),
        ).result()
        self._dtype = str(self.calibration.candidate)
        self.side = self._executor.submit(side_cls, loaded, config, self.calibration).result()
        self._info = replica_info(self.side, config)
        if config.models.simulated_costs:
            self._simulate(side, config)
        self._metrics = ReplicaMetrics()
        self._batches_running = 0  # _compute_batch calls not yet returned
        self._watchdog = ComputeWatchdog(
            config.models.stuck_forward_s, config.models.max_forward_failures
        )
        if os.environ.get(FAULT_DIR_ENV):  # tests only (specdec.worker.faults)
            install_faults(self.side.loaded.model, self._replica_id())
            log.warning("%s is set: forwards obey injected faults (tests only)", FAULT_DIR_ENV)
        log.info(
            "loaded %s (%s, %s) with a %d-byte session cache",
            model,
            self._dtype,
            device,
            config.models.cache_capacity_bytes,
        )

    def _simulate(self, side: str, config: SpecdecConfig) -> None:
        """Holds every forward to models.simulated_costs' table and reports its costs, labelled,
        instead of the calibration's (specdec.device.simulated)."""
        table = SimulatedCosts.load(config.models.simulated_costs)
        costs = table.sides[side]
        self._hold = ForwardHold(self.side.loaded.model, costs)
        self._info.costs.CopyFrom(cost_table(costs.calibration(self.calibration), config))
        self._info.simulated_costs = table.label
        log.warning("simulated device costs: every forward is held to %r", table.label)

    def _size_batches(self, batched, config: SpecdecConfig, method: str, run_batch) -> None:
        """Makes ``batched`` (this deployment's serve.batch method, which runs ``run_batch``
        as ``method``) the one _compute_batch sizes: each batch closes once the sessions active
        lately are in, or after models.batch_wait_fraction of the last batch's seconds
        (specdec.deployments.batching)."""
        self._batch_method = batched
        self._alone = (method, run_batch)
        self._sizer = BatchSizer(config.models.max_batch_size, config.models.batch_wait_fraction)
        self._resize_batches()

    def _serve_directly(self, config: SpecdecConfig, **handlers) -> None:
        """The calls (name in specdec.deployments.direct.MESSAGES -> this replica's coroutine)
        that a lease's holder may send over the direct path (service.direct_calls). Every
        deployment calls it once from its constructor."""
        models = config.models
        self._direct = DirectServer(handlers, models.cache_idle_s, models.max_batch_size)

    async def lease(self, session_id: str) -> AsyncIterator[str]:
        """Serve streaming method: a session's lease on this replica's direct endpoint
        (specdec.deployments.direct): "HOST:PORT SECRET", then open until the session is
        released or idles past models.cache_idle_s."""
        async for message in self._direct.lease(session_id):
            yield message

    async def direct_stats(self) -> dict[str, int]:
        """{"served": calls answered over the direct path, "leases": leases open now,
        "streams": direct call streams opened (a session's calls of this side share one)}."""
        direct = self._direct
        return {"served": direct.served, "leases": direct.open_leases, "streams": direct.streams}

    def _resize_batches(self) -> None:
        size, wait_s = self._sizer.next_batch()
        self._batch_method.set_max_batch_size(size)
        self._batch_method.set_batch_wait_timeout_s(wait_s)

    async def _batched(self, batched, request):
        """One call: run alone when no batch runs and no other session called lately, else
        through the serve.batch method ``batched``; raises its own error. A call the batch
        deferred (a prefill past its budget, or a long prompt with chunks left to prefill:
        SessionModel.run_batch) joins the next one, keeping its arrival time.

        Raises:
            ComputeUnhealthy: this replica's compute path is broken (stuck or failing,
                ComputeWatchdog); the call is refused at once instead of queueing behind it.
        """
        try:
            self._watchdog.check()
        except ComputeUnhealthy:
            self._metrics.refused.inc()
            raise
        self._direct.called(request.session.session_id)
        arrival = (time.monotonic(), request)
        if self._batches_running == 0 and self._sizer.active() <= 1:
            # Nothing to batch with: serve.batch's queue would only cost its hand-offs (about
            # 0.3 ms a call, measured). A batch of one is deferred only between the chunks of
            # a long prompt, which then go through the queue, where other calls can join.
            [response] = await self._compute_batch(*self._alone, [arrival])
        else:
            response = await batched(arrival)
        while isinstance(response, Deferred):
            response = await batched(arrival)
        if isinstance(response, Exception):
            raise response
        return response

    async def _compute_batch(
        self, method: str, fn: Callable[[list], list], arrivals: list[tuple[float, object]]
    ) -> list:
        """Runs fn over the requests of ``arrivals`` ([(arrival time.monotonic(), request)]),
        a batch Serve's serve.batch gathered or a lone call, on the compute thread; returns fn's
        list, whose items are responses or the exceptions of single requests."""
        self._batches_running += 1
        try:
            return await self._run_batch(method, fn, arrivals)
        finally:
            self._batches_running -= 1

    async def _run_batch(
        self, method: str, fn: Callable[[list], list], arrivals: list[tuple[float, object]]
    ) -> list:
        started = time.monotonic()
        tags = {"method": method}
        for arrived, _ in arrivals:
            self._metrics.batch_wait.observe(started - arrived, tags=tags)
        self._metrics.batch_size.observe(len(arrivals), tags=tags)
        requests = [request for _, request in arrivals]
        loop = asyncio.get_running_loop()
        self._watchdog.started()
        job = self._executor.submit(fn, requests)
        # The watchdog hears of the job's end from the job itself, not from this coroutine: a
        # cancelled caller must not make a forward that still runs (or hangs) look finished.
        job.add_done_callback(lambda done: loop.call_soon_threadsafe(self._batch_ended, done))
        results = await asyncio.wrap_future(job)
        self._sizer.observe((r.session.session_id for r in requests), time.monotonic() - started)
        self._resize_batches()
        deferred = sum(response is DEFERRED for response in results)
        if deferred:
            self._metrics.deferred.inc(deferred)
        chunks = sum(response is PREFILLING for response in results)
        if chunks:
            self._metrics.prefill_chunks.inc(chunks)
        for response in results:
            if not isinstance(response, (Exception, Deferred)):
                self._metrics.compute.observe(response.compute_s, tags=tags)
                if response.cache_miss:
                    self._metrics.rebuilds.inc()
        self._report_cache()
        return results

    def _batch_ended(self, job: concurrent.futures.Future) -> None:
        """Tells the watchdog that a batch's job on the compute thread ended, and whether a
        forward of it raised (run on the event loop)."""
        error = None
        if not job.cancelled():
            error = job.exception() or forward_error(job.result())
        self._watchdog.ended(error)
        if error is not None:
            self._metrics.failed_batches.inc()

    async def check_health(self) -> None:
        """Serve's periodic health check (every health_check_period_s): it fails while the
        compute path is broken, and it also expires sessions idle past models.cache_idle_s, so
        that a replica no call reaches any more frees the caches stranded on it.

        Raises:
            ComputeUnhealthy: a batch has run past models.stuck_forward_s, or the last
                models.max_forward_failures batches raised in a forward; after Serve's
                threshold of failed checks it replaces this replica.
        """
        dropped = self.side.sessions.expire()
        if dropped:
            log.info("expired %d idle session caches", dropped)
            self._report_cache()
        problem = self._watchdog.problem()
        if problem is not None:
            log.error("unhealthy: %s", problem)
            raise ComputeUnhealthy(problem)

    async def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        response = self.side.release(request)
        self._direct.released(request.session_id)
        self._sizer.release(request.session_id)
        self._resize_batches()
        self._report_cache()
        return response

    async def cache_stats(
        self, request: worker_pb2.CacheStatsRequest | None = None
    ) -> worker_pb2.CacheStats:
        return self.side.cache_stats()

    async def model_info(self) -> worker_pb2.ReplicaInfo:
        """The model (name, dtype, vocab_size, context_limit in tokens, eos_token_ids), its
        start-up calibration and the cost table computed from it (specdec.worker.info)."""
        return self._info

    async def replica_id(self) -> str:
        """This replica's Serve id (tests and operators use it to find a session's replica)."""
        return self._replica_id()

    @staticmethod
    def _replica_id() -> str:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id

    def _report_cache(self) -> None:
        stats = self.side.cache_stats()
        self._metrics.sessions.set(stats.sessions)
        self._metrics.cache_bytes.set(stats.bytes)
