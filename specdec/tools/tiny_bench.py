"""Throughput and acceptance on the tiny pair, in process or through a running service.

    python -m specdec.tools.tiny_bench                       # in-process SpeculativeEngine
    python -m specdec.tools.tiny_bench --address 127.0.0.1:9000   # through the gRPC service

Greedy, the tiny prompts, 128 new tokens, k = 0 (target only), fixed k and "auto". Through the
service it also reports the orchestration overhead per decode round (round time minus draft and
verify compute, from the response stats) and its share of the round. Numbers on random tiny models
measure the machinery, not the value of speculation on real models.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stats import SpeculationStats
from specdec.pairs.tiny import PROMPTS, save_pair

KS = (0, 1, 2, 4, 8, "auto")


def _in_process(max_new_tokens: int):
    from specdec.engine import SpeculativeEngine

    draft, target = save_pair(Path(tempfile.mkdtemp(prefix="specdec-tiny-")), noise=0.05)
    engine = SpeculativeEngine.from_pretrained(draft, target)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine.generate(PROMPTS[0], params, 4)  # warm-up
    return lambda prompt, k: engine.generate(prompt, params, k).stats


def _through_service(address: str, max_new_tokens: int):
    from specdec.client import SpecdecClient, build_request

    client = SpecdecClient(address)

    def run(prompt, k):
        request = build_request(
            prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=None if k == "auto" else k
        )
        return SpeculationStats.from_proto(client.generate(request).stats)

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", help="gRPC HOST:PORT of a running service (default: in process)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    run = (
        _through_service(args.address, args.max_new_tokens)
        if args.address
        else _in_process(args.max_new_tokens)
    )
    baseline = None
    for k in KS:
        stats = [run(prompt, k) for prompt in PROMPTS]
        tps = statistics.median(s.tokens_per_second for s in stats)
        baseline = baseline or tps
        drafted = sum(s.draft_tokens for s in stats)
        acceptance = sum(s.accepted_tokens for s in stats) / drafted if drafted else 0.0
        line = (
            f"k={k!s:>4}: {tps:7.1f} tok/s (median of {len(stats)}), {tps / baseline:4.2f}x "
            f"target-only, acceptance {acceptance:.2f}, "
            f"{statistics.mean(s.mean_accepted_tokens for s in stats):.2f} tokens/round, "
            f"mean k {statistics.mean(s.mean_k for s in stats):.1f}"
        )
        if args.address:
            overhead = statistics.median(s.overhead_time_s / max(s.rounds - 1, 1) for s in stats)
            share = statistics.median(
                s.overhead_time_s / (s.overhead_time_s + s.draft_time_s + s.verify_time_s)
                for s in stats
            )
            line += f", orchestration {overhead * 1e3:.2f} ms/round ({share:.0%} of round time)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
