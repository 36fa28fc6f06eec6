"""Throughput and acceptance on the tiny pair, in process or through a running service.

    python -m specdec.bench.tiny_bench                       # in-process SpeculativeEngine
    python -m specdec.bench.tiny_bench --address 127.0.0.1:9000   # through the gRPC service

Greedy, the tiny prompts, 128 new tokens, k = 0 (target only), fixed k and "auto". Through the
service it also reports the orchestration overhead per decode round (round time minus draft and
verify compute, from the response stats) and its share of the round, and says first when the
replicas hold their forwards to a simulated device's costs (models.simulated_costs). Numbers on
random tiny models measure the machinery, not the value of speculation on real models.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stats import SpeculationStats
from specdec.models.tiny import PROMPTS, save_pair
from specdec.tools.args import run_standalone

KS = (0, 1, 2, 4, 8, "auto")


def _in_process(max_new_tokens: int):
    from specdec.engine import SpeculativeEngine

    draft, target = save_pair(Path(tempfile.mkdtemp(prefix="specdec-tiny-")), noise=0.05)
    engine = SpeculativeEngine.from_pretrained(draft, target)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine.generate(PROMPTS[0], params, 4)  # warm-up
    return lambda prompt, k: engine.generate(prompt, params, k).stats


def _through_service(address: str, max_new_tokens: int):
    import os

    from specdec.client import API_KEY_ENV, SpecdecClient, build_request

    client = SpecdecClient(address, api_key=os.environ.get(API_KEY_ENV))
    simulated = client.model_info().simulated_costs
    if simulated:  # every figure below is then at the table's pace, not this machine's
        print(f"SIMULATED device costs (models.simulated_costs): {simulated}", flush=True)

    def run(prompt, k):
        request = build_request(
            prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=None if k == "auto" else k
        )
        return SpeculationStats.from_proto(client.generate(request).stats)

    return run


def median_tps(stats: list[SpeculationStats]) -> float:
    """The median over requests of tokens per second (tokens/s)."""
    return statistics.median(s.tokens_per_second for s in stats)


def format_line(
    k: int | str, stats: list[SpeculationStats], baseline_tps: float, orchestration: bool
) -> str:
    """One k's line: median tokens/s and its ratio to ``baseline_tps`` (target only, tokens/s);
    acceptance, tokens per decode round and mean k of all requests' summed counters; with
    ``orchestration``, the median orchestration seconds per decode round and its share of the
    round (SpeculationStats figures throughout)."""
    tps = median_tps(stats)
    total = SpeculationStats.total(stats)
    line = (
        f"k={k!s:>4}: {tps:7.1f} tok/s (median of {len(stats)}), {tps / baseline_tps:4.2f}x "
        f"target-only, acceptance {total.acceptance_rate:.2f}, "
        f"{total.mean_accepted_tokens:.2f} tokens/round, mean k {total.mean_k:.1f}"
    )
    if orchestration:
        overhead = statistics.median(s.orchestration_s_per_round for s in stats)
        share = statistics.median(s.orchestration_share for s in stats)
        line += f", orchestration {overhead * 1e3:.2f} ms/round ({share:.0%} of round time)"
    return line


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec tiny-bench` / `python -m specdec.bench.tiny_bench`."""
    parser.add_argument(
        "--address",
        help="gRPC HOST:PORT of a running service (default: in process; API key from "
        "$SPECDEC_API_KEY)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per request")


def main(args: argparse.Namespace) -> int:
    """Prints format_line for each k in KS (greedy, the tiny prompts); returns 0.

    Raises:
        grpc.RpcError: through the service (--address), a request failed.
    """
    run = (
        _through_service(args.address, args.max_new_tokens)
        if args.address
        else _in_process(args.max_new_tokens)
    )
    baseline = None
    for k in KS:
        stats = [run(prompt, k) for prompt in PROMPTS]
        baseline = baseline or median_tps(stats)
        print(format_line(k, stats, baseline, orchestration=bool(args.address)), flush=True)
    return 0


if __name__ == "__main__":
    run_standalone(add_cli_args, main, description=__doc__.splitlines()[0])
