"""The service concern of specdec's settings (specdec.config): the router's timeouts, the
limits of a request, the HTTP API's defaults and names, API keys. specdec.config.SpecdecConfig
holds it as ``service``; ``from specdec.config import ServiceConfig`` reaches it too.

Imports neither Ray nor torch, as specdec.config.
"""

from __future__ import annotations

import dataclasses
import math
import re

from specdec.config_fields import Section, at_least, require

# Where HTTP requests' unset sampling fields come from (generation_config): the target's
# generation_config.json ("auto", as vLLM's --generation-config) or nothing.
GENERATION_CONFIGS = ("auto", "none")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class ServiceConfig(Section):
    """service: the router's timeouts, the limits of a request, and the pools it reports."""

    call_timeout_s: float = 20.0
    """Seconds one propose or verify call may take before the router retries it (Serve routes
    the retry to a live replica). Must be below `unavailable_after_s`, so that a call that
    waits for a replica that does not exist is retried, and the request ends in time."""

    unavailable_after_s: float = 30.0
    """Seconds after which a request whose calls find no replica fails with UNAVAILABLE: the
    retries of a failed or timed-out call stop there (a retry never outlasts it), and so does
    the wait for the replicas' model info. A request no target replica has answered yet fails
    sooner: once the router counts no RUNNING target replica (readiness is NOT_SERVING then
    too)."""

    draft_timeout_s: float = 10.0
    """Seconds a decode round's propose may take. Past it, or on any error of the draft side,
    the request goes on without the draft (k = 0: the target alone, still exact; its stats
    count `rounds_without_draft`), and so do the router's other requests until the draft
    answers again (see `draft_retry_s`). A draft call that carries a whole sequence (the
    prompt's prefill, a rebuild) may take `call_timeout_s`, but a round waits for it at most
    this long: past it, the call runs on in the background as the draft's prefill."""

    direct_calls: bool = False
    """A session's propose and verify calls go straight to the replica that holds its cache, as
    the messages of one gRPC stream per session and side (specdec.deployments.direct), not
    through Serve's handle path each round: about a millisecond less a call than through Serve,
    and a stream's message about half a millisecond less than a unary gRPC call. Serve still
    places each session (a lease, one ongoing request on its replica for the session's life,
    for up to `max_batch_size` sessions a replica: autoscaling and draining count them); a
    direct call that fails goes through Serve instead. Off by default while it is new."""

    draft_retry_s: float = 1.0
    """Seconds from a draft failure to the router's first check that a draft replica answers
    again (its model info, in the background); each failed check doubles the wait, up to
    30 s. Speculation resumes once the check answers."""

    max_prompt_bytes: int = 1024**2
    """The largest prompt, in UTF-8 bytes of `prompt` or of all `messages` contents together;
    a larger one is refused with INVALID_ARGUMENT before it is tokenized."""

    max_messages: int = 256
    """The most chat `messages` one request may hold (INVALID_ARGUMENT past it)."""

    max_stop_strings: int = 16
    """The most `stop` strings one request may hold; each is searched for in every round."""

    max_stop_string_chars: int = 256
    """The longest `stop` string, in characters."""

    max_stop_token_ids: int = 256
    """The most `stop_token_ids` one request may hold (each must be below the vocabulary
    size)."""

    max_request_bytes: int = 8 * 1024**2
    """The largest request body the HTTP API reads, in bytes (larger: 413). The gRPC proxy's
    own bound is Ray Serve's `RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`, which specdec's deploy sets to
    this value (the shipped configs set it under `controller_options`); past it gRPC answers
    RESOURCE_EXHAUSTED. Keep it above `max_prompt_bytes`, so that a long prompt gets the
    INVALID_ARGUMENT that names it."""

    draft_pool: str = "draft_pool"
    """The Ray custom resource of the draft replicas, as GetModelInfo reports it (the config's
    `ray_actor_options` place the replicas)."""

    target_pool: str = "target_pool"
    """The Ray custom resource of the target replicas, as `draft_pool`."""

    served_model_name: str | None = None
    """The model's name in the HTTP API: the `id` of `/v1/models` and the `model` requests
    must name (another one is a 404). Null: the target replica's model name (the folder it
    loaded; `specdec serve` sets the Hub id or URI here when it downloads one first)."""

    chat_template: str | None = None
    """A Jinja chat template for `messages`, replacing the target tokenizer's: the template
    itself, or the path of a file holding it (`~` expanded). Null: the tokenizer's own."""

    generation_config: str = "auto"
    """Where an HTTP (OpenAI API) request's unset `temperature`, `top_p`, `top_k` and
    `max_tokens` come from, as vLLM's `--generation-config`. `auto`: the values the target's
    `generation_config.json` sets (its `repetition_penalty` or `min_p` are not applied; the
    router logs them), then OpenAI's defaults (temperature 1, top_p 1, no top-k); `none`:
    OpenAI's defaults alone. The gRPC API keeps its own defaults (greedy, 64 tokens)."""

    default_max_tokens: int | None = None
    """The token limit of an HTTP request that sets neither `max_tokens` nor
    `max_completion_tokens`, where the target's generation_config sets no `max_new_tokens`:
    null generates up to the context limit (or a stop), as OpenAI and vLLM do; a number caps
    what a client that leaves the field out can cost."""

    api_keys_file: str | None = None
    """A file of API keys, one a line (blank lines and `#` comments skipped), read by each
    router replica at start-up: then every data-plane request needs one of them
    (`Authorization: Bearer KEY` on HTTP, the `authorization` metadata on gRPC; else 401 or
    UNAUTHENTICATED); health, readiness and metrics stay open. A missing or unreadable file,
    or one without a key, fails the router's start. Unset, and no key in `api_keys_env`:
    authentication is off (see docs/security.md)."""

    api_keys_env: str | None = "SPECDEC_API_KEYS"
    """The environment variable of the router's processes whose comma-separated keys are
    accepted too (a Kubernetes Secret through `secretKeyRef`); unset or empty adds none; null
    reads no variable. Several keys at once let a new one roll out before the old one goes."""

    def _check(self) -> None:
        for name in ("call_timeout_s", "unavailable_after_s", "draft_timeout_s", "draft_retry_s"):
            value = getattr(self, name)
            require(name, math.isfinite(value) and value > 0, f"must be > 0 seconds, got {value}")
        require(
            "call_timeout_s",
            self.call_timeout_s < self.unavailable_after_s,
            f"must be below unavailable_after_s ({self.unavailable_after_s} s), got "
            f"{self.call_timeout_s} s: a call waiting for a missing replica would then never be "
            "retried, and a request would wait call_timeout_s, past unavailable_after_s",
        )
        for name in (
            "max_prompt_bytes",
            "max_messages",
            "max_stop_strings",
            "max_stop_string_chars",
            "max_stop_token_ids",
        ):
            at_least(name, getattr(self, name), 1)
        require(
            "max_request_bytes",
            self.max_request_bytes > self.max_prompt_bytes,
            f"must be above max_prompt_bytes ({self.max_prompt_bytes}), got "
            f"{self.max_request_bytes}",
        )
        for name in ("draft_pool", "target_pool"):
            require(name, getattr(self, name) != "", "must not be empty")
        require(
            "generation_config",
            self.generation_config in GENERATION_CONFIGS,
            f"must be one of {list(GENERATION_CONFIGS)}, got {self.generation_config!r}",
        )
        if self.default_max_tokens is not None:
            at_least("default_max_tokens", self.default_max_tokens, 1)
        require("served_model_name", self.served_model_name != "", "must be a name or null")
        require("chat_template", self.chat_template != "", "must be a template, a path or null")
        require("api_keys_file", self.api_keys_file != "", "must be a path or null")
        require(
            "api_keys_env",
            self.api_keys_env is None or _ENV_NAME.fullmatch(self.api_keys_env) is not None,
            f"must be an environment variable's name or null, got {self.api_keys_env!r}",
        )
