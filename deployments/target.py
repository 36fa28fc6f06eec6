"""The target deployment: replicas on the target pool, each a TargetVerifier."""

from __future__ import annotations

from ray import serve

from specdec.deployments.model_replica import CONSISTENT_HASH_ROUTER, ModelReplica
from specdec.engine import DEFAULT_MAX_SPECULATIVE_TOKENS
from specdec.models.verifier import TargetVerifier, fixed_width_for
from specdec.v1 import worker_pb2


@serve.deployment(
    ray_actor_options={"num_cpus": 0, "resources": {"target_pool": 1}},
    request_router_config=CONSISTENT_HASH_ROUTER,
    max_ongoing_requests=32,
)
class TargetModel(ModelReplica):
    """Verifies draft tokens for any session (see specdec.models.verifier.TargetVerifier)."""

    def __init__(
        self,
        model: str,
        fixed_shape_verify: bool | None = None,
        max_speculative_tokens: int = DEFAULT_MAX_SPECULATIVE_TOKENS,
        **kwargs,
    ) -> None:
        # The fixed width depends on the loaded dtype, so it is resolved after loading.
        super().__init__(TargetVerifier, model, **kwargs)
        self.side.set_fixed_width(
            fixed_width_for(self.side.loaded, max_speculative_tokens, fixed_shape_verify)
        )

    async def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        return await self._compute("verify", self.side.verify, request)
