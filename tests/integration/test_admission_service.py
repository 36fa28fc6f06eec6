"""Admission on a real local cluster, through the real endpoints: who may call (API keys) and
how much (limits).

Keys: with two configured (one from service.api_keys_file, one from the environment variable
service.api_keys_env names), both APIs answer only requests that carry one of them, 401 /
UNAUTHENTICATED otherwise, and health, readiness and metrics stay open. Limits: a huge prompt is
refused without stalling the other streams, malformed messages answer INVALID_ARGUMENT, past the
router's queue the proxy answers RESOURCE_EXHAUSTED at once, and HTTP requests take the target's
generation_config.

One cluster for the module (starting one costs most of a minute on two cores): the shipped
local config with the tiny pair (conftest.write_config), the two keys, a router that runs at
most ROUTER_ONGOING requests with QUEUED more waiting (so that its queue fills with a handful of
streams), and a target whose generation_config sets GENERATION.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from conftest import write_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from local_service import serving
from serve_state import scrape_metrics
from serve_state import wait_until as _wait_until

from specdec.client import SpecdecClient, build_request
from specdec.models.tiny import PROMPTS
from specdec.v1 import specdec_pb2

pytestmark = pytest.mark.integration
FILE_KEY = "file-key-0123456789"
ENV_KEY = "env-key-9876543210"
ENV_NAME = "SPECDEC_TEST_API_KEYS"  # not the default name: no other cluster of the session reads it
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
ROUTER_ONGOING = 3
QUEUED = 1
HUGE_PROMPT_BYTES = 5_000_000
# The target's generation_config sampling fields, and the service's default_max_tokens: what an
# HTTP request that leaves them out gets.
GENERATION = {"temperature": 0.5, "top_k": 4}
DEFAULT_MAX_TOKENS = 6


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_pair):
    """(gRPC address, OpenAI base URL) of the module's cluster: FILE_KEY in the keys file and
    ENV_KEY in the cluster processes' environment (the router's workers inherit it), the
    router's queue bounds, the target a copy whose generation_config sets GENERATION, and
    HTTP requests' token limit DEFAULT_MAX_TOKENS."""
    pytest.importorskip("ray")
    tmp = tmp_path_factory.mktemp("admission")
    keys = tmp / "api-keys"
    keys.write_text(f"# the key of the test\n\n{FILE_KEY}\n")
    target = _with_generation_config(tiny_pair[1], tmp / "target")
    path, port = write_config(
        tmp,
        tiny_pair[0],
        target,
        target_replicas=1,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        api_keys_file=str(keys),
        api_keys_env=ENV_NAME,
    )
    config = yaml.safe_load(path.read_text())
    for deployment in config["applications"][0]["deployments"]:
        if deployment["name"] == "SpeculativeRouter":
            deployment.update(max_ongoing_requests=ROUTER_ONGOING, max_queued_requests=QUEUED)
    path.write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_NAME, f"{ENV_KEY},")
        cluster = serving(tmp, path, port)
        _, _, address = cluster.__enter__()
    try:
        yield address, f"http://127.0.0.1:{config['http_options']['port']}/v1"
    finally:
        cluster.__exit__(None, None, None)


def _client(address, api_key=None):
    return SpecdecClient(address, timeout_s=120, api_key=api_key)


@pytest.fixture(scope="module")
def client(service):
    """A gRPC client that carries FILE_KEY."""
    with _client(service[0], FILE_KEY) as keyed:
        yield keyed


def _with_generation_config(source: Path, copy: Path) -> Path:
    """A copy of the model at ``source`` whose generation_config.json also sets GENERATION."""
    from transformers import GenerationConfig

    shutil.copytree(source, copy)
    config = GenerationConfig.from_pretrained(copy)
    config.update(do_sample=True, **GENERATION)
    config.save_pretrained(copy)
    return copy


def _largest_gap(client, request, during=None):
    """(largest seconds between two messages of a stream, its token ids); ``during`` runs in a
    thread once the stream's first message arrived."""
    stream = client.generate_stream(request)
    first = next(stream)
    tokens, gaps, last = list(first.token_ids), [], time.monotonic()
    worker = threading.Thread(target=during) if during else None
    if worker:
        worker.start()
    for message in stream:
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        tokens.extend(message.token_ids)
    if worker:
        worker.join()
    return max(gaps), tokens


def test_a_huge_prompt_is_refused_without_stalling_other_streams(client):
    """While a stream runs, a 5 MB prompt is refused with INVALID_ARGUMENT naming the prompt
    and its limit, and that stream's largest gap between messages stays within a generous
    factor of its largest gap in the same run without the big prompt (before the fix it
    tokenized for 6.8 s on the event loop)."""
    request = build_request(PROMPTS[2], max_new_tokens=120, num_speculative_tokens=1)
    # Warm up, then the undisturbed gap of the same stream.
    client.generate(build_request(PROMPTS[0], max_new_tokens=8))
    calm_gap, calm_tokens = _largest_gap(client, request)
    outcome = {}

    def huge():
        try:
            client.generate(build_request("x" * HUGE_PROMPT_BYTES, max_new_tokens=4))
        except grpc.RpcError as err:
            outcome["code"], outcome["details"] = err.code(), err.details()

    busy_gap, busy_tokens = _largest_gap(client, request, during=huge)
    assert outcome["code"] == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert outcome["details"].startswith("prompt: has 5000000 bytes"), outcome
    assert "max_prompt_bytes" in outcome["details"]
    assert busy_tokens == calm_tokens
    # Pickling and shipping 5 MB through the proxy costs the router's loop little; tokenizing
    # it there cost seconds. The floor keeps scheduler noise on 2 cores from deciding.
    assert busy_gap < max(10 * calm_gap, 1.0), (busy_gap, calm_gap)


def _raw_call(client, method, payload: bytes, stream: bool):
    """Sends ``payload`` as the request bytes of ``method``, unparsed; returns (code, details)."""
    path = f"/specdec.v1.SpeculativeDecoding/{method}"
    make = client.channel.unary_stream if stream else client.channel.unary_unary
    call = make(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        result = call(payload, metadata=client.metadata, timeout=60)
        if stream:
            list(result)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


BAD_UTF8_PROMPT = b"\x0a\x04ab\xc3\x28"  # field 1 (prompt), 4 bytes: "ab" then invalid UTF-8
MALFORMED = {"not-a-message": b"\xff\xff\xff\xff\xff", "bad-utf8-prompt": BAD_UTF8_PROMPT}


@pytest.mark.parametrize("payload", list(MALFORMED.values()), ids=list(MALFORMED))
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_malformed_messages_are_invalid_argument_with_a_plain_message(client, method, payload):
    assert specdec_pb2.GenerateRequest.DESCRIPTOR.fields_by_number[1].name == "prompt"
    code, details = _raw_call(client, method, payload, stream=method == "GenerateStream")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("request: the request is not a valid specdec.v1.GenerateRequest")
    assert "<class" not in details and "Traceback" not in details
    good = client.generate(build_request(PROMPTS[0], max_new_tokens=4))
    _ran_to_its_end(list(good.token_ids), good, max_new_tokens=4)


def _ran_to_its_end(token_ids, final, max_new_tokens):
    """The completion whose tokens are ``token_ids`` and whose last message is ``final`` ran
    to its end: its usage counts those tokens, and it ended at max_new_tokens ("length") or
    stopped before it ("stop"), not cut short."""
    assert token_ids and final.usage.completion_tokens == len(token_ids), final
    n = len(token_ids)
    assert (final.finish_reason == "length" and n == max_new_tokens) or (
        final.finish_reason == "stop" and n <= max_new_tokens
    ), (final.finish_reason, n)


def _outcome(client):
    """(status code, details, time.monotonic() when the answer came) of a short request."""
    try:
        client.generate(build_request(PROMPTS[0], max_new_tokens=4), timeout_s=120)
    except grpc.RpcError as err:
        return err.code(), err.details(), time.monotonic()
    return grpc.StatusCode.OK, "", time.monotonic()


def _ends(stream):
    """(tokens, time.monotonic() at its last message) of a stream read to its end."""
    tokens = [t for message in stream for t in message.token_ids]
    return tokens, time.monotonic()


def _running_stream(client, request, wait_s: float = 60.0):
    """A stream whose first message arrived (it runs on the router). Serve frees the slots of
    the module's earlier calls asynchronously, so a busy machine may still count one for a
    moment: retry a refusal until ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        stream = client.generate_stream(request)
        try:
            next(stream)
            return stream
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_past_the_router_queue_requests_are_refused_at_once(client):
    """ROUTER_ONGOING long streams fill the router, QUEUED more fill its queue; every request
    beyond is refused with RESOURCE_EXHAUSTED at once, and once the streams are done, the same
    requests succeed (below the limit nothing is refused)."""
    long = build_request(PROMPTS[3], max_new_tokens=230, num_speculative_tokens=1)
    holders = [_running_stream(client, long) for _ in range(ROUTER_ONGOING)]
    with concurrent.futures.ThreadPoolExecutor(ROUTER_ONGOING + QUEUED + 3) as pool:
        ends = [pool.submit(_ends, stream) for stream in holders]
        queued = [pool.submit(lambda: list(client.generate_stream(long))) for _ in range(QUEUED)]
        time.sleep(1.0)  # the queued ones reach the proxy's queue
        extra = [pool.submit(_outcome, client) for _ in range(3)]
        extra = [future.result(timeout=120) for future in extra]
        refused = [e for e in extra if e[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert refused, extra
        assert all(
            code in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED) for code, _, _ in extra
        )
        assert all("backpressure" in details for _, details, _ in refused), refused
        # "At once": every refusal came before any stream holding the router had ended (the
        # router was still full), not after a wait for a slot.
        ended = [future.result() for future in ends]
        assert all(tokens for tokens, _ in ended)
        first_end = min(end for _, end in ended)
        assert all(answered < first_end for _, _, answered in refused), (refused, first_end)
        for future in queued:
            messages = future.result()
            tokens = [t for message in messages for t in message.token_ids]
            _ran_to_its_end(tokens, messages[-1], long.max_new_tokens)
    for _ in range(ROUTER_ONGOING + QUEUED + 1):  # sequential: never past the limit
        assert client.generate(build_request(PROMPTS[0], max_new_tokens=4)).token_ids


def test_past_the_proxy_message_bound_grpc_answers_resource_exhausted(client):
    """The gRPC proxy's receive bound is max_request_bytes (8 MiB; deploy sets Serve's
    RAY_SERVE_GRPC_MAX_MESSAGE_SIZE from it; Serve's own default is 2 GiB): a 9 MiB prompt
    never reaches a router."""
    with pytest.raises(grpc.RpcError) as err:
        client.generate(build_request("x" * (9 * 1024**2), max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert client.generate(build_request(PROMPTS[0], max_new_tokens=4)).token_ids


def test_http_requests_take_the_targets_generation_config_and_default_max_tokens(service, client):
    """An HTTP request that sets no temperature, top_k, top_p or max_tokens samples with the
    target's generation_config values (temperature 0.5, top_k 4), top_p 1 (OpenAI's) and
    stops at default_max_tokens: token for token what gRPC gives with those values and seed.
    The same seeds at OpenAI's plain defaults (temperature 1, no top-k) give other text, so
    the comparison can tell the two apart."""
    _, base_url = service
    with openai.OpenAI(base_url=base_url, api_key=FILE_KEY, max_retries=0) as oai:
        model = oai.models.list().data[0].id

        def http(seed):
            extra = {"num_speculative_tokens": 0}
            return oai.completions.create(
                model=model, prompt=PROMPTS[2], seed=seed, extra_body=extra
            )

        answers = {seed: http(seed) for seed in (1, 2, 3)}

    def grpc_text(seed, **sampling):
        request = build_request(
            PROMPTS[2],
            seed=seed,
            num_speculative_tokens=0,
            max_new_tokens=DEFAULT_MAX_TOKENS,
            **sampling,
        )
        return client.generate(request).text

    for seed, answer in answers.items():
        assert answer.usage.completion_tokens <= DEFAULT_MAX_TOKENS
        assert answer.choices[0].text == grpc_text(seed, top_p=1.0, **GENERATION)
    plain = {seed: grpc_text(seed, temperature=1.0, top_p=1.0) for seed in answers}
    assert plain != {seed: answer.choices[0].text for seed, answer in answers.items()}


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == UNAUTHENTICATED, err.value
    return err.value


def test_grpc_without_or_with_a_wrong_key_is_unauthenticated(service):
    address, _ = service
    request = build_request(PROMPTS[0], max_new_tokens=8)
    for key in (None, "wrong-key", FILE_KEY[:-1], f"{FILE_KEY}x"):
        with _client(address, key) as client:
            err = _refused(lambda c=client: c.generate(request))
            assert ("no API key" if key is None else "invalid API key") in err.details()
            assert FILE_KEY not in err.details()
            _refused(lambda c=client: list(c.generate_stream(request)))
            _refused(client.model_info)
    # A scheme other than Bearer is no key either.
    with _client(address) as client:
        metadata = (*client.metadata, ("authorization", f"Basic {FILE_KEY}"))
        _refused(lambda: client.stub.Generate(request, metadata=metadata, timeout=60))


def test_grpc_with_either_key_answers_and_health_stays_open(service):
    address, _ = service
    request = build_request(PROMPTS[1], max_new_tokens=16, temperature=0.0)
    with _client(address, FILE_KEY) as by_file, _client(address, ENV_KEY) as by_env:
        unary = by_file.generate(request)
        streamed = list(by_env.generate_stream(request))
        assert by_env.model_info().target_model
    assert len(unary.token_ids) > 0
    assert [t for m in streamed for t in m.token_ids] == list(unary.token_ids)
    with _client(address) as anonymous:  # grpc.health.v1 needs no key
        health = health_pb2_grpc.HealthStub(anonymous.channel)
        check = health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def _http(url, body=None, headers=()):
    """(status, headers, parsed JSON body) of a GET (``body`` None) or POST."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=dict(headers))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        raw = err.read()
        return err.code, err.headers, json.loads(raw) if raw.startswith(b"{") else raw


def test_http_needs_a_bearer_key_health_and_readiness_do_not(service):
    address, base_url = service
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    for headers in ((), (("Authorization", "Bearer wrong"),), (("Authorization", FILE_KEY),)):
        for path, payload in (("/completions", body), ("/models", None)):
            status, answered, error = _http(base_url + path, payload, headers)
            assert status == 401, (path, headers, error)
            assert answered["WWW-Authenticate"] == "Bearer"
            assert error["error"]["code"] == "invalid_api_key"
            assert error["error"]["type"] == "invalid_request_error"
    wrong = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0, timeout=60)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with openai.OpenAI(base_url=base_url, api_key=ENV_KEY, max_retries=0, timeout=120) as oai:
        model = oai.models.list().data[0].id
        answer = oai.completions.create(model=model, **body)
    with _client(address, FILE_KEY) as client:
        grpc_answer = client.generate(build_request(PROMPTS[1], max_new_tokens=16, temperature=0))
    assert answer.choices[0].text == grpc_answer.text
    status, _, _ = _http(
        base_url + "/completions", body, (("Authorization", f"Bearer {FILE_KEY}"),)
    )
    assert status == 200
    root = base_url.removesuffix("/v1")
    assert _http(root + "/health")[0] == 200
    status, _, ready = _http(root + "/ready")
    assert status == 200 and ready["ready"] is True, ready
    for docs in ("/docs", "/openapi.json", "/redoc"):  # no route answers without a key
        assert _http(root + docs)[0] == 404, docs


def test_refusals_are_counted_and_metrics_stay_open(service):
    """The refused calls above show in ray_specdec_requests_total under UNAUTHENTICATED (Ray's
    metrics port needs no key); the service still serves afterwards."""

    def refused_counted():
        text = scrape_metrics()
        return all(
            any(
                line.startswith("ray_specdec_requests_total{")
                and f'method="{method}"' in line
                and 'code="UNAUTHENTICATED"' in line
                for line in text.splitlines()
            )
            for method in ("Generate", "GenerateStream", "GetModelInfo", "/v1/completions")
        )

    _wait_until(refused_counted, timeout_s=60)
    address, _ = service
    with _client(address, FILE_KEY) as client:
        assert client.generate(build_request(PROMPTS[2], max_new_tokens=4)).token_ids
