"""One replica's side of the controller's starting costs: its cost table, from its calibration.

A draft or target replica computes its table once, at start-up, and reports it in its
ReplicaInfo (specdec.worker.info); the router combines the two sides' tables with pure arithmetic
(specdec.decoding.costs.CostPrior.of), and so does the in-process engine.
"""

from __future__ import annotations

from specdec.config import SpecdecConfig
from specdec.device.calibration.results import Calibration, ExactWidths
from specdec.v1 import worker_pb2


def cost_table(calibration: Calibration | None, config: SpecdecConfig) -> worker_pb2.CostTable:
    """The forward costs of the calibration's chosen dtype: as measured by width (forward_s),
    by rows in the calibration's exact widths (rows_s; every width its own when it has none),
    padding and chunks included, up to config.models.max_batch_size x (k_max + 1) rows, and its
    prefill seconds per token. Empty without a calibration or its costs."""
    table = worker_pb2.CostTable()
    chosen = calibration.chosen if calibration is not None else None
    forward_s = tuple(chosen.forward_s) if chosen is not None else ()
    if not forward_s:
        return table
    widths = chosen.exact.widths if chosen.exact is not None else ()
    exact = ExactWidths(tuple(widths) or tuple(range(1, len(forward_s) + 1)), forward_s)
    rows = config.models.max_batch_size * (config.speculation.max_speculative_tokens + 1)
    table.forward_s.extend(forward_s)
    table.rows_s.extend(exact.rows_seconds(r) for r in range(1, rows + 1))
    table.prefill_s_per_token = chosen.prefill_s_per_token
    return table
