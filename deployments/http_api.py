"""The OpenAI-compatible HTTP API, served by the router deployment on Serve's HTTP port (8000).

Routes (under the application's route prefix, ``/`` in the shipped configs, so the OpenAI base
URL is ``http://HOST:8000/v1``, where OpenAI clients and gateways look): ``POST /v1/completions``,
``POST /v1/chat/completions`` (both unary or, with ``"stream": true``, server-sent events ending
in ``data: [DONE]``) and ``GET /v1/models``. Every route also answers under LEGACY_PREFIX
(``/specdec/v1/...``), the base URL of releases whose route prefix was ``/specdec``.

Why on the router deployment itself (``@serve.ingress(HTTP_APP)`` on SpeculativeRouter, with
OpenAIRoutes as a mixin) rather than a thin ingress deployment in front of it: a request's rounds
already run in the router, so an HTTP request runs them where a gRPC request does, through the
same validation, RoundLoop, metrics and stats; an ingress deployment would add a handle call per
streamed round, and a deployment to scale and keep ready. Serve's HTTP proxy sends HTTP requests
to the replica's ASGI app and its gRPC proxy calls the gRPC methods by name, so both APIs share
each router replica.

specdec.openai_api holds the mapping (request bodies to GenerateRequests, completion objects,
stream chunks, error objects); this module only moves bytes and maps failures to statuses.
"""

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec import openai_api
from specdec.config import SpecdecConfig
from specdec.decoding.request import ModelLimits
from specdec.decoding.round_loop import RoundLoop
from specdec.deployments.failures import grpc_status
from specdec.errors import InvalidRequestError
from specdec.openai_api import OpenAIError, OpenAIRequest, Responder
from specdec.v1 import worker_pb2

log = logging.getLogger("ray.serve")
# No /docs, /redoc or /openapi.json: they would be the only routes of the API's port that
# answer without a key when keys are on, and the API is documented in docs/api.md.
HTTP_APP = FastAPI(
    title="specdec",
    description="OpenAI-compatible speculative decoding",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)
# Where the routes were before they moved to the root; they answer there too (route).
LEGACY_PREFIX = "/specdec"
# Every path route() has registered (aliases too): what a gateway in front must let through.
ROUTE_PATHS: list[str] = []


def route(method: str, path: str) -> Callable[[Callable], Callable]:
    """Registers the decorated endpoint for ``method`` ("get", "post") at ``path`` and at
    LEGACY_PREFIX + ``path``, on HTTP_APP."""
    register = getattr(HTTP_APP, method)

    def decorate(endpoint: Callable) -> Callable:
        ROUTE_PATHS.extend((path, LEGACY_PREFIX + path))
        return register(LEGACY_PREFIX + path)(register(path)(endpoint))

    return decorate


# Metric labels of HTTP failures: the gRPC status names the gRPC API records, so a dashboard
# counts errors by code across both APIs.
_CODE_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _as_openai_error(err: Exception, parsed: OpenAIRequest | None) -> OpenAIError:
    """Any failure as an OpenAIError: the router's InvalidRequestError as a 400 naming the
    OpenAI field, ServiceUnavailable as 503, anything else as 500 (grpc_status decides,
    specdec.deployments.failures, so both APIs classify alike; never a traceback)."""
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, InvalidRequestError):
        if parsed is None:
            return OpenAIError.bad(err.field, err.message)
        return parsed.invalid(err)
    code, message = grpc_status(err)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return OpenAIError(401, message, None, "invalid_api_key")  # OpenAI's own code for it
    status = {"UNAVAILABLE": 503, "RESOURCE_EXHAUSTED": 429}.get(code.name, 500)
    return OpenAIError(status, message, None, code.name.lower())


class OpenAIRoutes:
    """The HTTP routes, a mixin of SpeculativeRouter (``@serve.ingress(HTTP_APP)`` there).

    Every route checks the ``Authorization`` header with the router's ``api_keys``
    (specdec.api_keys.ApiKeys) first: without an accepted key, 401 with OpenAI's error object
    (code ``invalid_api_key``) and ``WWW-Authenticate: Bearer``.

    A request's unset sampling fields and token limit take the router's ``http_defaults``
    (specdec.openai_api.RequestDefaults: the target's generation_config, then OpenAI's).

    Uses the router's ``config``, ``tokenizer``, ``metrics``, ``_model_info()`` (the draft's
    and target's specdec.v1.ReplicaInfo; ServiceUnavailable when the target does not answer),
    ``_limits()`` (the pair's ModelLimits), ``_round_loop(GenerateRequest)`` (validates and
    tokenizes, InvalidRequestError naming the field) and ``_succeed(method, completion,
    start)``.
    """

    @route("get", "/v1/models")
    async def list_models(self, request: Request) -> Response:
        """The served model (the target, named service.served_model_name or else by its model
        name; its id goes in requests' ``model``), the draft in ``draft_model`` (null while no
        draft replica has answered this router) and the context limit (tokens) in
        ``max_model_len``."""
        try:
            self.api_keys.check(request.headers.get("authorization"))
            draft, target = await self._model_info()
        except Exception as err:  # noqa: BLE001 - every failure becomes an error object
            return self._http_error_response("/v1/models", err, None)
        limits = ModelLimits.of(target, draft, self.config.speculation)
        model = {
            "id": served_name(self.config, target),
            "object": "model",
            "created": int(time.time()),
            "owned_by": "specdec",
            "draft_model": draft.name if draft is not None else None,
            "max_model_len": limits.context_limit,
        }
        return JSONResponse({"object": "list", "data": [model]})

    @route("post", openai_api.PATHS[openai_api.COMPLETIONS])
    async def completions(self, request: Request) -> Response:
        """OpenAI's completions (``prompt``); see specdec.openai_api for the fields."""
        return await self._http_serve(request, openai_api.COMPLETIONS)

    @route("post", openai_api.PATHS[openai_api.CHAT])
    async def chat_completions(self, request: Request) -> Response:
        """OpenAI's chat completions (``messages``, the target's chat template)."""
        return await self._http_serve(request, openai_api.CHAT)

    async def _http_serve(self, http_request: Request, endpoint: str) -> Response:
        """Parses and validates before answering (a bad request is a 400, never a stream that
        fails), then answers whole or as server-sent events."""
        method = openai_api.PATHS[endpoint]
        start = time.perf_counter()
        parsed = None
        try:
            # Before the body is read: a client without a key costs no more than its headers.
            self.api_keys.check(http_request.headers.get("authorization"))
            body = await _json_body(http_request, self.config.service.max_request_bytes)
            parsed = openai_api.parse(endpoint, body)
            _, target = await self._model_info()
            served = served_name(self.config, target)
            parsed.check_model(served)
            self.http_defaults.apply(parsed.request, (await self._limits()).context_limit)
            loop = await self._round_loop(parsed.request)
        except Exception as err:  # noqa: BLE001
            return self._http_error_response(method, err, parsed)
        responder = Responder(parsed, served, self._http_token_text)
        if parsed.stream:
            events = self._http_events(loop, responder, method, start)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            completion = await loop.complete()
        except asyncio.CancelledError:  # the client went away: run() has released the session
            self.metrics.record_request(method, "CANCELLED")
            raise
        except Exception as err:  # noqa: BLE001
            return self._http_error_response(method, err, parsed)
        self._succeed(method, completion, start)
        return JSONResponse(responder.response(completion))

    async def _http_events(
        self, loop: RoundLoop, responder: Responder, method: str, start: float
    ) -> AsyncIterator[bytes]:
        """The stream: one chunk per round with new text, the finish chunk with the stats (and
        the usage chunk), ``data: [DONE]``. A failure mid-stream is an error event before
        [DONE]. A client that disconnects cancels this generator (or closes it); either reaches
        RoundLoop.run, whose finally releases both sides' caches."""
        for chunk in responder.first_chunks():
            yield openai_api.sse(chunk)
        try:
            async with contextlib.aclosing(loop.run()) as deltas:
                async for delta in deltas:
                    for chunk in responder.delta_chunks(delta):
                        yield openai_api.sse(chunk)
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.record_request(method, "CANCELLED")
            raise
        except Exception as err:  # noqa: BLE001
            error = self._http_failure(method, err, responder.request)
            yield openai_api.sse(error.body())
            yield openai_api.DONE
            return
        self._succeed(method, loop.completion, start)
        for chunk in responder.final_chunks(loop.completion):
            yield openai_api.sse(chunk)
        yield openai_api.DONE

    def _http_token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

    def _http_failure(
        self, method: str, err: Exception, parsed: OpenAIRequest | None
    ) -> OpenAIError:
        """``err`` as an OpenAIError, counted in the request metrics by its gRPC code name
        (internal errors logged with their traceback)."""
        error = _as_openai_error(err, parsed)
        if error.status == 500:
            log.error("%s failed", method, exc_info=err)
        self.metrics.record_request(method, _CODE_NAMES.get(error.status, "INTERNAL"))
        return error

    def _http_error_response(
        self, method: str, err: Exception, parsed: OpenAIRequest | None
    ) -> JSONResponse:
        error = self._http_failure(method, err, parsed)
        # RFC 6750: a 401 names the scheme the client must use.
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)


def served_name(config: SpecdecConfig, target: worker_pb2.ReplicaInfo) -> str:
    """The model's id in this API: service.served_model_name, else the target's model name."""
    return config.service.served_model_name or target.name


async def _json_body(request: Request, max_bytes: int) -> object:
    """The parsed JSON body, read while it stays within ``max_bytes``.

    Raises:
        OpenAIError: 413 past max_bytes (the declared Content-Length is checked before reading
            anything), 400 when the body is not JSON.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise OpenAIError.bad(None, f"the request body is not valid JSON: {err}") from None


def _too_large(size: int, max_bytes: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body has {size}+ bytes; the limit is {max_bytes} (max_request_bytes)",
        None,
        "request_too_large",
    )
