"""The static runner (runner: static, the default on a GPU) through the whole service on the
CPU: the replicas build their slot pools, report the context limit max_model_len sets, and
greedy output at every k equals the service's own k = 0, token for token and logprob for
logprob, alone and with concurrent requests sharing batched forwards (tiny pair, bfloat16)."""

from __future__ import annotations

import concurrent.futures
from array import array

import pytest

from specdec.client import build_request
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.integration
NEW_TOKENS = 48
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def static_service(tmp_path_factory, tiny_service):
    settings = {"runner": "static", "dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN}
    tmp = tmp_path_factory.mktemp("static")
    with tiny_service(tmp, target_replicas=1, **settings) as (client, _, _):
        yield client


def _run(client, prompt, k):
    request = build_request(
        prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=k, logprobs=True
    )
    response = client.generate(request)
    return list(response.token_ids), array("f", response.logprobs)


def test_the_replicas_report_the_static_context_limit(static_service):
    info = static_service.model_info()
    assert info.context_limit == MAX_MODEL_LEN
    assert info.target_context_limit == MAX_MODEL_LEN


def test_greedy_output_equals_the_services_k0_at_every_k(static_service):
    for prompt in PROMPTS[:4]:
        expected = _run(static_service, prompt, 0)
        assert len(expected[0]) == NEW_TOKENS
        for k in (2, 8, None):  # None: k auto
            assert _run(static_service, prompt, k) == expected, (prompt, k)


def test_concurrent_requests_get_what_each_gets_alone(static_service):
    alone = {prompt: _run(static_service, prompt, 3) for prompt in PROMPTS}
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _run(static_service, p, 3), PROMPTS))
    for prompt, result in zip(PROMPTS, together):
        assert result == alone[prompt], prompt
