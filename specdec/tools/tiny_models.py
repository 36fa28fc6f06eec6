"""`specdec tiny-models`: write the tiny random draft/target pair of specdec.models.tiny to a
folder, to try the service without real weights."""

from __future__ import annotations

import argparse
from pathlib import Path

TINY_DIR = Path("~/.cache/specdec/tiny").expanduser()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec tiny-models`."""
    parser.add_argument(
        "directory", nargs="?", default=str(TINY_DIR), help="folder for draft/ and target/"
    )


def main(args: argparse.Namespace) -> int:
    """Writes ``<directory>/draft`` and ``<directory>/target`` (seconds) and prints their paths.

    Raises:
        OSError: the folder cannot be written.
    """
    from specdec.models.tiny import save_pair  # torch and transformers: only when run

    draft, target = save_pair(Path(args.directory).expanduser(), noise=0.05)
    print(f"draft: {draft}\ntarget: {target}")
    return 0
