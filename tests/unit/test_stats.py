"""SpeculationStats: raw counters in, each derived figure defined once, sums, the wire."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.decoding.stats import SpeculationStats, StatsRecorder
from specdec.v1 import specdec_pb2


def _request(**overrides) -> SpeculationStats:
    # A prefill (0.2 s draft, 1.0 s verify) and 4 decode rounds drafting 3, 3, 2, 0 tokens and
    # accepting 3, 1, 0, 0 of them: 4 + 4 = 8 tokens committed after the first.
    values = dict(
        rounds=5,
        draft_tokens=8,
        accepted_tokens=4,
        accepted_per_position=[2, 1, 1],
        drafted_per_position=[3, 3, 2],
        draft_time_s=0.2 + 0.8,
        verify_time_s=1.0 + 1.2,
        overhead_time_s=0.4,
        prefill_draft_time_s=0.2,
        prefill_verify_time_s=1.0,
        ttft_s=1.5,
        completion_tokens=9,
        wall_time_s=3.5,
    )
    return SpeculationStats(**{**values, **overrides})


def test_figures_of_one_request():
    s = _request()
    assert s.decode_rounds == 4
    assert s.acceptance_rate == pytest.approx(4 / 8)
    assert s.mean_accepted_tokens == pytest.approx((4 + 4) / 4)  # per decode round
    assert s.mean_k == pytest.approx(8 / 4)
    assert s.tokens_per_second == pytest.approx(9 / 3.5)
    assert s.decode_tokens_per_second == pytest.approx(8 / 2.0)
    assert s.draft_s_per_round == pytest.approx(0.8 / 4)
    assert s.verify_s_per_round == pytest.approx(1.2 / 4)
    assert s.orchestration_s_per_round == pytest.approx(0.4 / 4)
    assert s.round_s == pytest.approx(2.4 / 4)
    assert s.orchestration_share == pytest.approx(0.4 / 2.4)
    assert s.acceptance_per_position == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    # Per decode round, tokens committed = 1 + the accepted share of the drafted tokens.
    assert s.mean_accepted_tokens == pytest.approx(1 + s.acceptance_rate * s.mean_k)


def test_figures_without_a_decode_round_or_a_draft_are_zero():
    prefill_only = SpeculationStats(rounds=1, verify_time_s=1.0, prefill_verify_time_s=1.0)
    assert prefill_only.decode_rounds == 0
    for figure in (
        "acceptance_rate",
        "mean_accepted_tokens",
        "mean_k",
        "tokens_per_second",
        "decode_tokens_per_second",
        "draft_s_per_round",
        "verify_s_per_round",
        "orchestration_s_per_round",
        "orchestration_share",
    ):
        assert getattr(prefill_only, figure) == 0.0, figure
    target_only = SpeculationStats(
        rounds=11, accepted_per_position=[0, 0], drafted_per_position=[0, 0]
    )
    assert target_only.mean_accepted_tokens == 1.0 and target_only.mean_k == 0.0
    assert target_only.acceptance_per_position == [None, None]


def test_a_sum_adds_counters_and_derives_the_same_way():
    a = _request()
    b = _request(
        rounds=3,
        draft_tokens=2,
        accepted_tokens=2,
        accepted_per_position=[1, 1],
        drafted_per_position=[1, 1],
        overhead_time_s=0.1,
        completion_tokens=5,
        wall_time_s=1.5,
        ttft_s=0.5,
    )
    total = a + b
    assert total.requests == 2 and total.rounds == 8
    assert total.decode_rounds == a.decode_rounds + b.decode_rounds == 6
    assert total.accepted_per_position == [3, 2, 1]  # the shorter list padded with 0
    assert total.drafted_per_position == [4, 4, 2]
    assert total.acceptance_rate == pytest.approx(6 / 10)
    assert total.mean_accepted_tokens == pytest.approx((6 + 6) / 6)
    assert total.mean_k == pytest.approx(10 / 6)
    assert total.tokens_per_second == pytest.approx(14 / 5.0)
    assert total.decode_tokens_per_second == pytest.approx(12 / 3.0)
    assert total.orchestration_s_per_round == pytest.approx(0.5 / 6)
    assert SpeculationStats.total([a, b]) == total
    assert SpeculationStats.total([a]) == a
    assert SpeculationStats.total([]).requests == 0
    assert (a, b) == (_request(), b)  # the terms are left alone


def test_proto_round_trip_keeps_counters_and_sends_figures():
    s = _request()
    message = s.to_proto()
    assert message.acceptance_rate == pytest.approx(s.acceptance_rate)
    assert message.mean_accepted_tokens == pytest.approx(s.mean_accepted_tokens)
    assert message.mean_k == pytest.approx(s.mean_k)
    assert message.tokens_per_second == pytest.approx(s.tokens_per_second)
    wire = specdec_pb2.SpeculationStats.FromString(message.SerializeToString())
    back = SpeculationStats.from_proto(wire)
    for field in dataclasses.fields(SpeculationStats):
        assert getattr(back, field.name) == pytest.approx(getattr(s, field.name)), field.name
    with pytest.raises(ValueError, match="one request"):
        (s + s).to_proto()


def test_recorder_counts_rounds_and_leaves_figures_to_the_stats():
    recorder = StatsRecorder(k_max=3)
    recorder.prefill(verify_s=0.5)
    recorder.round(k=3, num_accepted=2, draft_s=0.3, verify_s=0.2, overhead_s=0.1)
    recorder.draft_prefill(draft_s=0.4)  # a draft prefill may end after the first round
    recorder.round(k=1, num_accepted=1, draft_s=0.1, verify_s=0.2, overhead_s=0.1)
    recorder.round(
        k=0, num_accepted=0, draft_s=0.0, verify_s=0.2, overhead_s=0.1, without_draft=True
    )
    s = recorder.finish(completion_tokens=7)
    assert (s.rounds, s.decode_rounds, s.draft_tokens, s.accepted_tokens) == (4, 3, 4, 3)
    assert s.rounds_without_draft == 1
    assert s.draft_s_per_round == pytest.approx(0.4 / 3)  # the draft prefill is kept apart
    assert s.drafted_per_position == [2, 1, 1] and s.accepted_per_position == [2, 1, 0]
    assert s.mean_accepted_tokens == pytest.approx((3 + 3) / 3)
    assert s.mean_k == pytest.approx(4 / 3)
    assert s.verify_s_per_round == pytest.approx(0.2)
    assert s.completion_tokens == 7 and s.wall_time_s >= s.ttft_s > 0
