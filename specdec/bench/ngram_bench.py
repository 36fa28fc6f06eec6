"""Microseconds of router work per round for proposals and stop rules, at N requests in flight.

    python -m specdec.bench.ngram_bench                          # 64 requests, Spec-Bench
    python -m specdec.bench.ngram_bench --requests 64 --shared-bytes 67108864

Each request's round in the router adds, for n-gram lookup: its proposal (ProposerChoice.choose,
the draft's plan priced beside it as in ``auto``) and the commit of the tokens the target
returned (RequestNgrams.commit). This runs N requests round-robin, as one router's event loop
serves them, over real prompts (Spec-Bench's summarization and RAG questions, tokenized with the
bundled target's tokenizer, rendered with its chat template), each round committing the accepted
part of its proposal plus one token, and prints per-round percentiles (microseconds) of:

- ``lookup``: the n-gram proposal and the commit alone;
- ``choice``: the whole per-round choice (KController's k pricing included; in a round that
  drafts, the pricing of lookup's tail after the draft's tokens, ProposerChoice.tail, on tokens
  standing in for the draft's) and the commit;
- ``detokenize``: the stop rules and the streamed text of the round's committed tokens
  (StopChecker.append with one stop string), which must not grow with the completion's length
  (run with ``--rounds 1024`` to see it stay flat).

The shared index (``--shared-bytes``) starts full. It also prints the one-off cost of indexing
a prompt. The header names the CPU. A benchmark,
never a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from specdec.bench.datasets import load_prompts
from specdec.config import SpeculationConfig
from specdec.decoding.costs import CostModel, CostPrior
from specdec.decoding.k_policy import KController
from specdec.decoding.ngram import RequestNgrams, shared_ngrams
from specdec.decoding.proposers import DRAFT, NGRAM, ProposerChoice
from specdec.decoding.request import encode_prompt
from specdec.decoding.stopping import StopChecker
from specdec.device.hardware import describe_device
from specdec.models.loading import load_tokenizer
from specdec.tools.args import run_standalone


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `python -m specdec.bench.ngram_bench`."""
    parser.add_argument("--requests", type=int, default=64, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=128, help="rounds per request")
    parser.add_argument(
        "--shared-bytes", type=int, default=64 * 1024**2, help="shared_ngram_bytes (0: off)"
    )
    parser.add_argument("--tokenizer", default="bundled:target", help="model whose tokenizer")
    parser.add_argument("--json", dest="out", help="write the figures as JSON here")


def _prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` token-id prompts: Spec-Bench's summarization and RAG questions in turn, as
    one chat message where the tokenizer has a chat template."""
    texts = [
        p.chat
        for category in ("summarization", "rag")
        for p in load_prompts("spec-bench", category=category)
    ]
    chat = getattr(tokenizer, "chat_template", None)
    texts = (texts * (count // len(texts) + 1))[:count]
    return [
        encode_prompt(tokenizer, None if chat else t, [_user(t)] if chat else None) for t in texts
    ]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples_s)
    return {
        "p50_us": statistics.median(us),
        "p99_us": us[min(len(us) - 1, int(0.99 * len(us)))],
        "mean_us": statistics.fmean(us),
    }


def run(args: argparse.Namespace) -> dict:
    """Runs the rounds; returns the figures (also printed)."""
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = _prompts(tokenizer, args.requests)
    config = SpeculationConfig(shared_ngram_bytes=args.shared_bytes)
    shared = shared_ngrams(config)
    written = 0
    while shared is not None and written < 2 * shared.capacity_tokens:
        for prompt in prompts:  # a full ring: its oldest tokens are being overwritten
            shared.add(prompt)
            written += len(prompt)
    costs = CostModel(config, CostPrior([0.25] * 9, 0.04))
    rng = random.Random(0)
    indexing, lookup, choice, detokenize = [], [], [], []
    requests = []
    for prompt in prompts:
        start = time.perf_counter()
        ngrams = RequestNgrams(prompt, config.ngram_min_n, config.ngram_max_n, shared)
        indexing.append(time.perf_counter() - start)
        chooser = ProposerChoice("auto", KController(costs, config), ngrams)
        stops = StopChecker(tokenizer, 1 << 30, (), ["\x00never-seen"])
        requests.append((ngrams, chooser, stops, prompt))
    for _ in range(args.rounds):
        for ngrams, chooser, stops, prompt in requests:
            drafts = [rng.choice(prompt) for _ in range(config.max_speculative_tokens)]
            start = time.perf_counter()
            proposal = chooser.choose(1000, 0, True, True)
            if proposal.source == DRAFT:  # a mixed round: lookup's tail after the draft's k
                k = proposal.plan.k
                chooser.tail(drafts[:k], [0.9] * k, 1000)
            chosen = time.perf_counter()
            tokens, _ = ngrams.propose(config.max_speculative_tokens)
            proposed = time.perf_counter()
            # The target keeps a random prefix of the proposal, then adds a prompt token: text
            # that copies its prompt in runs, as a summary does.
            kept = list(tokens[: rng.randrange(len(tokens) + 1)]) + [rng.choice(prompt)]
            ngrams.commit(kept)
            if proposal.source == NGRAM:
                chooser.observe_ngram(proposal, min(len(kept) - 1, len(proposal.tokens)))
            committed = time.perf_counter() - proposed
            choice.append(chosen - start + committed)
            lookup.append(proposed - chosen + committed)
            start = time.perf_counter()
            stops.append(kept, [0.0] * len(kept))
            detokenize.append(time.perf_counter() - start)
    for ngrams, *_ in requests:
        ngrams.finish()
    figures = {
        "device": describe_device("cpu"),
        "requests": args.requests,
        "rounds": args.rounds,
        "shared_ngram_bytes": args.shared_bytes,
        "shared_ngrams_indexed": len(shared) if shared is not None else 0,
        "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
        "index_prompt_ms_mean": statistics.fmean(indexing) * 1e3,
        "lookup": _percentiles(lookup),
        "choice": _percentiles(choice),
        "detokenize": _percentiles(detokenize),
    }
    print(json.dumps(figures, indent=2))
    return figures


def main(args: argparse.Namespace) -> int:
    figures = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    run_standalone(add_cli_args, main, prog="python -m specdec.bench.ngram_bench")
