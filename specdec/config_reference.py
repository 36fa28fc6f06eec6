"""The configuration reference (docs/configuration.md), generated from the docstrings under
each field of specdec.config's settings classes; tests/unit/test_config.py fails when the two
drift. ``python -m specdec.config_reference --write`` rewrites it."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

from specdec.config import SECTIONS

REFERENCE = "docs/configuration.md"  # where `python -m specdec.config_reference --write` writes it
REFERENCE_START = "<!-- config-reference:start -->"
REFERENCE_END = "<!-- config-reference:end -->"


def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring under it, on one line} of a config class, read from source.

    Raises:
        ValueError: a field without a docstring.
    """
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
    if missing:
        raise ValueError(f"{cls.__name__}: no docstring under {missing}")
    return docs


def reference_markdown() -> str:
    """The configuration reference: one table per concern (setting, default, meaning)."""
    intro = (
        "Generated from `specdec/config.py` and `specdec/config_service.py` by "
        "`python -m specdec.config_reference`. Each "
        "setting is a key of the Serve application's `args` (`deployments/config/*.yaml`) and "
        "a keyword argument of `SpeculativeEngine.from_pretrained` (in one process, of the "
        "`service` settings only `draft_retry_s` has an effect). A bad value or an unknown key "
        "stops the application at start-up with a message that starts with the setting's name."
    )
    parts = [textwrap.fill(intro, width=100, break_on_hyphens=False)]
    for section, cls in SECTIONS.items():
        title = inspect.getdoc(cls).split(":", 1)[1].strip().rstrip(".")
        rows = [
            f"### `{section}` ({cls.__name__}): {title}",
            "",
            "| setting | default | meaning |",
            "|---|---|---|",
        ]
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            meaning = docs[field.name].replace("|", "\\|")
            rows.append(f"| `{field.name}` | `{_yaml(field.default)}` | {meaning} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


def render_reference(text: str) -> str:
    """``text`` (docs/configuration.md) with the reference between its markers replaced by
    reference_markdown().

    Raises:
        ValueError: the markers are missing.
    """
    start, end = text.find(REFERENCE_START), text.find(REFERENCE_END)
    if start < 0 or end < start:
        raise ValueError(f"the reference lacks {REFERENCE_START} ... {REFERENCE_END}")
    return text[: start + len(REFERENCE_START)] + "\n" + reference_markdown() + text[end:]


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def main(argv: list[str] | None = None) -> int:
    """Prints the reference; ``--write`` replaces the marked section of REFERENCE (default
    docs/configuration.md, relative to the working directory: run it from the repository root)."""
    parser = argparse.ArgumentParser(
        prog="python -m specdec.config_reference", description=main.__doc__
    )
    parser.add_argument(
        "--write",
        nargs="?",
        const=REFERENCE,
        metavar="REFERENCE",
        help=f"update this file's marked section (default {REFERENCE})",
    )
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(reference_markdown())
        return 0
    path = Path(args.write)
    path.write_text(render_reference(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
