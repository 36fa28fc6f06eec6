"""`specdec demo`, what `make run` runs: the bundled real pair served on the local cluster.

1. Joins, verifies and converts the bundled pair once (progress bars; seconds when cached).
2. Starts the local three-node cluster, unless one is running (then it is used and left up).
3. Deploys deployments/config/local.yaml: dtype auto (each replica measures its candidates at
   start-up and reports what it chose; the bench header prints it).
4. Streams two real prompts through gRPC, each as a chat message: one coding, one general.
5. Sends one short chat completion through the OpenAI-compatible HTTP API (port 8000) and
   prints its text and usage.
6. Runs `specdec bench` on the first HumanEval prompts and prints its table; the JSON and the
   plot go to ``--out`` (default ``bench-results/``). Besides the service at k = 0 and
   speculative, it runs plain_generate (the target alone, transformers generate, fastest dtype
   here: the baseline of ``vs plain``), right after them on each prompt; HF assisted
   generation (transformers' default assistant settings) only with ``--hf``, and no in-process
   engine, to keep `make run` short (`specdec bench` runs both by default, HF at its best
   settings).
7. Stops exactly the cluster it started, whatever happened (a cluster that was already running
   is used, redeployed with local.yaml, and left running).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from specdec.client import SpecdecClient, build_request
from specdec.config import APPLICATION
from specdec.tools.args import config_path, positive_int
from specdec.tools.generate import print_summary

CONFIG = "local.yaml"
PROMPTS = (
    ("coding", "Write a Python function `is_prime(n: int) -> bool` with a short docstring."),
    ("chat", "In three sentences, explain why the sky is blue."),
)
HTTP_PROMPT = "Name three prime numbers."


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec demo`."""
    parser.add_argument(
        "--limit", type=positive_int, default=3, help="HumanEval prompts to benchmark"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=64,
        help="new tokens per benchmark prompt; the streamed answers get twice as many",
    )
    parser.add_argument("--out", default="bench-results", help="folder for the JSON and plot")
    parser.add_argument(
        "--hf",
        action="store_true",
        help="also run HF assisted generation with its default settings (on an AVX2-only CPU "
        "that took 14.6 of make run's 32.5 minutes; `specdec bench` runs it at its best)",
    )


def main(args: argparse.Namespace) -> int:
    """Runs the demo (module docstring); returns the benchmark's exit status (1: a greedy
    speculative output differed from target-only).

    Raises:
        specdec.errors.ModelLoadError: the bundled pair is not installed. RuntimeError: the
        cluster or the deployment failed. grpc.RpcError, urllib.error.HTTPError: a request
        failed.
    """
    from specdec.cluster import local
    from specdec.deployments.deploy import ServeConfig, deploy, local_models

    config = ServeConfig.load(config_path(CONFIG))
    Path(args.out).mkdir(parents=True, exist_ok=True)  # fail now, not after minutes of work
    print("== 1/5 the bundled model pair", flush=True)
    config = config.with_settings(**local_models(config))
    started = False
    try:
        try:
            address = local.address()
            print(f"== 2/5 using the running local cluster at {address}", flush=True)
        except RuntimeError:
            print("== 2/5 starting the local cluster (head, draft pool, target pool)", flush=True)
            address, started = local.up().address, True
        start = time.perf_counter()
        deploy(config, address=address)
        print(f"   deployed in {time.perf_counter() - start:.0f} s", flush=True)
        grpc_address = f"127.0.0.1:{config.grpc_port}"
        with SpecdecClient(grpc_address, APPLICATION, timeout_s=900) as client:
            print(f"== 3/5 streaming through gRPC at {grpc_address}", flush=True)
            for name, prompt in PROMPTS:
                _stream(client, name, prompt, args.max_new_tokens)
        base_url = config.http_base_url
        print(f"== 4/5 one chat completion through the OpenAI API at {base_url}", flush=True)
        _print_http_chat(http_chat(base_url, HTTP_PROMPT, args.max_new_tokens))
        print(
            f"== 5/5 benchmark: {args.limit} HumanEval prompts, {args.max_new_tokens} new "
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
    print(f"\n--- {name}: {prompt}", flush=True)
    request = build_request(
        messages=[{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens * 2
    )
    message = None
    for message in client.generate_stream(request):
        print(message.text, end="", flush=True)
    print()
    if message is not None:
        print_summary(message)
        sys.stderr.flush()


def http_chat(base_url: str, prompt: str, max_tokens: int, timeout_s: float = 900) -> dict:
    """POSTs one greedy chat completion (``prompt`` as the user message) to the OpenAI-compatible
    API at ``base_url`` (``.../v1``) with plain urllib; returns the response object (``choices``,
    ``usage``, ``specdec_stats``).

    Raises:
        urllib.error.HTTPError: the service answered an error object (400, 503, ...).
    """
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def _print_http_chat(answer: dict) -> None:
    """The answer's text, then its usage and acceptance (to stderr, like the gRPC summary)."""
    choice, usage = answer["choices"][0], answer["usage"]
    print(f"\n--- chat over HTTP: {HTTP_PROMPT}\n{choice['message']['content']}", flush=True)
    stats = answer["specdec_stats"]
    print(
        f"[{choice['finish_reason']}] usage: {usage['prompt_tokens']} prompt + "
        f"{usage['completion_tokens']} completion = {usage['total_tokens']} tokens, "
        f"acceptance {stats['acceptance_rate']:.2f}, mean k {stats['mean_k']:.1f}",
        file=sys.stderr,
    )
    sys.stderr.flush()


def bench_args(grpc_address: str, args: argparse.Namespace) -> argparse.Namespace:
    """The arguments of the demo's `specdec bench` run, parsed by bench's own parser (so a bench
    flag added or made required shows here, and in a unit test, not minutes into `make run`):
    the first args.limit HumanEval prompts, args.max_new_tokens new tokens, greedy, adaptive k,
    plain_generate, HF assisted (default settings) only with args.hf, no in-process engine,
    JSON and plot under args.out."""
    from specdec.bench import speedup

    out = Path(args.out)
    parser = argparse.ArgumentParser(prog="specdec bench")
    speedup.add_cli_args(parser)
    return parser.parse_args(
        [
            f"--address={grpc_address}",
            f"--application={APPLICATION}",
            "--dataset=humaneval",
            f"--limit={args.limit}",
            f"--max-new-tokens={args.max_new_tokens}",
            "--temperature=0",
            "--seed=0",
            "--k=auto",
            "--no-engine",
            "--no-hf-tune",
            "--timeout=900",
            f"--json={out / 'make-run.json'}",
            f"--plot={out / 'make-run.png'}",
            *([] if args.hf else ["--no-hf"]),
        ]
    )


def _bench(grpc_address: str, args: argparse.Namespace) -> int:
    """`specdec bench` with bench_args; returns its exit status."""
    from specdec.bench import speedup

    Path(args.out).mkdir(parents=True, exist_ok=True)
    parsed = bench_args(grpc_address, args)
    status = speedup.main(parsed)
    print(f"\nper-prompt records: {parsed.json}; plot: {parsed.plot}")
    return status


def _disconnect() -> None:
    """Leaves Ray as deploy() found it: connected drivers keep a cluster's workers busy."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
