"""`specdec serve`: deploy specdec to a running Ray cluster (or the local one, started first with
--local), from a Serve config YAML with optional model, dtype and API-key overrides."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.api_keys import read_keys_file
from specdec.config import APPLICATION
from specdec.tools.args import DEFAULT_CONFIG, config_path

# parsed-args attributes (--draft-model ...) that override the application arg of the same name
OVERRIDES = (
    "draft_model",
    "target_model",
    "dtype",
    "gemm",
    "draft_dtype",
    "draft_gemm",
    "api_keys_file",
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec serve`."""
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="Serve config YAML: a path, or local.yaml / gpu.yaml (shipped)",
    )
    parser.add_argument("--local", action="store_true", help="first bring up the local cluster")
    parser.add_argument("--address", help="Ray address (default: the local cluster's)")
    parser.add_argument("--draft-model", help="override the config's draft_model")
    parser.add_argument("--target-model", help="override the config's target_model")
    parser.add_argument(
        "--dtype",
        help="override the config's dtype for the target (auto, float32, bfloat16, float16, "
        "int8); the draft keeps the config's draft_dtype, or else its dtype",
    )
    parser.add_argument(
        "--gemm",
        help="override the config's gemm for the target (auto, plain, wm, dnnl, bf16w); the "
        "draft keeps the GEMM the config gives it",
    )
    parser.add_argument("--draft-dtype", help="override the config's draft_dtype (e.g. int8)")
    parser.add_argument("--draft-gemm", help="override the config's draft_gemm")
    parser.add_argument(
        "--api-keys-file",
        help="require one of this file's API keys on every request (one a line; "
        "docs/security.md); read here first, so a bad file fails before the deploy",
    )


def main(args: argparse.Namespace) -> int:
    """Deploys and prints where the service listens.

    On a cluster on this machine (--local, or no --address) the bundled pair is converted here,
    once, with progress bars, instead of in every replica.

    Raises:
        FileNotFoundError: no such config. specdec.errors.ConfigError: a bad setting, or an
        --api-keys-file that cannot be read or holds no key. specdec.errors.ModelLoadError: the
        bundled pair is not installed. RuntimeError: no cluster to deploy to, or the deployment
        failed.
    """
    from specdec.cluster import local
    from specdec.deployments.deploy import ServeConfig, bundled_models, deploy

    if args.api_keys_file:
        # The router reads the file from its own working directory: pass it absolute, and
        # fail on a missing or empty file now rather than in the router replica.
        args.api_keys_file = str(Path(args.api_keys_file).expanduser().resolve())
        read_keys_file(args.api_keys_file)
    address = args.address
    if args.local:
        try:
            address = local.address()
        except RuntimeError:
            address = local.up().address
    overrides = {key: getattr(args, key) for key in OVERRIDES if getattr(args, key)}
    # Parsed once (ConfigError before anything starts), then passed whole.
    config = ServeConfig.load(config_path(args.config), overrides)
    if args.local or args.address is None:
        config = config.with_settings(**bundled_models(config))
    deploy(config, address=address or local.address())
    print(
        f"specdec is serving (config {config.path}); gRPC on port {config.grpc_port}, "
        f"application '{APPLICATION}'"
    )
    return 0
