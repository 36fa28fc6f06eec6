"""What a draft or target replica reports about its model: built once, at start-up, by the model
replica (specdec.deployments.model_replica) and by the in-process engine alike."""

from __future__ import annotations

from specdec.config import SpecdecConfig
from specdec.device.cost_prior import cost_table
from specdec.v1 import worker_pb2
from specdec.worker.session import SessionModel


def replica_info(side: SessionModel, config: SpecdecConfig) -> worker_pb2.ReplicaInfo:
    """The side's model (name, vocabulary, context limit, EOS ids), the dtype it runs in (its
    calibration's; empty when not calibrated), its start-up calibration and the cost table
    computed from it (specdec.device.cost_prior.cost_table)."""
    loaded, calibration = side.loaded, side.calibration
    info = worker_pb2.ReplicaInfo(
        name=loaded.name,
        dtype=str(calibration.candidate) if calibration is not None else "",
        vocab_size=loaded.vocab_size,
        context_limit=side.context_limit,
        eos_token_ids=sorted(loaded.eos_token_ids),
        costs=cost_table(calibration, config),
    )
    if calibration is not None:
        calibration.to_proto(info.calibration)
    return info
