"""The router deployment: the public endpoint, running every request's speculative rounds.

gRPC on Serve's gRPC port; the OpenAI-compatible HTTP API (specdec.deployments.http_api, mounted
with ``@serve.ingress``) on its HTTP port, through the same validation and round loop.

It holds no weights, only the tokenizer. Each request runs specdec.decoding.round_loop.RoundLoop
over a specdec.deployments.transport.HandleTransport (Serve handles, or leases, to the draft and
target replicas that hold its session).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve._private.constants import RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from specdec.api_keys import ApiKeys
from specdec.config import SpecdecConfig
from specdec.decoding.costs import CostModel, CostPrior
from specdec.decoding.degrade import DraftAvailability
from specdec.decoding.ngram import shared_ngrams
from specdec.decoding.phases import PhaseGate
from specdec.decoding.request import (
    AUTO,
    ModelLimits,
    check_q_message_size,
    check_request_size,
    encode_prompt,
    prepare_request,
)
from specdec.decoding.round_loop import Completion, RoundLoop
from specdec.decoding.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from specdec.decoding.stopping import Delta
from specdec.deployments import health
from specdec.deployments.direct import Channels
from specdec.deployments.failures import ServiceUnavailable, grpc_status, retryable
from specdec.deployments.http_api import HTTP_APP, OpenAIRoutes
from specdec.deployments.http_health import HealthRoutes
from specdec.deployments.logs import route_specdec_logs
from specdec.deployments.metrics import RouterMetrics
from specdec.deployments.transport import HandleTransport
from specdec.errors import InvalidRequestError, MalformedRequest
from specdec.models.loading import (
    check_same_tokenizer,
    generation_defaults,
    load_tokenizer,
    read_chat_template,
)
from specdec.openai_api import RequestDefaults
from specdec.v1 import specdec_pb2, worker_pb2

log = logging.getLogger("ray.serve")


def sampling_params(request: specdec_pb2.GenerateRequest) -> SamplingParams:
    """SamplingParams from a GenerateRequest (unset fields take the defaults).

    Raises:
        InvalidRequestError naming the field.
    """

    def get(field, default):
        return getattr(request, field) if request.HasField(field) else default

    return SamplingParams(
        max_new_tokens=get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
        temperature=get("temperature", 0.0),
        top_k=get("top_k", 0),
        top_p=get("top_p", 1.0),
        seed=get("seed", None),
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
    )


# A router replica being scaled down holds whole requests (streams of many rounds), not single
# calls: it drains for up to graceful_shutdown_timeout_s (Serve's default, 20 s, is shorter than
# a long generation on a CPU) and checks every wait_loop_s whether its last stream has ended.
# The Kubernetes manifests give router pods at least this long to stop (k8s/base).
DRAIN_S = 300


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=256,
    graceful_shutdown_timeout_s=DRAIN_S,
    graceful_shutdown_wait_loop_s=1,
)
@serve.ingress(HTTP_APP)
class SpeculativeRouter(OpenAIRoutes, HealthRoutes):
    """Implements specdec.v1.SpeculativeDecoding (and grpc.health.v1.Health) on Serve's gRPC
    port, and the OpenAI-compatible HTTP API (specdec.deployments.http_api) on its HTTP port.
    With API keys configured (service.api_keys_file, api_keys_env; specdec.api_keys) both
    APIs answer only requests that carry one; health and readiness stay open.

    Args:
        draft, target: handles of the DraftModel and TargetModel deployments.
        config: the application's settings (specdec.config), parsed once by build_app: the
            router loads only the models' tokenizers, runs each request's rounds by
            config.speculation and calls the replicas within config.service's timeouts.
    """

    def __init__(
        self, draft: DeploymentHandle, target: DeploymentHandle, config: SpecdecConfig
    ) -> None:
        route_specdec_logs()  # the draft pool's availability changes
        self.config = config
        self.api_keys = ApiKeys.load(config.service.api_keys_file, config.service.api_keys_env)
        models, service = config.models, config.service
        self.tokenizer = load_tokenizer(models.target_model, models.target_revision)
        draft_tokenizer = load_tokenizer(models.draft_model, models.draft_revision)
        check_same_tokenizer(draft_tokenizer, self.tokenizer)
        if service.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(service.chat_template)
        generation = service.generation_config == "auto"
        self.http_defaults = RequestDefaults.of(
            generation_defaults(models.target_model, models.target_revision) if generation else {},
            service.default_max_tokens,
        )
        # A sampled round's q travels draft -> router -> target over Serve's per-replica gRPC
        # transport, whose receivers refuse messages past this many bytes.
        check_q_message_size(
            len(self.tokenizer), config.speculation, RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
        )
        self.draft = draft.options(_by_reference=False)
        self.target = target.options(_by_reference=False)
        self._channels = Channels() if config.service.direct_calls else None
        self.costs = CostModel(config.speculation)
        self.shared_ngrams = shared_ngrams(config.speculation)
        self.phases = PhaseGate() if config.speculation.alternate_phases else None
        self._prior_set = False
        self.draft_availability = DraftAvailability(
            config.service.draft_retry_s, probe=self._probe_draft, on_change=self._draft_changed
        )
        # One thread tokenizes every request's prompt, off the event loop and one at a time (a
        # flood of long prompts then costs one core, not one thread each).
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, "tokenize")
        self.metrics = RouterMetrics()
        self.metrics.draft_available.set(1)
        self._info = health.ModelInfoCache(
            {"draft": self.draft.model_info.remote, "target": self.target.model_info.remote},
            config.service.unavailable_after_s,
        )
        self._replicas = health.ReplicaCounts(
            lambda: _running_replicas({"draft": self.draft, "target": self.target})
        )

    async def Generate(
        self, request: specdec_pb2.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> specdec_pb2.GenerateResponse:
        """Unary generation: the whole completion with usage and stats. A client cancel or
        deadline stops the rounds and releases the session, as for a stream."""
        start = time.perf_counter()
        try:
            self._authenticate(grpc_context)
            completion = await (await self._round_loop(request)).complete()
        except asyncio.CancelledError:
            self.metrics.record_request("Generate", "CANCELLED")
            raise
        except Exception as err:  # noqa: BLE001 - every failure becomes a gRPC status
            self._fail("Generate", err, grpc_context)
            return specdec_pb2.GenerateResponse()
        self._succeed("Generate", completion, start)
        return _response(completion, request.logprobs)

    async def GenerateStream(
        self, request: specdec_pb2.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[specdec_pb2.GenerateResponse]:
        """One message per round with its new tokens and text; the last adds finish reason,
        usage and stats. A client cancel or deadline stops the rounds and releases the session."""
        start = time.perf_counter()
        try:
            self._authenticate(grpc_context)
            loop = await self._round_loop(request)
            async with contextlib.aclosing(loop.run()) as deltas:
                async for delta in deltas:
                    if delta.finish_reason is None:
                        yield _delta_message(delta, request.logprobs)
        except asyncio.CancelledError:
            self.metrics.record_request("GenerateStream", "CANCELLED")
            raise
        except Exception as err:  # noqa: BLE001
            self._fail("GenerateStream", err, grpc_context)
            raise  # a stream only reports its status code by raising
        final = _delta_message(delta, request.logprobs)
        _add_summary(final, loop.completion)
        self._succeed("GenerateStream", loop.completion, start)
        yield final

    async def GetModelInfo(
        self, request: specdec_pb2.ModelInfoRequest, grpc_context: RayServegRPCContext
    ) -> specdec_pb2.ModelInfo:
        try:
            self._authenticate(grpc_context)
            draft, target = await self._model_info(draft_wait_s=health.PROBE_S)
        except Exception as err:  # noqa: BLE001
            self._fail("GetModelInfo", err, grpc_context)
            return specdec_pb2.ModelInfo()
        service = self.config.service
        info = specdec_pb2.ModelInfo(
            target_model=target.name,
            vocab_size=target.vocab_size,
            target_context_limit=target.context_limit,
            context_limit=ModelLimits.of(target, draft, self.config.speculation).context_limit,
            draft_pool=service.draft_pool,
            target_pool=service.target_pool,
            target_dtype=target.dtype,
            max_speculative_tokens=self.config.speculation.max_speculative_tokens,
            target_calibration=target.calibration,
            simulated_costs=target.simulated_costs,
        )
        if draft is not None:  # else: no draft replica has answered yet (draft fields unset)
            info.draft_model = draft.name
            info.draft_context_limit = draft.context_limit
            info.draft_dtype = draft.dtype
            info.draft_calibration.CopyFrom(draft.calibration)
        return info

    async def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1: SERVING while a target replica runs once one has answered
        model_info, also while the draft is down; NOT_SERVING otherwise (see readiness). Waits
        at most health.PROBE_S seconds."""
        return health_pb2.HealthCheckResponse(status=await self._health_status())

    async def Watch(
        self, request: health_pb2.HealthCheckRequest
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """grpc.health.v1: the status now, then each change (checked every health.WATCH_POLL_S
        seconds) until the client cancels; the stream ends after health.WATCH_MAX_S seconds so
        that it never holds a draining replica (the client watches again)."""
        async for status in health.watch(self._health_status):
            yield health_pb2.HealthCheckResponse(status=status)

    async def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for HTTP /ready and gRPC health: ready while a target replica runs,
        once one has answered model_info; the draft only changes the reason ("degraded"). Waits
        at most health.PROBE_S seconds; never raises."""
        return await health.readiness(self._info, self._replicas)

    async def _health_status(self) -> int:
        ready, _ = await self.readiness()
        return (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def _round_loop(self, request: specdec_pb2.GenerateRequest) -> RoundLoop:
        """Validates and tokenizes; raises InvalidRequestError naming the field.

        Cheap checks first (the message parsed, sizes against config.service's limits, the
        sampling fields), then the tokenizer, in a worker thread: a long prompt never stalls
        the other requests' rounds on this replica's event loop.
        """
        if isinstance(request, MalformedRequest):
            raise InvalidRequestError("request", str(request))
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        check_request_size(
            request.prompt, messages, request.stop, request.stop_token_ids, self.config.service
        )
        params = sampling_params(request)
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool,
            encode_prompt,
            self.tokenizer,
            request.prompt or None,
            messages or None,
        )
        k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else AUTO
        prepared = prepare_request(
            prompt_ids,
            params,
            await self._limits(),
            k,
            proposer=request.proposer if request.HasField("proposer") else None,
            default_proposer=self.config.speculation.proposer,
        )
        transport = HandleTransport(
            self.draft,
            self.target,
            prepared.session_id,
            self.config.service,
            self._replicas,
            self._channels,
            self.metrics,
        )
        return RoundLoop(
            transport,
            self.tokenizer,
            prepared,
            self.costs,
            self.config.speculation,
            self.draft_availability,
            self.phases,
            self.shared_ngrams,
            draft_wait_s=self.config.service.draft_timeout_s,
        )

    async def _probe_draft(self) -> None:
        """Whether a draft replica answers (its model_info), within draft_timeout_s."""
        await asyncio.wait_for(self.draft.model_info.remote(), self.config.service.draft_timeout_s)

    def _draft_changed(self, available: bool) -> None:
        self.metrics.draft_available.set(int(available))

    async def _model_info(
        self, draft_wait_s: float = 0.0
    ) -> tuple[worker_pb2.ReplicaInfo | None, worker_pb2.ReplicaInfo]:
        """(draft, target) model_info. A request needs only the target's: the draft's is None
        when no draft replica has answered within draft_wait_s seconds (its fetch goes on in
        the background; requests run without the draft meanwhile).

        Raises:
            ServiceUnavailable: the target has not answered within unavailable_after_s.
        """
        try:
            target = await self._info.get("target")
        except Exception as err:  # noqa: BLE001 - retryable() decides; others propagate
            if not retryable(err):
                raise
            raise ServiceUnavailable(f"target deployment not answering: {err!r}") from err
        try:
            draft = await self._info.get("draft", draft_wait_s)
        except Exception:  # noqa: BLE001 - the draft is optional
            draft = None
        if not self._prior_set and draft is not None:
            # The replicas' start-up measurements price the first rounds of the first requests.
            prior = CostPrior.of(target.costs, draft.costs, self.config)
            if prior is not None:
                self.costs.set_prior(prior)
            self._prior_set = True
        return draft, target

    async def _limits(self) -> ModelLimits:
        draft, target = await self._model_info()
        return ModelLimits.of(target, draft, self.config.speculation)

    def _authenticate(self, grpc_context: RayServegRPCContext) -> None:
        """Checks the call's ``authorization`` metadata (``Bearer KEY``) against api_keys;
        Check and Watch never call it, so health stays open.

        Raises:
            specdec.errors.Unauthenticated: keys are configured and none of them was sent
                (_fail answers UNAUTHENTICATED and counts it; no session is opened).
        """
        metadata = dict(grpc_context.invocation_metadata())
        self.api_keys.check(metadata.get("authorization"))

    def _fail(self, method: str, err: Exception, grpc_context: RayServegRPCContext):
        code, details = grpc_status(err)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method)
        grpc_context.set_code(code)
        grpc_context.set_details(details)
        self.metrics.record_request(method, code.name)
        return code, details

    def _succeed(self, method: str, completion: Completion, start: float) -> None:
        self.metrics.record_request(method, "OK")
        self.metrics.record_completion(completion.stats, time.perf_counter() - start)


def _delta_message(delta: Delta, logprobs: bool) -> specdec_pb2.GenerateResponse:
    return specdec_pb2.GenerateResponse(
        text=delta.text, token_ids=delta.token_ids, logprobs=delta.logprobs if logprobs else ()
    )


def _add_summary(message: specdec_pb2.GenerateResponse, completion: Completion) -> None:
    message.finish_reason = completion.finish_reason
    message.usage.CopyFrom(
        specdec_pb2.Usage(
            prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens
        )
    )
    message.stats.CopyFrom(completion.stats.to_proto())


def _response(completion: Completion, logprobs: bool) -> specdec_pb2.GenerateResponse:
    message = specdec_pb2.GenerateResponse(
        text=completion.text,
        token_ids=completion.token_ids,
        logprobs=completion.logprobs if logprobs else (),
    )
    _add_summary(message, completion)
    return message


def _running_replicas(handles: dict[str, DeploymentHandle]) -> dict[str, int]:
    """{side: RUNNING replicas of the deployment behind its handle}, from Serve's status (a
    blocking call to the controller). Raises KeyError while an application or deployment is
    not in the status yet."""
    applications = serve.status().applications
    return {
        side: applications[h.app_name]
        .deployments[h.deployment_name]
        .replica_states.get("RUNNING", 0)
        for side, h in handles.items()
    }
