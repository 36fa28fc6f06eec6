"""Prometheus metrics of the deployments, through Ray Serve's metrics API.

Names follow Prometheus conventions once exported: Ray's exporter prefixes ``ray_`` and appends
``_total`` to counters, so the counter registered here as ``specdec_accepted_tokens`` is queried
as ``ray_specdec_accepted_tokens_total``, and the histogram ``specdec_ttft_seconds`` as
``ray_specdec_ttft_seconds_bucket`` / ``_sum`` / ``_count``. Counters are therefore registered
without ``_total``; units are part of the name (``_seconds``, ``_bytes``). ray.serve.metrics adds
the ``deployment``, ``replica`` and ``application`` tags itself.

The speculation counters cover vLLM's spec-decode metrics (num_drafts, num_draft_tokens,
num_accepted_tokens, num_accepted_tokens_per_pos); with ``specdec_decode_rounds`` every derived
figure of specdec.decoding.stats is a ratio of two counters' rates, e.g. acceptance rate =
accepted_tokens / draft_tokens and mean k = draft_tokens / decode_rounds. Those count every
proposer's tokens; ``specdec_proposed_tokens`` and ``specdec_proposed_accepted_tokens`` split them
by the tag ``proposer`` (``draft``: the draft model, ``ngram``: n-gram lookup in the router),
``specdec_ngram_rounds`` counts the decode rounds n-gram lookup proposed, and
``specdec_mixed_rounds`` those that verified lookup's tokens after the draft model's.
``specdec_overlapped_rounds`` and ``specdec_wasted_draft_tokens`` count pipelined drafting's
overlap and its waste; ``specdec_replica_calls`` splits the propose and verify calls by path
(``direct`` over a lease, ``serve`` through a handle) and ``specdec_direct_call_failures`` counts
the direct calls that fell back to Serve.
k8s/monitoring/grafana-dashboard.json plots them.
"""

from __future__ import annotations

from collections.abc import Mapping

from ray.serve import metrics

from specdec.decoding.stats import SpeculationStats

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
BATCH_BOUNDARIES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


class RouterMetrics:
    """Per-request and per-round metrics recorded by the router."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "specdec_requests",
            "Finished requests by method and status code.",
            tag_keys=("method", "code"),
        )
        self.rounds = metrics.Counter(
            "specdec_rounds", "Speculative rounds (target forward passes), prefills included."
        )
        self.decode_rounds = metrics.Counter(
            "specdec_decode_rounds", "Rounds after the prefill, each drafting 0 to k_max tokens."
        )
        self.drafts = metrics.Counter(
            "specdec_drafts", "Decode rounds that drafted at least one token."
        )
        self.draft_tokens = metrics.Counter(
            "specdec_draft_tokens", "Tokens proposed, by every proposer."
        )
        self.accepted_tokens = metrics.Counter(
            "specdec_accepted_tokens", "Proposed tokens accepted by the target."
        )
        self.proposed_tokens = metrics.Counter(
            "specdec_proposed_tokens",
            "Tokens proposed by `proposer` (draft: the draft model, ngram: n-gram lookup).",
            tag_keys=("proposer",),
        )
        self.proposed_accepted_tokens = metrics.Counter(
            "specdec_proposed_accepted_tokens",
            "Tokens proposed by `proposer` and accepted by the target.",
            tag_keys=("proposer",),
        )
        self.ngram_rounds = metrics.Counter(
            "specdec_ngram_rounds", "Decode rounds whose proposal came from n-gram lookup."
        )
        self.mixed_rounds = metrics.Counter(
            "specdec_mixed_rounds",
            "Decode rounds that verified n-gram lookup's tokens after the draft model's.",
        )
        self.draft_tokens_per_position = metrics.Counter(
            "specdec_draft_tokens_per_position",
            "Decode rounds that drafted a token at draft position `position` (0-based).",
            tag_keys=("position",),
        )
        self.accepted_tokens_per_position = metrics.Counter(
            "specdec_accepted_tokens_per_position",
            "Decode rounds whose draft token at position `position` (0-based) was accepted.",
            tag_keys=("position",),
        )
        self.completion_tokens = metrics.Counter(
            "specdec_completion_tokens", "Tokens generated, after stop trimming."
        )
        self.rounds_without_draft = metrics.Counter(
            "specdec_rounds_without_draft",
            "Decode rounds that could not call the draft model because the draft side was "
            "unavailable or failed (n-gram proposals where the text had a match, else k = 0).",
        )
        self.overlapped_rounds = metrics.Counter(
            "specdec_overlapped_rounds",
            "Decode rounds whose draft tokens were drafted while the previous round verified "
            "(speculation.pipelined_drafting).",
        )
        self.wasted_draft_tokens = metrics.Counter(
            "specdec_wasted_draft_tokens",
            "Tokens pipelined drafts drafted that no round verified (their guess was wrong).",
        )
        self.replica_calls = metrics.Counter(
            "specdec_replica_calls",
            "Propose (side draft) and verify (side target) calls by `path`: direct, over the "
            "session's lease (service.direct_calls), or serve, through a Serve handle.",
            tag_keys=("side", "path"),
        )
        self.direct_call_failures = metrics.Counter(
            "specdec_direct_call_failures",
            "Direct calls and lease openings on `side` that failed; the call went through Serve.",
            tag_keys=("side",),
        )
        self.draft_available = metrics.Gauge(
            "specdec_draft_available",
            "1 while this router calls the draft side, 0 while it runs rounds on the target "
            "alone after a draft failure.",
        )
        self.tokens_per_round = metrics.Histogram(
            "specdec_tokens_per_round",
            "Per request: tokens committed per decode round, bonus included.",
            boundaries=TOKENS_BOUNDARIES,
        )
        self.round_latency = metrics.Histogram(
            "specdec_round_latency_seconds",
            "Per request: seconds per decode round, split into draft, verify and orchestration.",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("part",),
        )
        self.ttft = metrics.Histogram(
            "specdec_ttft_seconds", "Time to first token, seconds.", boundaries=LATENCY_BOUNDARIES_S
        )
        self.request_latency = metrics.Histogram(
            "specdec_request_latency_seconds",
            "Request latency, seconds.",
            boundaries=LATENCY_BOUNDARIES_S,
        )

    def record_request(self, method: str, code: str) -> None:
        self.requests.inc(tags={"method": method, "code": code})

    def record_completion(self, stats: SpeculationStats, latency_s: float) -> None:
        """Adds one finished request's SpeculationStats and its latency (seconds).

        Counters take the stats' raw counts (Ray's counters refuse increments of 0, so a zero
        count adds nothing); the draft model's share of the proposed and accepted tokens is the
        total less n-gram lookup's. Tokens per round and the per-round seconds are the stats'
        figures per decode round; a request without a decode round adds to neither histogram.
        """
        for counter, value in (
            (self.rounds, stats.rounds),
            (self.decode_rounds, stats.decode_rounds),
            (self.drafts, stats.drafting_rounds),
            (self.draft_tokens, stats.draft_tokens),
            (self.accepted_tokens, stats.accepted_tokens),
            (self.completion_tokens, stats.completion_tokens),
            (self.rounds_without_draft, stats.rounds_without_draft),
            (self.ngram_rounds, stats.ngram_rounds),
            (self.mixed_rounds, stats.mixed_rounds),
            (self.overlapped_rounds, stats.overlapped_rounds),
            (self.wasted_draft_tokens, stats.wasted_draft_tokens),
        ):
            _add(counter, value)
        for proposer, proposed, accepted in (
            (
                "draft",
                stats.draft_tokens - stats.ngram_draft_tokens,
                stats.accepted_tokens - stats.ngram_accepted_tokens,
            ),
            ("ngram", stats.ngram_draft_tokens, stats.ngram_accepted_tokens),
        ):
            tags = {"proposer": proposer}
            _add(self.proposed_tokens, proposed, tags)
            _add(self.proposed_accepted_tokens, accepted, tags)
        for position, (drafted, accepted) in enumerate(
            zip(stats.drafted_per_position, stats.accepted_per_position)
        ):
            tags = {"position": str(position)}
            _add(self.draft_tokens_per_position, drafted, tags)
            _add(self.accepted_tokens_per_position, accepted, tags)
        if stats.decode_rounds:
            self.tokens_per_round.observe(stats.mean_accepted_tokens)
            for part, seconds in (
                ("draft", stats.draft_s_per_round),
                ("verify", stats.verify_s_per_round),
                ("orchestration", stats.orchestration_s_per_round),
            ):
                self.round_latency.observe(seconds, tags={"part": part})
        self.ttft.observe(stats.ttft_s)
        self.request_latency.observe(latency_s)

    def record_calls(
        self, paths: Mapping[tuple[str, str], int], failures: Mapping[str, int]
    ) -> None:
        """Adds one request's calls: {(side, path): calls} and {side: failed direct calls}."""
        for (side, path), calls in paths.items():
            _add(self.replica_calls, calls, {"side": side, "path": path})
        for side, failed in failures.items():
            _add(self.direct_call_failures, failed, {"side": side})


class ReplicaMetrics:
    """Cache occupancy, compute time and batching of a draft or target replica."""

    def __init__(self) -> None:
        self.sessions = metrics.Gauge(
            "specdec_cache_sessions", "Sessions held in the KV cache LRU."
        )
        self.cache_bytes = metrics.Gauge("specdec_cache_bytes", "Bytes of KV cache held.")
        self.rebuilds = metrics.Counter(
            "specdec_cache_rebuilds", "Calls that missed and made the router resend."
        )
        self.compute = metrics.Histogram(
            "specdec_compute_seconds",
            "Model compute per call, seconds.",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("method",),
        )
        self.batch_size = metrics.Histogram(
            "specdec_batch_size",
            "Sessions per batched model call (a batch of 1 ran alone).",
            boundaries=BATCH_BOUNDARIES,
            tag_keys=("method",),
        )
        self.deferred = metrics.Counter(
            "specdec_prefills_deferred",
            "Prefill calls a batch left to the next one (past models.batch_prefill_s).",
        )
        self.prefill_chunks = metrics.Counter(
            "specdec_prefill_chunks",
            "Chunks of long prompts prefilled ahead of their last one "
            "(models.prefill_chunk_tokens); other sessions' rows run between them.",
        )
        self.batch_wait = metrics.Histogram(
            "specdec_batch_wait_seconds",
            "Seconds a call waited from its arrival to the start of its batch.",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("method",),
        )
        self.failed_batches = metrics.Counter(
            "specdec_failed_batches",
            "Batches whose forwards raised (models.max_forward_failures in a row fail health).",
        )
        self.refused = metrics.Counter(
            "specdec_calls_refused",
            "Calls refused while the replica's compute path was stuck or failing.",
        )


def _add(counter: metrics.Counter, value: int, tags: dict[str, str] | None = None) -> None:
    if value > 0:
        counter.inc(value, tags=tags)
