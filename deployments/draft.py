"""The draft deployment: replicas on the draft pool, each a DraftProposer."""

from __future__ import annotations

from ray import serve

from specdec.config import SpecdecConfig
from specdec.deployments.model_replica import CONSISTENT_HASH_ROUTER, ModelReplica
from specdec.v1 import worker_pb2
from specdec.worker.static.sides import proposer_class


@serve.deployment(
    ray_actor_options={"num_cpus": 0, "resources": {"draft_pool": 1}},
    request_router_config=CONSISTENT_HASH_ROUTER,
    max_ongoing_requests=32,
)
class DraftModel(ModelReplica):
    """Proposes k tokens per round for any session (see specdec.worker.proposer.DraftProposer;
    specdec.worker.static.sides.StaticProposer under models.runner static).

    Args:
        config: the application's settings; loads config.models.draft_model.
    """

    def __init__(self, config: SpecdecConfig) -> None:
        super().__init__(proposer_class(config), "draft", config)
        self._size_batches(self._propose_batch, config, "propose", self.side.propose_batch)
        self._serve_directly(config, propose=self.propose)

    async def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        """One session's draft, stepped together with the calls that arrived with it."""
        return await self._batched(self._propose_batch, request)

    # As TargetModel._verify_batch: the calls that queued while a batch ran share the next one
    # (DraftProposer.propose_batch steps them together).
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)
    async def _propose_batch(self, arrivals: list[tuple[float, worker_pb2.ProposeRequest]]) -> list:
        return await self._compute_batch("propose", self.side.propose_batch, arrivals)
