"""API keys on a real local cluster: with keys configured (one from service.api_keys_file, one
from the environment variable service.api_keys_env names), both APIs answer only requests that
carry one of them, 401 / UNAUTHENTICATED otherwise, and health, readiness and metrics stay open.

One cluster for the whole module (starting one costs a minute or two on two cores)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_openai_api import http_base_url
from test_serving import _scrape_metrics, _wait_until

from specdec.client import SpecdecClient, build_request
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.integration
FILE_KEY = "file-key-0123456789"
ENV_KEY = "env-key-9876543210"
ENV_NAME = "SPECDEC_TEST_API_KEYS"  # not the default name: no other cluster of the session reads it
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tiny_service):
    """(gRPC address, HTTP base URL): the tiny pair served with two keys, FILE_KEY in the file
    and ENV_KEY in the cluster processes' environment (the router's workers inherit it)."""
    tmp = tmp_path_factory.mktemp("api-keys")
    keys = tmp / "api-keys"
    keys.write_text(f"# the key of the test\n\n{FILE_KEY}\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_NAME, f"{ENV_KEY},")
        service = tiny_service(tmp, api_keys_file=str(keys), api_keys_env=ENV_NAME)
        _, _, address = service.__enter__()
    try:
        yield address, http_base_url()
    finally:
        service.__exit__(None, None, None)


def _client(address, api_key=None):
    return SpecdecClient(address, timeout_s=120, api_key=api_key)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == UNAUTHENTICATED, err.value
    return err.value


def test_grpc_without_or_with_a_wrong_key_is_unauthenticated(keyed):
    address, _ = keyed
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


def test_grpc_with_either_key_answers_and_health_stays_open(keyed):
    address, _ = keyed
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


def test_http_needs_a_bearer_key_health_and_readiness_do_not(keyed):
    address, base_url = keyed
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


def test_refusals_are_counted_and_metrics_stay_open(keyed):
    """The refused calls above show in ray_specdec_requests_total under UNAUTHENTICATED (Ray's
    metrics port needs no key); the service still serves afterwards."""

    def refused_counted():
        text = _scrape_metrics()
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
    address, _ = keyed
    with _client(address, FILE_KEY) as client:
        assert client.generate(build_request(PROMPTS[2], max_new_tokens=4)).token_ids
