"""How the start-up calibration times candidates (specdec.device.calibration.measure) and
chooses among them (choice): repeated passes, and candidates cut short once a few widths show
they cannot win."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specdec.device.calibration import choice, measure
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.load import calibrate
from specdec.device.calibration.results import DtypeMeasurement, ExactWidths
from specdec.models.loading import load_model

FLOAT32, BFLOAT16 = Candidate("float32"), Candidate("bfloat16")


def test_unmeasured_widths_are_linear_between_measured_ones():
    assert measure._interpolated({1: 1.0, 4: 4.0, 8: 2.0}, 8) == [
        1.0, 2.0, 3.0, 4.0, 3.5, 3.0, 2.5, 2.0
    ]  # fmt: skip


def test_each_cost_is_the_minimum_of_its_passes(tiny_pair, monkeypatch):
    """A forward of w positions is timed 10 w + 5 s on its odd-numbered calls and 10 w s on its
    even ones: a cost is 10 w only if each width was timed more than once and the minimum kept."""
    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    real_forward, calls = loaded.model.forward, {}

    def counting_forward(*args, input_ids, **kwargs):
        counting_forward.width = width = input_ids.shape[1]
        calls[width] = calls.get(width, 0) + 1
        return real_forward(*args, input_ids=input_ids, **kwargs)

    def fake_timed(device, fn):
        fn()
        width = counting_forward.width
        return 10.0 * width + (5.0 if calls[width] % 2 else 0.0)

    monkeypatch.setattr(loaded.model, "forward", counting_forward)
    monkeypatch.setattr(measure, "_timed", fake_timed)
    _, result = calibrate(
        loaded, "target", [FLOAT32], max_speculative_tokens=3, automatic=False,
        exact_widths=False,
    )  # fmt: skip
    widths = range(1, len(result.chosen.forward_s) + 1)
    assert list(result.chosen.forward_s) == [10.0 * w for w in widths]
    assert result.chosen.prefill_s_per_token == 10.0  # the prefill is repeated too


def _prefills_timed(monkeypatch, float32_s: float, bfloat16_s: float) -> None:
    """Each prefill forward runs, but is timed ``bfloat16_s`` in a bfloat16 model and
    ``float32_s`` otherwise: real prefill timings of a tiny model put either dtype up to 2x
    ahead, which decides whether PREFILL_MARGIN rules the float32 rival out."""
    real_prefill = measure._timed_prefill

    def fake_prefill(model, ids):
        _, cache = real_prefill(model, ids)
        return (bfloat16_s if model.dtype == torch.bfloat16 else float32_s), cache

    monkeypatch.setattr(measure, "_timed_prefill", fake_prefill)


def test_a_candidate_predicted_slower_is_cut_short(tiny_pair, monkeypatch):
    monkeypatch.setattr(choice, "SLOWER_CUTOFF", 0.0)  # every later candidate is hopeless
    _prefills_timed(monkeypatch, float32_s=1.0, bfloat16_s=1.0)
    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    _, result = calibrate(
        loaded, "target", [FLOAT32, BFLOAT16], max_speculative_tokens=4, automatic=True
    )
    first, cut = result.candidates
    assert first.exact is not None and cut.exact is None  # no exactness measurement either
    costs = cut.forward_s  # measured at 1, 2, 4, 8 and the widest (9); 3 and 5-7 interpolated
    assert costs[2] == pytest.approx((costs[1] + costs[3]) / 2)
    assert costs[5] == pytest.approx((costs[3] * 2 + costs[7] * 2) / 4)
    assert result.candidate == FLOAT32


def test_a_target_candidate_that_prefills_too_slowly_to_be_chosen_is_cut_short(
    tiny_pair, monkeypatch
):
    """However fast its decode forwards (no candidate is hopeless by SLOWER_CUTOFF here), a
    target candidate prefilling more than PREFILL_MARGIN slower than a usable rival could not
    be chosen, so it gets neither its full costs nor an exactness measurement."""
    monkeypatch.setattr(choice, "SLOWER_CUTOFF", math.inf)
    _prefills_timed(monkeypatch, float32_s=1.0, bfloat16_s=1.0 + 2 * choice.PREFILL_MARGIN)
    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    _, result = calibrate(
        loaded, "target", [FLOAT32, BFLOAT16], max_speculative_tokens=4, automatic=True
    )
    first, cut = result.candidates
    assert first.exact is not None and cut.exact is None
    costs = cut.forward_s  # measured at 1, 2, 4, 8 and the widest (9); 3 interpolated
    assert costs[2] == pytest.approx((costs[1] + costs[3]) / 2)
    assert result.candidate == FLOAT32


# The bundled target in bfloat16 on the 2-core AMX Xeon: ms of one forward of w positions over a
# 200-token cache, minimum of 8 (every one of these widths exact on its own there).
AMX_BFLOAT16_MS = {1: 193, 4: 185, 7: 192, 8: 196, 10: 203, 12: 204, 14: 211, 17: 227}


def test_one_exact_width_is_priced_for_the_batches_the_replica_runs():
    """A half-precision target gets one exact width. Priced for a lone request alone, a flat
    cost curve picks a narrow width (fewer padded rows per plain step); priced at loads up to
    max_batch_size sessions, a width that holds a full batch's plain rows and a few sessions'
    drafts in one forward, not three."""
    k_max = 12
    known = sorted(AMX_BFLOAT16_MS)
    costs = measure._interpolated(
        {w: AMX_BFLOAT16_MS[w] / 1000 for w in known}, k_max + 1 + measure.EXTRA_WIDTHS
    )

    def best_width(max_batch_size: int) -> int:
        return min(
            range(1, len(costs) + 1),
            key=lambda w: choice.seconds_per_token(
                ExactWidths((w,), tuple(costs)), k_max, max_batch_size
            ),
        )

    assert choice.batch_loads(1) == [1]
    assert choice.batch_loads(8) == [1, 2, 4, 8]
    assert choice.batch_loads(6) == [1, 2, 4, 6]
    lone, batched = best_width(1), best_width(8)
    assert lone < 8  # 8 plain rows take two forwards
    assert batched >= 8
    one = ExactWidths((lone,), tuple(costs))
    assert one.rows_seconds(8) == pytest.approx(2 * costs[lone - 1])


def _measured(dtype: str, predicted_s: float, prefill_s_per_token: float):
    exact = ExactWidths((1,), (1.0,))
    return DtypeMeasurement(Candidate.parse(dtype), (1.0,), prefill_s_per_token, exact, predicted_s)


def test_a_target_is_not_chosen_for_throughput_at_the_cost_of_its_time_to_first_token():
    """The AVX-512 BF16 EPYC's case: float32+dnnl predicted faster per request, bfloat16
    prefilling 28% faster. A candidate prefilling more than PREFILL_MARGIN slower than the
    fastest one is passed over; when every usable one is, the fastest prediction wins again."""
    margin = 1 + choice.PREFILL_MARGIN
    dnnl = (_measured("float32+dnnl", 10.5, 0.0113), "float32+dnnl")
    bf16 = (_measured("bfloat16", 12.1, 0.0081), "bfloat16")
    assert choice.choose([dnnl, bf16])[1] == "float32+dnnl"  # no bound: the draft's rule
    assert choice.choose([dnnl, bf16], 0.0081)[1] == "bfloat16"
    within = (_measured("float32+dnnl", 10.5, 0.0081 * margin * 0.99), "float32+dnnl")
    assert choice.choose([within, bf16], 0.0081)[1] == "float32+dnnl"
    # The floor may come from a candidate that is not usable (no exact widths): then the
    # fastest-predicted usable one is kept rather than none.
    assert choice.choose([dnnl, bf16], 0.0050)[1] == "float32+dnnl"


def test_the_rival_a_candidate_must_beat_prefills_within_the_margin_of_the_fastest():
    dnnl = _measured("float32+dnnl", 10.5, 0.0113)
    slow = _measured("float32", 30.0, 0.0300)
    unusable = dataclasses.replace(_measured("float32+wm", 9.0, 0.0113), exact=None)
    done = [dnnl, slow, unusable]
    assert choice.rival(done, 0.0300, needs_exact=True, ttft=True) is dnnl
    assert choice.rival(done, 0.0081, needs_exact=True, ttft=True) is None
    assert choice.rival(done, 0.0081, needs_exact=True, ttft=False) is dnnl
    assert choice.rival(done, 0.0081, needs_exact=False, ttft=False) is unusable


def test_a_candidate_that_prefills_much_faster_is_measured_in_full_and_chosen(
    tiny_pair, monkeypatch
):
    """Every later candidate is hopeless by SLOWER_CUTOFF = 0 (so bfloat16 would be cut short,
    with no exact widths, and float32 kept), but bfloat16's prefill is timed 10x faster than
    float32's: the float32 rival does not count against it, so it is measured in full and
    chosen."""
    monkeypatch.setattr(choice, "SLOWER_CUTOFF", 0.0)
    _prefills_timed(monkeypatch, float32_s=10.0, bfloat16_s=1.0)
    loaded = load_model(str(tiny_pair[1]), dtype="float32")
    model, result = calibrate(
        loaded, "target", [FLOAT32, BFLOAT16], max_speculative_tokens=4, automatic=True
    )
    first, later = result.candidates
    assert later.exact is not None
    assert later.prefill_s_per_token * 10 == first.prefill_s_per_token
    assert result.candidate == BFLOAT16 and model.model.dtype == torch.bfloat16
