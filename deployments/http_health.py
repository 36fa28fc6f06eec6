"""HTTP liveness and readiness on Serve's HTTP port, in the router's FastAPI app beside the
OpenAI routes (specdec.deployments.http_api.HTTP_APP), under the application's route prefix
(``/health``, ``/ready`` with the shipped configs; ``/specdec/health`` and ``/specdec/ready``
too, as before).

gRPC clients ask grpc.health.v1 on port 9000 instead (SpeculativeRouter.Check / Watch); both
answer from the same decision, specdec.deployments.health.readiness.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from specdec.deployments.http_api import route


class HealthRoutes:
    """The HTTP health routes, a mixin of SpeculativeRouter; uses its ``readiness()``."""

    @route("get", "/health")
    async def health_endpoint(self) -> JSONResponse:
        """Liveness: 200 ``{"status": "alive"}`` whenever this router replica answers at all."""
        return JSONResponse({"status": "alive"})

    @route("get", "/ready")
    async def ready_endpoint(self) -> JSONResponse:
        """Readiness: 200 once a target replica has answered model_info (also while the draft
        is down, the reason then says "degraded"), 503 before; the body is ``{"ready": bool,
        "reason": str}``. Waits at most specdec.deployments.health.PROBE_S seconds."""
        ready, reason = await self.readiness()
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)
