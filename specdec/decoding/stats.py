"""Speculation statistics: raw counters per request, each derived figure defined once.

SpeculationStats holds only what was counted or timed. Every figure computed from those counts
(acceptance rate, tokens per decode round, mean k, tokens per second, per-round costs) is a
property here, and the service, the router's metrics and the benchmarks all read it from here.
Stats of many requests add up counter by counter (``a + b``, ``SpeculationStats.total``), so a
figure of a sum is computed exactly as for one request: a ratio of sums, never a mean of ratios.

Every request starts with a prefill round: one target forward pass over the prompt that commits
the first token and drafts nothing. The figures "per round" are per DECODE round (the rounds
after the prefill, which draft and verify); the prefill's compute is kept apart
(``prefill_draft_time_s``, ``prefill_verify_time_s``) so it can be taken out of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable

from specdec.v1 import specdec_pb2

_PER_POSITION = ("accepted_per_position", "drafted_per_position")


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; 0.0 when there is nothing to divide by."""
    return numerator / denominator if denominator > 0 else 0.0


@dataclasses.dataclass
class SpeculationStats:
    """What speculation did for one request, or for several added together.

    All fields are raw counters; for a sum each is the total over the requests.

    Attributes:
        rounds: target forward passes, one prefill per request included (it commits the first
            token).
        draft_tokens: tokens proposed, by the draft model and by n-gram lookup together.
        accepted_tokens: proposed tokens the target accepted (0 <= accepted <= drafted).
        accepted_per_position: decode rounds whose draft token at position i (0-based) was
            accepted; non-increasing in i, length k_max.
        drafted_per_position: decode rounds that drafted a token at position i (0-based).
        draft_time_s, verify_time_s: compute seconds reported by the draft and target models,
            the prefill included.
        overhead_time_s: decode-round seconds spent outside the models (transport, scheduling,
            stop checks); the prefill round is not included.
        prefill_draft_time_s, prefill_verify_time_s: the prefill's share of draft_time_s and
            verify_time_s, seconds.
        ttft_s: seconds from the request's start to its first token (for a sum: the requests'
            ttft_s added, so that wall_time_s - ttft_s stays the decode phase's seconds).
        completion_tokens: tokens of the completion, after stop trimming.
        wall_time_s: seconds from the request's start to its end.
        requests: requests counted (1 for one request's stats, 0 for an empty sum); each had
            exactly one prefill round among ``rounds``.
        rounds_without_draft: decode rounds that would have drafted but could not call the
            draft model because the draft side was unavailable or failed
            (specdec.decoding.degrade): they ran on n-gram proposals where the request's text
            had a match, else at k = 0; the output is still exact, only slower.
        ngram_rounds, ngram_draft_tokens, ngram_accepted_tokens: decode rounds whose proposal
            came from n-gram lookup (specdec.decoding.ngram), and the share of draft_tokens
            and accepted_tokens that lookup proposed (in those rounds and in mixed ones); the
            draft model's share is the difference.
        mixed_rounds: decode rounds that verified n-gram tokens after the draft model's
            (specdec.decoding.proposers, ProposerChoice.tail).
        overlapped_rounds: decode rounds whose draft tokens were drafted while the previous
            round verified (pipelined drafting): they made no draft call of their own.
        wasted_draft_tokens: tokens pipelined drafts drafted that no round verified (the
            previous round was not accepted whole, or its bonus token was not the draft's
            guess, or the request ended).
    """

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    overhead_time_s: float = 0.0
    prefill_draft_time_s: float = 0.0
    prefill_verify_time_s: float = 0.0
    ttft_s: float = 0.0
    completion_tokens: int = 0
    wall_time_s: float = 0.0
    requests: int = 1
    rounds_without_draft: int = 0
    ngram_rounds: int = 0
    ngram_draft_tokens: int = 0
    ngram_accepted_tokens: int = 0
    mixed_rounds: int = 0
    overlapped_rounds: int = 0
    wasted_draft_tokens: int = 0

    # --- derived figures: the only definitions --------------------------------------------

    @property
    def decode_rounds(self) -> int:
        """Rounds after the prefills: rounds - requests (never below 0)."""
        return max(self.rounds - self.requests, 0)

    @property
    def drafting_rounds(self) -> int:
        """Decode rounds that drafted at least one token (vLLM's "drafts"): every such round
        drafted position 0, so drafted_per_position[0]; 0 when nothing was drafted."""
        return self.drafted_per_position[0] if self.drafted_per_position else 0

    @property
    def acceptance_rate(self) -> float:
        """accepted_tokens / draft_tokens, in [0, 1]; 0.0 when nothing was drafted."""
        return _ratio(self.accepted_tokens, self.draft_tokens)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per decode round, the bonus (or correction) token included and
        before stop trimming: (accepted_tokens + decode_rounds) / decode_rounds, in
        [1, k_max + 1]. The prefill round is not counted. 0.0 when there was no decode round."""
        return _ratio(self.accepted_tokens + self.decode_rounds, self.decode_rounds)

    @property
    def mean_k(self) -> float:
        """Draft tokens per decode round: draft_tokens / decode_rounds; 0.0 without one."""
        return _ratio(self.draft_tokens, self.decode_rounds)

    @property
    def tokens_per_second(self) -> float:
        """completion_tokens / wall_time_s (tokens/s); 0.0 when no time was measured."""
        return _ratio(self.completion_tokens, self.wall_time_s)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second after the first token:
        (completion_tokens - requests) / (wall_time_s - ttft_s), tokens/s; 0.0 when either is
        not positive."""
        return _ratio(
            max(self.completion_tokens - self.requests, 0), self.wall_time_s - self.ttft_s
        )

    @property
    def draft_s_per_round(self) -> float:
        """Draft compute per decode round, prefill excluded, seconds; 0.0 without one."""
        return _ratio(self.draft_time_s - self.prefill_draft_time_s, self.decode_rounds)

    @property
    def verify_s_per_round(self) -> float:
        """Target compute per decode round, prefill excluded, seconds; 0.0 without one."""
        return _ratio(self.verify_time_s - self.prefill_verify_time_s, self.decode_rounds)

    @property
    def orchestration_s_per_round(self) -> float:
        """Seconds per decode round spent outside the models; 0.0 without a decode round."""
        return _ratio(self.overhead_time_s, self.decode_rounds)

    @property
    def round_s(self) -> float:
        """Seconds per decode round: draft + verify + orchestration."""
        return self.draft_s_per_round + self.verify_s_per_round + self.orchestration_s_per_round

    @property
    def orchestration_share(self) -> float:
        """Share of a decode round's seconds spent outside the models, in [0, 1]."""
        return _ratio(self.orchestration_s_per_round, self.round_s)

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """accepted_per_position[i] / drafted_per_position[i] per draft position i (0-based);
        None where position i was never drafted."""
        return [
            a / d if d else None
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    # --- sums -----------------------------------------------------------------------------

    def __add__(self, other: SpeculationStats) -> SpeculationStats:
        """Counter by counter; per-position lists element-wise (the shorter padded with 0)."""
        if not isinstance(other, SpeculationStats):
            return NotImplemented
        values = {}
        for field in dataclasses.fields(self):
            ours, theirs = getattr(self, field.name), getattr(other, field.name)
            if field.name in _PER_POSITION:
                values[field.name] = [
                    a + b for a, b in itertools.zip_longest(ours, theirs, fillvalue=0)
                ]
            else:
                values[field.name] = ours + theirs
        return SpeculationStats(**values)

    @classmethod
    def total(cls, stats: Iterable[SpeculationStats]) -> SpeculationStats:
        """The sum of many requests' stats (``requests`` = 0 for none)."""
        return sum(stats, cls(requests=0))

    # --- wire and records -----------------------------------------------------------------

    def figures(self) -> dict[str, float]:
        """The derived figures that the wire and the bench's JSON carry beside the counters."""
        return {
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "mean_k": self.mean_k,
            "tokens_per_second": self.tokens_per_second,
        }

    def as_dict(self) -> dict[str, object]:
        """Raw counters and derived figures as plain JSON-ready values."""
        return {**dataclasses.asdict(self), **self.figures()}

    def to_proto(self) -> specdec_pb2.SpeculationStats:
        """The wire message: the raw counters and the derived figures, for one request.

        Raises:
            ValueError: when these stats sum other than one request (the message has no
                request count, so a reader would take the prefills for decode rounds).
        """
        if self.requests != 1:
            raise ValueError(f"to_proto describes one request; these stats sum {self.requests}")
        counters = dataclasses.asdict(self)
        del counters["requests"]
        return specdec_pb2.SpeculationStats(**counters, **self.figures())

    @classmethod
    def from_proto(cls, message: specdec_pb2.SpeculationStats) -> SpeculationStats:
        """One request's raw counters back from the wire; the derived fields are recomputed
        from them, not read."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "requests"]
        values = {name: getattr(message, name) for name in names}
        for name in _PER_POSITION:
            values[name] = list(values[name])
        return cls(**values)


class StatsRecorder:
    """Accumulates one request's SpeculationStats round by round; times use
    time.perf_counter()."""

    def __init__(self, k_max: int) -> None:
        """k_max: the most draft tokens a round may propose (length of the per-position lists)."""
        self.start = time.perf_counter()
        self.stats = SpeculationStats(
            accepted_per_position=[0] * k_max, drafted_per_position=[0] * k_max
        )

    def prefill(self, verify_s: float) -> None:
        """Records the prefill round and its target compute, seconds."""
        s = self.stats
        s.rounds += 1
        s.verify_time_s += verify_s
        s.prefill_verify_time_s = verify_s
        s.ttft_s = time.perf_counter() - self.start

    def draft_prefill(self, draft_s: float) -> None:
        """Records the draft's prefill compute, seconds (it may end after the first rounds)."""
        s = self.stats
        s.draft_time_s += draft_s
        s.prefill_draft_time_s = draft_s

    def round(
        self,
        k: int,
        num_accepted: int,
        draft_s: float,
        verify_s: float,
        overhead_s: float,
        without_draft: bool = False,
        ngram: bool = False,
        ngram_tail: int = 0,
        overlapped: bool = False,
    ) -> None:
        """Records one decode round: k tokens proposed, num_accepted of them accepted, and the
        round's draft compute, target compute and time outside the models, seconds;
        ``without_draft`` when it could not call the draft model only because the draft side
        was unavailable; ``ngram`` when n-gram lookup proposed all its tokens; ``ngram_tail``
        when it proposed the last that many (a mixed round); ``overlapped`` when its draft
        tokens were drafted while the previous round verified."""
        s = self.stats
        s.rounds += 1
        s.overlapped_rounds += overlapped
        s.rounds_without_draft += without_draft
        s.ngram_rounds += ngram
        s.mixed_rounds += ngram_tail > 0
        looked_up = k if ngram else ngram_tail
        s.ngram_draft_tokens += looked_up
        s.ngram_accepted_tokens += max(num_accepted - (k - looked_up), 0)
        s.draft_tokens += k
        s.accepted_tokens += num_accepted
        for i in range(k):
            s.drafted_per_position[i] += 1
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        s.draft_time_s += draft_s
        s.verify_time_s += verify_s
        s.overhead_time_s += overhead_s

    def wasted(self, tokens: int) -> None:
        """Records pipelined draft tokens that no round verified."""
        self.stats.wasted_draft_tokens += tokens

    def finish(self, completion_tokens: int) -> SpeculationStats:
        """Notes the completion's length (tokens) and the request's wall time; returns the
        stats."""
        self.stats.completion_tokens = completion_tokens
        self.stats.wall_time_s = time.perf_counter() - self.start
        return self.stats
