"""The data plane's API keys: which keys the router accepts, and the check of a presented one.

HTTP clients send ``Authorization: Bearer KEY``, gRPC clients the ``authorization`` metadata
with the same value (specdec.client does). The router (specdec.deployments.router) loads the
keys once at start-up from service.api_keys_file and the environment variable named by
service.api_keys_env (what a Kubernetes Secret gives, through ``secretKeyRef``); several keys
are accepted at once, so a new key can be rolled out before the old one is removed. No key
configured: authentication is off, as for `make run`.

Imports neither Ray nor torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from specdec.errors import ConfigError, Unauthenticated

BEARER = "bearer"  # the scheme of RFC 6750, compared case-insensitively (RFC 7235)


class ApiKeys:
    """A set of accepted keys, held only as SHA-256 digests.

    Every check compares the presented key's digest with every stored digest by
    ``hmac.compare_digest`` and never stops at a match: the time it takes depends neither on
    how much of a key is right nor on which key matched (digests have equal lengths, so the
    comparison's time does not reveal the key's length either).

    Args:
        keys: the accepted keys; empty: authentication is off (every request passes).
    Raises:
        ValueError: a key is empty or has white space or a comma in it (it could not be sent
            in a header, or listed in the environment variable).
    """

    def __init__(self, keys: Iterable[str] = ()) -> None:
        digests = set()
        for key in keys:
            if not key or any(c.isspace() or c == "," for c in key):
                raise ValueError("an API key must be non-empty, without white space or commas")
            digests.add(_digest(key))
        self._digests = tuple(sorted(digests))

    def __len__(self) -> int:
        return len(self._digests)

    @property
    def enabled(self) -> bool:
        """Whether requests need a key (at least one is configured)."""
        return bool(self._digests)

    def accepts(self, key: str | None) -> bool:
        """Whether ``key`` is one of the accepted keys (always True while none is configured)."""
        if not self._digests:
            return True
        presented = _digest(key or "")
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)  # no early exit: see the class
        return matched  # None or "" never matches: no key is empty

    def check(self, authorization: str | None) -> None:
        """Checks an ``Authorization`` header's (or gRPC metadata's) value.

        Raises:
            Unauthenticated: keys are configured and the value is missing, not ``Bearer KEY``,
                or names no accepted key. The message never repeats the presented key.
        """
        if not self._digests:
            return
        if authorization is None:
            raise Unauthenticated("no API key: send the header `Authorization: Bearer KEY`")
        if not self.accepts(bearer_token(authorization)):
            raise Unauthenticated("invalid API key (expected `Authorization: Bearer KEY`)")

    @classmethod
    def load(
        cls, keys_file: str | None, env_name: str | None, environ: Mapping[str, str] = os.environ
    ) -> ApiKeys:
        """The keys of ``keys_file`` (read_keys_file) and of the environment variable
        ``env_name`` (comma-separated, blanks around each ignored; unset or empty: none), both
        accepted.

        Raises:
            ConfigError naming api_keys_file: the file is missing, unreadable or holds no key,
                or a key in it is malformed. ConfigError naming api_keys_env: a key in the
                variable is malformed.
        """
        keys = read_keys_file(keys_file) if keys_file is not None else []
        from_env = [k.strip() for k in environ.get(env_name, "").split(",")] if env_name else []
        from_env = [k for k in from_env if k]
        for name, some in (("api_keys_file", keys), ("api_keys_env", from_env)):
            try:
                cls(some)
            except ValueError as err:
                raise ConfigError(name, str(err)) from None
        return cls(keys + from_env)


def read_keys_file(path: str) -> list[str]:
    """The keys in the file at ``path``: one a line, blank lines and lines starting with ``#``
    skipped, blanks around a key ignored.

    Raises:
        ConfigError naming api_keys_file: the file cannot be read, or it holds no key (a file
            given but empty would otherwise turn authentication off unnoticed).
    """
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("api_keys_file", f"cannot read {path}: {err}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ConfigError("api_keys_file", f"{path} holds no key (one a line, # comments)")
    return keys


def bearer_token(authorization: str) -> str | None:
    """The KEY of ``Bearer KEY`` (scheme in any case, blanks around ignored); None for any
    other form."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != BEARER or not token:
        return None
    return token


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
