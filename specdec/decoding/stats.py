"""Per-request speculation statistics."""

from __future__ import annotations

import dataclasses
import time

from specdec.v1 import specdec_pb2


@dataclasses.dataclass
class SpeculationStats:
    """What speculation did for one request.

    Attributes:
        rounds: target forward passes, the prefill included (it commits the first token).
        draft_tokens: tokens proposed by the draft model.
        accepted_tokens: draft tokens the target accepted (0 <= accepted <= drafted).
        acceptance_rate: accepted_tokens / draft_tokens; 0 when nothing was drafted.
        mean_accepted_tokens: tokens committed per round, bonus included, before stop trimming:
            (accepted_tokens + rounds) / rounds, in [1, k + 1].
        accepted_per_position: rounds whose draft token at position i (0-based) was accepted;
            non-increasing in i, length k_max.
        ttft_s: seconds from the request's start to its first token.
        tokens_per_second: completion tokens / seconds from the request's start to its end.
        draft_time_s, verify_time_s: compute seconds reported by the draft and target models.
        overhead_time_s: decode-round seconds spent outside the models (transport, scheduling,
            stop checks); the prefill round is not included.
        mean_k: mean speculative tokens per decode round.
        prefill_draft_time_s, prefill_verify_time_s: the prefill's share of draft_time_s and
            verify_time_s, so per-round decode costs can be computed without it.
        drafted_per_position: decode rounds that drafted a token at position i (0-based);
            accepted_per_position[i] / drafted_per_position[i] is the acceptance at position i.
    """

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_tokens: float = 0.0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    ttft_s: float = 0.0
    tokens_per_second: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    overhead_time_s: float = 0.0
    mean_k: float = 0.0
    prefill_draft_time_s: float = 0.0
    prefill_verify_time_s: float = 0.0
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)

    @property
    def decode_rounds(self) -> int:
        """Rounds after the prefill."""
        return max(self.rounds - 1, 0)

    def to_proto(self) -> specdec_pb2.SpeculationStats:
        return specdec_pb2.SpeculationStats(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, message: specdec_pb2.SpeculationStats) -> SpeculationStats:
        values = {f.name: getattr(message, f.name) for f in dataclasses.fields(cls)}
        for name in ("accepted_per_position", "drafted_per_position"):
            values[name] = list(values[name])
        return cls(**values)


class StatsRecorder:
    """Accumulates SpeculationStats round by round; times use time.perf_counter()."""

    def __init__(self, k_max: int) -> None:
        self.start = time.perf_counter()
        self.stats = SpeculationStats(
            accepted_per_position=[0] * k_max, drafted_per_position=[0] * k_max
        )
        self._decode_rounds = 0
        self._k_total = 0

    def prefill(self, draft_s: float, verify_s: float) -> None:
        self.stats.rounds += 1
        self.stats.draft_time_s += draft_s
        self.stats.verify_time_s += verify_s
        self.stats.prefill_draft_time_s = draft_s
        self.stats.prefill_verify_time_s = verify_s
        self.stats.ttft_s = time.perf_counter() - self.start

    def round(
        self, k: int, num_accepted: int, draft_s: float, verify_s: float, overhead_s: float
    ) -> None:
        s = self.stats
        s.rounds += 1
        s.draft_tokens += k
        s.accepted_tokens += num_accepted
        for i in range(k):
            s.drafted_per_position[i] += 1
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1
        s.draft_time_s += draft_s
        s.verify_time_s += verify_s
        s.overhead_time_s += overhead_s
        self._decode_rounds += 1
        self._k_total += k

    def finish(self, completion_tokens: int) -> SpeculationStats:
        s = self.stats
        elapsed = time.perf_counter() - self.start
        s.acceptance_rate = s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0
        s.mean_accepted_tokens = (s.accepted_tokens + s.rounds) / s.rounds if s.rounds else 0.0
        s.tokens_per_second = completion_tokens / elapsed if elapsed > 0 else 0.0
        s.mean_k = self._k_total / self._decode_rounds if self._decode_rounds else 0.0
        return s
