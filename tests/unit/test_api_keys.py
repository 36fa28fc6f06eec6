"""The data plane's API keys without Ray: loading (file, environment), the check of a presented
key in constant time, and how a refusal answers on gRPC and HTTP."""

from __future__ import annotations

import hmac

import grpc
import pytest

from specdec import api_keys as api_keys_module
from specdec.api_keys import ApiKeys, bearer_token, read_keys_file
from specdec.config import SpecdecConfig
from specdec.deployments.failures import grpc_status
from specdec.deployments.http_api import _as_openai_error
from specdec.errors import ConfigError, Unauthenticated


def test_no_key_configured_lets_every_request_pass():
    keys = ApiKeys.load(None, "SPECDEC_API_KEYS", environ={})
    assert not keys.enabled and len(keys) == 0
    keys.check(None)
    keys.check("Bearer anything")
    assert (
        ApiKeys.load(None, "SPECDEC_API_KEYS", environ={"SPECDEC_API_KEYS": " , "}).enabled is False
    )


def test_keys_from_the_file_and_the_environment_are_all_accepted(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated 2026-12\n\n  old-key  \nnew-key\n# retired-key\n")
    assert read_keys_file(str(path)) == ["old-key", "new-key"]
    keys = ApiKeys.load(str(path), "KEYS", environ={"KEYS": "env-a, env-b,", "OTHER": "x"})
    assert keys.enabled and len(keys) == 4
    for key in ("old-key", "new-key", "env-a", "env-b"):
        keys.check(f"Bearer {key}")
        keys.check(f"bearer   {key} ")  # the scheme is case-insensitive (RFC 7235)
    for presented in ("Bearer retired-key", "Bearer x", "Bearer old-ke", "Bearer old-key2"):
        with pytest.raises(Unauthenticated, match="invalid API key"):
            keys.check(presented)
    with pytest.raises(Unauthenticated, match="no API key"):
        keys.check(None)
    for malformed in ("old-key", "Basic old-key", "Bearer", "Bearer ", ""):
        with pytest.raises(Unauthenticated) as refused:
            keys.check(malformed)
        assert "old-key" not in str(refused.value)  # never echoes what was sent
    assert not ApiKeys.load(str(path), None, environ={"SPECDEC_API_KEYS": "x"}).accepts("x")


def test_bad_key_sources_fail_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="^api_keys_file: cannot read") as missing:
        ApiKeys.load(str(tmp_path / "absent"), None, environ={})
    assert missing.value.field == "api_keys_file"
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n\n")
    with pytest.raises(ConfigError, match="^api_keys_file: .* holds no key"):
        ApiKeys.load(str(empty), None, environ={})
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    with pytest.raises(ConfigError, match="^api_keys_file: an API key must be"):
        ApiKeys.load(str(spaced), None, environ={})
    with pytest.raises(ConfigError, match="^api_keys_env: an API key must be"):
        ApiKeys.load(None, "KEYS", environ={"KEYS": "a b,c"})


def test_every_stored_key_is_compared_whichever_matches(monkeypatch):
    """No early exit: the time of a check does not say which key, if any, matched; and what is
    compared are digests of one length, never the keys themselves."""
    compared = []
    real = hmac.compare_digest

    def compare(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", compare)
    keys = ApiKeys(["first", "second", "third-and-much-longer"])
    for presented in ("first", "third-and-much-longer", "wrong", "", None):
        compared.clear()
        assert keys.accepts(presented) == (presented in ("first", "third-and-much-longer"))
        assert compared == [(32, 32)] * 3


def test_bearer_token_forms():
    assert bearer_token("Bearer k") == "k"
    assert bearer_token("BEARER  k ") == "k"
    assert bearer_token("Token k") is None and bearer_token("Bearerk") is None


def test_config_settings_and_their_checks():
    service = SpecdecConfig().service
    assert service.api_keys_file is None and service.api_keys_env == "SPECDEC_API_KEYS"
    config = SpecdecConfig.from_args(
        {
            "draft_model": "d",
            "target_model": "t",
            "api_keys_file": "/etc/keys",
            "api_keys_env": None,
        }
    )
    assert config.service.api_keys_file == "/etc/keys" and config.service.api_keys_env is None
    for bad, field in (
        ({"api_keys_file": ""}, "api_keys_file"),
        ({"api_keys_env": "A-B"}, "api_keys_env"),
    ):
        with pytest.raises(ConfigError) as err:
            SpecdecConfig.of(**bad)
        assert err.value.field == field


def test_a_refusal_answers_unauthenticated_and_openai_401():
    err = Unauthenticated("invalid API key (expected `Authorization: Bearer KEY`)")
    assert grpc_status(err) == (grpc.StatusCode.UNAUTHENTICATED, str(err))
    error = _as_openai_error(err, None)
    assert error.status == 401
    assert error.body() == {
        "error": {
            "message": str(err),
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",  # what OpenAI answers for a bad key
        }
    }


def test_serve_checks_the_keys_file_before_it_starts_anything(tmp_path, monkeypatch):
    import argparse

    from specdec.cluster import local
    from specdec.tools import serve

    monkeypatch.setattr(local, "up", lambda *a, **k: pytest.fail("started a cluster"))
    monkeypatch.setattr(local, "address", lambda *a, **k: pytest.fail("looked for a cluster"))
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    (tmp_path / "empty").write_text("\n")
    for name in ("absent", "empty"):
        args = parser.parse_args(["--local", "--api-keys-file", str(tmp_path / name)])
        with pytest.raises(ConfigError) as err:
            serve.main(args)
        assert err.value.field == "api_keys_file"
