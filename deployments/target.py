"""The target deployment: replicas on the target pool, each a TargetVerifier."""

from __future__ import annotations

from ray import serve

from specdec.config import SpecdecConfig
from specdec.deployments.model_replica import CONSISTENT_HASH_ROUTER, ModelReplica
from specdec.v1 import worker_pb2
from specdec.worker.static.sides import verifier_class


@serve.deployment(
    ray_actor_options={"num_cpus": 0, "resources": {"target_pool": 1}},
    request_router_config=CONSISTENT_HASH_ROUTER,
    max_ongoing_requests=32,
)
class TargetModel(ModelReplica):
    """Verifies draft tokens for any session (see specdec.worker.verifier.TargetVerifier;
    specdec.worker.static.sides.StaticVerifier under models.runner static).

    Args:
        config: the application's settings; loads config.models.target_model, and the verifier
            sizes its fixed width from max_speculative_tokens and the loaded dtype.
    """

    def __init__(self, config: SpecdecConfig) -> None:
        super().__init__(verifier_class(config), "target", config)
        self._size_batches(self._verify_batch, config, "verify", self.side.verify_batch)
        self._serve_directly(config, verify=self.verify)

    async def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        """One session's verify, run in a batch with the calls that arrived with it.

        Raises:
            ValueError: the request's q does not match its draft tokens (only this call fails).
        """
        return await self._batched(self._verify_batch, request)

    # serve.batch gathers the calls that arrive while the compute thread is busy: one packed
    # forward then serves them all (TargetVerifier.verify_batch). Sizes come from the config.
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)
    async def _verify_batch(self, arrivals: list[tuple[float, worker_pb2.VerifyRequest]]) -> list:
        return await self._compute_batch("verify", self.side.verify_batch, arrivals)
