"""Simulated device costs (specdec.device.simulated; issue 42, item 3): the table, its checks,
the forward hold on a real tiny model, and what a replica reports under it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from specdec.config import SpecdecConfig
from specdec.decoding.costs import CostPrior
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.results import Calibration, DtypeMeasurement, ExactWidths
from specdec.device.cost_prior import cost_table
from specdec.device.gemm import PLAIN
from specdec.device.simulated import ForwardHold, SideCosts, SimulatedCosts
from specdec.errors import ConfigError
from specdec.models.loading import load_model

COSTS_DIR = Path(__file__).parents[2] / "benchmarks" / "costs"
TARGET = {"forward_s": [0.04, 0.05, 0.06], "prefill_s_per_token": 0.01}
DRAFT = {"forward_s": [0.03], "prefill_s_per_token": 0.001}


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    return path


def test_a_forward_costs_its_rows_and_each_row_past_the_table_its_prefill_cost(tmp_path):
    table = SimulatedCosts.load(_write(tmp_path, {"label": "t", "target": TARGET, "draft": DRAFT}))
    target = table.sides["target"]
    assert [target.seconds(r) for r in (1, 2, 3)] == [0.04, 0.05, 0.06]
    assert target.seconds(13) == pytest.approx(0.06 + 10 * 0.01)
    assert table.sides["draft"].seconds(4) == pytest.approx(0.03 + 3 * 0.001)
    assert table.label == "t" and table.source == ""


@pytest.mark.parametrize(
    "change, field",
    [
        ({"label": ""}, "'label'"),
        ({"draft": None}, "'draft' must be an object"),
        ({"target": {**TARGET, "forward_s": []}}, "'target'.forward_s"),
        ({"target": {**TARGET, "forward_s": [0.01, -1]}}, "'target'.forward_s"),
        ({"target": {**TARGET, "forward_s": [True]}}, "'target'.forward_s"),
        ({"draft": {**DRAFT, "prefill_s_per_token": "fast"}}, "'draft'.prefill_s_per_token"),
        ({"draft": {"forward_s": [0.01]}}, "'draft'.prefill_s_per_token"),
    ],
)
def test_a_bad_table_names_the_setting_and_its_field(tmp_path, change, field):
    data = {"label": "t", "target": TARGET, "draft": DRAFT, **change}
    with pytest.raises(ConfigError, match="^simulated_costs: ") as raised:
        SimulatedCosts.load(_write(tmp_path, data))
    assert field in str(raised.value)


def test_a_missing_or_broken_file_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="^simulated_costs: cannot read"):
        SimulatedCosts.load(tmp_path / "absent.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^simulated_costs: cannot read"):
        SimulatedCosts.load(tmp_path / "broken.json")


def test_the_shipped_tables_load_with_a_label_and_a_source():
    paths = sorted(COSTS_DIR.glob("*.json"))
    assert paths, f"no cost tables in {COSTS_DIR}"
    for path in paths:
        table = SimulatedCosts.load(path)
        assert table.label and table.source
        # A decode draft step must be cheaper than a verify, or the table simulates no
        # speculation worth measuring.
        assert table.sides["draft"].seconds(1) < table.sides["target"].seconds(1)


@pytest.mark.parametrize(
    "settings",
    [{"simulated_costs": ""}, {"simulated_costs": "t.json", "device": "cuda"}],
)
def test_the_setting_needs_a_file_and_a_cpu_device(settings):
    with pytest.raises(ConfigError, match="simulated_costs"):
        SpecdecConfig.of(**settings)


def test_held_forwards_take_the_tables_time_and_compute_the_same_logits(tiny_pair):
    """Every forward path embeds first and ends in the final norm: a plain forward over 5
    positions is held to the table's 5 rows; the logits are the unheld model's, bitwise."""
    model = load_model(tiny_pair[1]).model
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.inference_mode():
        free = model(ids).logits
        costs = SideCosts(forward_s=(0.01,), prefill_s_per_token=0.05)  # 5 rows: 0.21 s
        hold = ForwardHold(model, costs)
        start = time.perf_counter()
        held = model(ids).logits
        elapsed = time.perf_counter() - start
        hold.remove()
        model(ids)
    assert torch.equal(free, held)
    assert elapsed >= costs.seconds(5)
    assert hold.forwards == 1  # the forward after remove() was not seen


def _calibration(forward_s, widths) -> Calibration:
    exact = ExactWidths(widths, forward_s) if widths else None
    chosen = DtypeMeasurement(Candidate("float32", PLAIN), forward_s, 0.001, exact, 1.0)
    slower = DtypeMeasurement(Candidate("bfloat16", PLAIN), forward_s, 0.002, None, 2.0)
    return Calibration("cpu: test", chosen.candidate, True, (chosen, slower), 0.5)


def test_the_reported_costs_are_the_tables_in_the_real_exact_widths():
    """The router prices rounds with the reported table (CostPrior.of): the simulated forward
    of each width, rows in the real replica's exact widths (width 4 only: 5 rows = 2 x 4)."""
    config = SpecdecConfig.of(max_speculative_tokens=3, max_batch_size=2)
    costs = SideCosts(forward_s=(0.02, 0.021, 0.022, 0.023), prefill_s_per_token=0.001)
    target = cost_table(costs.calibration(_calibration((1.0,) * 4, (4,))), config)
    assert list(target.forward_s) == pytest.approx([0.02, 0.021, 0.022, 0.023])
    assert list(target.rows_s) == pytest.approx([0.023] * 4 + [0.046] * 4)
    assert target.prefill_s_per_token == pytest.approx(0.001)
    draft = cost_table(SideCosts((0.002,), 1e-4).calibration(_calibration((0.5, 0.6), ())), config)
    prior = CostPrior.of(target, draft, config)
    assert prior.verify_s == pytest.approx((0.023,) * 4)
    assert (prior.draft_step_s, prior.catchup_s) == pytest.approx((0.002, 0.0021))
