"""`specdec demo`, what `make run` runs: the bundled real pair served on the local cluster.

1. Joins, verifies and converts the bundled pair once (progress bars; seconds when cached).
2. Starts the local three-node cluster, unless one is running (then it is used and left up).
3. Deploys deployments/config/local.yaml: target bfloat16, draft int8.
4. Streams two real prompts through gRPC, each as a chat message: one coding, one general.
5. Runs `specdec bench` on the first HumanEval prompts and prints its table; the JSON and the
   plot go to ``--out`` (default ``bench-results/``).
6. Stops exactly the cluster it started, whatever happened (a cluster that was already running
   is used, redeployed with local.yaml, and left running).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specdec.client import DEFAULT_APPLICATION, SpecdecClient, build_request

CONFIG = "local.yaml"
PROMPTS = (
    ("coding", "Write a Python function `is_prime(n: int) -> bool` with a short docstring."),
    ("chat", "In three sentences, explain why the sky is blue."),
)


def main(args: argparse.Namespace) -> int:
    """Runs the demo (module docstring); returns the benchmark's exit status (1: a greedy
    speculative output differed from target-only)."""
    from specdec.cli import _config_path, _grpc_port
    from specdec.cluster import local
    from specdec.deployments.deploy import deploy, resolve_bundled

    config = _config_path(CONFIG)
    Path(args.out).mkdir(parents=True, exist_ok=True)  # fail now, not after minutes of work
    print("== 1/4 the bundled model pair", flush=True)
    overrides = resolve_bundled(config)
    started = False
    try:
        try:
            address = local.address()
            print(f"== 2/4 using the running local cluster at {address}", flush=True)
        except RuntimeError:
            print("== 2/4 starting the local cluster (head, draft pool, target pool)", flush=True)
            address, started = local.up().address, True
        start = time.perf_counter()
        deploy(config, address=address, overrides=overrides)
        print(f"   deployed in {time.perf_counter() - start:.0f} s", flush=True)
        grpc_address = f"127.0.0.1:{_grpc_port(config)}"
        with SpecdecClient(grpc_address, DEFAULT_APPLICATION, timeout_s=900) as client:
            print(f"== 3/4 streaming through gRPC at {grpc_address}", flush=True)
            for name, prompt in PROMPTS:
                _stream(client, name, prompt, args.max_new_tokens)
        print(
            f"== 4/4 benchmark: {args.limit} HumanEval prompts, {args.max_new_tokens} new "
            "tokens, greedy",
            flush=True,
        )
        return _bench(grpc_address, args)
    finally:
        _disconnect()
        if started:
            print(f"stopped the local cluster ({len(local.down())} processes)", flush=True)


def _stream(client: SpecdecClient, name: str, prompt: str, max_new_tokens: int) -> None:
    """Streams one chat prompt to stdout (2 x max_new_tokens tokens: a whole short answer),
    then its speculation summary to stderr."""
    from specdec.cli import _print_summary

    print(f"\n--- {name}: {prompt}", flush=True)
    request = build_request(
        messages=[{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens * 2
    )
    message = None
    for message in client.generate_stream(request):
        print(message.text, end="", flush=True)
    print()
    if message is not None:
        _print_summary(message)
        sys.stderr.flush()


def _bench(grpc_address: str, args: argparse.Namespace) -> int:
    """`specdec bench` on the first args.limit HumanEval prompts, greedy, adaptive k."""
    from specdec.tools import bench

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench_args = argparse.Namespace(
        address=grpc_address,
        application=DEFAULT_APPLICATION,
        dataset="humaneval",
        data_file=None,
        category=None,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        seed=0,
        k=None,
        no_hf=False,
        timeout=900.0,
        json=str(out / "make-run.json"),
        plot=str(out / "make-run.png"),
    )
    status = bench.main(bench_args)
    print(f"\nper-prompt records: {bench_args.json}; plot: {bench_args.plot}")
    return status


def _disconnect() -> None:
    """Leaves Ray as deploy() found it: connected drivers keep a cluster's workers busy."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
