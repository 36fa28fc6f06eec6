"""The draft pool's node dies mid-request: requests go on with the target alone (issue 13, item 1).

Runs on the session's shared cluster (tests/integration/conftest.py: draft_timeout_s 3 s,
draft_retry_s 0.5 s) and leaves it as it found it: the draft node is started again and the test
waits until speculation resumes.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from test_serving import _replicas, _scrape_metrics, _wait_until

from specdec.client import build_request
from specdec.cluster.faults import kill_node, restart_node
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.integration
K = 3
NEW_TOKENS = 200


@pytest.fixture(scope="module")
def client(served):
    return served[0]


def _collect(stream, first):
    """(token ids, final stats) of a stream whose first message was already read."""
    tokens, last = list(first.token_ids), first
    for message in stream:
        tokens += message.token_ids
        last = message
    return tokens, last.stats


def _rounds_without_draft_exported() -> float:
    """The router's specdec_rounds_without_draft counter as Prometheus exports it (0 absent)."""
    total = 0.0
    for line in _scrape_metrics().splitlines():
        if line.startswith("ray_specdec_rounds_without_draft") and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_draft_node_killed_mid_request_degrades_then_speculation_resumes(client, served, reference):
    info = served[1]
    _wait_until(lambda: len(_replicas("DraftModel")) == 1, timeout_s=90)
    prompts = PROMPTS[:4]
    streams = [
        client.generate_stream(
            build_request(p, max_new_tokens=NEW_TOKENS, num_speculative_tokens=K)
        )
        for p in prompts
    ]
    firsts = [next(s) for s in streams]  # every session is running its rounds
    kill_node(info.state_dir, "draft")

    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        results = list(pool.map(_collect, streams, firsts))
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == reference(prompt, NEW_TOKENS)  # exact: OK, not an error, same tokens
    assert sum(stats.rounds_without_draft for _, stats in results) > 0

    # A new request while the draft pool has no node: it never needs the draft (n-gram lookup
    # may stand in for it; the draft model proposes nothing).
    request = build_request(PROMPTS[4], max_new_tokens=24, num_speculative_tokens=K)
    during = client.generate(request)
    assert list(during.token_ids) == reference(PROMPTS[4], 24)
    stats = during.stats
    assert stats.rounds_without_draft > 0 and stats.draft_tokens == stats.ngram_draft_tokens
    assert client.model_info().target_model  # the target side answers info without the draft

    restart_node(info.state_dir, "draft")
    _wait_until(lambda: len(_replicas("DraftModel")) == 1, timeout_s=180)
    deadline = time.monotonic() + 60
    while True:  # the router's background check lets the draft back within draft_retry_s x 2^n
        after = client.generate(request)
        assert list(after.token_ids) == reference(PROMPTS[4], 24)
        model_drafted = after.stats.draft_tokens - after.stats.ngram_draft_tokens
        if after.stats.rounds_without_draft == 0 and model_drafted > 0:
            break
        assert time.monotonic() < deadline, "speculation did not resume after the draft returned"
        time.sleep(0.5)
    _wait_until(lambda: _rounds_without_draft_exported() > 0, timeout_s=60)
