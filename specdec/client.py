"""A thin gRPC client for the public SpeculativeDecoding service, and the pieces of a
connection (TLS credentials, the API key's metadata) that the benchmarks' grpc.aio channels
share."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from specdec.config import APPLICATION
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:9000"
# Where the CLI reads the API key from when --api-key is not given: a flag's value would show
# in `ps` and in shell histories.
API_KEY_ENV = "SPECDEC_API_KEY"


def call_metadata(application: str, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata of every call: ``application`` (Serve's gRPC proxy routes by it) and, with
    ``api_key``, ``authorization: Bearer KEY`` (specdec.api_keys checks it on the router)."""
    metadata = (("application", application),)
    if api_key:
        metadata += (("authorization", f"Bearer {api_key}"),)
    return metadata


def channel_credentials(tls: bool, ca_file: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel: None for plaintext (``tls`` false and no ``ca_file``);
    else the server's certificate is verified against ``ca_file`` (PEM), or without one
    against the system's trusted roots. A ``ca_file`` alone means TLS.

    Raises:
        OSError: ``ca_file`` cannot be read.
    """
    if not tls and ca_file is None:
        return None
    roots = Path(ca_file).expanduser().read_bytes() if ca_file is not None else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def open_channel(
    address: str, tls: bool = False, ca_file: str | None = None, *, aio: bool = False
) -> grpc.Channel | grpc.aio.Channel:
    """A channel to ``address``: plaintext, or TLS as channel_credentials says; a grpc.aio
    channel with ``aio``.

    Raises:
        OSError: ``ca_file`` cannot be read.
    """
    credentials = channel_credentials(tls, ca_file)
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(address)
    return module.secure_channel(address, credentials)


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
        address: "host:port" of the proxy (port 9000 by default), or of a gateway in front.
        application: the Serve application name, sent as the ``application`` metadata.
        timeout_s: default per-call deadline in seconds (None = no deadline).
        api_key: sent as ``authorization: Bearer KEY`` on every call (None: no key; the
            service then answers UNAUTHENTICATED if it has keys configured).
        tls: connect with TLS (a gateway that terminates it), verifying the server's
            certificate against ``ca_file`` or the system's roots.
        ca_file: a PEM file of the CA that signed the server's certificate (implies tls).
    Raises:
        OSError: ``ca_file`` cannot be read. From the calls: grpc.RpcError with the server's
        status code, e.g. INVALID_ARGUMENT naming the bad field, UNAUTHENTICATED, UNAVAILABLE,
        DEADLINE_EXCEEDED (UNAVAILABLE too when the server's certificate does not verify).
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        application: str = APPLICATION,
        timeout_s: float | None = None,
        *,
        api_key: str | None = None,
        tls: bool = False,
        ca_file: str | None = None,
    ) -> None:
        self.address = address
        self.channel = open_channel(address, tls, ca_file)
        self.stub = specdec_pb2_grpc.SpeculativeDecodingStub(self.channel)
        self.metadata = call_metadata(application, api_key)
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
