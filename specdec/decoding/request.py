"""Turning a user's request into validated token ids and limits: shared by engine and router."""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdec.config import PROPOSERS, ServiceConfig, SpeculationConfig
from specdec.decoding.sampling import SamplingParams
from specdec.errors import ConfigError, InvalidRequestError
from specdec.v1 import worker_pb2

AUTO = "auto"
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the deployed pair allows. context_limit: tokens, the smaller model's."""

    vocab_size: int
    context_limit: int
    max_speculative_tokens: int
    eos_token_ids: frozenset[int]

    @classmethod
    def of(
        cls,
        target: worker_pb2.ReplicaInfo,
        draft: worker_pb2.ReplicaInfo | None,
        config: SpeculationConfig,
    ) -> ModelLimits:
        """The pair's limits from its replicas' infos (specdec.worker.info.replica_info): the
        target's vocabulary and EOS ids, the smaller context limit (the target's alone while
        no draft replica has answered: ``draft`` None), and config's max_speculative_tokens.
        The router, its HTTP API and the in-process engine all build their limits here."""
        contexts = [target.context_limit] + ([draft.context_limit] if draft is not None else [])
        return cls(
            vocab_size=target.vocab_size,
            context_limit=min(contexts),
            max_speculative_tokens=config.max_speculative_tokens,
            eos_token_ids=frozenset(target.eos_token_ids),
        )


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A validated request.

    Attributes:
        max_new_tokens: the request's limit, capped so prompt + completion fit the context.
        num_speculative_tokens: fixed k, or None for adaptive.
        seed: the request's seed, or a fresh random one.
        proposer: who proposes each round's tokens: one of specdec.config.PROPOSERS
            (SpeculationConfig.proposer explains each).
    """

    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    num_speculative_tokens: int | None
    seed: int
    stop_token_ids: frozenset[int]
    proposer: str = AUTO


# Bytes of one sparse q entry on the wire, at most: its token id (a varint of up to 5 bytes for
# the int32s of a vocabulary, 3 for ids below 2**21) and its float32 probability.
Q_ENTRY_BYTES = 4 + 4
# Room the rest of a propose answer or verify call takes beside q: the session's new token ids
# (a rebuild resends the whole sequence, up to 5 bytes per id) and a few scalars. 1 MiB holds
# a rebuild of a 200,000-token sequence.
Q_MESSAGE_HEADROOM_BYTES = 1024**2


def check_request_size(
    prompt: str,
    messages: Sequence[dict[str, Any]],
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    limits: ServiceConfig,
) -> None:
    """Checks a request's sizes against the service's limits, before any work on it: counts
    first, then lengths (O(1) per item, never a scan of one huge string but for its encoding).

    Args:
        prompt: the text prompt ("" when unset); messages: [{"role", "content"}].
        limits: ServiceConfig's max_prompt_bytes, max_messages, max_stop_strings,
            max_stop_string_chars, max_stop_token_ids.
    Raises:
        InvalidRequestError naming the field and the limit (INVALID_ARGUMENT).
    """
    _at_most("messages", len(messages), limits.max_messages, "messages", "max_messages")
    _at_most("stop", len(stop), limits.max_stop_strings, "strings", "max_stop_strings")
    _at_most(
        "stop_token_ids",
        len(stop_token_ids),
        limits.max_stop_token_ids,
        "ids",
        "max_stop_token_ids",
    )
    for i, s in enumerate(stop):
        _at_most(
            f"stop[{i}]",
            len(s),
            limits.max_stop_string_chars,
            "characters",
            "max_stop_string_chars",
        )
    field = "messages" if messages else "prompt"
    texts = [prompt, *(m.get("content") or "" for m in messages)]
    # A character takes 1 to 4 UTF-8 bytes: past the limit in characters is past it in bytes
    # (refused without encoding a huge text); only a text within 4x of it needs encoding.
    size = sum(len(text) for text in texts)
    if limits.max_prompt_bytes < size * 4 and size <= limits.max_prompt_bytes:
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    _at_most(field, size, limits.max_prompt_bytes, "bytes", "max_prompt_bytes")


def _at_most(field: str, value: int, limit: int, unit: str, setting: str) -> None:
    if value > limit:
        raise InvalidRequestError(field, f"has {value} {unit}; the limit is {limit} ({setting})")


def q_message_bytes(vocab_size: int, speculation: SpeculationConfig) -> int:
    """Bytes of the largest sampled round's q on the wire, headroom for the rest of the message
    included: k_max rows of min(draft_top_n or vocab_size, vocab_size) entries of Q_ENTRY_BYTES
    (specdec.decoding.sampling.truncate_top_n)."""
    top_n = speculation.draft_top_n
    width = vocab_size if top_n <= 0 or top_n >= vocab_size else top_n
    return speculation.max_speculative_tokens * width * Q_ENTRY_BYTES + Q_MESSAGE_HEADROOM_BYTES


def check_q_message_size(vocab_size: int, speculation: SpeculationConfig, cap_bytes: int) -> None:
    """Refuses at start-up a draft_top_n whose q would not fit the transport's message cap
    (Ray Serve's per-replica gRPC transport: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH, 4 MiB
    by default) at k = max_speculative_tokens and any temperature.

    Raises:
        ConfigError naming draft_top_n, with the sizes and the largest draft_top_n that fits.
    """
    size = q_message_bytes(vocab_size, speculation)
    if size <= cap_bytes:
        return
    rows = speculation.max_speculative_tokens
    fits = max(0, (cap_bytes - Q_MESSAGE_HEADROOM_BYTES) // (rows * Q_ENTRY_BYTES))
    raise ConfigError(
        "draft_top_n",
        f"{speculation.draft_top_n} makes a sampled round's q {size} bytes "
        f"({rows} rows of {vocab_size if speculation.draft_top_n == 0 else speculation.draft_top_n}"
        f" tokens x {Q_ENTRY_BYTES} bytes, plus {Q_MESSAGE_HEADROOM_BYTES} for the rest), past "
        f"the {cap_bytes}-byte message cap of Serve's replica transport "
        f"(RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH); use draft_top_n <= {fits} with "
        f"max_speculative_tokens {rows}, or raise that cap on every replica",
    )


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | Sequence[int] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a text prompt, a list of ids, or chat messages (rendered with the chat
    template, generation prompt appended). Exactly one of ``prompt`` and ``messages`` is set.

    Raises:
        InvalidRequestError: both or neither given, an empty prompt, a malformed message, or a
            tokenizer without a chat template.
    """
    has_prompt = prompt is not None and len(prompt) > 0
    has_messages = messages is not None and len(messages) > 0
    if has_prompt == has_messages:
        field = "prompt" if prompt is not None or not messages else "messages"
        raise InvalidRequestError(field, "set exactly one of prompt and messages, non-empty")
    if has_messages:
        return _encode_chat(tokenizer, messages)
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return [int(t) for t in prompt]


def _encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]]
) -> list[int]:
    for i, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role",
                f"must be one of {sorted(CHAT_ROLES)}, got {message.get('role')!r}",
            )
        if not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "messages", "the target tokenizer has no chat template; send a prompt"
        )
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def prepare_request(
    prompt_ids: list[int],
    params: SamplingParams,
    limits: ModelLimits,
    num_speculative_tokens: int | str | None = AUTO,
    session_id: str | None = None,
    proposer: str | None = None,
    default_proposer: str = AUTO,
) -> PreparedRequest:
    """Validates a tokenized request against the model pair's limits.

    ``proposer`` None (unset) takes ``default_proposer`` (the service's
    SpeculationConfig.proposer).

    Raises:
        InvalidRequestError: empty prompt, ids outside the vocabulary, a prompt that leaves no room
            in the context, a stop token id not below the vocabulary size, max_new_tokens past
            the context limit, k outside [0, k_max], or a proposer not in PROPOSERS.
    """
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("prompt", "is empty")
    if any(not 0 <= t < limits.vocab_size for t in prompt_ids):
        raise InvalidRequestError("prompt", f"token ids must be in [0, {limits.vocab_size})")
    if n >= limits.context_limit:
        raise InvalidRequestError(
            "prompt",
            f"has {n} tokens; the context limit is "
            f"{limits.context_limit}, leaving no room to generate",
        )
    bad_stop = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError(
            "stop_token_ids",
            f"ids must be below the vocabulary size {limits.vocab_size}, got {bad_stop}",
        )
    if params.max_new_tokens > limits.context_limit:
        raise InvalidRequestError(
            "max_new_tokens",
            f"{params.max_new_tokens} exceeds the context limit of {limits.context_limit} tokens",
        )
    return PreparedRequest(
        session_id=session_id or uuid.uuid4().hex,
        prompt_ids=list(prompt_ids),
        params=params,
        max_new_tokens=min(params.max_new_tokens, limits.context_limit - n),
        num_speculative_tokens=_parse_k(num_speculative_tokens, limits.max_speculative_tokens),
        seed=params.seed if params.seed is not None else secrets.randbits(63),
        stop_token_ids=limits.eos_token_ids | frozenset(params.stop_token_ids),
        proposer=_parse_proposer(default_proposer if proposer is None else proposer),
    )


def _parse_proposer(value: object) -> str:
    if value not in PROPOSERS:
        raise InvalidRequestError("proposer", f"must be one of {list(PROPOSERS)}, got {value!r}")
    return value


def _parse_k(value: int | str | None, k_max: int) -> int | None:
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= k_max:
        raise InvalidRequestError(
            "num_speculative_tokens", f"must be 'auto' or an integer in [0, {k_max}], got {value!r}"
        )
    return value
