"""Errors the core raises; the router maps them to gRPC status codes."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is invalid. ``field`` names it; the router answers INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        # Ray ships exceptions between processes by pickling them.
        return type(self), (self.field, self.message)


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded, or the draft and target do not fit together."""
