"""A thin gRPC client for the public SpeculativeDecoding service."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from specdec.config import APPLICATION
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:9000"


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    num_speculative_tokens: int | None = None,
    logprobs: bool = False,
    proposer: str | None = None,
) -> specdec_pb2.GenerateRequest:
    """A GenerateRequest; fields left None stay unset (server defaults; k unset = adaptive;
    ``proposer`` unset = the service's speculation.proposer, one of specdec.config.PROPOSERS).
    The server validates the values (INVALID_ARGUMENT naming the field); a value of the wrong
    type raises TypeError here, from protobuf."""
    request = specdec_pb2.GenerateRequest(
        prompt=prompt or "",
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        logprobs=logprobs,
        messages=[specdec_pb2.ChatMessage(**m) for m in messages or ()],
    )
    optional = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "num_speculative_tokens": num_speculative_tokens,
        "proposer": proposer,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(request, name, value)
    return request


class SpecdecClient:
    """Calls the router through Ray Serve's gRPC proxy.

    Args:
        address: "host:port" of the proxy (port 9000 by default).
        application: the Serve application name, sent as the ``application`` metadata.
        timeout_s: default per-call deadline in seconds (None = no deadline).
    Raises (from the calls): grpc.RpcError with the server's status code, e.g. INVALID_ARGUMENT
        naming the bad field, UNAVAILABLE, DEADLINE_EXCEEDED.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        application: str = APPLICATION,
        timeout_s: float | None = None,
    ) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = specdec_pb2_grpc.SpeculativeDecodingStub(self.channel)
        self.metadata = (("application", application),)
        self.timeout_s = timeout_s

    def generate(
        self, request: specdec_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> specdec_pb2.GenerateResponse:
        return self.stub.Generate(
            request, metadata=self.metadata, timeout=timeout_s or self.timeout_s
        )

    def generate_stream(
        self, request: specdec_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> Iterator[specdec_pb2.GenerateResponse]:
        """Yields one message per round; cancel by closing the iterator (``.cancel()``)."""
        return self.stub.GenerateStream(
            request, metadata=self.metadata, timeout=timeout_s or self.timeout_s
        )

    def model_info(self, timeout_s: float | None = None) -> specdec_pb2.ModelInfo:
        return self.stub.GetModelInfo(
            specdec_pb2.ModelInfoRequest(),
            metadata=self.metadata,
            timeout=timeout_s or self.timeout_s,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpecdecClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
