"""A broken target replica leaves rotation: an injected forward exception (sticky, as a CUDA
error is) and a hung forward on one replica make its health check fail, Serve replaces it, and
the requests on the other replica finish with the target-only output (specdec.worker.faults
injects the faults; specdec.worker.compute_health decides).

A cluster of its own at the shipped timeouts, with the health settings short: Serve checks
every second, a batch is stuck after 3 s, and 2 failed batches in a row mark a replica
broken."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
import yaml
from conftest import write_config
from local_service import serving

from specdec.client import build_request
from specdec.config import APPLICATION
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2
from specdec.worker.faults import FAULT_DIR_ENV

pytestmark = pytest.mark.integration

HEALTH_PERIOD_S = 1.0  # Serve's health_check_period_s for the target replicas
STUCK_FORWARD_S = 3.0
MAX_FORWARD_FAILURES = 2
NEW_TOKENS = 120
STREAMS = 6
# From the fault to the replica out of rotation and its replacement started: the watchdog's
# bound (stuck) or the failed batches (at once), Serve's 3 failed checks in a row, its stop;
# with slack for a busy host.
LEAVES_WITHIN_S = STUCK_FORWARD_S + 3 * HEALTH_PERIOD_S + 20
START_WITHIN_S = 300  # a replica's start on a 2-core host busy with streams and other tests


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_pair):
    """(client, fault folder): the tiny pair on a cluster of its own; the target replicas read
    injected faults from the folder (SPECDEC_FAULT_DIR, specdec.worker.faults)."""
    pytest.importorskip("ray")
    tmp = tmp_path_factory.mktemp("replica-health")
    faults = tmp / "faults"
    faults.mkdir()
    # The shipped timeouts (120 s a call): a call on a hung replica is not retried for its
    # timeout but once Serve stops the replica, which its failed health checks make it do.
    path, port = write_config(
        tmp,
        *tiny_pair,
        stuck_forward_s=STUCK_FORWARD_S,
        max_forward_failures=MAX_FORWARD_FAILURES,
        target_env={FAULT_DIR_ENV: str(faults)},
    )
    config = yaml.safe_load(path.read_text())
    (app,) = config["applications"]
    target = next(d for d in app["deployments"] if d["name"] == "TargetModel")
    target.update(
        health_check_period_s=HEALTH_PERIOD_S,
        health_check_timeout_s=5,
        graceful_shutdown_timeout_s=1,  # a hung call never ends: stop the replica soon
    )
    path.write_text(yaml.safe_dump(config))
    with serving(tmp, path, port) as (client, _, _):
        yield client, faults


def _target_replicas() -> list:
    """Serve's ReplicaDetails of the TargetModel replicas, in every state."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    details = ServeInstanceDetails(**serve.context._get_global_client().get_serve_details())
    return details.applications[APPLICATION].deployments["TargetModel"].replicas


def _running(replicas: list) -> set[str]:
    return {r.replica_id for r in replicas if r.state == "RUNNING"}


def _replicas() -> set[str]:
    """The ids of the RUNNING TargetModel replicas."""
    return _running(_target_replicas())


def _fresh_pair(faults) -> str:
    """Waits for two RUNNING target replicas that no fault was injected into (an earlier
    test's victim gone); returns the one to break."""
    _wait_until(
        lambda: (
            len(healthy := _replicas()) == 2 and not any((faults / r).exists() for r in healthy)
        ),
        timeout_s=120,
    )
    return sorted(_replicas())[0]


def _wait_until(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        time.sleep(0.1)
    return time.monotonic() - start


class _Replacement:
    """Watches, from a thread, when ``victim`` leaves the RUNNING target replicas and when
    Serve starts a replica in its place (a new id, in any state: its model then loads, which
    takes a minute or more on a busy 2-core host and says nothing about health)."""

    def __init__(self, victim: str) -> None:
        self.victim, self.start = victim, time.monotonic()
        self.left_s: float | None = None
        self.replaced_s: float | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._watch = self._pool.submit(self._run, {r.replica_id for r in _target_replicas()})

    def _run(self, before: set[str]) -> None:
        while time.monotonic() - self.start < LEAVES_WITHIN_S:
            replicas = _target_replicas()
            now = time.monotonic() - self.start
            if self.left_s is None and self.victim not in _running(replicas):
                self.left_s = now
            if self.replaced_s is None and {r.replica_id for r in replicas} - before:
                self.replaced_s = now
            if self.left_s is not None and self.replaced_s is not None:
                return
            time.sleep(0.1)

    def result(self) -> tuple[float, float]:
        """Seconds from the start to (the victim out of rotation, its replacement started);
        fails past LEAVES_WITHIN_S."""
        self._watch.result()
        self._pool.shutdown()
        assert self.left_s is not None, f"{self.victim} still RUNNING after {LEAVES_WITHIN_S} s"
        assert self.replaced_s is not None, f"no replacement after {LEAVES_WITHIN_S} s"
        return self.left_s, self.replaced_s


def _handle_on(replica: str):
    """A TargetModel handle whose session key hashes to ``replica`` (a session the test
    drives itself), and that key."""
    from ray import serve

    base = serve.get_deployment_handle("TargetModel", APPLICATION)
    for i in range(500):
        handle = base.options(session_id=f"driver-{i}")
        if handle.replica_id.remote().result() == replica:
            return handle, f"driver-{i}"
    raise AssertionError(f"no session key reaches {replica}")


def _prefill(session_id: str, token_ids: list[int]) -> worker_pb2.VerifyRequest:
    tokens = worker_pb2.SessionTokens(session_id=session_id, new_token_ids=token_ids)
    return worker_pb2.VerifyRequest(session=tokens, sampling=worker_pb2.SamplingConfig())


def _run_streams(client, inject) -> tuple[list, list[str]]:
    """STREAMS concurrent greedy streams (k = 2 and adaptive k in turn); ``inject()`` runs once
    every stream has its first tokens (each session then holds a cache on some target
    replica). Returns (per stream its token ids or the grpc.RpcError that ended it, the
    prompts)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]
    streams = [
        client.generate_stream(
            build_request(p, max_new_tokens=NEW_TOKENS, num_speculative_tokens=k)
        )
        for p, k in zip(prompts, [2, None] * STREAMS)
    ]
    firsts = [list(next(s).token_ids) for s in streams]
    inject()

    def rest(stream, first):
        try:
            return first + [t for m in stream for t in m.token_ids]
        except grpc.RpcError as err:
            return err

    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        return list(pool.map(rest, streams, firsts)), prompts


def _check_outcomes(outcomes, prompts, reference, victim: str) -> int:
    """Every stream ended with the target-only output, or failed on ``victim`` (its error
    names the replica: a request on another replica never fails). Returns the failures."""
    failed = 0
    for prompt, outcome in zip(prompts, outcomes):
        if isinstance(outcome, grpc.RpcError):
            assert victim in outcome.details(), outcome.details()
            failed += 1
        else:
            assert outcome == reference(prompt, NEW_TOKENS), prompt
    return failed


def _break_one(service, reference, fault: str, drive) -> tuple[int, float, float]:
    """Writes ``fault`` for one of two fresh target replicas (the victim) once STREAMS streams
    run, then calls ``drive(handle, key)`` (a handle whose session key reaches the victim);
    checks every stream (_check_outcomes). Returns (streams failed on the victim, seconds
    until it left rotation, seconds until a replacement ran)."""
    client, faults = service
    victim = _fresh_pair(faults)
    handle, key = _handle_on(victim)
    watch = {}

    def inject():
        (faults / victim).write_text(fault)
        watch["replacement"] = _Replacement(victim)
        drive(handle, key)

    outcomes, prompts = _run_streams(client, inject)
    failed = _check_outcomes(outcomes, prompts, reference, victim)
    return failed, *watch["replacement"].result()


def test_a_sticky_forward_error_takes_the_replica_out_and_others_finish(service, reference):
    def drive(handle, key):
        # Calls of sessions on the victim fail in their forward (as the victim's streams do)
        # until MAX_FORWARD_FAILURES batches in a row have, and then the replica refuses calls
        # at once (the router retries those elsewhere).
        errors = []
        while len(errors) <= MAX_FORWARD_FAILURES and "Unhealthy" not in repr(errors[-1:]):
            try:
                handle.verify.remote(_prefill(f"{key}-{len(errors)}", [5, 6, 7])).result()
            except Exception as err:  # noqa: BLE001 - the errors are what this checks
                errors.append(err)
        assert all("InjectedFault" in type(e).__name__ for e in errors[:-1]), errors
        assert "ComputeUnhealthy" in type(errors[-1]).__name__, errors[-1]
        assert "compute failing" in str(errors[-1])

    # Every forward on the victim raises from the fault on: a sticky device error.
    failed, left_s, replaced_s = _break_one(service, reference, "raise", drive)
    print(
        f"sticky forward error: {failed} of {STREAMS} streams failed on the victim, none "
        f"elsewhere; out of rotation {left_s:.1f} s after the fault, a replacement started "
        f"after {replaced_s:.1f} s"
    )


def test_a_hung_forward_takes_the_replica_out_and_every_request_finishes(service, reference):
    def drive(handle, key):
        handle.verify.remote(_prefill(f"{key}-hung", [5, 6, 7]))  # hangs with the streams'

    failed, left_s, replaced_s = _break_one(service, reference, "hang", drive)
    # The streams on the hung replica waited until Serve stopped it (their calls then failed
    # as a dead replica's do), well within call_timeout_s (120 s), were retried on the live
    # replica and rebuilt there: none failed.
    assert failed == 0
    assert left_s > STUCK_FORWARD_S  # the watchdog waited its bound
    print(
        f"hung forward: no stream failed; out of rotation {left_s:.1f} s after the hang, a "
        f"replacement started after {replaced_s:.1f} s"
    )
