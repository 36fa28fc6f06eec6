"""The `specdec` command line: cluster, serve, generate, loadtest, bench, demo, tiny-models.

Ray, torch and transformers are imported only by the subcommands that need them, so
`specdec generate` starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from specdec.client import DEFAULT_ADDRESS, DEFAULT_APPLICATION, SpecdecClient, build_request

DEFAULT_CONFIG = "local.yaml"  # looked up in the packaged deployments/config/ when not a path
TINY_DIR = Path("~/.cache/specdec/tiny").expanduser()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except grpc.RpcError as err:
        print(f"specdec: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, OSError, ImportError) as err:
        print(f"specdec: {err}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    cluster = commands.add_parser("cluster", help="local multi-node Ray cluster on this machine")
    cluster.add_argument("action", choices=["up", "down", "status"])
    cluster.add_argument("--state-dir", help="where the cluster records its processes")
    cluster.set_defaults(func=_cluster)

    serve = commands.add_parser("serve", help="deploy specdec to a running Ray cluster")
    serve.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="Serve config YAML: a path, or local.yaml / gpu.yaml (shipped)",
    )
    serve.add_argument("--local", action="store_true", help="first bring up the local cluster")
    serve.add_argument("--address", help="Ray address (default: the local cluster's)")
    serve.add_argument("--draft-model", help="override the config's draft_model")
    serve.add_argument("--target-model", help="override the config's target_model")
    serve.add_argument("--dtype", help="override the config's dtype (the target's)")
    serve.add_argument("--draft-dtype", help="override the config's draft_dtype (e.g. int8)")
    serve.set_defaults(func=_serve)

    generate = commands.add_parser("generate", help="call the gRPC endpoint")
    generate.add_argument("prompt")
    generate.add_argument("--address", default=DEFAULT_ADDRESS, help="gRPC HOST:PORT")
    generate.add_argument("--application", default=DEFAULT_APPLICATION)
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    generate.add_argument(
        "--stream", action="store_true", help="print tokens as rounds commit them"
    )
    generate.add_argument("--max-new-tokens", type=int)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument(
        "--k",
        default="auto",
        type=_k_value,
        help="speculative tokens per round: an int >= 0 (0 = off) or auto",
    )
    generate.add_argument("--json", action="store_true", help="print the whole response as JSON")
    generate.add_argument("--timeout", type=float, help="deadline in seconds")
    generate.set_defaults(func=_generate)

    tiny = commands.add_parser("tiny-models", help="write a tiny random draft/target pair")
    tiny.add_argument("directory", nargs="?", default=str(TINY_DIR))
    tiny.set_defaults(func=_tiny_models)
    _add_loadtest(commands)
    _add_bench(commands)

    demo = commands.add_parser(
        "demo",
        help="what `make run` runs: serve the bundled pair, "
        "stream two prompts, benchmark a small sample",
    )
    demo.add_argument(
        "--limit", type=_positive_int, default=3, help="HumanEval prompts to benchmark (default 3)"
    )
    demo.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=64,
        help="new tokens per benchmark prompt; the streamed answers get twice as many (default 64)",
    )
    demo.add_argument("--out", default="bench-results", help="folder for the JSON and plot")
    demo.set_defaults(func=_demo)
    return parser


def _add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="speculative vs target-only through the service, "
        "and Hugging Face assisted generation in process",
    )
    bench.add_argument("--address", default=DEFAULT_ADDRESS, help="gRPC HOST:PORT")
    bench.add_argument("--application", default=DEFAULT_APPLICATION)
    bench.add_argument(
        "--dataset", default="humaneval", help="humaneval, mt-bench, spec-bench, or a .jsonl path"
    )
    bench.add_argument("--data-file", help="the question file of mt-bench / spec-bench")
    bench.add_argument("--category", help="only this category of the dataset")
    bench.add_argument(
        "--limit", type=_positive_int, default=20, help="first N prompts (default 20)"
    )
    bench.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=128,
        help="new tokens per request (default 128)",
    )
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    bench.add_argument("--seed", type=int, default=0, help="sampling: prompt i uses seed + i")
    bench.add_argument(
        "--k",
        default="auto",
        type=_k_value,
        help="speculative tokens per round in the speculative mode: int or auto",
    )
    bench.add_argument(
        "--no-hf",
        action="store_true",
        help="skip the in-process Hugging Face assisted-generation baseline",
    )
    bench.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, s")
    bench.add_argument("--json", metavar="OUT", help="one record per prompt and a summary")
    bench.add_argument(
        "--plot", metavar="OUT.png", help="speedup per prompt, acceptance per draft position"
    )
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from specdec.tools import bench

    return bench.main(args)


def _demo(args: argparse.Namespace) -> int:
    from specdec.tools import demo

    return demo.main(args)


def _add_loadtest(commands) -> None:
    loadtest = commands.add_parser("loadtest", help="staged gRPC load with per-second records")
    loadtest.add_argument("--address", default=DEFAULT_ADDRESS, help="gRPC HOST:PORT")
    loadtest.add_argument("--application", default=DEFAULT_APPLICATION)
    loadtest.add_argument(
        "--stages",
        default="1x30s,8x90s,1x60s",
        type=_stages,
        help="CONCURRENCYxDURATION,... (durations in ms, s or m)",
    )
    loadtest.add_argument(
        "--dataset",
        default="tiny",
        help="tiny (built in), humaneval, mt-bench, spec-bench or a .jsonl path",
    )
    loadtest.add_argument("--data-file", help="the dataset's question file")
    loadtest.add_argument("--max-new-tokens", type=int, default=64)
    loadtest.add_argument(
        "--k",
        default="auto",
        type=_k_value,
        help="speculative tokens per round: an int >= 0 (0 = off) or auto",
    )
    loadtest.add_argument("--temperature", type=float, help="default: greedy")
    loadtest.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GenerateStream, TTFT at the first message (default on)",
    )
    loadtest.add_argument(
        "--ray-address", help="Ray address for replica counts (default: the local cluster's)"
    )
    loadtest.add_argument("--max-requests", type=int, help="start at most N requests")
    loadtest.add_argument(
        "--timeout", type=float, default=300.0, help="deadline of each request, seconds"
    )
    loadtest.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after the last stage",
    )
    loadtest.add_argument("--json", metavar="OUT", help="write the per-second report as JSON")
    loadtest.add_argument("--plot", metavar="OUT.png", help="plot load, latency, replicas")
    loadtest.set_defaults(func=_loadtest)


def _stages(text: str):
    from specdec.tools.loadtest import parse_stages

    try:
        return parse_stages(text, flag="")
    except ValueError as err:  # argparse names the flag: "argument --stages: ..."
        raise argparse.ArgumentTypeError(str(err).lstrip(": ")) from None


def _loadtest(args: argparse.Namespace) -> int:
    from specdec.tools import loadtest

    return loadtest.main(args)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _k_value(text: str) -> int | None:
    """--k: None for auto, else an integer (the server checks the range)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def _cluster(args: argparse.Namespace) -> None:
    from specdec.cluster import local

    if args.action == "up":
        info = local.up(args.state_dir)
        print(f"local cluster up at {info.address} ({len(info.nodes)} nodes)")
    elif args.action == "down":
        pids = local.down(args.state_dir)
        print(f"stopped {len(pids)} processes" if pids else "no local cluster was running")
    else:
        print(local.format_status(local.status(args.state_dir)))


def _serve(args: argparse.Namespace) -> None:
    from specdec.cluster import local
    from specdec.deployments.deploy import deploy, resolve_bundled

    address = args.address
    if args.local:
        try:
            address = local.address()
        except RuntimeError:
            address = local.up().address
    overrides = {
        k: v
        for k, v in (
            ("draft_model", args.draft_model),
            ("target_model", args.target_model),
            ("dtype", args.dtype),
            ("draft_dtype", args.draft_dtype),
        )
        if v
    }
    config = _config_path(args.config)
    if args.local or args.address is None:  # a cluster on this machine: convert bundled
        # models here, once, with progress bars, instead of in every replica
        overrides = resolve_bundled(config, overrides)
    deploy(config, address=address or local.address(), overrides=overrides)
    print(
        f"specdec is serving (config {config}); gRPC on port {_grpc_port(config)}, "
        f"application '{DEFAULT_APPLICATION}'"
    )


def _config_path(name: str) -> Path:
    """A config file path, or the name of one shipped in deployments/config/."""
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


def _grpc_port(config: Path) -> int:
    import yaml

    return yaml.safe_load(config.read_text())["grpc_options"]["port"]


def _generate(args: argparse.Namespace) -> None:
    request = build_request(
        None if args.chat else args.prompt,
        messages=[{"role": "user", "content": args.prompt}] if args.chat else None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        num_speculative_tokens=args.k,
        logprobs=args.json,
    )
    with SpecdecClient(args.address, args.application, timeout_s=args.timeout) as client:
        if not args.stream:
            response = client.generate(request)
            print(_json(response) if args.json else response.text)
            return
        for message in client.generate_stream(request):
            if args.json:
                print(_json(message), flush=True)
            else:
                print(message.text, end="", flush=True)
        if not args.json:
            print()
            _print_summary(message)


def _print_summary(last) -> None:
    s = last.stats
    print(
        f"[{last.finish_reason}] {last.usage.completion_tokens} tokens, "
        f"{s.tokens_per_second:.1f} tok/s, TTFT {s.ttft_s * 1e3:.0f} ms, "
        f"acceptance {s.acceptance_rate:.2f}, {s.mean_accepted_tokens:.2f} tokens/round, "
        f"mean k {s.mean_k:.1f}",
        file=sys.stderr,
    )


def _json(message) -> str:
    return json.dumps(
        json_format.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    )


def _tiny_models(args: argparse.Namespace) -> None:
    from specdec.pairs.tiny import save_pair

    draft, target = save_pair(Path(args.directory).expanduser(), noise=0.05)
    print(f"draft: {draft}\ntarget: {target}")


if __name__ == "__main__":
    sys.exit(main())
