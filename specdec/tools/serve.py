"""`specdec serve`: deploy specdec to a running Ray cluster (or the local one, started first with
--local), from a Serve config YAML with optional model, dtype and API-key overrides, and any
other setting through ``--set KEY=VALUE``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from specdec.api_keys import read_keys_file
from specdec.config import APPLICATION
from specdec.tools.args import DEFAULT_CONFIG, config_path

# parsed-args attributes (--draft-model ...) that override the application arg of the same name
OVERRIDES = (
    "draft_model",
    "target_model",
    "draft_revision",
    "target_revision",
    "served_model_name",
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
    parser.add_argument(
        "--draft-model",
        help="override the config's draft_model: a local folder, a .gguf file, bundled:draft, "
        "a Hugging Face Hub id or a folder's URI (s3://, gs://, file://)",
    )
    parser.add_argument("--target-model", help="override the config's target_model, as above")
    parser.add_argument(
        "--draft-revision", help="the Hub revision (branch, tag, commit) of a Hub-id draft"
    )
    parser.add_argument(
        "--target-revision", help="the Hub revision (branch, tag, commit) of a Hub-id target"
    )
    parser.add_argument(
        "--served-model-name",
        help="the model's id in the HTTP API (default: the target's Hub id, URI or folder)",
    )
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
        "--set",
        dest="settings",
        action="append",
        default=[],
        type=setting,
        metavar="KEY=VALUE",
        help="override any setting, repeatable: a specdec setting (docs/configuration.md, e.g. "
        "call_timeout_s=60) or a dotted path in the Serve config (e.g. "
        "deployments.TargetModel.autoscaling_config.max_replicas=4, http_options.port=8001); "
        "VALUE is read as YAML (numbers, true, null, [lists])",
    )
    parser.add_argument(
        "--api-keys-file",
        help="require one of this file's API keys on every request (one a line; "
        "docs/security.md); read here first, so a bad file fails before the deploy",
    )


def check_pair(config) -> None:
    """Refuses a draft whose tokenizer differs from the target's (token ids are compared
    across the two models), from the local folders, before anything is deployed.

    Raises:
        specdec.errors.ModelLoadError naming both models.
    """
    from specdec.errors import ModelLoadError
    from specdec.models.loading import check_same_tokenizer, load_tokenizer

    if config.app is None:
        return
    models = config.app.models
    try:
        check_same_tokenizer(
            load_tokenizer(models.draft_model), load_tokenizer(models.target_model)
        )
    except ModelLoadError as err:
        raise ModelLoadError(
            f"draft_model {models.draft_model} cannot draft for target_model "
            f"{models.target_model}: {err}"
        ) from None


def setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as (KEY, VALUE read as YAML).

    Raises:
        argparse.ArgumentTypeError: no ``=``, an empty key, or a value that is not YAML.
    """
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise argparse.ArgumentTypeError(f"{key}: the value is not YAML: {err}") from None


def main(args: argparse.Namespace) -> int:
    """Deploys and prints where the service listens.

    On a cluster on this machine (--local, or no --address) the bundled pair is converted here,
    and a Hub id or URI downloaded, once, with progress bars, instead of in every replica; then
    the two tokenizers are compared (check_pair), all before the cluster starts.

    Raises:
        FileNotFoundError: no such config. specdec.errors.ConfigError: a bad setting, or an
        --api-keys-file that cannot be read or holds no key. specdec.errors.ModelLoadError: the
        bundled pair is not installed, a model cannot be fetched, or the draft's tokenizer is
        not the target's. RuntimeError: no cluster to deploy to, or the deployment
        failed.
    """
    from specdec.cluster import local
    from specdec.deployments.deploy import ServeConfig, deploy, local_models

    if args.api_keys_file:
        # The router reads the file from its own working directory: pass it absolute, and
        # fail on a missing or empty file now rather than in the router replica.
        args.api_keys_file = str(Path(args.api_keys_file).expanduser().resolve())
        read_keys_file(args.api_keys_file)
    overrides = dict(args.settings)
    overrides |= {key: getattr(args, key) for key in OVERRIDES if getattr(args, key)}
    # Parsed once (ConfigError before anything starts), then passed whole.
    config = ServeConfig.load(config_path(args.config), overrides)
    if args.local or args.address is None:
        # Converted, downloaded and checked before any process starts.
        config = config.with_settings(**local_models(config))
        check_pair(config)
    address = args.address
    if args.local:
        try:
            address = local.address()
        except RuntimeError:
            address = local.up().address
    deploy(config, address=address or local.address())
    print(
        f"specdec is serving (config {config.path}):\n"
        f"  gRPC  127.0.0.1:{config.grpc_port}, metadata application={APPLICATION} "
        "(specdec generate, specdec.v1.SpeculativeDecoding)\n"
        f"  HTTP  {config.http_base_url} (OpenAI API: /completions, /chat/completions, /models)"
    )
    return 0
