"""k8s/monitoring: the Grafana dashboard's PromQL parses and reads only metrics that specdec or
Ray Serve define; the PodMonitor scrapes a port every Ray container names, through the
NetworkPolicy; the router's metrics follow Prometheus naming. No cluster, no Ray."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import dashboard
import pytest
import yaml
from test_k8s_manifests import K8S, KUSTOMIZATIONS, render

from specdec.decoding.stats import SpeculationStats
from specdec.deployments import metrics as metrics_module

MONITORING = K8S / "monitoring"
# Ray Serve's own metrics that the dashboard reads, each with the module that registers it.
RAY_SERVE_METRICS = {"ray_serve_deployment_replica_healthy": "ray.serve._private.deployment_state"}


class FakeMetric:
    """Stands in for ray.serve.metrics' Counter / Gauge / Histogram: keeps what was recorded."""

    def __init__(self, kind: str, name: str, description: str = "", **options) -> None:
        self.kind, self.name, self.options, self.records = kind, name, options, []

    def inc(self, value=1.0, tags=None):
        assert value > 0, f"{self.name}: Ray refuses an increment of {value}"
        self.records.append((value, tags or {}))

    def observe(self, value, tags=None):
        self.records.append((value, tags or {}))

    set = observe

    def total(self, **tags) -> float:
        return sum(v for v, t in self.records if tags.items() <= t.items())

    def exported(self) -> set[str]:
        """The names Ray's exporter gives this metric in Prometheus."""
        name = f"ray_{self.name}"
        if self.kind == "Counter":
            return {f"{name}_total"}
        if self.kind == "Histogram":
            return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        return {name}


@pytest.fixture
def fake_metrics(monkeypatch):
    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(
            metrics_module.metrics,
            kind,
            lambda *args, _kind=kind, **kwargs: FakeMetric(_kind, *args, **kwargs),
        )


def _defined(*owners) -> dict[str, FakeMetric]:
    return {m.name: m for owner in owners for m in vars(owner).values()}


# --- the dashboard ------------------------------------------------------------------------------


def test_every_dashboard_query_parses_as_promql():
    board = dashboard.load()
    exprs = dashboard.queries(board)
    assert len(exprs) >= 15
    defined = {v["name"] for v in board["templating"]["list"]} | set(dashboard.GRAFANA_BUILTINS)
    for expr in exprs:
        assert dashboard.variables_used(expr) <= defined, expr
        assert dashboard.metric_names(dashboard.substitute(expr, board)), expr


def test_the_parser_rejects_what_prometheus_rejects():
    assert dashboard.metric_names("sum by (le) (rate(a_bucket[5m])) / b") == {"a_bucket", "b"}
    for bad in ("sum(rate(a_total[5m])", "rate(a_total)", "histogram_quantile(0.9 a_bucket)"):
        with pytest.raises(ValueError):
            dashboard.metric_names(bad)


def test_dashboard_reads_only_metrics_that_specdec_or_ray_serve_define(fake_metrics):
    defined = _defined(metrics_module.RouterMetrics(), metrics_module.ReplicaMetrics())
    exported = set().union(*(m.exported() for m in defined.values()))
    used = dashboard.dashboard_metric_names()
    ours = {n for n in used if n.startswith("ray_specdec_")}
    assert ours <= exported, sorted(ours - exported)
    for name in used - ours:
        module = importlib.util.find_spec(RAY_SERVE_METRICS[name])
        assert f'"{name.removeprefix("ray_")}"' in Path(module.origin).read_text(), name


def test_dashboard_covers_what_a_team_watches():
    used = dashboard.dashboard_metric_names()
    exprs = " ".join(dashboard.queries(dashboard.load()))
    for name in (
        "ray_specdec_ttft_seconds_bucket",  # TTFT percentiles
        "ray_specdec_request_latency_seconds_bucket",  # latency percentiles
        "ray_specdec_completion_tokens_total",  # tokens/s
        "ray_specdec_accepted_tokens_total",  # acceptance rate
        "ray_specdec_accepted_tokens_per_position_total",  # ... per position
        "ray_specdec_decode_rounds_total",  # mean k
        "ray_specdec_rounds_total",  # rounds/s
        "ray_serve_deployment_replica_healthy",  # replicas per deployment
        "ray_specdec_cache_bytes",
        "ray_specdec_cache_sessions",
        "ray_specdec_requests_total",  # errors by code
        "ray_specdec_batch_size_bucket",  # sessions per batch (issue 12)
        "ray_specdec_batch_size_sum",
        "ray_specdec_batch_wait_seconds_bucket",  # batch wait
    ):
        assert name in used, name
    assert "histogram_quantile(0.99" in exprs and 'code!="OK"' in exprs


# --- metric names and what the router records ---------------------------------------------------


def test_metric_names_follow_prometheus_conventions(fake_metrics):
    defined = _defined(metrics_module.RouterMetrics(), metrics_module.ReplicaMetrics())
    for name, metric in defined.items():
        assert name.startswith("specdec_"), name
        assert not name.endswith(("_total", "_s", "_ms")), f"{name}: Ray appends _total itself"
        # A histogram has a unit (seconds), or counts something its name says: tokens, or
        # sessions per batch (the specdec_batch_size).
        if metric.kind == "Histogram" and "tokens" not in name and name != "specdec_batch_size":
            assert name.endswith("_seconds"), name
    assert defined["specdec_cache_bytes"].kind == "Gauge"
    for name in ("specdec_drafts", "specdec_draft_tokens", "specdec_accepted_tokens"):
        assert defined[name].kind == "Counter"  # vLLM's num_drafts, num_draft_tokens, ...
    assert defined["specdec_accepted_tokens_per_position"].options["tag_keys"] == ("position",)


def test_router_records_the_stats_raw_counts(fake_metrics):
    # A prefill and 4 decode rounds drafting 3, 3, 2, 0 tokens and accepting 3, 1, 0, 0.
    stats = SpeculationStats(
        rounds=5,
        draft_tokens=8,
        accepted_tokens=4,
        accepted_per_position=[2, 1, 1, 0],
        drafted_per_position=[3, 3, 2, 0],
        ttft_s=0.5,
        completion_tokens=9,
        wall_time_s=2.0,
    )
    router = metrics_module.RouterMetrics()
    router.record_completion(stats, latency_s=2.0)
    assert router.rounds.total() == 5 and router.decode_rounds.total() == 4
    assert router.drafts.total() == stats.drafting_rounds == 3
    assert router.draft_tokens.total() == 8 and router.accepted_tokens.total() == 4
    assert router.completion_tokens.total() == 9
    for position, (drafted, accepted) in enumerate([(3, 2), (3, 1), (2, 1), (0, 0)]):
        assert router.draft_tokens_per_position.total(position=str(position)) == drafted
        assert router.accepted_tokens_per_position.total(position=str(position)) == accepted
    # The figures a dashboard derives from the counters are the stats' own.
    assert router.draft_tokens.total() / router.decode_rounds.total() == stats.mean_k
    assert router.accepted_tokens.total() / router.draft_tokens.total() == stats.acceptance_rate
    assert router.tokens_per_round.records == [(stats.mean_accepted_tokens, {})]
    assert router.ttft.records == [(0.5, {})] and router.request_latency.records == [(2.0, {})]

    prefill_only = metrics_module.RouterMetrics()
    prefill_only.record_completion(SpeculationStats(rounds=1, completion_tokens=1), 0.1)
    assert prefill_only.drafts.records == [] and prefill_only.round_latency.records == []
    assert prefill_only.proposed_tokens.records == [] and prefill_only.ngram_rounds.records == []


def test_router_counts_proposed_and_accepted_tokens_by_proposer(fake_metrics):
    # 4 decode rounds: the draft model proposed 3 and 2 tokens (3 accepted), n-gram lookup 4
    # and 1 in two rounds (2 accepted).
    stats = SpeculationStats(
        rounds=5,
        draft_tokens=10,
        accepted_tokens=5,
        accepted_per_position=[3, 2, 0, 0],
        drafted_per_position=[4, 3, 2, 1],
        completion_tokens=9,
        ngram_rounds=2,
        ngram_draft_tokens=5,
        ngram_accepted_tokens=2,
    )
    router = metrics_module.RouterMetrics()
    router.record_completion(stats, latency_s=1.0)
    assert router.proposed_tokens.total(proposer="draft") == 5
    assert router.proposed_tokens.total(proposer="ngram") == 5
    assert router.proposed_accepted_tokens.total(proposer="draft") == 3
    assert router.proposed_accepted_tokens.total(proposer="ngram") == 2
    assert router.ngram_rounds.total() == 2
    # The totals stay every proposer's, and the split adds up to them.
    assert router.draft_tokens.total() == router.proposed_tokens.total() == 10
    assert router.accepted_tokens.total() == router.proposed_accepted_tokens.total() == 5
    assert router.proposed_tokens.options["tag_keys"] == ("proposer",)

    draft_only = metrics_module.RouterMetrics()
    no_ngram = {"ngram_rounds": 0, "ngram_draft_tokens": 0, "ngram_accepted_tokens": 0}
    draft_only.record_completion(dataclasses.replace(stats, **no_ngram), 1.0)
    assert {t["proposer"] for _, t in draft_only.proposed_tokens.records} == {"draft"}
    assert draft_only.ngram_rounds.records == []


# --- PodMonitor, NetworkPolicy, kustomization -------------------------------------------------


def _monitoring_docs() -> list[dict]:
    return list(yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text()))


def test_podmonitor_is_well_formed():
    (monitor,) = _monitoring_docs()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert set(monitor["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector"}
    assert monitor["spec"]["selector"]["matchLabels"]
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "relabelings"}
        assert endpoint["path"] == "/metrics"
        for rule in endpoint.get("relabelings", []):
            assert set(rule) <= {"sourceLabels", "targetLabel"}
            assert all(label.startswith("__meta_kubernetes_pod_") for label in rule["sourceLabels"])


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_podmonitor_scrapes_every_ray_pod_through_the_networkpolicy(kustomization):
    (monitor,) = _monitoring_docs()
    # The NetworkPolicy of every Ray pod is `specdec` (the head has an egress one of its own).
    docs = {
        d["kind"]: d
        for d in render(K8S / kustomization)
        if d["kind"] != "NetworkPolicy" or d["metadata"]["name"] == "specdec"
    }
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]
    ]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    numbers = set()
    for pod in pods:
        assert (
            monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        )
        ray = pod["spec"]["containers"][0]
        ports = {p.get("name"): p["containerPort"] for p in ray.get("ports", [])}
        assert endpoint["port"] in ports, ray["name"]
        numbers.add(ports[endpoint["port"]])
    assert numbers == {8080}  # Ray's metrics export port (KubeRay's default)
    policy = docs["NetworkPolicy"]["spec"]
    admitted = [
        rule
        for rule in policy["ingress"]
        if any(p["port"] == 8080 for p in rule.get("ports", []))
        and any(
            peer.get("namespaceSelector", {})
            .get("matchLabels", {})
            .get("kubernetes.io/metadata.name")
            == "monitoring"
            for peer in rule.get("from", [])
        )
    ]
    assert admitted, "no NetworkPolicy rule admits Prometheus to the metrics port"


def test_monitoring_kustomization_ships_the_podmonitor_and_the_dashboard():
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["podmonitor.yaml"]
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == [dashboard.DASHBOARD.name]
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
    for path in kustomization["resources"] + generator["files"]:
        assert (MONITORING / path).is_file(), path
