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


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded, or the draft and target do not fit together."""
