"""The target deployment: replicas on the target pool, each a TargetVerifier."""

from __future__ import annotations

from ray import serve

from specdec.config import SpecdecConfig
from specdec.deployments.model_replica import CONSISTENT_HASH_ROUTER, ModelReplica
from specdec.models.verifier import TargetVerifier
from specdec.v1 import worker_pb2


@serve.deployment(
    ray_actor_options={"num_cpus": 0, "resources": {"target_pool": 1}},
    request_router_config=CONSISTENT_HASH_ROUTER,
    max_ongoing_requests=32,
)
class TargetModel(ModelReplica):
    """Verifies draft tokens for any session (see specdec.models.verifier.TargetVerifier).

    Args:
        config: the application's settings; loads config.models.target_model, and the verifier
            sizes its fixed width from max_speculative_tokens and the loaded dtype.
    """

    def __init__(self, config: SpecdecConfig) -> None:
        super().__init__(TargetVerifier, "target", config)

    async def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        return await self._compute("verify", self.side.verify, request)
