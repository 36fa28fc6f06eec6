"""The client side of a secured connection without Ray: TLS that really verifies the server's
certificate (against a CA made here), the API key's metadata, and the flags that set both."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
from concurrent import futures

import grpc
import pytest

from specdec.bench.loadtest import LoadTest, Stage
from specdec.client import SpecdecClient, build_request, call_metadata, channel_credentials
from specdec.tools import generate
from specdec.tools.args import add_connection_args, client_options
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return key, _certificate(name, key, subject, key, ca=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate it signed (localhost, 127.0.0.1), and a CA that signed
    nothing here; the PEM files of both CAs."""
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _ca("specdec test CA")
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _certificate("localhost", server_key, ca_cert.subject, ca_key, ca=False)
    _, other_cert = _ca("some other CA")
    files = {}
    for name, cert in (("ca", ca_cert), ("other", other_cert)):
        files[name] = root / f"{name}.pem"
        files[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    chain = server_cert.public_bytes(serialization.Encoding.PEM)
    return {"key": _pem(server_key), "chain": chain, **{k: str(v) for k, v in files.items()}}


class Router(specdec_pb2_grpc.SpeculativeDecodingServicer):
    """Answers what a call's metadata was: the authorization value as the model's name."""

    def __init__(self):
        self.seen = []

    def _authorization(self, context) -> str:
        metadata = dict(context.invocation_metadata())
        self.seen.append(metadata)
        return metadata.get("authorization", "")

    def GetModelInfo(self, request, context):
        return specdec_pb2.ModelInfo(target_model=self._authorization(context))

    def Generate(self, request, context):
        return specdec_pb2.GenerateResponse(text=self._authorization(context), token_ids=[1])


@pytest.fixture(scope="module")
def tls_server(pki):
    """A gRPC server with TLS on 127.0.0.1 (certificate of pki's CA); (port, Router)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    router = Router()
    specdec_pb2_grpc.add_SpeculativeDecodingServicer_to_server(router, server)
    credentials = grpc.ssl_server_credentials([(pki["key"], pki["chain"])])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield port, router
    server.stop(0)


def test_tls_with_the_ca_file_verifies_and_sends_the_key(tls_server, pki):
    port, router = tls_server
    for host in ("localhost", "127.0.0.1"):
        with SpecdecClient(
            f"{host}:{port}", timeout_s=10, api_key="k-1", tls=True, ca_file=pki["ca"]
        ) as client:
            assert client.model_info().target_model == "Bearer k-1"
    assert router.seen[-1]["application"] == "specdec"
    # A CA file alone means TLS.
    with SpecdecClient(f"localhost:{port}", timeout_s=10, ca_file=pki["ca"]) as client:
        assert client.model_info().target_model == ""  # no key, no authorization metadata


def test_a_certificate_the_ca_did_not_sign_is_refused(tls_server, pki):
    port, router = tls_server
    calls = len(router.seen)
    for options in ({"tls": True, "ca_file": pki["other"]}, {"tls": True}, {}):
        # The system's roots do not know the test CA either; plaintext speaks no TLS at all.
        client = SpecdecClient(f"localhost:{port}", timeout_s=5, api_key="k", **options)
        with client, pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, options
    assert len(router.seen) == calls  # the key never reached a server that did not verify


def test_loadtest_over_tls_with_a_key(pki):
    class AioRouter(specdec_pb2_grpc.SpeculativeDecodingServicer):
        async def Generate(self, request, context):
            metadata = dict(context.invocation_metadata())
            if metadata.get("authorization") != "Bearer load-key":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
            return specdec_pb2.GenerateResponse(token_ids=[1, 2])

    async def run(api_key):
        server = grpc.aio.server()
        specdec_pb2_grpc.add_SpeculativeDecodingServicer_to_server(AioRouter(), server)
        credentials = grpc.ssl_server_credentials([(pki["key"], pki["chain"])])
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        try:
            load = LoadTest(
                [build_request("a")],
                address=f"localhost:{port}",
                api_key=api_key,
                tls=True,
                ca_file=pki["ca"],
                stream=False,
                max_requests=3,
                progress=False,
            )
            return await load.run([Stage(1, 10)])
        finally:
            await server.stop(0)

    summary = asyncio.run(run("load-key"))["summary"]
    assert summary["completed"] == 3 and summary["error_count"] == 0
    summary = asyncio.run(run("wrong"))["summary"]
    assert summary["errors"] == {"UNAUTHENTICATED": 3}


def test_call_metadata_and_plaintext_default():
    assert call_metadata("specdec") == (("application", "specdec"),)
    assert call_metadata("app", "k") == (("application", "app"), ("authorization", "Bearer k"))
    assert channel_credentials(False) is None
    with pytest.raises(OSError):
        channel_credentials(True, "/nonexistent/ca.pem")


def test_connection_flags_and_the_key_from_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    assert client_options(parser.parse_args([])) == {"api_key": None, "tls": False, "ca_file": None}
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    args = parser.parse_args(["--tls", "--ca-file", "ca.pem"])
    assert client_options(args) == {"api_key": "from-env", "tls": True, "ca_file": "ca.pem"}
    args = parser.parse_args(["--api-key", "from-flag"])
    assert client_options(args)["api_key"] == "from-flag"

    made = []

    class Client:
        def __init__(self, *args, **kwargs):
            made.append((args, kwargs))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, request):
            return specdec_pb2.GenerateResponse(text="ok")

    monkeypatch.setattr(generate, "SpecdecClient", Client)
    parser = argparse.ArgumentParser()
    generate.add_cli_args(parser)
    assert generate.main(parser.parse_args(["hi", "--address", "gw:443", "--tls"])) == 0
    assert made == [
        (
            ("gw:443", "specdec"),
            {"timeout_s": None, "api_key": "from-env", "tls": True, "ca_file": None},
        )
    ]
