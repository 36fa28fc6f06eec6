"""Draft and target autoscale on their own load, and no request is lost or changed meanwhile.

Its own local cluster (a separate state dir), started and stopped by this module, so no other
module's damage (test_serving kills a node) can reach it. The model deployments scale at the
shipped target of ongoing requests per replica (local.yaml: a full batch, 8), with the delays
shrunk from minutes to seconds; the router at 3 (shipped 64: it would need hundreds of streams
on two cores), so that its scale-down, which drains live streams, happens in every run. Load
comes from specdec.bench.loadtest with Stages that end on a scaling event (``until``) rather
than after a guessed time.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import yaml
from local_service import LOCAL_CONFIG

from specdec import SamplingParams
from specdec.bench.loadtest import LoadTest, Stage, build_requests, run
from specdec.bench.soak import AUTOSCALING
from specdec.models.tiny import PROMPTS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the local cluster reads /proc"
    ),
]
DRAFT, TARGET, ROUTER = "DraftModel", "TargetModel", "SpeculativeRouter"
MAX_NEW_TOKENS = 48


def _shipped_target(name: str) -> int:
    """The shipped local config's target_ongoing_requests of deployment ``name``."""
    app = yaml.safe_load(LOCAL_CONFIG.read_text())["applications"][0]
    deployment = next(d for d in app["deployments"] if d["name"] == name)
    return deployment["autoscaling_config"]["target_ongoing_requests"]


# The soak's delays of seconds and 1..2 replicas each (AUTOSCALING); the models' shipped targets.
SCALING = {
    **AUTOSCALING,
    **{
        name: {**AUTOSCALING[name], "target_ongoing_requests": _shipped_target(name)}
        for name in (DRAFT, TARGET)
    },
}
# Three times a model replica's target (as 6 clients were at the soak's target of 2): the busy
# side then asks for 3 replicas and gets its maximum, 2.
CONCURRENCY = 3 * max(SCALING[name]["target_ongoing_requests"] for name in (DRAFT, TARGET))


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory, tiny_service):
    """(gRPC address, Ray address) of the tiny pair served with fast autoscaling."""
    # One session per forward: a replica's queue then grows with the load on its side, which
    # is what Serve's autoscaler reads. With batching, the draft's 8 steps for 6 sessions are 8
    # shared forwards, and whether it or the target queues more became a race (CI, stop 19).
    tmp = tmp_path_factory.mktemp("autoscaling")
    with tiny_service(tmp, SCALING, max_batch_size=1) as (_, info, address):
        yield address, info.address


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy target-only output of every prompt, computed before any load."""
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    return [engine.generate(prompt, params, 0).token_ids for prompt in PROMPTS]


LOADED = (1, 2)  # the stages of _load with CONCURRENCY clients


def _load(autoscaled, k: int, busy: str) -> dict:
    """Idle until every deployment has 1 replica; CONCURRENCY clients with speculative ``k``
    until ``busy`` has 2 RUNNING replicas, 4 s more on them; then 1 client until all are
    back to 1. Returns the report, with the LoadTest's results under "results"."""
    address, ray_address = autoscaled
    all_one = lambda r: set(r.values()) == {1}  # noqa: E731
    stages = [
        Stage(0, 60, until=all_one),
        Stage(CONCURRENCY, 60, until=lambda r: r.get(busy, 0) >= 2),
        Stage(CONCURRENCY, 4),
        Stage(1, 60, until=all_one),
    ]
    requests = build_requests(max_new_tokens=MAX_NEW_TOKENS, k=k)
    load = LoadTest(
        requests,
        address=address,
        request_timeout_s=60,
        drain_s=30,
        keep_outputs=True,
        progress=False,
    )
    report = asyncio.run(run(load, stages, ray_address))
    report["results"] = load.results
    return report


def _replicas(report, stages=None) -> dict[str, list[int]]:
    """{deployment: RUNNING count per second} over the run (or the given stages)."""
    rows = [r for r in report["per_second"] if stages is None or r["stage"] in stages]
    names = {name for r in rows for name in r["replicas"] or {}}
    return {name: [(r["replicas"] or {}).get(name, 0) for r in rows] for name in names}


def _explain(report) -> str:
    """Replica counts, in-flight requests per second and the summary: why nothing scaled."""
    in_flight = [r["in_flight"] for r in report["per_second"]]
    return f"replicas {_replicas(report)}; in flight {in_flight}; summary {report['summary']}"


def _check_no_loss_and_exact(report, reference) -> None:
    summary = report["summary"]
    assert not report["notes"], report["notes"]
    assert summary["errors"] == {} and summary["cut"] == 0, summary
    done = [r for r in report["results"] if r.code == "OK"]
    assert len(done) == summary["started"] > 20
    for result in done:
        assert result.token_ids == reference[result.prompt_index], result


def test_verification_only_load_scales_the_target_not_the_draft(autoscaled, reference):
    report = _load(autoscaled, k=0, busy=TARGET)  # k=0: rounds never call the draft
    counts = _replicas(report)
    assert max(_replicas(report, LOADED)[TARGET]) >= 2, _explain(report)
    assert counts[TARGET][-1] == 1, counts  # back to 1 after the load ended
    assert set(counts[DRAFT]) == {1}, counts
    _check_no_loss_and_exact(report, reference)


def test_speculative_load_scales_the_draft(autoscaled, reference):
    report = _load(autoscaled, k=8, busy=DRAFT)  # 8 draft steps per verify: the draft is busy
    counts = _replicas(report)
    assert max(_replicas(report, LOADED)[DRAFT]) >= 2, _explain(report)
    assert counts[DRAFT][-1] == 1, counts
    _check_no_loss_and_exact(report, reference)
