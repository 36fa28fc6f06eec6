"""The draft deployment: replicas on the draft pool, each a DraftProposer."""

from __future__ import annotations

from ray import serve

from specdec.config import SpecdecConfig
from specdec.deployments.model_replica import CONSISTENT_HASH_ROUTER, ModelReplica
from specdec.models.proposer import DraftProposer
from specdec.v1 import worker_pb2


@serve.deployment(
    ray_actor_options={"num_cpus": 0, "resources": {"draft_pool": 1}},
    request_router_config=CONSISTENT_HASH_ROUTER,
    max_ongoing_requests=32,
)
class DraftModel(ModelReplica):
    """Proposes k tokens per round for any session (see specdec.models.proposer.DraftProposer).

    Args:
        config: the application's settings; loads config.models.draft_model.
    """

    def __init__(self, config: SpecdecConfig) -> None:
        super().__init__(DraftProposer, "draft", config)

    async def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        return await self._compute("propose", self.side.propose, request)
