"""specdec.bench.loadtest without Ray: stage parsing, statistics, a run on a fake gRPC server."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from specdec.bench.loadtest import LoadTest, Stage, format_summary, parse_stages
from specdec.bench.report import percentiles
from specdec.client import build_request
from specdec.v1 import specdec_pb2, specdec_pb2_grpc


def test_parse_stages_units_and_errors_name_the_flag():
    assert parse_stages("1x30s, 8x1.5m,2x500ms,0x2") == [
        Stage(1, 30.0),
        Stage(8, 90.0),
        Stage(2, 0.5),
        Stage(0, 2.0),
    ]
    for bad in ("8", "8x", "x30s", "8x30h", "-1x3s", "8x0s", ""):
        with pytest.raises(ValueError, match="^--stages: "):
            parse_stages(bad)


def test_percentiles_interpolate_like_numpy():
    assert percentiles([4.0, 1.0, 3.0, 2.0], (50, 95)) == {"p50": 2.5, "p95": 3.85}
    assert percentiles([], (50,)) == {"p50": None}


class FakeRouter(specdec_pb2_grpc.SpeculativeDecodingServicer):
    """Streams 4 one-token messages, 5 ms apart; prompt "bad" fails, "slow" never ends."""

    async def GenerateStream(self, request, context):
        if request.prompt == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: bad")
        for i in range(4):
            await asyncio.sleep(3600 if request.prompt == "slow" else 0.005)
            yield specdec_pb2.GenerateResponse(token_ids=[i])

    async def Generate(self, request, context):
        await asyncio.sleep(0.01)
        return specdec_pb2.GenerateResponse(token_ids=[7, 8])


async def _run(prompts, stages, **options):
    server = grpc.aio.server()
    specdec_pb2_grpc.add_SpeculativeDecodingServicer_to_server(FakeRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        load = LoadTest(
            [build_request(p) for p in prompts],
            address=f"127.0.0.1:{port}",
            progress=False,
            **options,
        )
        return load, await load.run(stages)
    finally:
        await server.stop(0)


def test_run_records_every_second_errors_and_outputs():
    load, report = asyncio.run(
        _run(["a", "bad", "b"], parse_stages("2x1.2s,1x1s"), keep_outputs=True)
    )
    summary = report["summary"]
    assert summary["started"] == summary["completed"] + summary["error_count"] > 30
    assert summary["errors"] == {"INVALID_ARGUMENT": summary["error_count"]} and summary["cut"] == 0
    assert [s["concurrency"] for s in report["stages"]] == [2, 1]
    assert sum(s["started"] for s in report["stages"]) == summary["started"]
    rows = report["per_second"]
    assert [r["t"] for r in rows] == list(range(len(rows))) and len(rows) >= 2
    assert rows[0]["concurrency"] == 2 and rows[0]["tokens_per_s"] > 0
    assert rows[0]["latency_s"]["p50"] > 0.015 and rows[0]["ttft_s"]["p50"] > 0
    ok = [r for r in load.results if r.code == "OK"]
    assert all(r.token_ids == [0, 1, 2, 3] and r.tokens == 4 for r in ok)
    json.dumps(report)  # JSON-ready
    assert "overall" in format_summary(report)


def test_bounded_by_max_requests_and_the_drain_cuts_what_is_left():
    _, report = asyncio.run(_run(["a"], [Stage(2, 30)], max_requests=5, stream=False))
    assert report["summary"]["completed"] == 5 and report["summary"]["duration_s"] < 5
    _, report = asyncio.run(_run(["slow"], [Stage(1, 0.3)], drain_s=0.2))
    assert report["summary"]["cut"] == 1 and report["summary"]["error_count"] == 0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from specdec.bench.plots import plot_loadtest

    _, report = asyncio.run(_run(["a"], parse_stages("1x1s,2x1s")))
    for row in report["per_second"]:
        row["replicas"] = {"DraftModel": 1, "TargetModel": 1 + row["stage"]}
    plot_loadtest(report, tmp_path / "load.png")
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"
