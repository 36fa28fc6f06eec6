"""Prometheus metrics of the deployments, through Ray Serve's metrics API.

Names carry the ``specdec_`` prefix; Ray's exporter adds ``ray_`` (and ``_total`` to counters),
so a dashboard queries e.g. ``ray_specdec_accepted_tokens_total``. ray.serve.metrics adds the
``deployment``, ``replica`` and ``application`` tags itself.
"""

from __future__ import annotations

from ray.serve import metrics

LATENCY_BOUNDARIES_S = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
]
TOKENS_BOUNDARIES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17]


class RouterMetrics:
    """Per-request and per-round metrics recorded by the router."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "specdec_requests",
            "Finished requests by method and gRPC status.",
            tag_keys=("method", "code"),
        )
        self.rounds = metrics.Counter(
            "specdec_rounds", "Speculative rounds (target forward passes)."
        )
        self.draft_tokens = metrics.Counter(
            "specdec_draft_tokens", "Tokens proposed by the draft model."
        )
        self.accepted_tokens = metrics.Counter(
            "specdec_accepted_tokens", "Draft tokens accepted by the target."
        )
        self.tokens_per_round = metrics.Histogram(
            "specdec_accepted_tokens_per_round",
            "Tokens committed per round, bonus included.",
            boundaries=TOKENS_BOUNDARIES,
        )
        self.round_latency = metrics.Histogram(
            "specdec_round_latency_s",
            "Seconds per round, split into draft, verify and orchestration.",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("part",),
        )
        self.ttft = metrics.Histogram(
            "specdec_ttft_s", "Time to first token, seconds.", boundaries=LATENCY_BOUNDARIES_S
        )
        self.request_latency = metrics.Histogram(
            "specdec_request_latency_s",
            "Request latency, seconds.",
            boundaries=LATENCY_BOUNDARIES_S,
        )

    def record_request(self, method: str, code: str) -> None:
        self.requests.inc(tags={"method": method, "code": code})

    def record_completion(self, stats, latency_s: float) -> None:
        """Adds one finished request's SpeculationStats."""
        decode_rounds = max(stats.rounds - 1, 0)
        self.rounds.inc(stats.rounds)
        if stats.draft_tokens:
            self.draft_tokens.inc(stats.draft_tokens)
        if stats.accepted_tokens:
            self.accepted_tokens.inc(stats.accepted_tokens)
        self.tokens_per_round.observe(stats.mean_accepted_tokens)
        if decode_rounds:
            for part, seconds in (
                ("draft", stats.draft_time_s),
                ("verify", stats.verify_time_s),
                ("orchestration", stats.overhead_time_s),
            ):
                self.round_latency.observe(
                    seconds / stats.rounds if part != "orchestration" else seconds / decode_rounds,
                    tags={"part": part},
                )
        self.ttft.observe(stats.ttft_s)
        self.request_latency.observe(latency_s)


class ReplicaMetrics:
    """Cache occupancy of a draft or target replica."""

    def __init__(self) -> None:
        self.sessions = metrics.Gauge(
            "specdec_cache_sessions", "Sessions held in the KV cache LRU."
        )
        self.cache_bytes = metrics.Gauge("specdec_cache_bytes", "Bytes of KV cache held.")
        self.rebuilds = metrics.Counter(
            "specdec_cache_rebuilds", "Calls that missed and made the router resend."
        )
        self.compute = metrics.Histogram(
            "specdec_compute_s",
            "Model compute per call, seconds.",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("method",),
        )
