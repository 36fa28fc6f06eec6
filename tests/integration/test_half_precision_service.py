"""Bitwise exact after a replica loss in half precision (issue 11, item 2), through the
multi-width code (issue 46, item 2): the tiny pair served in bfloat16 with a target whose exact
widths form several sets (tests/width_sets.py, installed in the TargetModel replicas by
tests/width_set_site/sitecustomize.py; the tiny target's own bfloat16 calibration keeps a single
width). A target replica holding sessions is killed mid-request, the sessions are rebuilt on
the other replica (which reused the first one's start-up calibration after its own exactness
check) and continue with the same token ids and logprobs as the undisturbed run, which equals
the service's target alone (k = 0). Both sides prefill in chunks of 8 tokens
(models.prefill_chunk_tokens; the prompts are 9-20 tokens), so the rebuilt sessions replay
chunked prefills too.

The reference is the service's own k = 0, not an engine in this process: in half precision a
row's result depends on the width it is padded to, and a process that measures its own exact
width may pick another one. This process runs two threads and the replicas one, so their
calibrations have different keys; on the AMX Xeon, where bfloat16 costs the same at every
width, the two picked different widths, and a logprob differed in the 5th significant digit
(-3.84470 against -3.84481) with the tokens equal."""

from __future__ import annotations

import concurrent.futures
from array import array

import pytest
from serve_state import cache_stats_per_replica as _cache_stats_per_replica
from serve_state import kill as _kill
from serve_state import metric_total, scrape_metrics
from serve_state import running_replicas as _replicas
from serve_state import wait_until as _wait_until
from width_sets import service_env, set_of

from specdec.client import build_request
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.integration
DTYPE = "bfloat16"
NEW_TOKENS = 160
CASES = [(prompt, k) for prompt, k in zip(PROMPTS[:6], [3, None, 3, None, 1, 3])]
CHUNK = 8
CHUNKS_METRIC = "ray_specdec_prefill_chunks_total"


@pytest.fixture(scope="module")
def half_service(tmp_path_factory, tiny_service, tiny_pair):
    tmp = tmp_path_factory.mktemp("bf16")
    env = service_env(tiny_pair[1], tmp / "calibrations")
    # At the shipped timeouts: a killed replica's calls fail at once and are retried.
    args = {"dtype": DTYPE, "target_env": env, "prefill_chunk_tokens": CHUNK}
    with tiny_service(tmp, **args) as (client, _, _):
        yield client


def test_the_target_pads_to_several_widths_of_one_set(half_service):
    calibration = half_service.model_info().target_calibration
    assert calibration.dtype == DTYPE
    widths = list(calibration.exact_widths)
    assert len(widths) > 1, calibration  # its candidates' costs tell a lost set from noise
    assert len({set_of(w) for w in widths}) == 1


@pytest.fixture(scope="module")
def target_alone(half_service):
    """Each prompt's (token ids, wire logprobs) through the service at k = 0."""
    responses = {p: half_service.generate(_request(p, 0)) for p, _ in CASES}
    return {p: (list(r.token_ids), _f32(r.logprobs)) for p, r in responses.items()}


def _request(prompt, k):
    return build_request(prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=k, logprobs=True)


def _f32(values):
    """The wire's float32 values (a logprob crosses gRPC as a float)."""
    return array("f", values)


def test_killed_half_precision_target_replica_continues_bitwise(half_service, target_alone):
    client = half_service
    _wait_until(lambda: len(_replicas("TargetModel")) == 2, timeout_s=90)
    undisturbed = {}
    for prompt, k in CASES:
        response = client.generate(_request(prompt, k))
        tokens, logprobs = target_alone[prompt]
        assert list(response.token_ids) == tokens
        assert _f32(response.logprobs) == logprobs
        undisturbed[prompt] = (list(response.token_ids), _f32(response.logprobs))

    streams = [client.generate_stream(_request(prompt, k)) for prompt, k in CASES]
    firsts = [next(s) for s in streams]  # every session now holds a cache on some replica
    busy = {rid for rid, (_, s) in _cache_stats_per_replica("TargetModel").items() if s.sessions}
    _kill(next(r for r in _replicas("TargetModel") if r.replica_id in busy))

    def rest(stream, first):
        tokens, logprobs = list(first.token_ids), list(first.logprobs)
        for message in stream:
            tokens += message.token_ids
            logprobs += message.logprobs
        return tokens, _f32(logprobs)

    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        disturbed = list(pool.map(rest, streams, firsts))
    for (prompt, _), (tokens, logprobs) in zip(CASES, disturbed):
        assert tokens == undisturbed[prompt][0]
        assert logprobs == undisturbed[prompt][1]
    survivors = _cache_stats_per_replica("TargetModel")
    assert sum(s.rebuilds for _, s in survivors.values()) >= 1


def test_both_sides_prefilled_the_prompts_in_chunks(half_service, target_alone, tiny_pair):
    # The k = 0 requests alone ran each prompt's chunks ahead of its last one on the target;
    # the speculative ones (the kill test's) on the draft too.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_pair[1]))
    ahead = sum((len(tokenizer.encode(prompt)) - 1) // CHUNK for prompt, _ in CASES)
    assert ahead >= len(CASES)

    def chunks(deployment):
        return metric_total(scrape_metrics(), CHUNKS_METRIC, deployment=deployment)

    _wait_until(lambda: chunks("TargetModel") >= ahead, timeout_s=60)
    _wait_until(lambda: chunks("DraftModel") >= 1, timeout_s=60)
