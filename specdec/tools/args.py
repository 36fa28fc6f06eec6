"""Argument types and look-ups shared by the `specdec` subcommands (specdec.cli dispatches to
each tool's ``add_cli_args`` and ``main``; the tools take their common pieces from here).

Imports nothing heavy: `specdec generate` builds its parser from this module and must stay fast.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
from collections.abc import Callable
from pathlib import Path

from specdec.config import APPLICATION, PROPOSERS

DEFAULT_CONFIG = "local.yaml"  # looked up in the packaged deployments/config/ when not a path


def shown_default(action: argparse.Action) -> str | None:
    """The text DefaultsHelpFormatter appends to ``action``'s help as ``(default: TEXT)``, or
    None when it appends nothing: a default of None, False or SUPPRESS, an empty one ("", [],
    ()), help that already says "default" (or is SUPPRESS), or a positional that cannot be
    left out. A list or tuple is joined as it is typed: with spaces after a flag that takes
    several values, else with commas."""
    default, help_text = action.default, action.help or ""
    if default is None or default is False or default is argparse.SUPPRESS:
        return None
    if isinstance(default, str | list | tuple) and not default:
        return None
    if help_text == argparse.SUPPRESS or "default" in help_text.lower():
        return None
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return None
    if isinstance(default, list | tuple):
        several = action.nargs not in (None, argparse.OPTIONAL)
        return (" " if several else ",").join(map(str, default))
    return str(default)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The help formatter of `specdec` and every subcommand: each flag's help ends with
    ``(default: VALUE)`` where shown_default gives one, and nothing is appended for a flag with
    no meaningful default or whose help already names it (no "(default: None)" noise)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        shown = shown_default(action)
        if shown is None:
            return help_text
        return f"{help_text} (default: {shown.replace('%', '%%')})".lstrip()


class RawDescriptionDefaultsHelpFormatter(
    argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter
):
    """DefaultsHelpFormatter that prints the description (and epilog) as written, line breaks
    kept, as argparse.RawDescriptionHelpFormatter: for a docstring laid out as paragraphs."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1 (argparse names the flag).
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def k_value(text: str) -> int | None:
    """argparse type of --k, speculative tokens per round: None for "auto", else the integer.

    The range is left to the server, which knows its k_max and refuses a bad k naming it.

    Raises:
        argparse.ArgumentTypeError: neither "auto" nor an integer.
    """
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def add_k_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    """Adds --k (type k_value, default "auto" meaning the server's controller chooses)."""
    parser.add_argument("--k", default="auto", type=k_value, help=help_text)


def add_proposer_arg(parser: argparse.ArgumentParser) -> None:
    """Adds --proposer (one of specdec.config.PROPOSERS; default unset: the service's
    speculation.proposer decides)."""
    parser.add_argument(
        "--proposer",
        choices=PROPOSERS,
        help="who proposes each round's tokens (default: the service's speculation.proposer)",
    )


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """How a command reaches the gRPC service: --address, --application, --api-key, --tls,
    --ca-file (client_options turns the last three into SpecdecClient's keywords)."""
    from specdec.client import API_KEY_ENV, DEFAULT_ADDRESS

    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="gRPC HOST:PORT")
    parser.add_argument("--application", default=APPLICATION, help="the Serve application's name")
    parser.add_argument(
        "--api-key",
        help=f"the service's API key (default: ${API_KEY_ENV}; prefer it, a flag shows in ps)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="TLS to a gateway that terminates it (HOST:443)"
    )
    parser.add_argument(
        "--ca-file",
        help="PEM CA that signed the server's certificate (implies --tls; default: the "
        "system's trusted roots)",
    )


def client_options(args: argparse.Namespace) -> dict:
    """SpecdecClient's api_key, tls and ca_file from add_connection_args' flags; the key from
    the environment variable specdec.client.API_KEY_ENV when --api-key is not given."""
    import os

    from specdec.client import API_KEY_ENV

    return {
        "api_key": args.api_key or os.environ.get(API_KEY_ENV) or None,
        "tls": args.tls,
        "ca_file": args.ca_file,
    }


def add_prompt_set_args(parser: argparse.ArgumentParser) -> None:
    """The service's connection (add_connection_args) and the prompt set of a benchmark:
    --dataset, --data-file, --category, --limit (specdec.bench.datasets reads them)."""
    add_connection_args(parser)
    parser.add_argument(
        "--dataset", default="humaneval", help="humaneval, mt-bench, spec-bench, or a .jsonl path"
    )
    parser.add_argument(
        "--data-file",
        help="the question file of mt-bench / spec-bench (default: looked up in $SPECDEC_DATA, "
        "then ../shared/data/prompts)",
    )
    parser.add_argument("--category", help="only this category of the dataset (default: all)")
    parser.add_argument("--limit", type=positive_int, default=20, help="first N prompts")


def check_report_paths(args: argparse.Namespace) -> None:
    """Fails before a benchmark runs, not after it, on an unwritable --json / --plot or a
    --plot without matplotlib.

    Raises:
        ValueError: the directory of --json or --plot does not exist.
        ImportError: --plot given and matplotlib missing.
    """
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"--json/--plot: no directory for {path}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise ImportError("--plot needs matplotlib: pip install 'specdec[bench]'") from err


def config_path(name: str) -> Path:
    """A Serve config YAML: ``name`` when it is an existing path, else the file of that name
    shipped in deployments/config/ (local.yaml, gpu.yaml).

    Raises:
        FileNotFoundError: neither; the message lists the shipped names.
    """
    path = Path(name)
    if path.exists():
        return path
    shipped = Path(str(importlib.resources.files("specdec.deployments") / "config" / name))
    if shipped.exists():
        return shipped
    raise FileNotFoundError(
        f"no Serve config {name!r} (neither a file nor one of "
        f"{sorted(p.name for p in shipped.parent.glob('*.yaml'))})"
    )


def run_standalone(
    add_cli_args: Callable[[argparse.ArgumentParser], None],
    main: Callable[[argparse.Namespace], int],
    **parser_kwargs,
) -> None:
    """`python -m specdec.tools.X`: parses sys.argv with the tool's own add_cli_args, runs its
    main and exits with main's status. ``parser_kwargs`` go to argparse.ArgumentParser (prog,
    description, formatter_class: DefaultsHelpFormatter unless given)."""
    parser = argparse.ArgumentParser(**{"formatter_class": DefaultsHelpFormatter, **parser_kwargs})
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
