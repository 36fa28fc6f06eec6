"""`specdec generate`: one request to the gRPC endpoint, printed whole or streamed.

Imports only the gRPC client (no torch, transformers or Ray), so it starts in a fraction of a
second.
"""

from __future__ import annotations

import argparse
import json
import sys

from google.protobuf import json_format

from specdec.client import SpecdecClient, build_request
from specdec.decoding.sampling import DEFAULT_MAX_NEW_TOKENS
from specdec.tools.args import add_connection_args, add_k_arg, add_proposer_arg, client_options


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec generate`."""
    parser.add_argument("prompt", help="the prompt text (a user message with --chat)")
    add_connection_args(parser)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    parser.add_argument("--stream", action="store_true", help="print tokens as rounds commit them")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"new tokens at most (default: the service's, {DEFAULT_MAX_NEW_TOKENS})",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature, 0 = greedy (default: the service's, 0)",
    )
    parser.add_argument(
        "--top-p", type=float, help="nucleus sampling mass, in (0, 1] (default: the service's, 1)"
    )
    parser.add_argument(
        "--top-k",
        type=int,
        help="sample among the K likeliest tokens, 0 = off (default: the service's, off)",
    )
    parser.add_argument("--seed", type=int, help="sampling seed (default: a random one)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_k_arg(parser, "speculative tokens per round: an int >= 0 (0 = off) or auto")
    add_proposer_arg(parser)
    parser.add_argument("--json", action="store_true", help="print the whole response as JSON")
    parser.add_argument("--timeout", type=float, help="deadline in seconds (default: none)")


def main(args: argparse.Namespace) -> int:
    """Sends ``args.prompt`` (as a chat message with --chat) and prints the text, or the response
    as JSON (--json), or the streamed messages as they come (--stream) followed by print_summary.

    Raises:
        grpc.RpcError: the service refused or failed the request (the dispatcher prints it).
    """
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
        proposer=args.proposer,
    )
    client = SpecdecClient(
        args.address, args.application, timeout_s=args.timeout, **client_options(args)
    )
    with client:
        if not args.stream:
            response = client.generate(request)
            print(_json(response) if args.json else response.text)
            return 0
        for message in client.generate_stream(request):
            if args.json:
                print(_json(message), flush=True)
            else:
                print(message.text, end="", flush=True)
        if not args.json:
            print()
            print_summary(message)
    return 0


def print_summary(last) -> None:
    """Prints to stderr the speculation summary of a response's last streamed message
    (specdec.v1 GenerateResponse): finish reason, completion tokens, tokens/s, TTFT in ms,
    acceptance, tokens per round, mean k; and, when n-gram lookup proposed, its rounds and its
    accepted of proposed tokens."""
    s = last.stats
    ngram = (
        f", n-gram {s.ngram_accepted_tokens}/{s.ngram_draft_tokens} accepted in "
        f"{s.ngram_rounds} rounds and {s.mixed_rounds} mixed"
        if s.ngram_draft_tokens
        else ""
    )
    print(
        f"[{last.finish_reason}] {last.usage.completion_tokens} tokens, "
        f"{s.tokens_per_second:.1f} tok/s, TTFT {s.ttft_s * 1e3:.0f} ms, "
        f"acceptance {s.acceptance_rate:.2f}, {s.mean_accepted_tokens:.2f} tokens/round, "
        f"mean k {s.mean_k:.1f}{ngram}",
        file=sys.stderr,
    )


def _json(message) -> str:
    return json.dumps(
        json_format.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    )
