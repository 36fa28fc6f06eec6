"""service.direct_calls on a real local cluster: rounds over leases straight to the replicas
(deployments/direct.py), exact, and Serve's path whenever a lease cannot carry a call."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from serve_state import (
    all_caches_empty,
    handle,
    metric_total,
    per_replica,
    running_replicas,
    scrape_metrics,
    streams_survive_a_killed_target,
    wait_until,
)

from specdec.client import build_request
from specdec.deployments.direct import SECRET_HEADER, SERVICE
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_service):
    """The tiny pair with direct calls, two target replicas (one is killed below)."""
    with tiny_service(tmp_path_factory.mktemp("direct"), direct_calls=True) as (client, _, _):
        yield client


def _direct_stats(deployment):
    """{"served": ..., "leases": ..., "streams": ...} summed over ``deployment``'s RUNNING
    replicas."""
    answers = per_replica(deployment, "direct_stats")
    assert len(answers) == len(running_replicas(deployment)), "a replica no probe reached"
    keys = ("served", "leases", "streams")
    return {key: sum(stats[key] for _, stats in answers.values()) for key in keys}


def _calls(name="ray_specdec_replica_calls_total", **labels):
    return metric_total(scrape_metrics(), name, **labels)


def test_greedy_output_over_direct_calls_equals_the_target_alone(client, reference):
    """Concurrent greedy requests at k = 0, 2 and auto equal the target alone, and both sides
    answered most of their calls directly (a session's first call of a side goes via Serve)."""
    before = {d: _direct_stats(d) for d in ("DraftModel", "TargetModel")}
    cases = [(p, k) for p in PROMPTS[:3] for k in (0, 2, None)]

    def run(case):
        prompt, k = case
        request = build_request(prompt, max_new_tokens=48, num_speculative_tokens=k)
        return list(client.generate(request).token_ids)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(run, cases))
    for (prompt, _), tokens in zip(cases, outputs):
        assert tokens == reference(prompt, 48)
    after = {d: _direct_stats(d) for d in ("DraftModel", "TargetModel")}
    served, streams = (
        {d: after[d][k] - before[d][k] for d in after} for k in ("served", "streams")
    )
    # k = 2 alone makes 47 or fewer rounds a request; every one after the first is direct.
    assert served["TargetModel"] >= len(cases) * 10
    assert served["DraftModel"] >= 3
    # A session's direct calls of a side travel on one stream (no call here fails).
    assert 1 <= streams["TargetModel"] <= len(cases) and 1 <= streams["DraftModel"] <= len(cases)
    # The router's metrics split the calls by path: each session's first call of a side via
    # Serve, the rest direct.
    for side in ("draft", "target"):
        for path in ("direct", "serve"):
            wait_until(lambda s=side, p=path: _calls(side=s, path=p) > 0, timeout_s=60)


def test_leases_end_with_their_requests(client):
    """Once its requests are over, no replica holds a lease or a cache."""
    client.generate(build_request(PROMPTS[4], max_new_tokens=32, num_speculative_tokens=2))
    stream = client.generate_stream(
        build_request(PROMPTS[5], max_new_tokens=200, num_speculative_tokens=2)
    )
    for _ in range(3):
        next(stream)
    stream.cancel()
    wait_until(
        lambda: all(_direct_stats(d)["leases"] == 0 for d in ("DraftModel", "TargetModel")),
        timeout_s=30,
    )
    wait_until(all_caches_empty)


def test_a_direct_call_needs_its_replicas_lease_secret(client):
    """The direct port answers only callers that hold a lease (the secret travels in it)."""
    lease = handle("TargetModel", "secret-probe").options(stream=True).lease.remote("secret-probe")
    address, secret = next(iter(lease)).split(" ", 1)
    request = worker_pb2.VerifyRequest(
        session=worker_pb2.SessionTokens(session_id="secret-probe", prefix_len=5)
    )
    with grpc.insecure_channel(address) as channel:
        stream = channel.stream_stream(
            f"/{SERVICE}/verify",
            request_serializer=worker_pb2.VerifyRequest.SerializeToString,
            response_deserializer=worker_pb2.VerifyResponse.FromString,
        )

        def verify(*requests, metadata):
            return list(stream(iter(requests), timeout=10, metadata=metadata))

        for metadata in ((), ((SECRET_HEADER, "0" * len(secret)),)):
            with pytest.raises(grpc.RpcError) as err:
                verify(request, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the secret: answered, in order, on one stream (a session this replica never
        # saw is a cache miss, and so is every call after it that carries no prefix).
        answers = verify(request, request, metadata=((SECRET_HEADER, secret),))
        assert [answer.cache_miss for answer in answers] == [True, True]
        # A call the replica refuses for its input: INVALID_ARGUMENT naming the field (the
        # router raises it as through Serve, instead of sending the call again via Serve).
        bad = worker_pb2.VerifyRequest(
            session=worker_pb2.SessionTokens(session_id="secret-probe", prefix_len=0)
        )
        with pytest.raises(grpc.RpcError) as err:
            verify(bad, metadata=((SECRET_HEADER, secret),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "new_token_ids" in err.value.details()
    lease.cancel()


def test_killed_target_replica_mid_request_gives_identical_output(client, reference):
    """A direct call to a killed replica fails; the call goes through Serve to the other
    replica, which rebuilds the session: every output still equals the target alone, and
    the router counts the failed direct calls."""
    failed = _calls("ray_specdec_direct_call_failures_total", side="target")
    streams_survive_a_killed_target(client, reference)
    wait_until(
        lambda: _calls("ray_specdec_direct_call_failures_total", side="target") > failed,
        timeout_s=60,
    )


def test_leases_stop_at_a_batch_of_sessions_a_replica(client):
    """A replica grants leases to at most max_batch_size sessions (8): the next session's lease
    answers "" at once (its calls go through Serve), and so does the lease of a session it
    already released."""
    leases = [
        handle("DraftModel", f"cap-{i}").options(stream=True).lease.remote(f"cap-{i}")
        for i in range(9)
    ]
    firsts = [next(iter(lease)) for lease in leases]  # sent together: any one is refused
    assert sorted(first == "" for first in firsts) == [False] * 8 + [True], firsts
    granted = next(f"cap-{i}" for i, first in enumerate(firsts) if first)
    handle("DraftModel", granted).release.remote(
        worker_pb2.ReleaseRequest(session_id=granted)
    ).result()
    late = handle("DraftModel", granted).options(stream=True).lease.remote(granted)
    assert next(iter(late)) == ""
    for lease in leases:
        lease.cancel()
    wait_until(lambda: _direct_stats("DraftModel")["leases"] == 0, timeout_s=30)
