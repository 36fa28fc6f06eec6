"""`specdec loadtest`: a staged gRPC load generator (grpc.aio) with per-second records.

Each stage holds a fixed number of concurrent clients for a duration (``--stages 1x30s,8x90s``);
every client sends one request after the other, round-robin over the prompt set. Per second the
run records requests started and completed, errors by gRPC code, tokens per second, latency and
time to first token (TTFT) percentiles, and the RUNNING replica count of every deployment (from
``serve.status()``, see specdec.bench.replica_monitor). Requests the service refused under load
(RESOURCE_EXHAUSTED: past the router's ``max_queued_requests``; they never started) are counted
as ``refused``, apart from failures (``errors``). It stops by itself: after the last stage (or
``max_requests``) in-flight requests get ``drain_s`` seconds, then they are cancelled and
reported as cut.

Time fields are seconds; ``t`` counts from the start of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from specdec.bench.replica_monitor import ReplicaMonitor
from specdec.bench.report import percentiles, write_json
from specdec.bench.requests import REFUSED, RequestRecord, send_async
from specdec.client import DEFAULT_ADDRESS, call_metadata, open_channel
from specdec.config import APPLICATION
from specdec.tools.args import add_connection_args, add_k_arg, client_options
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

_STAGE = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)(ms|s|m)?$")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}


@dataclasses.dataclass(frozen=True)
class Stage:
    """``concurrency`` clients for ``duration_s`` seconds.

    ``until``, when set, ends the stage early: it is called once a second with the RUNNING
    replica counts ({deployment: n}) and the stage ends when it returns True (tests use it to
    wait for a scaling event instead of guessing how long it takes).
    """

    concurrency: int
    duration_s: float
    until: Callable[[Mapping[str, int]], bool] | None = None


def parse_stages(text: str, flag: str = "--stages") -> list[Stage]:
    """``"1x30s,8x90s,1x1m"`` -> Stages (concurrency x duration; units ms, s (default), m).

    Raises:
        ValueError: a message that names ``flag`` and the bad part.
    """
    stages = []
    for part in (p.strip() for p in text.split(",")):
        match = _STAGE.match(part)
        if not match:
            raise ValueError(f"{flag}: {part!r} is not CONCURRENCYxDURATION (e.g. 8x90s)")
        duration_s = float(match[2]) * _UNITS[match[3]]
        if duration_s <= 0:
            raise ValueError(f"{flag}: {part!r} has a zero duration")
        stages.append(Stage(int(match[1]), duration_s))
    return stages


@dataclasses.dataclass(kw_only=True)
class RequestResult(RequestRecord):
    """One request of the load (specdec.bench.requests.RequestRecord, times in s since the
    run's start; ``ttft_s``: streaming, the first message's arrival; unary, the server's TTFT;
    ``token_ids`` kept only with keep_outputs): its prompt and stage."""

    prompt_index: int
    stage: int


@dataclasses.dataclass
class _Second:
    started: int = 0
    completed: int = 0
    refused: int = 0
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens: int = 0
    latency_s: list = dataclasses.field(default_factory=list)
    ttft_s: list = dataclasses.field(default_factory=list)
    stage: int = 0
    concurrency: int = 0
    in_flight: int = 0
    replicas: dict | None = None


class LoadTest:
    """Drives staged load against the router's gRPC endpoint.

    Args:
        requests: the GenerateRequests to cycle through (index = ``prompt_index``).
        address: gRPC "host:port" of Serve's proxy.
        application: Serve application name (the ``application`` metadata).
        api_key, tls, ca_file: the connection, as specdec.client.SpecdecClient takes them.
        stream: GenerateStream (TTFT measured at the first message) instead of Generate.
        request_timeout_s: gRPC deadline of each request, in seconds.
        drain_s: seconds in-flight requests may still run after the last stage.
        max_requests: stop starting requests after this many (None: no bound).
        keep_outputs: keep each completed request's token ids (``RequestResult.token_ids``).
        progress: write a live status line to stderr.
    """

    def __init__(
        self,
        requests: Sequence[specdec_pb2.GenerateRequest],
        *,
        address: str = DEFAULT_ADDRESS,
        application: str = APPLICATION,
        api_key: str | None = None,
        tls: bool = False,
        ca_file: str | None = None,
        stream: bool = True,
        request_timeout_s: float = 300.0,
        drain_s: float = 30.0,
        max_requests: int | None = None,
        keep_outputs: bool = False,
        progress: bool = True,
    ) -> None:
        if not requests:
            raise ValueError("the prompt set is empty")
        self.requests = list(requests)
        self.address, self.application, self.stream = address, application, stream
        self.metadata = call_metadata(application, api_key)
        self.tls, self.ca_file = tls, ca_file
        self.request_timeout_s, self.drain_s = request_timeout_s, drain_s
        self.max_requests, self.keep_outputs, self.progress = max_requests, keep_outputs, progress
        self.results: list[RequestResult] = []
        self._seconds: list[_Second] = []
        self._stage_spans: list[tuple[float, float]] = []

    async def run(self, stages: Sequence[Stage], monitor: ReplicaMonitor | None = None) -> dict:
        """Runs every stage, then drains; returns the report (see ``report``).

        ``monitor`` (started by the caller) supplies replica counts; without one they are
        left out of the records.
        """
        self._monitor, self._stages = monitor, list(stages)
        self._t0 = time.monotonic()
        self._prompt = itertools.count()
        self._concurrency, self._stage, self._stopping = 0, 0, False
        self._workers: dict[int, asyncio.Task] = {}
        self._in_flight: set[asyncio.Task] = set()
        async with open_channel(self.address, self.tls, self.ca_file, aio=True) as channel:
            self._stub = specdec_pb2_grpc.SpeculativeDecodingStub(channel)
            ticker = asyncio.create_task(self._tick())
            try:
                for index, stage in enumerate(self._stages):
                    await self._run_stage(index, stage)
                    if self._exhausted():
                        break
                self._stopping = True
                await self._drain()
            finally:
                self._end_s = self._now()
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
                self._record_second(self._bucket(self._now()))
                if self.progress and sys.stderr.isatty():
                    sys.stderr.write("\n")
        return self.report()

    # ------------------------------------------------------------------ load

    async def _run_stage(self, index: int, stage: Stage) -> None:
        self._stage, self._concurrency = index, stage.concurrency
        start = self._now()
        for slot in range(stage.concurrency):
            if slot not in self._workers or self._workers[slot].done():
                self._workers[slot] = asyncio.create_task(self._worker(slot))
        while (left := start + stage.duration_s - self._now()) > 0 and not self._exhausted():
            if stage.until and self._monitor and stage.until(self._monitor.running):
                break
            await asyncio.sleep(min(left, 0.25))
        self._stage_spans.append((start, self._now()))

    def _exhausted(self) -> bool:
        return (
            self.max_requests is not None
            and len(self.results) >= self.max_requests
            and not self._in_flight
        )

    async def _worker(self, slot: int) -> None:
        # A slot above the stage's concurrency finishes its request, then retires.
        while not self._stopping and slot < self._concurrency:
            if self.max_requests is not None and len(self.results) >= self.max_requests:
                return
            index = next(self._prompt) % len(self.requests)
            result = RequestResult(prompt_index=index, stage=self._stage, start_s=self._now())
            self.results.append(result)
            self._bucket(result.start_s).started += 1
            task = asyncio.create_task(self._call(result))
            self._in_flight.add(task)  # a task of its own, so the drain can cancel the call
            try:
                await task
            finally:
                self._in_flight.discard(task)

    async def _call(self, result: RequestResult) -> None:
        ids = await send_async(
            self._stub,
            self.requests[result.prompt_index],
            result,
            stream=self.stream,
            metadata=self.metadata,
            timeout_s=self.request_timeout_s,
            clock=self._now,
            on_tokens=self._count_tokens,
        )
        bucket = self._bucket(result.end_s)
        if result.cut:
            return
        if result.code == REFUSED:
            bucket.refused += 1
            return
        if result.code != "OK":
            bucket.errors[result.code] += 1
            return
        bucket.completed += 1
        bucket.latency_s.append(result.latency_s)
        bucket.ttft_s.append(result.ttft_s)
        if self.keep_outputs:
            result.token_ids = ids

    async def _drain(self) -> None:
        pending = set(self._in_flight)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._workers.values(), *pending, return_exceptions=True)

    # ------------------------------------------------------------------ records

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _count_tokens(self, t: float, n: int) -> None:
        self._bucket(t).tokens += n

    def _bucket(self, t: float) -> _Second:
        while len(self._seconds) <= int(t):
            self._seconds.append(_Second())
        return self._seconds[int(t)]

    def _record_second(self, bucket: _Second) -> None:
        bucket.stage, bucket.concurrency = self._stage, 0 if self._stopping else self._concurrency
        bucket.in_flight = len(self._in_flight)
        if self._monitor is not None:
            bucket.replicas = self._monitor.running

    async def _tick(self) -> None:
        """Once a second: snapshot concurrency and replicas; redraw the progress line."""
        while True:
            now = self._now()
            await asyncio.sleep(math.ceil(now + 1e-3) - now)
            now = self._now()
            self._record_second(self._bucket(now - 0.5))  # the second that just ended
            if self.progress and sys.stderr.isatty():
                sys.stderr.write("\r" + self._progress_line(now) + "\033[K")
                sys.stderr.flush()
            elif self.progress and round(now) % 10 == 0:  # a log file: a line every 10 s
                print(self._progress_line(now), file=sys.stderr, flush=True)

    def _progress_line(self, now: float) -> str:
        recent = self._seconds[max(0, int(now) - 5) : int(now)]
        lat = percentiles([x for s in recent for x in s.latency_s], (50, 95))
        done = sum(s.completed for s in recent) / max(1, len(recent))
        toks = sum(s.tokens for s in recent) / max(1, len(recent))
        errors = sum(sum(s.errors.values()) for s in self._seconds)
        refused = sum(s.refused for s in self._seconds)
        stage = f"stage {self._stage + 1}/{len(self._stages)}" if not self._stopping else "draining"
        replicas = " ".join(
            f"{name[:6]}={n}"
            for name, n in (self._monitor.running if self._monitor else {}).items()
        )
        p95 = f"{lat['p95']:.2f}s" if lat["p95"] is not None else "-"
        return (
            f"{now:6.0f}s {stage} c={self._concurrency} in-flight {len(self._in_flight)} | "
            f"{done:.1f} req/s {toks:.0f} tok/s p95 {p95} | errors {errors} refused {refused} | "
            f"{replicas}"
        )

    def report(self) -> dict:
        """{"per_second": [...], "stages": [...], "summary": {...}} (JSON-ready).

        per_second: t, stage, concurrency, in_flight, started, completed, refused
        (RESOURCE_EXHAUSTED, not in errors), errors {code: n},
        tokens_per_s, latency_s {p50, p95, p99}, ttft_s {p50, p95}, replicas {deployment:
        RUNNING} (latency and TTFT of the requests that completed in that second).
        stages / summary: counts (refused apart from errors and error_count), requests_per_s
        and tokens_per_s (completed over the stage's wall time), the same percentiles over the
        stage's requests (by start time), min/max RUNNING replicas per deployment; the
        summary's duration_s includes the drain and it adds cut (requests cancelled by the end
        of the run).
        """
        per_second = [_second_record(t, s) for t, s in enumerate(self._seconds)]
        stages = []
        for index, (start, end) in enumerate(self._stage_spans):
            results = [r for r in self.results if r.stage == index]
            seconds = per_second[int(start) : max(int(start) + 1, math.ceil(end))]
            stages.append(
                {
                    "stage": index,
                    "concurrency": self._stages[index].concurrency,
                    "start_s": round(start, 3),
                    "duration_s": round(end - start, 3),
                    **_summary(results, seconds, end - start),
                }
            )
        summary = {
            "duration_s": round(self._end_s, 3),
            **_summary(self.results, per_second, self._end_s),
        }
        summary["cut"] = sum(r.cut for r in self.results)
        return {"per_second": per_second, "stages": stages, "summary": summary}


def _second_record(t: int, s: _Second) -> dict:
    return {
        "t": t,
        "stage": s.stage,
        "concurrency": s.concurrency,
        "in_flight": s.in_flight,
        "started": s.started,
        "completed": s.completed,
        "refused": s.refused,
        "errors": dict(s.errors),
        "tokens_per_s": s.tokens,
        "latency_s": percentiles(s.latency_s, (50, 95, 99)),
        "ttft_s": percentiles(s.ttft_s, (50, 95)),
        "replicas": s.replicas,
    }


def _summary(results: Sequence[RequestResult], seconds: Sequence[dict], wall_s: float) -> dict:
    ok = [r for r in results if r.code == "OK" and not r.cut]
    errors = collections.Counter(
        r.code for r in results if r.code not in ("OK", REFUSED) and not r.cut
    )
    replicas: dict[str, dict[str, int]] = {}
    for record in seconds:
        for name, n in (record["replicas"] or {}).items():
            span = replicas.setdefault(name, {"min": n, "max": n})
            span["min"], span["max"] = min(span["min"], n), max(span["max"], n)
    wall_s = max(wall_s, 1e-9)
    return {
        "started": len(results),
        "completed": len(ok),
        "refused": sum(r.code == REFUSED and not r.cut for r in results),
        "errors": dict(errors),
        "error_count": sum(errors.values()),
        "requests_per_s": round(len(ok) / wall_s, 3),
        "tokens_per_s": round(sum(r.tokens for r in ok) / wall_s, 1),
        "latency_s": percentiles([r.latency_s for r in ok], (50, 95, 99)),
        "ttft_s": percentiles([r.ttft_s for r in ok], (50, 95)),
        "replicas": replicas,
    }


# ---------------------------------------------------------------------- command line

TINY_DATASET = "tiny"  # specdec.models.tiny.PROMPTS: 8 short raw prompts


def build_requests(
    dataset: str = TINY_DATASET,
    *,
    data_file: str | None = None,
    max_new_tokens: int | None = None,
    k: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
) -> list[specdec_pb2.GenerateRequest]:
    """One GenerateRequest per prompt of ``dataset`` ("tiny" or a specdec.bench.datasets name/path).

    ``k`` None leaves num_speculative_tokens unset (the router's adaptive k).
    """
    from specdec.client import build_request

    if dataset == TINY_DATASET and data_file is None:
        from specdec.models.tiny import PROMPTS

        fields = [{"prompt": p} for p in PROMPTS]
    else:
        from specdec.bench.datasets import load_prompts

        fields = [p.request_fields() for p in load_prompts(dataset, data_file=data_file)]
    return [
        build_request(
            **f,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            num_speculative_tokens=k,
        )
        for f in fields
    ]


def default_ray_address() -> str | None:
    """The local cluster's GCS address when one is up (``specdec cluster up``), else None."""
    from specdec.cluster import local

    try:
        return local.address()
    except RuntimeError:
        return None


async def run(
    load: LoadTest,
    stages: Sequence[Stage],
    ray_address: str | None,
    application: str = APPLICATION,
) -> dict:
    """Starts a ReplicaMonitor (when ``ray_address`` is set), runs ``load``, stops the monitor.

    A monitor that cannot start leaves replica counts out, with a note in ``report["notes"]``.
    """
    notes = []
    monitor = None
    if ray_address is None:
        notes.append(
            "no Ray address (no local cluster up, no --ray-address): replica counts not recorded"
        )
    else:
        monitor = ReplicaMonitor(ray_address, application)
        try:
            await monitor.start()
        except RuntimeError as err:
            notes.append(f"replica counts not recorded: {err}")
            monitor = None
    try:
        report = await load.run(stages, monitor)
    finally:
        if monitor is not None:
            await monitor.close()
    report["notes"] = notes
    return report


def stages_arg(text: str) -> list[Stage]:
    """argparse type of --stages: parse_stages, its error as argparse's (which names the flag).

    Raises:
        argparse.ArgumentTypeError: a part is not CONCURRENCYxDURATION or has a zero duration.
    """
    try:
        return parse_stages(text, flag="")
    except ValueError as err:  # argparse prefixes "argument --stages: "
        raise argparse.ArgumentTypeError(str(err).lstrip(": ")) from None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `specdec loadtest`."""
    add_connection_args(parser)
    parser.add_argument(
        "--stages",
        default="1x30s,8x90s,1x60s",
        type=stages_arg,
        help="CONCURRENCYxDURATION,... (durations in ms, s or m)",
    )
    parser.add_argument(
        "--dataset",
        default="tiny",
        help="tiny (built in), humaneval, mt-bench, spec-bench or a .jsonl path",
    )
    parser.add_argument(
        "--data-file",
        help="the dataset's question file (default: looked up in $SPECDEC_DATA, "
        "then ../shared/data/prompts)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request")
    add_k_arg(parser, "speculative tokens per round: an int >= 0 (0 = off) or auto")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: greedy)")
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GenerateStream, TTFT at the first message (default: on)",
    )
    parser.add_argument(
        "--ray-address",
        help="Ray address for replica counts (default: the local cluster's when one is up, "
        "else no replica counts)",
    )
    parser.add_argument(
        "--max-requests", type=int, help="start at most N requests (default: no limit)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="deadline of each request, seconds"
    )
    parser.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after the last stage",
    )
    parser.add_argument("--json", metavar="OUT", help="write the per-second report as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="plot load, latency, replicas")


def main(args: argparse.Namespace) -> int:
    """``specdec loadtest`` (flags: add_cli_args): run, print the summary, write JSON/plot.

    Returns 1 when any request failed, else 0 (requests refused under load are not failures).
    """
    requests = build_requests(
        args.dataset,
        data_file=args.data_file,
        max_new_tokens=args.max_new_tokens,
        k=args.k,
        temperature=args.temperature,
    )
    ray_address = args.ray_address or default_ray_address()
    load = LoadTest(
        requests,
        address=args.address,
        application=args.application,
        **client_options(args),
        stream=args.stream,
        request_timeout_s=args.timeout,
        drain_s=args.drain,
        max_requests=args.max_requests,
        progress=True,
    )
    report = asyncio.run(run(load, args.stages, ray_address, args.application))
    report["config"] = {
        "address": args.address,
        "tls": args.tls or args.ca_file is not None,
        "stages": [{"concurrency": s.concurrency, "duration_s": s.duration_s} for s in args.stages],
        "dataset": args.dataset,
        "max_new_tokens": args.max_new_tokens,
        "k": "auto" if args.k is None else args.k,
        "temperature": args.temperature,
        "stream": args.stream,
        "ray_address": ray_address,
    }
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(format_summary(report))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        from specdec.bench.plots import plot_loadtest

        plot_loadtest(report, args.plot)
    return 1 if report["summary"]["error_count"] else 0


def format_summary(report: Mapping) -> str:
    """One line per stage and one overall: requests, errors, req/s, tok/s, p50/p95, replicas."""

    def line(name: str, s: Mapping) -> str:
        lat, ttft = s["latency_s"], s["ttft_s"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        replicas = " ".join(f"{d} {r['min']}-{r['max']}" for d, r in s["replicas"].items())
        return (
            f"{name:<10} {s['completed']:>5}/{s['started']:<5} ok, refused {s['refused']}, "
            f"errors {s['errors'] or 0}, "
            f"{s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:.0f} tok/s, latency p50 "
            f"{fmt(lat['p50'])} p95 {fmt(lat['p95'])} s, TTFT p50 {fmt(ttft['p50'])} s"
            + (f", replicas {replicas}" if replicas else "")
        )

    lines = [line(f"stage {s['stage'] + 1} ({s['concurrency']}x)", s) for s in report["stages"]]
    summary = report["summary"]
    lines.append(line("overall", summary) + f", cut at end {summary['cut']}")
    return "\n".join(lines)
