from specdec.v1 import specdec_pb2 as _specdec_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionTokens(_message.Message):
    __slots__ = ("session_id", "prefix_len", "new_token_ids", "prompt_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    def __init__(self, session_id: _Optional[str] = ..., prefix_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class SamplingConfig(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("width", "token_ids", "probs")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    width: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, width: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session", "num_speculative_tokens", "sampling", "draft_top_n", "min_draft_confidence", "assumed_token_ids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_N_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session: SessionTokens
    num_speculative_tokens: int
    sampling: SamplingConfig
    draft_top_n: int
    min_draft_confidence: float
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[_Union[SessionTokens, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingConfig, _Mapping]] = ..., draft_top_n: _Optional[int] = ..., min_draft_confidence: _Optional[float] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("cache_miss", "token_ids", "q", "compute_s", "catchup_s", "catchup_tokens", "confidences")
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_S_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    cache_miss: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: SparseDistribution
    compute_s: float
    catchup_s: float
    catchup_tokens: int
    confidences: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, cache_miss: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[SparseDistribution, _Mapping]] = ..., compute_s: _Optional[float] = ..., catchup_s: _Optional[float] = ..., catchup_tokens: _Optional[int] = ..., confidences: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session", "draft_token_ids", "q", "sampling")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session: SessionTokens
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: SparseDistribution
    sampling: SamplingConfig
    def __init__(self, session: _Optional[_Union[SessionTokens, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[SparseDistribution, _Mapping]] = ..., sampling: _Optional[_Union[SamplingConfig, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("cache_miss", "num_accepted", "token_ids", "logprobs", "compute_s", "batch_sessions", "batch_rows")
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    cache_miss: bool
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    compute_s: float
    batch_sessions: int
    batch_rows: int
    def __init__(self, cache_miss: _Optional[bool] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., compute_s: _Optional[float] = ..., batch_sessions: _Optional[int] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class CacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("sessions", "bytes", "capacity_bytes", "evictions", "rebuilds")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REBUILDS_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    bytes: int
    capacity_bytes: int
    evictions: int
    rebuilds: int
    def __init__(self, sessions: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., rebuilds: _Optional[int] = ...) -> None: ...

class CostTable(_message.Message):
    __slots__ = ("forward_s", "rows_s", "prefill_s_per_token")
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    ROWS_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    forward_s: _containers.RepeatedScalarFieldContainer[float]
    rows_s: _containers.RepeatedScalarFieldContainer[float]
    prefill_s_per_token: float
    def __init__(self, forward_s: _Optional[_Iterable[float]] = ..., rows_s: _Optional[_Iterable[float]] = ..., prefill_s_per_token: _Optional[float] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("name", "dtype", "vocab_size", "context_limit", "eos_token_ids", "calibration", "costs", "simulated_costs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_COSTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    vocab_size: int
    context_limit: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    calibration: _specdec_pb2.DeviceCalibration
    costs: CostTable
    simulated_costs: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_limit: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., calibration: _Optional[_Union[_specdec_pb2.DeviceCalibration, _Mapping]] = ..., costs: _Optional[_Union[CostTable, _Mapping]] = ..., simulated_costs: _Optional[str] = ...) -> None: ...
