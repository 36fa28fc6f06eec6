"""The `specdec` command line: cluster, serve, generate, loadtest, soak, bench, sweep, demo,
tiny-models, tiny-bench, k8s.

Ray, torch and transformers are imported only by the subcommands that need them, so
`specdec generate` starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

import grpc

from specdec import __version__
from specdec.tools.args import DefaultsHelpFormatter

# subcommand -> (module with add_cli_args(parser) and main(args) -> int, one-line help).
# Only the chosen subcommand's module is imported: its imports are its own business.
COMMANDS: dict[str, tuple[str, str]] = {
    "cluster": ("specdec.cluster.commands", "local multi-node Ray cluster on this machine"),
    "serve": ("specdec.tools.serve", "deploy specdec to a running Ray cluster"),
    "generate": ("specdec.tools.generate", "call the gRPC endpoint"),
    "tiny-models": ("specdec.tools.tiny_models", "write a tiny random draft/target pair"),
    "loadtest": ("specdec.bench.loadtest", "staged gRPC load with per-second records"),
    "soak": (
        "specdec.bench.soak",
        "minutes of greedy load on the tiny pair on a cluster of its own, with scaling, "
        "a killed target replica and a killed draft node: counts, exactness, memory",
    ),
    "bench": (
        "specdec.bench.speedup",
        "speculative vs target-only through the service, "
        "and Hugging Face assisted generation in process",
    ),
    "demo": (
        "specdec.tools.demo",
        "what `make run` runs: serve the bundled pair, "
        "stream two prompts, benchmark a small sample",
    ),
    "tiny-bench": (
        "specdec.bench.tiny_bench",
        "throughput and acceptance per k on the tiny pair, in process or through the service",
    ),
    "sweep": (
        "specdec.bench.sweep",
        "concurrency x k through the service: aggregate and per-request tokens/s, TTFT, "
        "latency, exactness against k=0",
    ),
    "k8s": (
        "specdec.tools.k8s",
        "render the generated k8s/ patches, or put the model pair where a Ray pod expects it",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Runs ``specdec COMMAND ...`` (sys.argv when ``argv`` is None); returns the exit status.

    A gRPC error, or a RuntimeError, ValueError, OSError or ImportError, is printed as one
    ``specdec: ...`` line and gives status 1; argparse exits with 2 on bad flags.
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser, module = build_parser(argv)
        args = parser.parse_args(argv)
        return module.main(args)
    except grpc.RpcError as err:
        print(f"specdec: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, OSError, ImportError) as err:
        print(f"specdec: {err}", file=sys.stderr)
        return 1


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    """The `specdec` parser for ``argv``, and the module of the subcommand it names.

    Every subcommand is listed (with its help) but only the named one gets its flags, so only
    its module is imported. The command is the first argument not starting with "-" (the top
    level has no options but --help and --version); with none, or an unknown one, the module
    is None and parse_args reports the error. Every parser prints its flags' defaults
    (DefaultsHelpFormatter; a subcommand's own subparsers pass its formatter_class on).
    """
    parser = argparse.ArgumentParser(
        prog="specdec", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        subparser = commands.add_parser(name, help=help_text, formatter_class=DefaultsHelpFormatter)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_cli_args(subparser)
    return parser, module


if __name__ == "__main__":
    sys.exit(main())
