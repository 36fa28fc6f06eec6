"""A thin gRPC client for the public SpeculativeDecoding service."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from specdec.errors import MalformedRequest
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:9000"
DEFAULT_APPLICATION = "specdec"


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
) -> specdec_pb2.GenerateRequest:
    """A GenerateRequest; fields left None stay unset (server defaults; k unset = adaptive)."""
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
        application: str = DEFAULT_APPLICATION,
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


def add_servicer_to_server(servicer: object, server: grpc.aio.Server) -> None:
    """Registers specdec.v1.SpeculativeDecoding on ``server``, as the generated
    ``add_SpeculativeDecodingServicer_to_server`` does, with request parsing that never raises.

    The Serve configs list this function in ``grpc_options.grpc_servicer_functions``: Serve's
    gRPC proxy keeps the request deserializers the servicer function registers and parses each
    request with them before any deployment code runs. Where the generated parser raises (bytes
    that are not the method's message, invalid UTF-8 in a string field) and grpc answers
    UNKNOWN with "Unexpected <class 'google.protobuf.message.DecodeError'>", this one returns a
    specdec.errors.MalformedRequest, which the proxy hands to the router like a request and the
    router answers with INVALID_ARGUMENT and a plain message.
    """
    service = specdec_pb2.DESCRIPTOR.services_by_name["SpeculativeDecoding"]
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=parse_or_mark(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:  # grpcio >= 1.63 looks registered methods up first
        register(service.full_name, handlers)


def parse_or_mark(message_cls: type) -> Callable[[bytes], object]:
    """A request deserializer: bytes -> a ``message_cls`` message, or a MalformedRequest naming
    the message type when they do not parse."""

    def parse(data: bytes) -> object:
        try:
            return message_cls.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as err:
            return MalformedRequest(message_cls.DESCRIPTOR.full_name, _plain(err))

    return parse


def _plain(err: Exception) -> str:
    """The parser's complaint without Python class names (upb says "Error parsing message")."""
    text = str(err).strip() or "it does not parse"
    return text[:200]
