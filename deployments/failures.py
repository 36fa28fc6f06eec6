"""How the router classifies failures: which failed handle calls may be sent again, and the
gRPC status a failed request answers with (the HTTP API maps the same statuses,
specdec.deployments.http_api)."""

from __future__ import annotations

import asyncio

import grpc
from ray.exceptions import (
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    WorkerCrashedError,
)
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)

from specdec.errors import ComputeUnhealthy, InvalidRequestError, Unauthenticated


class ServiceUnavailable(RuntimeError):
    """No draft or target replica answered in time; the router answers UNAVAILABLE."""


# What a replica that died, is draining, or was never placed makes a handle call raise: the call
# never ran to completion on a live replica, so it is safe to send again (draws are keyed by
# position, and a replica without the session rebuilds it). With Serve's per-replica gRPC
# transport a dead or shut-down replica raises ActorUnavailableError (a RayActorError) or
# RequestCancelledError (its server cancelled the call while draining), other gRPC failures
# grpc.aio.AioRpcError (handled by code in retryable); a replica whose node died raises the
# node and worker errors. A replica whose compute path is broken refuses calls before running
# them (ComputeUnhealthy) until Serve replaces it. Other errors of the replica's own code
# (RayTaskError) are not here: sending the same call again would fail again, so they answer
# INTERNAL.
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    ComputeUnhealthy,
    asyncio.TimeoutError,
    RayActorError,
    WorkerCrashedError,
    NodeDiedError,
    LocalRayletDiedError,
    ObjectLostError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
    BackPressureError,
    RequestCancelledError,
)
RETRYABLE_GRPC_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
# The retry hint of a RESOURCE_EXHAUSTED the router itself answers, in seconds (Serve's proxy
# answers the requests past the router's max_queued_requests itself; see docs/service.md).
RETRY_HINT_S = 1.0


def retryable(err: BaseException) -> bool:
    """Whether a failed handle call may be sent again: a replica dying, draining or missing
    (RETRYABLE_ERRORS, or a gRPC transport failure with a code in RETRYABLE_GRPC_CODES)."""
    if isinstance(err, RETRYABLE_ERRORS):
        return True
    return isinstance(err, grpc.aio.AioRpcError) and err.code() in RETRYABLE_GRPC_CODES


def grpc_status(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed request answers with; the message never carries a traceback."""
    if isinstance(err, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(err)
    if isinstance(err, ServiceUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(err)
    if isinstance(err, BackPressureError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err.message} Retry after {RETRY_HINT_S:g} s."
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"
