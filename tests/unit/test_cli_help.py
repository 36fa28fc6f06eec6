"""`specdec --help` and every subcommand's (nested ones too): each flag has help, and each
meaningful default shows as ``(default: VALUE)`` unless the help already names one; no
``(default: None)`` noise. The real parsers of specdec.cli.build_parser; no cluster, no service.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from specdec import cli
from specdec.tools.args import (
    DefaultsHelpFormatter,
    RawDescriptionDefaultsHelpFormatter,
    shown_default,
)

ROOT = Path(__file__).resolve().parents[2]
# the actions that need no help of their own: argparse's -h/--help and --version, and a
# subcommand group (each of its subcommands has its own parser, checked in turn)
EXEMPT = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _walk(parser: argparse.ArgumentParser, argv: tuple[str, ...]) -> Iterator[tuple]:
    """(argv to reach it, parser) of ``parser`` and of every subparser below it."""
    yield argv, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*argv, name))


@cache
def _parsers(command: str | None) -> tuple[tuple[tuple[str, ...], argparse.ArgumentParser], ...]:
    """The parsers of ``specdec COMMAND`` and its own subcommands (with the flags that
    build_parser adds for the named command only); the top level alone for None."""
    parser, _ = cli.build_parser([command] if command else [])
    if command is None:
        return (((), parser),)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return tuple(_walk(sub.choices[command], (command,)))


def _checked(command: str | None) -> Iterator[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    """("specdec SUB ...", parser, action) of every action that must have help."""
    for argv, parser in _parsers(command):
        for action in parser._actions:
            if not isinstance(action, EXEMPT):
                yield " ".join(("specdec", *argv)), parser, action


def _flag(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or f"positional {action.dest!r}"


def _meaningful(default: object) -> bool:
    """A default worth printing: not None, False, SUPPRESS or empty ("" / [] / ())."""
    if default is None or default is False or default == argparse.SUPPRESS:
        return False
    return not (isinstance(default, str | list | tuple) and not default)


def _words(text: str) -> str:
    return " ".join(text.split())  # argparse wraps lines wherever the terminal width says


COMMANDS = [None, *cli.COMMANDS]
IDS = ["specdec", *cli.COMMANDS]


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_every_flag_has_help(command):
    missing = [
        f"{where}: {_flag(action)}"
        for where, _, action in _checked(command)
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS
    ]
    assert not missing, f"flags without help: {missing}"


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_every_default_shows_in_help(command):
    """Each meaningful default is in the rendered --help right after its flag's help text, as
    ``(default: VALUE)`` (a list as typed: spaced or comma-joined), unless that help text
    already says "default" (a computed or hand-worded one)."""
    unshown = []
    for where, parser, action in _checked(command):
        if not _meaningful(action.default) or "default" in (action.help or "").lower():
            continue
        if not action.option_strings and action.nargs not in ("?", "*"):
            continue  # a required positional: its default is never used
        values = {str(action.default)}
        if isinstance(action.default, list | tuple):
            values |= {sep.join(map(str, action.default)) for sep in (" ", ",")}
        rendered = _words(parser.format_help())
        if not any(_words(f"{action.help or ''} (default: {v})") in rendered for v in values):
            unshown.append(f"{where}: {_flag(action)} (default {action.default!r})")
    assert not unshown, f"defaults missing from --help: {unshown}"


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_help_has_no_empty_or_repeated_default(command):
    """No "(default: None)"-like noise, and help that names its default gets no second one."""
    for argv, parser in _parsers(command):
        where = " ".join(("specdec", *argv))
        assert parser.formatter_class is not None and issubclass(
            parser.formatter_class, DefaultsHelpFormatter
        ), f"{where}: formatter_class {parser.formatter_class.__name__}"
        rendered = _words(parser.format_help())
        for noise in ("None", "False", "[]", "()", "SUPPRESS"):
            assert f"(default: {noise})" not in rendered, f"{where}: (default: {noise})"
        for action in parser._actions:
            if "default" in (action.help or "").lower():
                assert shown_default(action) is None, f"{where}: {_flag(action)} twice"


@pytest.mark.parametrize(
    "argv",
    [argv for command in COMMANDS for argv, _ in _parsers(command)],
    ids=lambda argv: " ".join(("specdec", *argv)),
)
def test_help_exits_0(argv, capsys):
    parser, _ = cli.build_parser(list(argv))
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*argv, "--help"])
    assert exit_.value.code == 0, f"specdec {' '.join(argv)} --help: exit {exit_.value.code}"
    assert capsys.readouterr().out.startswith(f"usage: {' '.join(('specdec', *argv))}")


def test_serve_help_from_the_installed_script():
    script = Path(sys.executable).parent / "specdec"
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    run = subprocess.run(
        [str(script), "serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "(default: local.yaml)" in _words(run.stdout)


def test_formatter_shows_only_meaningful_defaults():
    parser = argparse.ArgumentParser(prog="t", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--zero", type=int, default=0, help="zero is a default")
    parser.add_argument("--seed", type=int, default=0, help="a seed")
    parser.add_argument("--pct", default="50%", help="a share")
    parser.add_argument("--none", help="unset")
    parser.add_argument("--flag", action="store_true", help="a switch")
    parser.add_argument("--stop", action="append", default=[], help="repeatable")
    parser.add_argument("--roles", nargs="+", default=["draft", "target"], help="roles")
    parser.add_argument("--modes", default=(0, 2), help="a comma list")
    parser.add_argument("dest", help="required")
    parser.add_argument("folder", nargs="?", default="here", help="optional")
    text = _words(parser.format_help())
    assert "zero is a default --seed" in text  # "default" in the help: nothing appended
    for shown in ("a seed (default: 0)", "a share (default: 50%)", "optional (default: here)"):
        assert shown in text
    assert "roles (default: draft target)" in text and "a comma list (default: 0,2)" in text
    for bare in ("unset --flag", "a switch --stop", "repeatable --roles", "required folder"):
        assert bare in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_raw_variant_keeps_the_description_lines():
    description = "first line\n\nsecond paragraph,\n  indented"
    parser = argparse.ArgumentParser(
        prog="t", description=description, formatter_class=RawDescriptionDefaultsHelpFormatter
    )
    parser.add_argument("--n", type=int, default=3, help="count")
    text = parser.format_help()
    assert description in text and "count (default: 3)" in text
