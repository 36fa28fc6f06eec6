"""The cost prior and the limits are built once, the same way, by the service (each replica's
ReplicaInfo, combined by the router) and by the in-process engine."""

from __future__ import annotations

import pytest

from specdec import SpeculativeEngine
from specdec.config import SpecdecConfig
from specdec.decoding.costs import CostPrior
from specdec.decoding.request import ModelLimits
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.results import Calibration, DtypeMeasurement, ExactWidths
from specdec.device.cost_prior import cost_table
from specdec.device.gemm import PLAIN
from specdec.models.loading import load_model
from specdec.v1 import worker_pb2
from specdec.worker.info import replica_info
from specdec.worker.proposer import DraftProposer
from specdec.worker.verifier import TargetVerifier

TARGET_S = (0.1, 0.2, 0.25, 0.3)  # forward_s by width 1..4
DRAFT_S = (0.05, 0.06, 0.07, 0.08)


def _calibration(forward_s, exact_widths=None, prefill_s_per_token=0.0) -> Calibration:
    exact = ExactWidths(exact_widths, forward_s) if exact_widths else None
    chosen = DtypeMeasurement(
        Candidate("float32", PLAIN), forward_s, prefill_s_per_token, exact, 1.0
    )
    return Calibration("cpu: test", Candidate("float32", PLAIN), False, (chosen,), 0.5)


CALIBRATIONS = {
    "target": _calibration(TARGET_S, exact_widths=(1, 4)),
    "draft": _calibration(DRAFT_S, prefill_s_per_token=0.002),
}
CONFIG = SpecdecConfig.of(max_speculative_tokens=3, max_batch_size=2)


def test_the_prior_prices_rows_in_the_targets_exact_widths_and_the_drafts_own_forwards():
    target = cost_table(CALIBRATIONS["target"], CONFIG)
    draft = cost_table(CALIBRATIONS["draft"], CONFIG)
    # The cheapest cover by forwards of width 1 or 4: 2 rows as 1 + 1, 3 and 4 rows padded to 4,
    # 5 rows as 4 + 1, 6 as 4 + 1 + 1, 7 and 8 as 4 + 4.
    rows_s = [0.1, 0.2, 0.3, 0.3, 0.4, 0.5, 0.6, 0.6]
    assert list(target.rows_s) == pytest.approx(rows_s)
    assert list(target.forward_s) == list(TARGET_S)
    prior = CostPrior.of(target, draft, CONFIG)
    assert prior == CostPrior(
        verify_s=rows_s[:4],  # k = 0 .. 3
        draft_step_s=0.05,
        catchup_s=0.06,
        batch_verify_s=rows_s,  # max_batch_size 2 x (k_max + 1) rows
        catchup_token_s=0.002,
    )
    alone = CONFIG.with_settings(max_batch_size=1)
    prior = CostPrior.of(cost_table(CALIBRATIONS["target"], alone), draft, alone)
    assert prior.verify_s == pytest.approx(rows_s[:4]) and prior.batch_verify_s == ()
    assert prior.catchup_token_s == 0.002


def test_no_prior_without_both_sides_costs():
    draft = cost_table(CALIBRATIONS["draft"], CONFIG)
    assert cost_table(None, CONFIG) == worker_pb2.CostTable()
    assert CostPrior.of(cost_table(None, CONFIG), draft, CONFIG) is None
    assert CostPrior.of(draft, worker_pb2.CostTable(), CONFIG) is None


def test_the_engine_and_the_service_build_equal_priors_and_limits(tiny_pair):
    """The service: each replica reports replica_info of its side (ModelReplica.model_info),
    and the router combines the two (CostPrior.of, ModelLimits.of). The engine must build the
    same from the same calibrations and config, max_batch_size included."""
    draft_dir, target_dir = tiny_pair
    draft, target = load_model(draft_dir), load_model(target_dir)
    engine = SpeculativeEngine(draft, target, CONFIG, calibrations=CALIBRATIONS)
    draft_info = replica_info(DraftProposer(draft, CONFIG, CALIBRATIONS["draft"]), CONFIG)
    target_info = replica_info(TargetVerifier(target, CONFIG, CALIBRATIONS["target"]), CONFIG)
    service_prior = CostPrior.of(target_info.costs, draft_info.costs, CONFIG)
    assert service_prior is not None and service_prior.batch_verify_s
    assert engine.costs.prior == service_prior
    assert engine.limits == ModelLimits.of(target_info, draft_info, CONFIG.speculation)
    assert engine.limits.context_limit == min(draft.context_limit, target.context_limit)
    assert engine.limits.eos_token_ids == target.eos_token_ids
    assert target_info.calibration.exact_widths == [1, 4]
    assert (target_info.dtype, target_info.vocab_size) == ("float32", target.vocab_size)
