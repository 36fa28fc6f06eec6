"""The OpenAI-compatible HTTP API's mapping: request bodies in, response objects out.

No Ray and no web framework here (specdec.deployments.http_api serves it). A JSON body of
``POST /v1/completions`` or ``POST /v1/chat/completions`` becomes a specdec.v1 GenerateRequest,
the very message the gRPC API takes, so both APIs share the router's one validation
(specdec.decoding.request, SamplingParams.validate) and its one round loop. This module checks
only what the wire types and OpenAI's shapes need, and refuses what specdec cannot honour (``n``
> 1, ``best_of``, tools, penalties, ``logit_bias``, ``response_format``, ``suffix``, ``echo``,
top-k alternatives in ``logprobs``, any unknown field), naming the field in OpenAI's error
object. A JSON ``null`` counts as leaving a field out. The round loop's Delta and Completion then
become OpenAI's completion objects and server-sent-event chunks, with the request's
SpeculationStats (its wire form, as in gRPC) in the extension field ``specdec_stats``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2

if TYPE_CHECKING:
    from specdec.decoding.round_loop import Completion
    from specdec.decoding.stats import SpeculationStats
    from specdec.decoding.stopping import Delta

COMPLETIONS = "completions"
CHAT = "chat"
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
STATS_FIELD = "specdec_stats"
DONE = b"data: [DONE]\n\n"

# "user" only labels the end user for the caller's own records: accepted and ignored.
_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "logprobs",
        "user",
        # specdec's extensions, as in gRPC's GenerateRequest
        "top_k",
        "num_speculative_tokens",
        "proposer",
        "stop_token_ids",
    }
)
_ACCEPTED = {
    COMPLETIONS: _COMMON | {"prompt"},
    CHAT: _COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
}
_ONE_CHOICE = "specdec returns one choice per request"
_EXACT = "would change the target's distribution, which speculative decoding reproduces exactly"
# Fields specdec cannot honour, per endpoint: accepted only with the value that asks for nothing.
_NEUTRAL: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    COMPLETIONS: {
        "n": (lambda v: v == 1, _ONE_CHOICE),
        "best_of": (lambda v: v == 1, _ONE_CHOICE),
        "echo": (lambda v: v is False, "echoing the prompt is not supported"),
        "suffix": (lambda v: v == "", "suffixes (insertion) are not supported"),
        "presence_penalty": (lambda v: v == 0, _EXACT),
        "frequency_penalty": (lambda v: v == 0, _EXACT),
        "logit_bias": (lambda v: v == {}, _EXACT),
    },
    CHAT: {
        "n": (lambda v: v == 1, _ONE_CHOICE),
        "presence_penalty": (lambda v: v == 0, _EXACT),
        "frequency_penalty": (lambda v: v == 0, _EXACT),
        "logit_bias": (lambda v: v == {}, _EXACT),
        "tools": (lambda v: v == [], "tool calling is not supported"),
        "tool_choice": (lambda v: v == "none", "tool calling is not supported"),
        "parallel_tool_calls": (lambda v: False, "tool calling is not supported"),
        "functions": (lambda v: v == [], "function calling is not supported"),
        "function_call": (lambda v: v == "none", "function calling is not supported"),
        "response_format": (
            lambda v: v == {"type": "text"},
            "structured output is not supported; only {'type': 'text'}",
        ),
    },
}
_CHAT_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
_NO_ALTERNATIVES = (
    "top alternatives are not available: specdec returns the target's log-probability of "
    "each chosen token only"
)


class OpenAIError(Exception):
    """An error answered as OpenAI's error object.

    Attributes:
        status: the HTTP status (400 bad input, 401 no accepted API key, 404 unknown model, 500
            internal, 503 no replica
            answered).
        message: starts with the field's name when ``param`` is set.
        param: the request field at fault, or None.
        code: a short machine-readable reason (``unsupported_parameter``, ``invalid_value``...).
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def bad(cls, param: str | None, reason: str, code: str = "invalid_value") -> OpenAIError:
        """A 400 naming ``param``; the message is ``"param: reason"``."""
        return cls(400, f"{param}: {reason}" if param else reason, param, code)

    def body(self) -> dict[str, dict[str, Any]]:
        """``{"error": {"message", "type", "param", "code"}}``; type ``invalid_request_error``
        for 4xx, ``server_error`` for 5xx, as OpenAI answers."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclasses.dataclass(frozen=True)
class OpenAIRequest:
    """A parsed body of one of the two endpoints.

    Attributes:
        endpoint: COMPLETIONS or CHAT.
        request: what the router runs (the gRPC API's message).
        model: the ``model`` asked for, or None.
        stream: answer with server-sent events.
        include_usage: stream_options.include_usage: a last chunk with usage and no choices.
        logprobs: return the target's raw log-probability of each chosen token.
        max_tokens_param: the field that set the token limit, named in errors about it.
    """

    endpoint: str
    request: specdec_pb2.GenerateRequest
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    max_tokens_param: str = "max_tokens"

    def invalid(self, err: InvalidRequestError) -> OpenAIError:
        """The router's InvalidRequestError (naming a GenerateRequest field) as a 400 naming
        the OpenAI field that carried it."""
        renames = {"max_new_tokens": self.max_tokens_param}
        if self.endpoint == CHAT:
            renames["prompt"] = "messages"
        param = renames.get(err.field, err.field)
        return OpenAIError.bad(param, err.message)

    def check_model(self, served: str) -> None:
        """Raises OpenAIError (404, param ``model``) when the request names another model."""
        if self.model is not None and self.model != served:
            message = f"model: {self.model!r} is not served here; use {served!r}"
            raise OpenAIError(404, message, "model", "model_not_found")


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """What an HTTP request's unset sampling fields and token limit take
    (specdec.config.ServiceConfig.generation_config and default_max_tokens): the target's
    generation_config where it sets them, else OpenAI's defaults. The gRPC API keeps its own
    (greedy, 64 tokens: specdec.v1 GenerateRequest).

    Attributes:
        temperature, top_p, top_k: as GenerateRequest's; top_k 0 is off.
        max_tokens: completion tokens, or None for up to the context limit.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None

    @classmethod
    def of(
        cls, generation: Mapping[str, float | int], default_max_tokens: int | None = None
    ) -> RequestDefaults:
        """From a model's generation defaults (specdec.models.loading.generation_defaults:
        temperature, top_p, top_k, max_new_tokens, each optional) and the service's
        default_max_tokens, used where the model sets no max_new_tokens."""
        base = cls()
        return cls(
            temperature=float(generation.get("temperature", base.temperature)),
            top_p=float(generation.get("top_p", base.top_p)),
            top_k=int(generation.get("top_k", base.top_k)),
            max_tokens=generation.get("max_new_tokens", default_max_tokens),
        )

    def apply(self, request: specdec_pb2.GenerateRequest, context_limit: int) -> None:
        """Sets ``request``'s unset temperature, top_p, top_k and max_new_tokens (the last at
        most ``context_limit`` tokens: the router caps it to what the prompt leaves)."""
        for field in ("temperature", "top_p", "top_k"):
            if not request.HasField(field):
                setattr(request, field, getattr(self, field))
        if not request.HasField("max_new_tokens"):
            request.max_new_tokens = min(self.max_tokens or context_limit, context_limit)


def parse(endpoint: str, body: Any) -> OpenAIRequest:
    """Maps a JSON body of ``endpoint`` (COMPLETIONS or CHAT) to an OpenAIRequest.

    Values are checked only for their JSON type and for what specdec refuses; ranges
    (temperature >= 0, max_tokens >= 1, ...) are the router's, checked when it runs the request.

    Raises:
        OpenAIError: 400 naming the first unknown or unsupported field, or a field of the wrong
            type.
    """
    if not isinstance(body, dict):
        raise OpenAIError.bad(None, "the request body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}
    _refuse_unsupported(endpoint, body)
    request = specdec_pb2.GenerateRequest()
    if endpoint == CHAT:
        request.messages.extend(_messages(body.get("messages")))
    else:
        request.prompt = _prompt(body.get("prompt"))
    max_tokens_param = _set_limit(request, body, endpoint)
    for param, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("seed", int)):
        if param in body:
            _set(request, param, _typed(body, param, kind), param)
    k = body.get("num_speculative_tokens", "auto")
    if k != "auto":
        if not _is(k, int):
            raise OpenAIError.bad(
                "num_speculative_tokens", f"must be 'auto' or an integer, got {k!r}", "invalid_type"
            )
        _set(request, "num_speculative_tokens", k)
    if "proposer" in body:
        # Its value is the router's to check (prepare_request), as for gRPC.
        request.proposer = _typed(body, "proposer", str)
    stop = body.get("stop", [])
    request.stop.extend(_list_of(body, "stop", str, [stop] if isinstance(stop, str) else stop))
    request.stop_token_ids.extend(_list_of(body, "stop_token_ids", int))
    stream = _typed(body, "stream", bool, False)
    logprobs = _logprobs(endpoint, body)
    request.logprobs = logprobs
    return OpenAIRequest(
        endpoint=endpoint,
        request=request,
        model=_typed(body, "model", str, None),
        stream=stream,
        include_usage=_include_usage(body, stream),
        logprobs=logprobs,
        max_tokens_param=max_tokens_param,
    )


def _refuse_unsupported(endpoint: str, body: dict[str, Any]) -> None:
    neutral = _NEUTRAL[endpoint]
    for name, value in body.items():
        if name in neutral:
            is_neutral, reason = neutral[name]
            if not is_neutral(value):
                raise OpenAIError.bad(name, f"{reason}; got {value!r}", "unsupported_parameter")
        elif name not in _ACCEPTED[endpoint]:
            raise OpenAIError.bad(name, f"unknown field for {PATHS[endpoint]}", "unknown_parameter")


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def _is(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)


def _typed(body: Mapping[str, Any], param: str, kind: type, default: Any = None) -> Any:
    """body[param] when it is of ``kind`` (JSON's: a bool is no integer), else ``default`` when
    absent. Raises OpenAIError (400, ``invalid_type``) otherwise."""
    if param not in body:
        return default
    value = body[param]
    if not _is(value, kind):
        raise OpenAIError.bad(param, f"must be {_KIND_NAMES[kind]}, got {value!r}", "invalid_type")
    return value


def _list_of(body: Mapping[str, Any], param: str, kind: type, value: Any = None) -> list:
    value = body.get(param, []) if value is None else value
    if not isinstance(value, list) or not all(_is(v, kind) for v in value):
        raise OpenAIError.bad(
            param, f"must be a list of {_KIND_NAMES[kind].split()[-1]}s", "invalid_type"
        )
    return value


def _set(request: specdec_pb2.GenerateRequest, field: str, value: Any, param: str = "") -> None:
    """Sets a GenerateRequest field; a value its wire type cannot hold (a negative seed, an
    integer past int32) is a 400 naming ``param`` (default: the field)."""
    try:
        setattr(request, field, value)
    except (TypeError, ValueError):
        raise OpenAIError.bad(param or field, f"{value!r} is out of range") from None


def _set_limit(request: specdec_pb2.GenerateRequest, body: dict[str, Any], endpoint: str) -> str:
    """Sets max_new_tokens from max_tokens or (chat) max_completion_tokens; returns the field
    named in errors about the limit."""
    names = [n for n in ("max_completion_tokens", "max_tokens") if n in body]
    values = {_typed(body, name, int) for name in names}
    if len(values) > 1:
        raise OpenAIError.bad(names[0], "differs from max_tokens; set one of them")
    param = names[0] if names else "max_tokens"
    if values:
        _set(request, "max_new_tokens", values.pop(), param)
    return param


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise OpenAIError.bad("prompt", "one prompt per request", "unsupported_parameter")
    raise OpenAIError.bad("prompt", "must be a string (token-id prompts are not supported)")


def _messages(messages: Any) -> list[specdec_pb2.ChatMessage]:
    """ChatMessages from OpenAI's messages: content a string or a list of text parts (joined
    with newlines); roles are checked by the router."""
    if messages is None:
        return []
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise OpenAIError.bad("messages", "must be a list of objects", "invalid_type")
    out = []
    for i, message in enumerate(messages):
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v)
        if extra:
            raise OpenAIError.bad(
                f"messages[{i}].{extra[0]}", "is not supported", "unsupported_parameter"
            )
        role = message.get("role", "")
        if not isinstance(role, str):
            raise OpenAIError.bad(f"messages[{i}].role", "must be a string", "invalid_type")
        out.append(
            specdec_pb2.ChatMessage(
                role=_CHAT_ROLE_ALIASES.get(role, role), content=_content(message, i)
            )
        )
    return out


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    raise OpenAIError.bad(
        f"messages[{i}].content", "must be a string or a list of text parts", "invalid_type"
    )


def _logprobs(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether to return chosen-token logprobs. Completions: ``logprobs`` is an integer count
    of alternatives and only 0 is served; chat: ``logprobs`` a boolean and ``top_logprobs``
    0."""
    if endpoint == COMPLETIONS:
        count = _typed(body, "logprobs", int)
        if count is not None and count != 0:
            raise OpenAIError.bad("logprobs", f"only 0 is supported; {_NO_ALTERNATIVES}")
        return count is not None
    top = _typed(body, "top_logprobs", int, 0)
    if top != 0:
        raise OpenAIError.bad("top_logprobs", f"only 0 is supported; {_NO_ALTERNATIVES}")
    return _typed(body, "logprobs", bool, False)


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise OpenAIError.bad("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise OpenAIError.bad("stream_options", "must be an object", "invalid_type")
    for name in options:
        if name != "include_usage":
            raise OpenAIError.bad(f"stream_options.{name}", "unknown field", "unknown_parameter")
    return bool(_typed(options, "include_usage", bool, False))


def stats_object(stats: SpeculationStats) -> dict[str, Any]:
    """One request's speculation stats as gRPC carries them (SpeculationStats.to_proto: raw
    counters and derived figures, proto field names), as a JSON object."""
    return json_format.MessageToDict(
        stats.to_proto(),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )


def usage_object(completion: Completion) -> dict[str, int]:
    """OpenAI's usage: prompt, completion and total tokens."""
    prompt, generated = completion.prompt_tokens, completion.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Responder:
    """Builds the answers to one parsed request.

    Args:
        request: the parsed request.
        model: the served model's id (the target's name).
        token_text: a token id's text (the tokenizer's decoding of it alone), for logprobs; a
            token holding part of a multi-byte character decodes to U+FFFD, and ``bytes`` are
            those of that text (as vLLM answers).
    """

    def __init__(
        self, request: OpenAIRequest, model: str, token_text: Callable[[int], str]
    ) -> None:
        self.request = request
        chat = request.endpoint == CHAT
        self._object = "chat.completion" if chat else "text_completion"
        self._chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self._head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model,
        }
        self._token_text = token_text
        self._text_offset = 0  # completions: characters of token text before the next token

    @property
    def _chat(self) -> bool:
        return self.request.endpoint == CHAT

    def response(self, completion: Completion) -> dict[str, Any]:
        """The unary answer: one choice, usage and ``specdec_stats``."""
        logprobs = self._logprobs(completion.token_ids, completion.logprobs)
        if self._chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": completion.text}}
        else:
            choice = {"index": 0, "text": completion.text}
        choice |= {"logprobs": logprobs, "finish_reason": completion.finish_reason}
        return {
            **self._head,
            "object": self._object,
            "choices": [choice],
            "usage": usage_object(completion),
            STATS_FIELD: stats_object(completion.stats),
        }

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chunks before any token: chat's role announcement (as OpenAI sends it)."""
        if not self._chat:
            return []
        return [self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None})]

    def delta_chunks(self, delta: Delta) -> list[dict[str, Any]]:
        """The chunk of one round's new text (and logprobs, when asked for); none when the
        round added neither (text held back for a possible stop string)."""
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        if not delta.text and not (logprobs and delta.token_ids):
            return []
        body = {"delta": {"content": delta.text}} if self._chat else {"text": delta.text}
        return [self._chunk(body | {"logprobs": logprobs})]

    def final_chunks(self, completion: Completion) -> list[dict[str, Any]]:
        """The finish_reason chunk, carrying ``specdec_stats``; then, with include_usage, the
        usage chunk with no choices."""
        body = {"delta": {}} if self._chat else {"text": ""}
        finish = self._chunk(body | {"logprobs": None}, completion.finish_reason)
        finish[STATS_FIELD] = stats_object(completion.stats)
        if not self.request.include_usage:
            return [finish]
        usage = {**self._head, "object": self._chunk_object, "choices": []}
        return [finish, usage | {"usage": usage_object(completion)}]

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk = {
            **self._head,
            "object": self._chunk_object,
            "choices": [{"index": 0, **choice, "finish_reason": finish_reason}],
        }
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        """OpenAI's logprobs of the chosen tokens, or None when not asked for. Chat:
        ``{"content": [{token, logprob, bytes, top_logprobs: []}]}``; completions: ``{tokens,
        token_logprobs, top_logprobs: None, text_offset}`` (offsets count the tokens' texts)."""
        if not self.request.logprobs:
            return None
        texts = [self._token_text(t) for t in token_ids]
        if self._chat:
            return {
                "content": [
                    {
                        "token": text,
                        "logprob": logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [],
                    }
                    for text, logprob in zip(texts, logprobs)
                ]
            }
        offsets = []
        for text in texts:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }
