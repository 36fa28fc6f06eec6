"""Errors the core raises; the router maps them to gRPC status codes."""

from __future__ import annotations


class FieldError(ValueError):
    """A named field is invalid. ``field`` names it; the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        # Ray ships exceptions between processes by pickling them.
        return type(self), (self.field, self.message)


class InvalidRequestError(FieldError):
    """A request field is invalid. ``field`` names it; the router answers INVALID_ARGUMENT."""


class ConfigError(FieldError):
    """A setting (specdec.config) is invalid or unknown. ``field`` names it; raised at start-up,
    before any model is loaded."""


class ComputeUnhealthy(RuntimeError):
    """A replica's compute path is broken: a forward has run past ``models.stuck_forward_s`` or
    ``models.max_forward_failures`` batches in a row raised (specdec.worker.compute_health).
    The replica's health check raises it, so Serve replaces the replica, and so do the calls
    the replica refuses meanwhile; the router sends those again (they never ran), and Serve
    routes them to a live replica once this one has left rotation."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded, or the draft and target do not fit together."""


class MalformedRequest:
    """Stands in for a request message that did not parse (bytes that are not the method's
    message, or a string field holding invalid UTF-8).

    Serve's gRPC proxy parses each request with the deserializer its servicer function
    registered, before any deployment code runs; a parse error there would answer UNKNOWN with
    a Python exception class in the details. specdec.servicer.add_servicer_to_server registers
    a deserializer that returns this instead, the proxy passes it on like a request, and the
    router answers INVALID_ARGUMENT with ``str(self)``. It is a plain object (pickled from the
    proxy to the router), never raised.
    """

    def __init__(self, message_type: str, reason: str) -> None:
        self.message_type = message_type
        self.reason = reason

    def __str__(self) -> str:
        return f"the request is not a valid {self.message_type} message ({self.reason})"


class Unauthenticated(Exception):
    """A data-plane request without an accepted API key (specdec.api_keys); the router answers
    UNAUTHENTICATED on gRPC, 401 on HTTP. The message never repeats the presented key."""
