"""Limits on a real local cluster, through the real gRPC endpoint: a huge prompt is refused
without stalling the other streams, malformed messages answer INVALID_ARGUMENT, and past the
router's queue the proxy answers RESOURCE_EXHAUSTED at once.

One cluster of its own: the shipped local config with the tiny pair (conftest.write_config),
and a router that runs at most ROUTER_ONGOING requests with QUEUED more waiting, so that its
queue fills with a handful of streams.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from conftest import write_config
from local_service import serving

from specdec.client import build_request
from specdec.models.tiny import PROMPTS
from specdec.v1 import specdec_pb2

pytestmark = pytest.mark.integration
ROUTER_ONGOING = 3
QUEUED = 1
HUGE_PROMPT_BYTES = 5_000_000
# The target's generation_config sampling fields, and the service's default_max_tokens: what an
# HTTP request that leaves them out gets.
GENERATION = {"temperature": 0.5, "top_k": 4}
DEFAULT_MAX_TOKENS = 6


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_pair):
    """(gRPC client, OpenAI base URL): the tiny pair, its target a copy whose
    generation_config sets GENERATION, and HTTP requests' token limit DEFAULT_MAX_TOKENS."""
    pytest.importorskip("ray")
    tmp = tmp_path_factory.mktemp("limits")
    target = _with_generation_config(tiny_pair[1], tmp / "target")
    path, port = write_config(tmp, tiny_pair[0], target, default_max_tokens=DEFAULT_MAX_TOKENS)
    config = yaml.safe_load(path.read_text())
    for deployment in config["applications"][0]["deployments"]:
        if deployment["name"] == "SpeculativeRouter":
            deployment.update(max_ongoing_requests=ROUTER_ONGOING, max_queued_requests=QUEUED)
    path.write_text(yaml.safe_dump(config))
    with serving(tmp, path, port) as (client, _, _):
        yield client, f"http://127.0.0.1:{config['http_options']['port']}/v1"


@pytest.fixture(scope="module")
def client(service):
    return service[0]


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
    assert good.finish_reason in ("stop", "length")


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
            assert future.result()[-1].finish_reason in ("stop", "length")
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


def test_http_requests_take_the_targets_generation_config_and_default_max_tokens(service):
    """An HTTP request that sets no temperature, top_k, top_p or max_tokens samples with the
    target's generation_config values (temperature 0.5, top_k 4), top_p 1 (OpenAI's) and
    stops at default_max_tokens: token for token what gRPC gives with those values and seed.
    The same seeds at OpenAI's plain defaults (temperature 1, no top-k) give other text, so
    the comparison can tell the two apart."""
    import openai

    client, base_url = service
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as oai:
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
