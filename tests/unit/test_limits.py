"""Limits checked before work: the timeouts' relation, request sizes, stop token ids, the draft's
q against the replica transport's message cap, tiny temperatures, special-token stop strings,
malformed messages and the loadtest's refused count."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest
import torch
import yaml

from specdec import SamplingParams
from specdec.client import build_request
from specdec.config import ServiceConfig, SpecdecConfig, SpeculationConfig
from specdec.decoding.request import (
    Q_MESSAGE_HEADROOM_BYTES,
    ModelLimits,
    check_q_message_size,
    check_request_size,
    prepare_request,
    q_message_bytes,
)
from specdec.decoding.sampling import GREEDY_BELOW_TEMPERATURE
from specdec.decoding.stopping import STOP, StopChecker
from specdec.errors import ConfigError, InvalidRequestError, MalformedRequest
from specdec.models.tiny import PROMPTS, build_tokenizer
from specdec.servicer import parse_or_mark
from specdec.v1 import specdec_pb2, worker_pb2
from specdec.worker.sampling import processed_probs, truncate_top_n

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "deployments" / "config").glob("*.yaml"))
QWEN_VOCAB = 151936  # the bundled pair's tokenizer


# --- item 2: the timeouts -------------------------------------------------------------------


def test_call_timeout_must_be_below_unavailable_after():
    with pytest.raises(ConfigError) as err:
        ServiceConfig(call_timeout_s=300, unavailable_after_s=30)
    assert err.value.field == "call_timeout_s" and "unavailable_after_s" in str(err.value)
    with pytest.raises(ConfigError):
        ServiceConfig(call_timeout_s=30, unavailable_after_s=30)
    ServiceConfig()  # the defaults fit together
    assert ServiceConfig(call_timeout_s=29, unavailable_after_s=30).call_timeout_s == 29.0


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_fit_the_limits(path):
    raw = yaml.safe_load(path.read_text())
    app = next(a for a in raw["applications"] if a["name"] == "specdec")
    config = SpecdecConfig.from_args(app["args"])
    assert config.service.call_timeout_s < config.service.unavailable_after_s
    # The gRPC proxy's bound (for KubeRay, which reads this file) is max_request_bytes.
    env = raw["controller_options"]["runtime_env"]["env_vars"]
    assert int(env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]) == config.service.max_request_bytes
    router = next(d for d in app["deployments"] if d["name"] == "SpeculativeRouter")
    assert router["max_queued_requests"] >= 1
    functions = raw["grpc_options"]["grpc_servicer_functions"]
    assert "specdec.servicer.add_servicer_to_server" in functions


def test_deploy_sets_the_proxy_message_bound_from_the_app():
    pytest.importorskip("ray")
    from specdec.deployments import deploy

    config = deploy.ServeConfig.load(SHIPPED[0], {"max_request_bytes": 3 * 1024**2})
    env = deploy.controller_options(config)["runtime_env"]["env_vars"]
    assert env[deploy.GRPC_MAX_MESSAGE_ENV] == str(3 * 1024**2)


def test_retryable_covers_what_a_dying_or_draining_replica_raises():
    pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
    from ray.serve.exceptions import (
        BackPressureError,
        DeploymentUnavailableError,
        RequestCancelledError,
    )

    from specdec.deployments.failures import grpc_status, retryable

    def rpc_error(code):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")

    for err in (
        ActorDiedError(),
        ActorUnavailableError("gone", None),
        RequestCancelledError("r"),
        BackPressureError(num_queued_requests=3, max_queued_requests=2),
        DeploymentUnavailableError(None),
        TimeoutError(),
        rpc_error(grpc.StatusCode.UNAVAILABLE),
        rpc_error(grpc.StatusCode.CANCELLED),
    ):
        assert retryable(err), err
    for err in (
        ValueError("bug"),
        RayTaskError("f", "tb", ValueError("bug")),
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED),
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT),
    ):
        assert not retryable(err), err
    code, details = grpc_status(BackPressureError(num_queued_requests=3, max_queued_requests=2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Retry after" in details


class _NeverAnswers:
    """A Serve handle whose calls never answer (Serve queues a call while no replica exists);
    ``calls`` holds the loop time of each call."""

    deployment_name = "TargetModel"

    def __init__(self) -> None:
        self.calls: list[float] = []

    def options(self, **_):
        return self

    def __getattr__(self, name):
        self.calls.append(asyncio.get_running_loop().time())
        return type("M", (), {"remote": staticmethod(lambda _: asyncio.sleep(3600))})


def _timed_verify(transport) -> tuple[float, str]:
    """(seconds, message) of a verify that must end with ServiceUnavailable within 10 s."""
    from specdec.deployments.failures import ServiceUnavailable

    async def run():
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ServiceUnavailable) as err:
            await asyncio.wait_for(transport.verify(worker_pb2.VerifyRequest()), timeout=10)
        return loop.time() - start, str(err.value)

    return asyncio.run(run())


def test_a_call_to_a_missing_replica_ends_within_unavailable_after():
    """A handle call that never answers (Serve queues it while no replica exists) is retried
    and the request gives up by unavailable_after_s, not call_timeout_s after it."""
    pytest.importorskip("ray")
    from specdec.deployments.transport import HandleTransport

    target = _NeverAnswers()
    service = ServiceConfig(call_timeout_s=0.3, unavailable_after_s=0.5)
    transport = HandleTransport(_NeverAnswers(), target, "s", service)
    elapsed, message = _timed_verify(transport)
    assert len(target.calls) >= 2  # the timed-out call was retried
    assert elapsed < service.unavailable_after_s + service.call_timeout_s / 2
    assert "no replica answered within 0.5 s" in message


def test_a_new_request_is_refused_at_once_when_a_later_count_finds_no_target_replica():
    """At the shipped timeouts (120 s a call, 180 s in all), the first verify of a request and
    a release, waiting for a target replica, end within a second or two once a replica count
    taken after they began finds none RUNNING: the verify with ServiceUnavailable naming the
    deployment."""
    pytest.importorskip("ray")
    from specdec.deployments import health
    from specdec.deployments.transport import HandleTransport

    replicas = health.ReplicaCounts(lambda: {"draft": 1, "target": 0}, max_age_s=0.0)
    service = ServiceConfig(call_timeout_s=120, unavailable_after_s=180)
    transport = HandleTransport(_NeverAnswers(), _NeverAnswers(), "s", service, replicas)
    elapsed, message = _timed_verify(transport)
    assert elapsed < 3 and "no TargetModel replica is running" in message, (elapsed, message)

    async def release():
        await asyncio.wait_for(transport.release("s", ("target",)), timeout=3)

    asyncio.run(release())  # the release gave up too, within the 3 s


class _AnswersOnce(_NeverAnswers):
    """A handle whose first call answers (an empty message) and whose later ones never do."""

    def __getattr__(self, name):
        self.calls.append(asyncio.get_running_loop().time())
        if len(self.calls) > 1:
            return super().__getattr__(name)

        async def answer(_):
            return worker_pb2.VerifyResponse()

        return type("M", (), {"remote": staticmethod(answer)})


def test_a_request_a_replica_answered_waits_for_a_replacement():
    """Once a target replica has answered a request, its later calls are not refused when no
    replica is running (one may restart and rebuild the session): they wait for their
    timeouts, here unavailable_after_s 1.5 s."""
    pytest.importorskip("ray")
    from specdec.deployments import health
    from specdec.deployments.transport import HandleTransport

    replicas = health.ReplicaCounts(lambda: {"draft": 1, "target": 0}, max_age_s=0.0)
    service = ServiceConfig(call_timeout_s=0.3, unavailable_after_s=1.5)
    target = _AnswersOnce()
    transport = HandleTransport(_NeverAnswers(), target, "s", service, replicas)
    asyncio.run(transport.verify(worker_pb2.VerifyRequest()))  # answered
    elapsed, message = _timed_verify(transport)
    assert "no replica answered within 1.5 s" in message and elapsed >= 1.0, (elapsed, message)
    assert len(target.calls) >= 3  # the answered call, then the waiting one and its retries


def test_a_count_from_before_the_call_never_ends_it():
    """A count of no target replica taken before the call began (a replica may have started
    since) does not end it: the call waits for its own timeouts."""
    pytest.importorskip("ray")
    from specdec.deployments import health
    from specdec.deployments.transport import HandleTransport

    counts = {"draft": 1, "target": 0}
    replicas = health.ReplicaCounts(lambda: dict(counts), max_age_s=3600)
    asyncio.run(replicas.get(wait_s=5))  # counted once: no target replica
    counts["target"] = 1  # never counted again within max_age_s
    service = ServiceConfig(call_timeout_s=0.3, unavailable_after_s=1.5)
    transport = HandleTransport(_NeverAnswers(), _NeverAnswers(), "s", service, replicas)
    elapsed, message = _timed_verify(transport)
    assert "no replica answered within 1.5 s" in message and elapsed >= 1.0, (elapsed, message)


# --- item 3: request sizes ------------------------------------------------------------------

SMALL = ServiceConfig(
    max_prompt_bytes=100,
    max_messages=2,
    max_stop_strings=2,
    max_stop_string_chars=5,
    max_stop_token_ids=2,
    max_request_bytes=1000,
)
OVER = [
    ({"prompt": "x" * 101}, "prompt", "max_prompt_bytes"),
    ({"prompt": "é" * 51}, "prompt", "max_prompt_bytes"),  # 102 bytes in 51 characters
    ({"messages": [{"role": "user", "content": "x"}] * 3}, "messages", "max_messages"),
    (
        {"messages": [{"role": "user", "content": "x" * 60}] * 2},
        "messages",
        "max_prompt_bytes",
    ),
    ({"stop": ["a", "b", "c"]}, "stop", "max_stop_strings"),
    ({"stop": ["ok", "sixsix"]}, "stop[1]", "max_stop_string_chars"),
    ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids", "max_stop_token_ids"),
]


def _check(prompt="hi", messages=(), stop=(), stop_token_ids=()):
    check_request_size(prompt, list(messages), list(stop), list(stop_token_ids), SMALL)


@pytest.mark.parametrize("fields, field, setting", OVER, ids=[f"{o[1]}-{o[2]}" for o in OVER])
def test_each_size_limit_names_its_field_and_setting(fields, field, setting):
    fields = {"prompt": "" if "messages" in fields else "hi", **fields}
    with pytest.raises(InvalidRequestError) as err:
        _check(**fields)
    assert err.value.field == field and setting in str(err.value)


def test_requests_at_the_limits_pass():
    _check(prompt="é" * 50, stop=["12345", "x"], stop_token_ids=[1, 2])
    _check(prompt="", messages=[{"role": "user", "content": "x" * 50}] * 2)


def test_stop_token_ids_must_be_below_the_vocabulary():
    limits = ModelLimits(
        vocab_size=320, context_limit=256, max_speculative_tokens=4, eos_token_ids=frozenset({0})
    )
    params = SamplingParams(stop_token_ids=[5, 1_000_000_000])
    with pytest.raises(InvalidRequestError) as err:
        prepare_request([1, 2, 3], params, limits)
    assert err.value.field == "stop_token_ids" and "320" in str(err.value)
    ok = prepare_request([1, 2, 3], SamplingParams(stop_token_ids=[319]), limits)
    assert 319 in ok.stop_token_ids


# --- item 4: malformed messages -------------------------------------------------------------


def test_request_parsing_marks_what_does_not_parse():
    parse = parse_or_mark(specdec_pb2.GenerateRequest)
    assert parse(build_request("hi").SerializeToString()).prompt == "hi"
    for data in (b"\xff\xff\xff\xff\xff", b"\x0a\x04ab\xc3\x28"):
        marked = parse(data)
        assert isinstance(marked, MalformedRequest)
        assert str(marked).startswith("the request is not a valid specdec.v1.GenerateRequest")
        assert "<class" not in str(marked)


def test_the_servicer_function_registers_every_method_with_the_marking_parser():
    recorded = {}

    class Server:
        def add_generic_rpc_handlers(self, handlers):
            recorded["generic"] = handlers

        def add_registered_method_handlers(self, name, handlers):
            recorded[name] = handlers

    from specdec.servicer import add_servicer_to_server

    class Servicer:
        Generate = GenerateStream = GetModelInfo = staticmethod(lambda *a: None)

    add_servicer_to_server(Servicer(), Server())
    handlers = recorded["specdec.v1.SpeculativeDecoding"]
    assert set(handlers) == {"Generate", "GenerateStream", "GetModelInfo"}
    assert handlers["GenerateStream"].response_streaming
    assert isinstance(handlers["Generate"].request_deserializer(b"\xff"), MalformedRequest)


# --- item 5: temperatures, special-token stops, whole-vocabulary q --------------------------


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    assert torch.isnan(processed_probs(logits, 1e-40)).any()  # what it would do unguarded
    for temperature in (1e-40, 5e-324, GREEDY_BELOW_TEMPERATURE / 2):
        params = SamplingParams(temperature=temperature)
        assert params.temperature == 0.0 and params.greedy
    assert SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).temperature > 0
    probs = processed_probs(logits, GREEDY_BELOW_TEMPERATURE)
    assert not torch.isnan(probs).any() and probs[0, 0] == 1.0


def test_a_tiny_temperature_generates_the_greedy_output(engine):
    tiny = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=1e-40), 2)
    greedy = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12), 0)
    assert tiny.token_ids == greedy.token_ids
    assert all(math.isfinite(p) for p in tiny.logprobs)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_a_stop_string_that_is_a_special_token_stops_there(tokenizer):
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = tokenizer.encode("The quick brown fox")
    checker = StopChecker(tokenizer, 100, {tokenizer.eos_token_id}, stop=["<|im_start|>"])
    delta = checker.append(ids[:2] + [start] + ids[2:], [-1.0] * (len(ids) + 1))
    assert checker.finish_reason == STOP == delta.finish_reason
    assert checker.token_ids == ids[:2] + [start]
    assert checker.text == tokenizer.decode(ids[:2])
    # Without it as a stop string, the same block runs on.
    plain = StopChecker(tokenizer, 100, {tokenizer.eos_token_id})
    plain.append(ids[:2] + [start] + ids[2:], [-1.0] * (len(ids) + 1))
    assert plain.finish_reason is None and len(plain.token_ids) == len(ids) + 1


def test_a_stop_string_mixing_a_special_token_and_text_is_refused(tokenizer):
    with pytest.raises(InvalidRequestError) as err:
        StopChecker(tokenizer, 100, {tokenizer.eos_token_id}, stop=["<|im_end|>\n"])
    assert err.value.field == "stop" and "<|im_end|>" in str(err.value)


def test_whole_vocabulary_q_is_refused_at_start_up_when_it_cannot_fit():
    cap = 4 * 1024**2  # Serve's per-replica gRPC transport
    whole = SpeculationConfig(max_speculative_tokens=12, draft_top_n=0)
    with pytest.raises(ConfigError) as err:
        check_q_message_size(QWEN_VOCAB, whole, cap)
    assert err.value.field == "draft_top_n" and "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH" in str(
        err.value
    )
    check_q_message_size(QWEN_VOCAB, SpeculationConfig(max_speculative_tokens=12), cap)
    check_q_message_size(320, whole, cap)  # the tiny pair: whole vocabulary works


@pytest.mark.parametrize("vocab, top_n", [(320, 0), (5000, 0), (5000, 64)])
def test_the_q_size_bound_holds_for_real_messages(vocab, top_n):
    """The bound the start-up check uses is at least the serialized size of a propose answer
    with k_max full rows (the worst case of probabilities and ids)."""
    speculation = SpeculationConfig(max_speculative_tokens=8, draft_top_n=top_n)
    probs = torch.softmax(torch.randn(8, vocab), dim=-1)
    ids, values = truncate_top_n(probs, top_n)
    response = worker_pb2.ProposeResponse(token_ids=[vocab - 1] * 8, compute_s=1.0)
    response.q.width = ids.shape[1]
    response.q.token_ids.extend(ids.flatten().tolist())
    response.q.probs.extend(values.flatten().tolist())
    bound = q_message_bytes(vocab, speculation)
    assert response.ByteSize() <= bound - Q_MESSAGE_HEADROOM_BYTES + 64


# --- item 6: the loadtest counts refused requests apart ---------------------------------------


def test_loadtest_reports_refused_apart_from_failures():
    from specdec.bench.loadtest import LoadTest, format_summary, parse_stages
    from specdec.v1 import specdec_pb2_grpc

    class Router(specdec_pb2_grpc.SpeculativeDecodingServicer):
        async def GenerateStream(self, request, context):
            if request.prompt == "full":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "backpressure")
            if request.prompt == "bad":
                await context.abort(grpc.StatusCode.INTERNAL, "bug")
            await asyncio.sleep(0.005)
            yield specdec_pb2.GenerateResponse(token_ids=[1])

    async def run():
        server = grpc.aio.server()
        specdec_pb2_grpc.add_SpeculativeDecodingServicer_to_server(Router(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            requests = [build_request(p) for p in ("a", "full", "bad")]
            load = LoadTest(requests, address=f"127.0.0.1:{port}", progress=False)
            return await load.run(parse_stages("1x0.6s"))
        finally:
            await server.stop(0)

    report = asyncio.run(run())
    summary = report["summary"]
    assert summary["refused"] > 0 and summary["errors"] == {"INTERNAL": summary["error_count"]}
    assert summary["started"] == summary["completed"] + summary["refused"] + summary["error_count"]
    assert sum(r["refused"] for r in report["per_second"]) == summary["refused"]
    assert f"refused {summary['refused']}" in format_summary(report)


def test_http_bodies_past_max_request_bytes_are_413_before_being_read_whole():
    pytest.importorskip("ray")
    from starlette.requests import Request

    from specdec.deployments.http_api import _json_body
    from specdec.openai_api import OpenAIError

    def request(body: bytes, declared: int | None):
        chunks = [body[i : i + 10] for i in range(0, len(body), 10)] or [b""]
        read = []

        async def receive():
            chunk = chunks[len(read)]
            read.append(chunk)
            return {"type": "http.request", "body": chunk, "more_body": len(read) < len(chunks)}

        headers = [(b"content-length", str(declared).encode())] if declared is not None else []
        scope = {"type": "http", "method": "POST", "headers": headers}
        return Request(scope, receive), read

    ok, _ = request(b'{"prompt": "hi"}', 16)
    assert asyncio.run(_json_body(ok, 16)) == {"prompt": "hi"}
    for declared in (None, 16):  # a body longer than it declares is cut off as well
        big, read = request(b'{"prompt": "' + b"x" * 100 + b'"}', declared)
        with pytest.raises(OpenAIError) as err:
            asyncio.run(_json_body(big, 50))
        assert err.value.status == 413 and "max_request_bytes" in err.value.message
        assert sum(map(len, read)) <= 60  # stopped reading past the limit
    declared_big, read = request(b"{}", 10**9)
    with pytest.raises(OpenAIError):
        asyncio.run(_json_body(declared_big, 50))
    assert read == []  # refused on the declared length alone
