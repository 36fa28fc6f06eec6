"""What the running Serve application holds, for integration tests: its RUNNING replicas, a
handle bound to a session, each replica's cache, its exported metrics, and a replica to kill."""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request

from specdec.client import build_request
from specdec.config import APPLICATION as APP
from specdec.models.tiny import PROMPTS


def running_replicas(deployment):
    """``deployment``'s RUNNING replicas (Serve's ReplicaDetails)."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    details = ServeInstanceDetails(**serve.context._get_global_client().get_serve_details())
    return [
        r
        for r in details.applications[APP].deployments[deployment].replicas
        if r.state == "RUNNING"
    ]


def handle(deployment, session_id=None):
    """A handle to ``deployment``, bound to ``session_id`` (routed as that session's calls)."""
    from ray import serve

    bound = serve.get_deployment_handle(deployment, APP)
    return bound.options(session_id=session_id) if session_id else bound


def per_replica(deployment, method):
    """{replica_id: (probe session, what ``method`` answered)} for ``deployment``'s RUNNING
    replicas, reaching each through a session key that hashes to it (those reached in 200
    tries)."""
    answers = {}
    for i in range(200):
        probe = handle(deployment, f"probe-{i}")
        replica = probe.replica_id.remote().result()
        if replica not in answers:
            answers[replica] = (f"probe-{i}", getattr(probe, method).remote().result())
        if len(answers) == len(running_replicas(deployment)):
            break
    return answers


def cache_stats_per_replica(deployment):
    """{replica_id: (probe session, CacheStats)} (see per_replica)."""
    return per_replica(deployment, "cache_stats")


def all_caches_empty():
    """Whether every draft and target replica holds no session and no cache bytes."""
    return all(
        s.sessions == 0 and s.bytes == 0
        for deployment in ("DraftModel", "TargetModel")
        for _, s in cache_stats_per_replica(deployment).values()
    )


def wait_until(predicate, timeout_s=20.0):
    """Polls ``predicate`` every 0.2 s; fails the test after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def kill(replica):
    """Kills a replica's actor for good (Serve starts a replacement)."""
    import ray

    ray.kill(ray.get_actor(replica.actor_name, namespace="serve"), no_restart=True)


def streams_survive_a_killed_target(client, reference, n=200):
    """Six concurrent greedy k = 1 streams; once each holds a cache, a target replica holding
    sessions is killed; asserts every output equals ``reference`` (the target alone) and that
    a surviving replica rebuilt at least one session. Needs two RUNNING target replicas."""
    wait_until(lambda: len(running_replicas("TargetModel")) == 2, timeout_s=60)
    prompts = PROMPTS[:6]
    streams = [
        client.generate_stream(build_request(p, max_new_tokens=n, num_speculative_tokens=1))
        for p in prompts
    ]
    firsts = [next(s) for s in streams]  # every session now holds a cache on some replica
    busy = {rid for rid, (_, s) in cache_stats_per_replica("TargetModel").items() if s.sessions}
    kill(next(r for r in running_replicas("TargetModel") if r.replica_id in busy))

    def rest(stream, first):
        return list(first.token_ids) + [t for m in stream for t in m.token_ids]

    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        outputs = list(pool.map(rest, streams, firsts))
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == reference(prompt, n)
    survivors = cache_stats_per_replica("TargetModel")
    assert sum(s.rebuilds for _, s in survivors.values()) >= 1


def scrape_metrics() -> str:
    """Every live node's Prometheus exposition (Ray's metrics agent), concatenated."""
    import ray

    text = ""
    for node in ray.nodes():
        if node["Alive"] and node.get("MetricsExportPort"):
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                text += response.read().decode()
    return text


def exported_names(text: str) -> set[str]:
    """Metric names of the samples in a Prometheus text exposition."""
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, flags=re.MULTILINE))


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in ``text`` whose labels include ``labels``."""
    total = 0.0
    for found, value in re.findall(rf"^{name}{{([^}}]*)}} (\S+)$", text, flags=re.MULTILINE):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', found))
        if all(pairs.get(key) == want for key, want in labels.items()):
            total += float(value)
    return total
