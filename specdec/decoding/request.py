"""Turning a user's request into validated token ids and limits: shared by engine and router."""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from specdec.decoding.sampling import SamplingParams
from specdec.errors import InvalidRequestError

AUTO = "auto"
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the deployed pair allows. context_limit: tokens, the smaller model's."""

    vocab_size: int
    context_limit: int
    max_speculative_tokens: int
    eos_token_ids: frozenset[int]


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A validated request.

    Attributes:
        max_new_tokens: the request's limit, capped so prompt + completion fit the context.
        num_speculative_tokens: fixed k, or None for adaptive.
        seed: the request's seed, or a fresh random one.
    """

    session_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    num_speculative_tokens: int | None
    seed: int
    stop_token_ids: frozenset[int]


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
) -> PreparedRequest:
    """Validates a tokenized request against the model pair's limits.

    Raises:
        InvalidRequestError: empty prompt, ids outside the vocabulary, a prompt that leaves no room
            in the context, max_new_tokens past the context limit, or k outside [0, k_max].
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
    )


def _parse_k(value: int | str | None, k_max: int) -> int | None:
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= k_max:
        raise InvalidRequestError(
            "num_speculative_tokens", f"must be 'auto' or an integer in [0, {k_max}], got {value!r}"
        )
    return value
