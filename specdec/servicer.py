"""The server side of the public gRPC API: how Serve's gRPC proxy registers and parses it.

The Serve configs list ``specdec.servicer.add_servicer_to_server`` in
``grpc_options.grpc_servicer_functions``. Imports grpc and protobuf only (the proxy imports it).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from specdec.errors import MalformedRequest
from specdec.v1 import specdec_pb2


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
