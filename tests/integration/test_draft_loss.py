"""Losing the draft pool costs speed only, at the shipped timeouts (issue 44, item 0).

The shared cluster's timeouts are cut to seconds (conftest), and a request that waits out one
of them there passes unnoticed. This module runs a cluster of its own with the shipped local
config's timeouts (call 120 s, unavailable 180 s, draft 10 s, draft retry 1 s): with them a
fresh request after the draft node died took 120 s at k = 0 (its end waited for the draft's
release) and 240 s with k auto. Now each must answer within its undisturbed latency plus
SLACK_S, over gRPC and HTTP, and give the same tokens.
"""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest
from test_openai_api import http_base_url
from test_serving import _replicas, _wait_until

from specdec.client import build_request
from specdec.cluster.faults import kill_node
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.integration
SLACK_S = 5.0  # the bound over the undisturbed latency
NEW_TOKENS = 48
CASES = [("grpc", "auto"), ("grpc", 0), ("http", "auto"), ("http", 0)]


def _request(client, oai, model, api, k):
    """(seconds, output) of one greedy request: gRPC token ids, or HTTP text."""
    start = time.perf_counter()
    if api == "grpc":
        k_field = None if k == "auto" else k
        request = build_request(
            PROMPTS[5], max_new_tokens=NEW_TOKENS, num_speculative_tokens=k_field
        )
        output = list(client.generate(request).token_ids)
    else:
        answer = oai.completions.create(
            model=model,
            prompt=PROMPTS[5],
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"num_speculative_tokens": k},
        )
        output = answer.choices[0].text
    return time.perf_counter() - start, output


def _drain(stream):
    return [token for message in stream for token in message.token_ids]


def test_fresh_requests_after_the_draft_node_dies_answer_in_their_usual_time(
    tiny_service, tmp_path_factory, reference
):
    tmp = tmp_path_factory.mktemp("shipped-timeouts")
    with tiny_service(tmp, shipped_timeouts=True) as (client, info, _):
        _wait_until(lambda: len(_replicas("DraftModel")) == 1, timeout_s=90)
        with openai.OpenAI(base_url=http_base_url(), api_key="unused", max_retries=0) as oai:
            model = oai.models.list().data[0].id
            for case in CASES:  # warm-up: the first rounds measure the costs
                _request(client, oai, model, *case)
            before = {case: _request(client, oai, model, *case) for case in CASES}

            streams = [
                client.generate_stream(
                    build_request(p, max_new_tokens=200, num_speculative_tokens=4)
                )
                for p in PROMPTS[:3]
            ]
            firsts = [list(next(s).token_ids) for s in streams]
            kill_node(info.state_dir, "draft")
            with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
                rests = list(pool.map(_drain, streams))
            for prompt, first, rest in zip(PROMPTS[:3], firsts, rests):
                assert first + rest == reference(prompt, 200)

            for case in CASES:
                seconds, output = _request(client, oai, model, *case)
                assert output == before[case][1], case
                assert seconds <= before[case][0] + SLACK_S, (case, seconds, before[case][0])
            assert oai.models.list().data[0].id == model
