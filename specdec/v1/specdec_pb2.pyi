from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "num_speculative_tokens", "logprobs", "proposer")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    logprobs: bool
    proposer: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., proposer: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_tokens", "accepted_per_position", "ttft_s", "tokens_per_second", "draft_time_s", "verify_time_s", "overhead_time_s", "mean_k", "prefill_draft_time_s", "prefill_verify_time_s", "drafted_per_position", "completion_tokens", "wall_time_s", "rounds_without_draft", "ngram_rounds", "ngram_draft_tokens", "ngram_accepted_tokens", "mixed_rounds", "overlapped_rounds", "wasted_draft_tokens")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_K_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_WITHOUT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    NGRAM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIXED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    WASTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_tokens: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    ttft_s: float
    tokens_per_second: float
    draft_time_s: float
    verify_time_s: float
    overhead_time_s: float
    mean_k: float
    prefill_draft_time_s: float
    prefill_verify_time_s: float
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    completion_tokens: int
    wall_time_s: float
    rounds_without_draft: int
    ngram_rounds: int
    ngram_draft_tokens: int
    ngram_accepted_tokens: int
    mixed_rounds: int
    overlapped_rounds: int
    wasted_draft_tokens: int
    def __init__(self, rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_tokens: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., ttft_s: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., draft_time_s: _Optional[float] = ..., verify_time_s: _Optional[float] = ..., overhead_time_s: _Optional[float] = ..., mean_k: _Optional[float] = ..., prefill_draft_time_s: _Optional[float] = ..., prefill_verify_time_s: _Optional[float] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., completion_tokens: _Optional[int] = ..., wall_time_s: _Optional[float] = ..., rounds_without_draft: _Optional[int] = ..., ngram_rounds: _Optional[int] = ..., ngram_draft_tokens: _Optional[int] = ..., ngram_accepted_tokens: _Optional[int] = ..., mixed_rounds: _Optional[int] = ..., overlapped_rounds: _Optional[int] = ..., wasted_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "usage", "stats")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    usage: Usage
    stats: SpeculationStats
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[SpeculationStats, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("draft_model", "target_model", "vocab_size", "draft_context_limit", "target_context_limit", "context_limit", "draft_pool", "target_pool", "max_speculative_tokens", "draft_dtype", "target_dtype", "draft_calibration", "target_calibration", "simulated_costs")
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONTEXT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TARGET_CONTEXT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_POOL_FIELD_NUMBER: _ClassVar[int]
    TARGET_POOL_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_COSTS_FIELD_NUMBER: _ClassVar[int]
    draft_model: str
    target_model: str
    vocab_size: int
    draft_context_limit: int
    target_context_limit: int
    context_limit: int
    draft_pool: str
    target_pool: str
    max_speculative_tokens: int
    draft_dtype: str
    target_dtype: str
    draft_calibration: DeviceCalibration
    target_calibration: DeviceCalibration
    simulated_costs: str
    def __init__(self, draft_model: _Optional[str] = ..., target_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., draft_context_limit: _Optional[int] = ..., target_context_limit: _Optional[int] = ..., context_limit: _Optional[int] = ..., draft_pool: _Optional[str] = ..., target_pool: _Optional[str] = ..., max_speculative_tokens: _Optional[int] = ..., draft_dtype: _Optional[str] = ..., target_dtype: _Optional[str] = ..., draft_calibration: _Optional[_Union[DeviceCalibration, _Mapping]] = ..., target_calibration: _Optional[_Union[DeviceCalibration, _Mapping]] = ..., simulated_costs: _Optional[str] = ...) -> None: ...

class DeviceCalibration(_message.Message):
    __slots__ = ("device", "dtype", "automatic", "candidates", "exact_widths", "seconds", "reused")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EXACT_WIDTHS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    device: str
    dtype: str
    automatic: bool
    candidates: _containers.RepeatedCompositeFieldContainer[DtypeCost]
    exact_widths: _containers.RepeatedScalarFieldContainer[int]
    seconds: float
    reused: bool
    def __init__(self, device: _Optional[str] = ..., dtype: _Optional[str] = ..., automatic: _Optional[bool] = ..., candidates: _Optional[_Iterable[_Union[DtypeCost, _Mapping]]] = ..., exact_widths: _Optional[_Iterable[int]] = ..., seconds: _Optional[float] = ..., reused: _Optional[bool] = ...) -> None: ...

class DtypeCost(_message.Message):
    __slots__ = ("dtype", "forward_s", "cache_tokens", "exact", "prefill_s_per_token")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    forward_s: _containers.RepeatedScalarFieldContainer[float]
    cache_tokens: int
    exact: bool
    prefill_s_per_token: float
    def __init__(self, dtype: _Optional[str] = ..., forward_s: _Optional[_Iterable[float]] = ..., cache_tokens: _Optional[int] = ..., exact: _Optional[bool] = ..., prefill_s_per_token: _Optional[float] = ...) -> None: ...
