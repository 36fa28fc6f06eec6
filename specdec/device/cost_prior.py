"""The controller's starting costs, from the calibrations the draft and target replicas report."""

from __future__ import annotations

from specdec.decoding.controller import CostPrior
from specdec.device.calibration.results import ExactWidths


def cost_prior(
    target, draft, max_speculative_tokens: int, max_batch_size: int = 1
) -> CostPrior | None:
    """The controller's starting costs from two specdec.v1.DeviceCalibration messages: verify
    of k draft tokens = the target's k + 1 rows in its exact widths (padding and chunks
    included), a draft step = the draft's 1-row forward, its catch-up = its 2-row forward, a
    longer catch-up = the draft's prefill seconds per token, and a batched verify of r rows, r
    up to max_batch_size x (k_max + 1), = r rows in the exact widths. None when either side
    reported no costs."""
    target_chosen, draft_chosen = _chosen(target), _chosen(draft)
    target_costs = tuple(target_chosen.forward_s) if target_chosen else ()
    draft_costs = tuple(draft_chosen.forward_s) if draft_chosen else ()
    if not target_costs or not draft_costs:
        return None
    draft_prefill = draft_chosen.prefill_s_per_token
    exact = ExactWidths(
        tuple(target.exact_widths) or tuple(range(1, len(target_costs) + 1)), target_costs
    )
    verify_s = [exact.rows_seconds(k + 1) for k in range(max_speculative_tokens + 1)]
    catchup_s = draft_costs[1] if len(draft_costs) > 1 else None
    batch_rows = max_batch_size * (max_speculative_tokens + 1) if max_batch_size > 1 else 0
    return CostPrior(
        verify_s=verify_s,
        draft_step_s=draft_costs[0],
        catchup_s=catchup_s,
        batch_verify_s=[exact.rows_seconds(rows) for rows in range(1, batch_rows + 1)],
        catchup_token_s=draft_prefill if draft_prefill > 0 else None,  # 0: not reported
    )


def _chosen(message):
    """The DtypeCost of the dtype a DeviceCalibration message chose; None without one."""
    return next((c for c in message.candidates if c.dtype == message.dtype), None)
