"""How long one long prompt stalls the streams already decoding, through the running service.

    specdec serve --local                                    # prefill_chunk_tokens: 512
    python -m specdec.bench.prefill_stall --json chunked.json
    specdec cluster down
    specdec serve --local --set prefill_chunk_tokens=0       # each prompt in one forward
    python -m specdec.bench.prefill_stall --json whole.json

One greedy stream (a request for a long list, so that it outlasts the long prompt) decodes.
After its first ``--warm`` messages a second request arrives whose prompt is about
``--prompt-tokens`` tokens of Spec-Bench summarization text and which asks for one token. The
stream's calls and the long prompt's prefill then share the target replica (and the draft's).
Printed, in seconds: the stream's median gap between messages before the long request, its
largest gap from the long request's arrival to its answer, and that request's time to its
token. With chunked prefill the largest gap is about one chunk's prefill plus a round; without,
the whole prompt's.

The header names the machine. A benchmark, never a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from specdec.bench.datasets import load_prompts
from specdec.bench.report import machine, run_record
from specdec.client import DEFAULT_ADDRESS, SpecdecClient, build_request
from specdec.models.loading import load_tokenizer
from specdec.tools.args import run_standalone

STREAM = {"role": "user", "content": "Write the numbers from 1 to 500 in words, one per line."}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m specdec.bench.prefill_stall`."""
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="gRPC HOST:PORT")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="the long prompt's size")
    parser.add_argument("--stream-tokens", type=int, default=256, help="the stream's tokens")
    parser.add_argument("--warm", type=int, default=8, help="stream messages before it arrives")
    parser.add_argument("--tokenizer", default="bundled:target", help="model whose tokenizer")
    parser.add_argument("--json", dest="out", help="write the figures as JSON here")


def long_prompt(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of Spec-Bench summarization questions, one after another."""
    text, parts = "", iter(load_prompts("spec-bench", category="summarization"))
    while len(tokenizer.encode(text)) < tokens:
        part = next(parts)
        text += (part.chat or part.prompt or "") + "\n\n"
    return tokenizer.decode(tokenizer.encode(text)[:tokens])


def main(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer)
    prompt = long_prompt(tokenizer, args.prompt_tokens)
    client = SpecdecClient(args.address, timeout_s=900)
    info = client.model_info()
    host = machine()
    print(f"# {host}; target {info.target_dtype}, draft {info.draft_dtype}")
    arrivals: list[float] = []
    long_times: dict[str, float] = {}
    started = threading.Event()

    def send_long() -> None:
        started.wait()
        long_times["sent"] = time.perf_counter()
        response = client.generate(build_request(prompt, max_new_tokens=1))
        long_times["answered"] = time.perf_counter()
        long_times["prompt_tokens"] = response.usage.prompt_tokens

    sender = threading.Thread(target=send_long)
    sender.start()
    request = build_request(messages=[STREAM], max_new_tokens=args.stream_tokens)
    for _ in client.generate_stream(request):
        arrivals.append(time.perf_counter())
        if len(arrivals) == args.warm:
            started.set()
    started.set()
    sender.join()
    figures = _figures(arrivals, long_times)
    print(json.dumps(figures, indent=2))
    if args.out:
        config = {**vars(args), "target": info.target_dtype, "draft": info.draft_dtype}
        command = " ".join(["python -m specdec.bench.prefill_stall", *sys.argv[1:]])
        record = run_record(command, host, config, figures=figures)
        with open(args.out, "w") as out:
            json.dump(record, out, indent=2)
    return 0


def _figures(arrivals: list[float], long_times: dict[str, float]) -> dict:
    """The stream's gaps before and during the long request, and that request's latency."""
    sent, answered = long_times["sent"], long_times["answered"]
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    before = [gap for at, gap in gaps if at <= sent]
    during = [gap for at, gap in gaps if sent < at <= answered + max(before, default=0)]
    return {
        "long_prompt_tokens": int(long_times["prompt_tokens"]),
        "long_request_s": round(answered - sent, 3),
        "stream_gap_before_p50_s": round(statistics.median(before), 3) if before else None,
        "stream_gap_during_max_s": round(max(during), 3) if during else None,
        "stream_messages_during": len(during),
        "stream_gaps_during_s": [round(gap, 3) for gap in during],
        "stream_messages": len(arrivals),
    }


if __name__ == "__main__":
    run_standalone(add_cli_args, main, prog="python -m specdec.bench.prefill_stall")
