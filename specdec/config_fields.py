"""How a settings section of specdec.config checks its values: each against its field's type,
then the section's own ranges, every failure a ConfigError that names the setting."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from specdec.errors import ConfigError

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


class Section:
    """What the concerns share: each value checked against its field's annotation (ints and
    floats never accept a bool; a float field accepts an int and stores it as a float), then the
    concern's own range checks (``_check``)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = typed(field.name, getattr(self, field.name), hints[field.name])
            object.__setattr__(self, field.name, value)
        self._check()

    def _check(self) -> None:
        """Raises ConfigError naming the first setting out of its range."""


def typed(name: str, value: Any, hint: Any) -> Any:
    """``value`` if it fits the annotation ``hint`` (int, float, bool, str, or one of them |
    None), an int made a float for a float field; raises ConfigError naming ``name``."""
    optional = isinstance(hint, types.UnionType)
    base = next(t for t in typing.get_args(hint) if t is not type(None)) if optional else hint
    if value is None and optional:
        return None
    if base in (int, float) and isinstance(value, bool):
        fits = False
    elif base is float and isinstance(value, int):
        fits, value = True, float(value)
    else:
        fits = isinstance(value, base)
    words = _TYPE_WORDS[base] + (" or null" if optional else "")
    require(name, fits, f"must be {words}, got {value!r} ({type(value).__name__})")
    return value


def require(name: str, ok: bool, message: str) -> None:
    """Raises ConfigError(name, message) unless ``ok``."""
    if not ok:
        raise ConfigError(name, message)


def at_least(name: str, value: int, low: int) -> None:
    """Raises ConfigError naming ``name`` when ``value`` is below ``low``."""
    require(name, value >= low, f"must be at least {low}, got {value}")
