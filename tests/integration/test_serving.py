"""The service on a real local Ray cluster, called through the real gRPC endpoint."""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
import urllib.error
import urllib.request

import dashboard
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from local_service import LOCAL_CONFIG
from serve_state import all_caches_empty as _all_caches_empty
from serve_state import (
    exported_names,
    metric_total,
    scrape_metrics,
    streams_survive_a_killed_target,
)
from serve_state import handle as _handle
from serve_state import running_replicas as _replicas
from serve_state import wait_until as _wait_until

from specdec.client import build_request
from specdec.config import APPLICATION, PROPOSERS
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2

pytestmark = pytest.mark.integration
APP = APPLICATION


@pytest.fixture(scope="module")
def client(served):
    return served[0]


@pytest.mark.parametrize("k", [0, 1, 3, 8, None])
def test_greedy_over_grpc_equals_target_only(client, reference, k):
    for prompt in PROMPTS[:4]:
        out = client.generate(build_request(prompt, max_new_tokens=24, num_speculative_tokens=k))
        assert list(out.token_ids) == reference(prompt, 24), (prompt, k)
        assert out.usage.completion_tokens == len(out.token_ids)
        assert out.finish_reason in ("stop", "length")
        assert out.stats.rounds >= 1 and 0 <= out.stats.accepted_tokens <= out.stats.draft_tokens


def test_every_proposer_is_accepted_and_greedy_output_stays_target_only(client, reference):
    for proposer in PROPOSERS:
        request = build_request(PROMPTS[0], max_new_tokens=24, proposer=proposer)
        out = client.generate(request)
        assert list(out.token_ids) == reference(PROMPTS[0], 24), proposer
        stats = out.stats
        assert stats.ngram_draft_tokens <= stats.draft_tokens
        assert stats.ngram_accepted_tokens <= stats.accepted_tokens
        if proposer in ("ngram", "none"):  # the draft model is never called
            assert stats.draft_tokens == stats.ngram_draft_tokens, proposer
        if proposer in ("draft", "none"):  # the draft is up: n-gram lookup never stands in
            assert stats.ngram_rounds == 0, proposer


def test_stream_deltas_concatenate_to_the_unary_text(client):
    request = build_request(PROMPTS[1], max_new_tokens=30, num_speculative_tokens=3, logprobs=True)
    unary = client.generate(request)
    messages = list(client.generate_stream(request))
    assert "".join(m.text for m in messages) == unary.text
    assert [t for m in messages for t in m.token_ids] == list(unary.token_ids)
    assert [p for m in messages for p in m.logprobs] == pytest.approx(
        list(unary.logprobs), abs=1e-5
    )
    assert all(not m.finish_reason for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == unary.finish_reason and last.usage == unary.usage
    assert last.stats.rounds == unary.stats.rounds


def test_sampled_output_is_reproducible_by_seed(client):
    request = build_request(
        PROMPTS[0], max_new_tokens=20, temperature=1.0, seed=5, num_speculative_tokens=3
    )
    assert client.generate(request).token_ids == client.generate(request).token_ids


def _verify_batch_counts(text):
    """(batches, batches of more than one session) of the target's verify calls, summed over
    replicas, from the ray_specdec_batch_size histogram in a Prometheus exposition."""
    total = single = 0.0
    for line in text.splitlines():
        if line.startswith("ray_specdec_batch_size") and 'method="verify"' in line:
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith("ray_specdec_batch_size_count"):
                total += value
            elif 'le="1.0"' in line or 'le="1"' in line:
                single += value
    return total, total - single


def test_concurrent_requests_share_verify_batches_and_stay_exact(client, reference):
    # 8 concurrent requests with different prompts, k, temperatures and lengths: the target
    # replicas run their verify calls in shared packed forwards (the batch-size metric counts
    # batches of more than one session), and every greedy output equals its solo k = 0 output.
    # `served` allows one prefill per batch: new prompts that arrive together wait for later
    # batches (whether they do is a race on the tiny pair: test_batching pins it down).
    before = _verify_batch_counts(scrape_metrics())
    requests = [
        build_request(
            PROMPTS[i],
            max_new_tokens=24 + 4 * i,
            num_speculative_tokens=(0, 2, 4, None)[i % 4],
            temperature=0.8 if i % 3 == 2 else 0.0,
            seed=i,
        )
        for i in range(8)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        outputs = list(pool.map(client.generate, requests))
    for i, (request, out) in enumerate(zip(requests, outputs)):
        assert len(out.token_ids) == request.max_new_tokens or out.finish_reason == "stop"
        if request.temperature == 0:
            assert list(out.token_ids) == reference(PROMPTS[i], len(out.token_ids)), i
    deadline, shared = time.monotonic() + 60, 0.0
    while time.monotonic() < deadline and shared <= before[1]:
        time.sleep(2)
        total, shared = _verify_batch_counts(scrape_metrics())
    assert shared > before[1], "no verify batch held more than one session"


def test_model_info_health_and_reflection(client, tiny_pair):
    info = client.model_info()
    assert info.draft_model == str(tiny_pair[0]) and info.target_model == str(tiny_pair[1])
    assert info.draft_pool == "draft_pool" and info.target_pool == "target_pool"
    assert info.context_limit == 256 and info.vocab_size > 0
    health = health_pb2_grpc.HealthStub(client.channel).Check(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    answers = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    services = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "specdec.v1.SpeculativeDecoding" in services


def test_health_watch_streams_until_the_client_cancels(client):
    """Watch answers SERVING at once, then stays open (it would send only a change); a client
    cancel ends it cleanly and the service keeps answering."""
    stub = health_pb2_grpc.HealthStub(client.channel)
    stream = stub.Watch(health_pb2.HealthCheckRequest(), timeout=60)
    assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(next, stream)
        time.sleep(3)  # three polls of the router with nothing new to say
        assert not pending.done(), "Watch ended after one message"
        stream.cancel()
        with pytest.raises(grpc.RpcError) as err:
            pending.result(timeout=10)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    health = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _http_get(path, timeout_s=10.0):
    """(status, JSON body) of GET path on Serve's HTTP proxy, under the application's prefix."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    details = ServeInstanceDetails(**serve.context._get_global_client().get_serve_details())
    prefix = details.applications[APP].route_prefix.rstrip("/")
    url = f"http://127.0.0.1:{details.http_options.port}{prefix}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_http_health_and_ready(client):
    """At the root (the shipped route prefix is /) and under the /specdec alias alike."""
    for prefix in ("", "/specdec"):
        assert _http_get(prefix + "/health") == (200, {"status": "alive"})
        status, body = _http_get(prefix + "/ready")
        assert status == 200 and body["ready"] is True, body


def test_replicas_run_only_on_their_pool_nodes(client):
    import ray

    pools = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for deployment, pool in (("DraftModel", "draft_pool"), ("TargetModel", "target_pool")):
        replicas = _replicas(deployment)
        assert replicas
        for replica in replicas:
            assert pool in pools[replica.node_id], (deployment, replica.node_id)
            other = "target_pool" if pool == "draft_pool" else "draft_pool"
            assert other not in pools[replica.node_id]
    for replica in _replicas("SpeculativeRouter"):  # on the head, away from the model nodes
        assert "router_pool" in pools[replica.node_id]
        assert not {"draft_pool", "target_pool"} & set(pools[replica.node_id])


K_MAX = yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]["args"][
    "max_speculative_tokens"
]
BAD_REQUESTS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x " * 300}, "prompt"),  # past the 256-token context limit
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": -5}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 100_000}, "max_new_tokens"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "temperature": math.nan}, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -1}, "top_k"),
    ({"prompt": "hi", "num_speculative_tokens": K_MAX + 1}, "num_speculative_tokens"),
    ({"prompt": "hi", "proposer": "medusa"}, "proposer"),
    ({"prompt": "hi", "proposer": ""}, "proposer"),  # set, though empty: not the default
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"prompt": "hi", "stop_token_ids": [1_000_000_000]}, "stop_token_ids"),  # past the vocab
    ({"prompt": "hi", "stop": ["x"] * 17}, "stop"),  # past max_stop_strings
    ({"prompt": "hi", "stop": ["x" * 257]}, "stop[0]"),  # past max_stop_string_chars
    ({"prompt": "hi", "stop": ["<|im_end|>\n"]}, "stop"),  # a special token beside text
    ({"messages": [{"role": "user", "content": "hi"}] * 257}, "messages"),  # past max_messages
]


@pytest.mark.parametrize("fields, field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_input_is_invalid_argument_naming_the_field(client, reference, fields, field, stream):
    request = build_request(**fields)
    with pytest.raises(grpc.RpcError) as err:
        if stream:
            list(client.generate_stream(request))
        else:
            client.generate(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()
    good = client.generate(build_request(PROMPTS[0], max_new_tokens=8))
    assert list(good.token_ids) == reference(PROMPTS[0], 8)


def _counted(text, method, code="CANCELLED"):
    """``method``'s requests the router counted with status ``code`` (CANCELLED: a client
    cancel or deadline), summed over its replicas, from the ray_specdec_requests_total counter
    in a Prometheus exposition."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ray_specdec_requests_total")
        and f'method="{method}"' in line
        and f'code="{code}"' in line
    )


def _stream_outcomes():
    text = scrape_metrics()
    return _counted(text, "GenerateStream"), _counted(text, "GenerateStream", "OK")


# Serve's gRPC proxy loses a client cancel that lands while it writes a message to the client
# (it never cancels the router's call; ray-project/ray PR #42665, closed unmerged): the request
# then runs to its end. Seen on about 1 stream in 10 here, so the test allows that many tries.
_CANCEL_TRIES = 3


def test_cancelled_stream_releases_both_caches(client):
    """A client that cancels a stream after two messages stops its rounds: both caches are
    empty and the router counts the stream CANCELLED, not OK (run to its end)."""
    for _ in range(_CANCEL_TRIES):
        cancelled, ran_out = _stream_outcomes()
        stream = client.generate_stream(
            build_request(PROMPTS[2], max_new_tokens=200, num_speculative_tokens=1)
        )
        next(stream)
        next(stream)
        stream.cancel()
        _wait_until(_all_caches_empty)
        # The metrics export lags by seconds: wait until the stream is counted either way.
        counted = cancelled + ran_out
        _wait_until(lambda seen=counted: sum(_stream_outcomes()) > seen, timeout_s=90)
        if _stream_outcomes()[0] > cancelled:
            return
    pytest.fail(f"every one of {_CANCEL_TRIES} cancelled streams ran to its end")


def test_deadline_is_deadline_exceeded_and_releases_the_session(client):
    before = _counted(scrape_metrics(), "Generate")
    request = build_request(PROMPTS[3], max_new_tokens=230, num_speculative_tokens=1)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(request, timeout_s=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until(_all_caches_empty)
    # Released because the deadline stopped the rounds, not because the 230 tokens ran to
    # their end: the router counted the request as CANCELLED (the export lags by seconds).
    _wait_until(lambda: _counted(scrape_metrics(), "Generate") > before, timeout_s=90)


def test_killed_target_replica_mid_request_gives_identical_output(client, reference):
    """Several concurrent greedy streams; the target replica holding sessions is killed; every
    request still finishes with the undisturbed output, rebuilt on the other replica."""
    streams_survive_a_killed_target(client, reference)


def test_prometheus_metrics_are_exported(client):
    """The service exports the named metrics and every metric the Grafana dashboard
    (k8s/monitoring/grafana-dashboard.json) queries, once it has served a few requests."""
    for prompt in PROMPTS[:3]:
        client.generate(build_request(prompt, max_new_tokens=16, num_speculative_tokens=2))
    # A draft call for a session no replica holds: a cache miss, which counts a rebuild.
    miss = worker_pb2.ProposeRequest(
        session=worker_pb2.SessionTokens(
            session_id="metrics-miss", prefix_len=3, new_token_ids=[1]
        ),
        num_speculative_tokens=1,
    )
    assert _handle("DraftModel", "metrics-miss").propose.remote(miss).result().cache_miss
    wanted = [
        "ray_specdec_requests_total",
        "ray_specdec_accepted_tokens_total",
        "ray_specdec_rounds_total",
        "ray_specdec_round_latency_seconds_bucket",
        "ray_specdec_ttft_seconds_bucket",
        "ray_specdec_cache_sessions",
        "ray_specdec_compute_seconds_bucket",
        "ray_specdec_proposed_tokens_total",
        "ray_specdec_proposed_accepted_tokens_total",
        "ray_specdec_replica_calls_total",
        *sorted(dashboard.dashboard_metric_names()),
    ]
    exported: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not set(wanted) <= exported:
        time.sleep(2)
        text = scrape_metrics()
        exported = exported_names(text)
    missing = [name for name in wanted if name not in exported]
    assert not missing, missing
    assert 'part="orchestration"' in text and 'code="OK"' in text
    assert 'position="0"' in text
    assert 'proposer="draft"' in text  # k = 2 requests: the draft model proposed
    # Without direct calls every propose and verify goes through Serve.
    assert metric_total(text, "ray_specdec_replica_calls_total", side="target", path="serve") > 0
    assert metric_total(text, "ray_specdec_replica_calls_total", path="direct") == 0


def _probe_until(done, check, period_s=0.25):
    """[(seconds, answer)] of check() called every period_s seconds until done() holds; a
    probe that raises is recorded with its exception as the answer."""
    probes = []
    while not done():
        start = time.monotonic()
        try:
            answer = check()
        except Exception as err:  # noqa: BLE001 - recorded, the test asserts on it
            answer = err
        probes.append((time.monotonic() - start, answer))
        time.sleep(period_s)
    return probes


def test_readiness_answers_within_a_second_under_64_long_streams(client, reference):
    """64 greedy streams of 32 tokens each in flight: gRPC health Check, with a kubelet-like
    1 s deadline, answers SERVING every time, and so does HTTP /ready; every stream still ends
    with the target-only tokens."""
    stub = health_pb2_grpc.HealthStub(client.channel)
    n, streams = 32, 64  # 32 tokens: still dozens of probes under the full load
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    running = []

    def stream(prompt):
        messages = client.generate_stream(
            build_request(prompt, max_new_tokens=n, num_speculative_tokens=2)
        )
        running.append(1)
        return [t for m in messages for t in m.token_ids]

    def check():
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
        return status, _http_get("/ready", 1.0)[0]

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        outputs = [pool.submit(stream, p) for p in prompts]
        _wait_until(lambda: len(running) == streams, timeout_s=60)
        done = lambda: sum(f.done() for f in outputs) > streams // 2  # noqa: E731
        probes = _probe_until(done, check)
        tokens = [f.result() for f in outputs]
    for prompt, got in zip(prompts, tokens):
        assert got == reference(prompt, n)
    seconds = sorted(s for s, _ in probes)
    print(
        f"Check + /ready under {streams} streams: {len(probes)} probes, p50 "
        f"{seconds[len(seconds) // 2]:.3f} s, max {seconds[-1]:.3f} s"
    )
    assert len(probes) >= 4, "the streams ended before readiness was probed under load"
    serving = (health_pb2.HealthCheckResponse.SERVING, 200)
    assert [a for _, a in probes] == [serving] * len(probes), probes


def test_no_target_replica_left_is_unavailable_not_a_hang(client, served):
    """The target-pool node dies (its `ray start` process, which this test session started)
    while four streams are in flight: no node can host a target replica any more. Readiness
    turns NOT_SERVING, and then, at the shipped timeouts (UNAVAILABLE after 180 s of retries),
    a new request fails with UNAVAILABLE naming the missing replica within seconds: the router
    counts no RUNNING target replica, as readiness does. The in-flight streams, which a replica
    had answered, have not failed by then: they wait (up to unavailable_after_s) for a
    replacement that rebuilds their sessions, and the client cancels them. Runs last: the
    cluster has no target pool afterwards."""
    import os
    import signal

    _wait_until(lambda: len(_replicas("TargetModel")) == 2, timeout_s=90)
    streams = [
        client.generate_stream(build_request(p, max_new_tokens=230, num_speculative_tokens=0))
        for p in PROMPTS[:4]
    ]
    for stream in streams:
        next(stream)
    os.kill(served[1].node("target").pid, signal.SIGKILL)

    def outcome(stream):
        try:
            list(stream)
        except grpc.RpcError as err:
            return err.code(), err.details()
        return grpc.StatusCode.OK, ""

    stub = health_pb2_grpc.HealthStub(client.channel)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        in_flight = [pool.submit(outcome, stream) for stream in streams]
        # The replicas die with their node's raylet a moment later; readiness tells when.
        _wait_until(
            lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == not_serving,
            timeout_s=60,
        )
        asked = time.monotonic()
        after = outcome(client.generate_stream(build_request(PROMPTS[0], max_new_tokens=8)))
        assert after[0] == grpc.StatusCode.UNAVAILABLE, after
        assert "no TargetModel replica is running" in after[1], after
        refused_s = time.monotonic() - asked
        assert refused_s < 30, refused_s  # not call_timeout_s (120 s) nor 180 s of retries
        early = [f.result() for f in in_flight if f.done()]
        assert all(code == grpc.StatusCode.OK for code, _ in early), early
        for stream in streams:
            stream.cancel()
        ended = [f.result(timeout=60) for f in in_flight]
    assert all(code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED) for code, _ in ended)
    # Readiness tells the truth over HTTP too: with no target replica running, /ready is 503.
    status, body = _http_get("/ready")
    assert status == 503 and "no target replica is running" in body["reason"], body
