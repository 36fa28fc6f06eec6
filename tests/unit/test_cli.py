"""The `specdec` dispatcher and the tools' own flags: every --help works, `specdec generate` stays
free of torch, the demo's bench arguments parse with bench's own parser, and the tools never
import the dispatcher. No cluster, no service."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specdec import cli
from specdec.bench import speedup
from specdec.tools import demo
from specdec.tools.args import config_path, k_value, positive_int

ROOT = Path(__file__).resolve().parents[2]
NESTED = {"k8s": ("render", "models")}  # subcommands with subcommands of their own


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command(capsys):
    out = _help(capsys, ["--help"])
    assert out.startswith("usage: specdec ")
    for name, (_, help_text) in cli.COMMANDS.items():
        assert name in out
        assert help_text.split()[0] in out


@pytest.mark.parametrize(
    "argv",
    [[name] for name in cli.COMMANDS]
    + [[name, sub] for name, subs in NESTED.items() for sub in subs],
    ids=" ".join,
)
def test_every_subcommand_help(capsys, argv):
    assert _help(capsys, [*argv, "--help"]).startswith(f"usage: specdec {' '.join(argv)}")


def test_version_prints_the_package_version_and_exits_0(capsys):
    from importlib.metadata import version

    assert _help(capsys, ["--version"]).strip() == f"specdec {version('specdec')}"


def test_bad_flag_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--limit", "0"])
    assert exit_.value.code == 2
    assert "argument --limit: must be an integer >= 1, got '0'" in capsys.readouterr().err


def test_generate_help_does_not_import_torch_or_ray():
    script = (
        "import sys\n"
        "from specdec import cli\n"
        "try:\n"
        "    cli.main(['generate', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-4000:]


def test_demo_bench_arguments_parse_with_bench_parser():
    """A bench flag made required, renamed or retyped fails here, not minutes into `make run`."""
    parser = argparse.ArgumentParser()
    demo.add_cli_args(parser)
    args = demo.bench_args("127.0.0.1:9000", parser.parse_args(["--limit", "3", "--out", "out"]))
    assert vars(args) == dict(
        address="127.0.0.1:9000",
        application="specdec",
        api_key=None,
        tls=False,
        ca_file=None,
        dataset="humaneval",
        data_file=None,
        category=None,
        limit=3,
        max_new_tokens=64,
        temperature=0.0,
        seed=0,
        k=None,
        proposer=None,
        no_plain=False,
        plain_gemms=False,
        no_engine=True,
        no_hf=True,
        no_hf_tune=True,
        device="auto",
        timeout=900.0,
        json=str(Path("out") / "make-run.json"),
        plot=str(Path("out") / "make-run.png"),
    )
    bench_parser = argparse.ArgumentParser()
    speedup.add_cli_args(bench_parser)
    assert set(vars(args)) == set(vars(bench_parser.parse_args([])))
    with_hf = demo.bench_args("127.0.0.1:9000", parser.parse_args(["--hf"]))
    assert not with_hf.no_hf and with_hf.no_hf_tune


def test_shared_argument_types():
    assert positive_int("3") == 3
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="integer >= 1"):
            positive_int(bad)
    assert k_value("auto") is None
    assert k_value("0") == 0 and k_value("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="integer or 'auto'"):
        k_value("many")


def test_generate_sends_the_proposer_only_when_given(monkeypatch, capsys):
    from specdec.tools import generate
    from specdec.v1 import specdec_pb2

    sent = []

    class Client:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, request):
            sent.append(request)
            return specdec_pb2.GenerateResponse(text="ok")

    monkeypatch.setattr(generate, "SpecdecClient", Client)
    for argv in (["hi", "--proposer", "ngram"], ["hi"]):
        parser = argparse.ArgumentParser()
        generate.add_cli_args(parser)
        assert generate.main(parser.parse_args(argv)) == 0
    assert sent[0].HasField("proposer") and sent[0].proposer == "ngram"
    assert not sent[1].HasField("proposer")  # the service's speculation.proposer decides
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hi", "--proposer", "medusa"])
    assert exit_.value.code == 2
    assert "argument --proposer: invalid choice: 'medusa'" in capsys.readouterr().err


def test_bench_proposer_list():
    assert speedup.proposer_list("auto,draft, ngram") == ["auto", "draft", "ngram"]
    for bad in ("ngram,ngram", "medusa", "auto,"):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct names"):
            speedup.proposer_list(bad)


def test_config_path_finds_shipped_configs_and_names_them_when_missing(tmp_path):
    shipped = config_path("local.yaml")
    assert yaml.safe_load(shipped.read_text())["grpc_options"]["port"] == 9000
    own = tmp_path / "mine.yaml"
    own.write_text("grpc_options:\n  port: 9100\n")
    assert config_path(str(own)) == own
    with pytest.raises(FileNotFoundError, match="gpu.yaml"):
        config_path("nope.yaml")


def test_tools_never_import_the_dispatcher():
    """specdec.cli imports the tools (lazily); an import back would be a cycle."""
    found = []
    for path in [*(ROOT / "specdec").rglob("*.py"), *(ROOT / "cluster").rglob("*.py")]:
        if path == ROOT / "specdec" / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if "specdec.cli" in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found


def test_k8s_module_runs_standalone():
    """The k8s manifests call `python -m specdec.tools.k8s`: its own parser, same flags."""
    run = subprocess.run(
        [sys.executable, "-m", "specdec.tools.k8s", "render", "--check", "--k8s-dir", "k8s"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]


def test_tiny_bench_module_runs_standalone():
    """benchmarks/README.md calls `python -m specdec.bench.tiny_bench`: its own parser, same
    flags."""
    run = subprocess.run(
        [sys.executable, "-m", "specdec.bench.tiny_bench", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "--address" in run.stdout and "--max-new-tokens" in run.stdout
