"""specdec.bench.sweep without Ray: flag parsing, the prompt schedule, cell summaries, best
fixed k, exactness against k=0 and the table from synthetic records; one cell and the whole
command against a fake gRPC service."""

from __future__ import annotations

import argparse
import json
import threading
from concurrent import futures

import grpc
import pytest

from specdec import cli
from specdec.bench import sweep
from specdec.bench.datasets import BenchPrompt
from specdec.bench.plots import plot_sweep
from specdec.bench.sweep import CellRequest
from specdec.client import SpecdecClient
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

# --- flags ------------------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser()
    sweep.add_cli_args(parser)
    return parser.parse_args(argv)


def test_flags_parse_lists_and_defaults():
    args = _parse(["--concurrency", "1, 4,2", "--k", "auto,0,3"])
    assert args.concurrency == [1, 4, 2]
    assert args.k == [None, 0, 3]
    defaults = _parse([])
    assert defaults.concurrency == [1, 2, 4, 8]
    assert defaults.k == [0, None, 2, 4]
    assert defaults.max_new_tokens == 128 and defaults.requests_per_stream == 1
    assert [sweep.mode_label(k) for k in defaults.k] == ["k=0", "auto", "k=2", "k=4"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "x"], "--concurrency"),
        (["--concurrency", "1,,2"], "--concurrency"),
        (["--concurrency", "2,2"], "--concurrency"),
        (["--concurrency", "-1"], "--concurrency"),
        (["--k", "-1"], "--k"),
        (["--k", "fast"], "--k"),
        (["--k", ""], "--k"),
        (["--k", "auto,auto"], "--k"),
        (["--requests-per-stream", "0"], "--requests-per-stream"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", *argv])
    assert exit_.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_schedule_gives_concurrent_streams_different_prompts():
    streams = [sweep.schedule(s, 3, 2, 10) for s in range(3)]
    assert streams == [[0, 3], [1, 4], [2, 5]]
    # Every step's concurrent requests differ while there are prompts enough; then it wraps.
    assert sweep.schedule(1, 2, 3, 3) == [1, 0, 2]


# --- synthetic records ------------------------------------------------------------------------


def _record(c, k, prompt, ids, latency=1.0, ttft=0.1, code="OK", stream=0):
    return CellRequest(
        concurrency=c,
        mode=sweep.mode_label(k),
        k=k,
        stream=stream,
        sequence=0,
        prompt_index=prompt,
        prompt_id=str(prompt),
        start_s=0.0,
        end_s=latency,
        ttft_s=ttft,
        tokens=len(ids),
        token_ids=list(ids),
        code=code,
    )


def test_cell_summary_from_synthetic_records():
    records = [
        _record(2, 2, 0, [1] * 10, latency=2.0, ttft=0.2),
        _record(2, 2, 1, [1] * 30, latency=3.0, ttft=0.4, stream=1),
        _record(2, 2, 2, [], latency=0.5, ttft=None, code="DEADLINE_EXCEEDED"),
    ]
    cell = sweep.summarize_cell(records, wall_s=4.0)

    assert cell["concurrency"] == 2 and cell["mode"] == "k=2" and cell["k"] == 2
    assert cell["requests"] == 3 and cell["completed"] == 2
    assert cell["errors"] == {"DEADLINE_EXCEEDED": 1}
    assert cell["tokens"] == 40
    assert cell["aggregate_tokens_per_s"] == pytest.approx(40 / 4.0)
    assert cell["per_request_tokens_per_s"] == pytest.approx((10 / 2.0 + 30 / 3.0) / 2)
    assert cell["ttft_s"] == {"p50": pytest.approx(0.3), "p95": pytest.approx(0.39)}
    assert cell["latency_s"] == {"p50": pytest.approx(2.5), "p95": pytest.approx(2.95)}
    assert cell["checked"] == 0 and cell["mismatches"] == 0  # never compared

    with pytest.raises(ValueError, match="2 cells"):
        sweep.summarize_cell([records[0], _record(1, 2, 0, [1])], 1.0)
    with pytest.raises(ValueError):
        sweep.summarize_cell([], 1.0)


def test_mismatches_are_counted_against_k0_at_the_smallest_concurrency():
    runs = [
        ([_record(1, 0, 0, [5, 6, 7])], 1.0),
        ([_record(1, 2, 0, [5, 6, 7])], 1.0),
        ([_record(2, 0, 0, [5, 6, 9]), _record(2, 0, 1, [8, 8], stream=1)], 1.0),
        ([_record(2, 2, 0, [5, 6, 7]), _record(2, 2, 1, [8, 1], stream=1)], 1.0),
        ([_record(2, None, 0, [5, 6, 7]), _record(2, None, 1, [], code="INTERNAL")], 1.0),
    ]
    summary = sweep.summarize(runs)
    by_cell = {(c["concurrency"], c["mode"]): c for c in summary["cells"]}

    # Prompt 0's reference is c=1's k=0 output, so c=2's differing k=0 output is a mismatch.
    assert (by_cell[1, "k=0"]["mismatches"], by_cell[1, "k=0"]["checked"]) == (0, 1)
    assert (by_cell[1, "k=2"]["mismatches"], by_cell[1, "k=2"]["checked"]) == (0, 1)
    assert (by_cell[2, "k=0"]["mismatches"], by_cell[2, "k=0"]["checked"]) == (1, 2)
    assert (by_cell[2, "k=2"]["mismatches"], by_cell[2, "k=2"]["checked"]) == (1, 2)
    # A failed request is an error, not a mismatch.
    assert (by_cell[2, "auto"]["mismatches"], by_cell[2, "auto"]["checked"]) == (0, 1)
    assert by_cell[2, "auto"]["errors"] == {"INTERNAL": 1}
    assert summary["notes"] == []
    assert runs[3][0][1].match is False and runs[3][0][0].match is True


def test_without_k0_exactness_is_skipped_and_said():
    summary = sweep.summarize(
        [([_record(1, 2, 0, [1, 2])], 1.0), ([_record(1, None, 0, [3])], 1.0)]
    )
    assert all(c["checked"] == 0 and c["mismatches"] == 0 for c in summary["cells"])
    assert summary["notes"] == ["exactness not checked: k=0 is not among the modes (--k)"]
    assert "# note: exactness not checked" in sweep.format_table(summary)


def _cell(c, mode, rate):
    k = "auto" if mode == "auto" else int(mode.split("=")[1])
    return {"concurrency": c, "mode": mode, "k": k, "aggregate_tokens_per_s": rate}


def test_best_fixed_k_ignores_k0_and_auto_and_ties_go_to_the_smaller_k():
    cells = [_cell(1, "k=0", 500.0), _cell(1, "auto", 400.0), _cell(1, "k=4", 90.0)]
    cells.append(_cell(1, "k=2", 120.0))
    assert sweep.best_fixed_k(cells)["mode"] == "k=2"
    assert sweep.best_fixed_k([_cell(1, "k=3", 50.0), _cell(1, "k=1", 50.0)])["mode"] == "k=1"
    assert sweep.best_fixed_k([_cell(1, "k=0", 1.0), _cell(1, "auto", 2.0)]) is None
    assert sweep.best_fixed_k([_cell(1, "k=2", None)]) is None


def test_compare_ratios_and_scaling_over_c1():
    cells = [
        _cell(1, "k=0", 100.0),
        _cell(1, "auto", 150.0),
        _cell(1, "k=2", 200.0),
        _cell(4, "k=0", 300.0),
        _cell(4, "auto", 330.0),
        _cell(4, "k=2", 250.0),
        _cell(4, "k=3", 275.0),
    ]
    rows = sweep.compare(cells)
    assert [r["concurrency"] for r in rows] == [1, 4]
    one, four = rows
    assert one["best_fixed_k"] == "k=2" and one["best_fixed_tokens_per_s"] == 200.0
    assert one["auto_vs_best_fixed"] == pytest.approx(0.75)
    assert one["auto_vs_k0"] == pytest.approx(1.5)
    assert one["best_fixed_vs_k0"] == pytest.approx(2.0)
    assert four["best_fixed_k"] == "k=3"
    assert four["auto_vs_best_fixed"] == pytest.approx(330 / 275, abs=1e-4)
    assert four["best_fixed_vs_k0"] == pytest.approx(275 / 300, abs=1e-4)
    assert four["base_concurrency"] == 1
    assert four["scaling"] == {
        "k=0": pytest.approx(3.0),
        "auto": pytest.approx(2.2),
        "k=2": pytest.approx(1.25),
        "k=3": None,  # not run at c=1
    }
    # Without c=1 the smallest concurrency is the base; without k=0 no ratio to it.
    rows = sweep.compare([_cell(2, "auto", 10.0), _cell(8, "auto", 25.0)])
    assert rows[1]["base_concurrency"] == 2 and rows[1]["scaling"] == {"auto": 2.5}
    assert rows[1]["auto_vs_k0"] is None and rows[1]["best_fixed_k"] is None


def test_table_carries_the_numbers():
    runs = [
        ([_record(1, 0, 0, [1] * 12, latency=0.5, ttft=0.05)], 0.5),
        ([_record(1, 3, 0, [1] * 12, latency=0.25, ttft=0.04)], 0.25),
        (
            [
                _record(2, 0, 0, [1] * 12, latency=0.8, ttft=0.07),
                _record(2, 0, 1, [2] * 12, latency=0.8, ttft=0.09, stream=1),
            ],
            0.8,
        ),
        (
            [
                _record(2, 3, 0, [1] * 12, latency=0.6, ttft=0.06),
                _record(2, 3, 1, [2] * 11 + [9], latency=0.6, ttft=0.08, stream=1),
            ],
            0.6,
        ),
    ]
    table = sweep.format_table(sweep.summarize(runs))
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["c", "mode", "agg"]
    row = next(line for line in lines if line.split()[:2] == ["2", "k=3"])
    # agg 24/0.6 = 40.0 tok/s; per request 20.0; TTFT p50 0.070 p95 0.079; latency 0.600
    assert row.split() == [
        "2",
        "k=3",
        "40.0",
        "20.0",
        "0.070",
        "0.079",
        "0.600",
        "0.600",
        "1/2",
        "0",
    ]
    assert "# c=1: best fixed k: k=3 (48.0 tok/s)" in table
    assert "best fixed / k=0 2.00" in table  # 48 / 24
    assert "# c=2: best fixed k: k=3 (40.0 tok/s)" in table
    assert "agg over c=1: k=0 1.25, k=3 0.83" in table  # 30/24, 40/48


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [
        ([_record(c, k, 0, [1] * 8, latency=0.1 * c)], 0.1 * c) for c in (1, 2, 4) for k in (0, 2)
    ]
    path = tmp_path / "sweep.png"
    plot_sweep(sweep.summarize(runs), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- against a fake service -------------------------------------------------------------------


class FakeRouter(specdec_pb2_grpc.SpeculativeDecodingServicer):
    """Streams the prompt's bytes as token ids, two per message after an empty first message;
    with k = 3 the prompt "odd" ends differently. ``gate`` holds each request until that many
    are in flight (at most 10 s), so concurrent requests show in ``max_in_flight``."""

    def __init__(self):
        self.lock = threading.Condition()
        self.in_flight = self.max_in_flight = 0
        self.gate = 1
        self.requests: list[specdec_pb2.GenerateRequest] = []

    def GenerateStream(self, request, context):
        with self.lock:
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.lock.notify_all()
            self.lock.wait_for(lambda: self.in_flight >= self.gate, timeout=10)
        try:
            text = request.prompt or request.messages[0].content
            ids = list(text.encode())[: request.max_new_tokens]
            if text == "odd" and request.num_speculative_tokens == 3:
                ids[-1] += 1
            yield specdec_pb2.GenerateResponse()
            for i in range(0, len(ids), 2):
                yield specdec_pb2.GenerateResponse(token_ids=ids[i : i + 2])
            # The final message: stats that name the request's length, so a test can tell
            # whose they are.
            stats = specdec_pb2.SpeculationStats(
                draft_tokens=2 * len(ids), accepted_tokens=len(ids), draft_time_s=0.25 * len(ids)
            )
            yield specdec_pb2.GenerateResponse(finish_reason="length", stats=stats)
        finally:
            with self.lock:
                self.in_flight -= 1

    def Generate(self, request, context):
        if request.HasField("num_speculative_tokens") and request.num_speculative_tokens > 8:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_speculative_tokens: above 8")
        return specdec_pb2.GenerateResponse(token_ids=[1])

    def GetModelInfo(self, request, context):
        return specdec_pb2.ModelInfo(
            draft_model="/m/draft",
            target_model="/m/target",
            draft_dtype="float32",
            target_dtype="float32",
            max_speculative_tokens=8,
        )


@pytest.fixture
def fake_service():
    router = FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    specdec_pb2_grpc.add_SpeculativeDecodingServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield router, f"127.0.0.1:{port}"
    server.stop(None)


def test_run_cell_holds_c_streams_at_once_with_different_prompts(fake_service):
    router, address = fake_service
    prompts = [BenchPrompt(id=f"p{i}", category="x", prompt=f"prompt {i}") for i in range(5)]
    router.gate = 3
    with SpecdecClient(address, timeout_s=30) as client:
        records, wall_s = sweep.run_cell(client, prompts, 3, 2, 4, requests_per_stream=2)

    assert router.max_in_flight == 3
    assert wall_s > 0
    assert [(r.stream, r.sequence, r.prompt_index) for r in records] == [
        (0, 0, 0),
        (0, 1, 3),
        (1, 0, 1),
        (1, 1, 4),
        (2, 0, 2),
        (2, 1, 0),
    ]
    for r in records:
        assert r.ok and r.mode == "k=2" and r.concurrency == 3
        assert r.token_ids == list(prompts[r.prompt_index].prompt.encode())[:4]
        assert r.tokens == 4
        assert (r.draft_tokens, r.accepted_tokens, r.draft_time_s) == (8, 4, 1.0)
        assert 0 < r.ttft_s <= r.latency_s
    cell = sweep.summarize_cell(records, wall_s)
    assert (cell["draft_tokens"], cell["accepted_tokens"]) == (48, 24)
    assert cell["draft_time_s"] == pytest.approx(6.0)
    sent = router.requests
    assert all(q.temperature == 0.0 and q.HasField("temperature") for q in sent)
    assert all(q.num_speculative_tokens == 2 and q.max_new_tokens == 4 for q in sent)


def test_auto_leaves_k_unset(fake_service):
    router, address = fake_service
    prompts = [BenchPrompt(id="a", category="x", chat="hello")]
    with SpecdecClient(address, timeout_s=30) as client:
        records, _ = sweep.run_cell(client, prompts, 1, None, 3)
    assert records[0].mode == "auto" and records[0].token_ids == list(b"hel")
    assert not router.requests[0].HasField("num_speculative_tokens")


def test_command_reports_every_cell_and_fails_on_a_mismatch(fake_service, tmp_path, capsys):
    _, address = fake_service
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"id": p, "prompt": p}) + "\n" for p in ("odd", "even", "other"))
    )
    args = _parse(
        [
            f"--address={address}",
            f"--dataset={data}",
            "--concurrency=1,2",
            "--k=0,auto,3",
            "--max-new-tokens=3",
            f"--json={tmp_path / 'out.json'}",
        ]
    )

    assert sweep.main(args) == 1  # k=3 changes "odd"

    report = json.loads((tmp_path / "out.json").read_text())
    cells = {(c["concurrency"], c["mode"]): c for c in report["summary"]["cells"]}
    assert list(cells) == [(1, "k=0"), (1, "auto"), (1, "k=3"), (2, "k=0"), (2, "auto"), (2, "k=3")]
    assert {m: cells[1, m]["requests"] for m in ("k=0", "auto", "k=3")} == dict.fromkeys(
        ("k=0", "auto", "k=3"), 1
    )
    assert cells[2, "k=0"]["requests"] == 2
    # c=1 runs "odd" (prompt 0); c=2 runs "odd" and "even".
    assert cells[1, "k=3"]["mismatches"] == 1 and cells[2, "k=3"]["mismatches"] == 1
    assert cells[2, "auto"]["mismatches"] == 0 and cells[2, "auto"]["checked"] == 2
    assert all(c["tokens"] == 3 * c["requests"] for c in cells.values())
    assert len(report["requests"]) == 9
    matches = [(r["concurrency"], r["mode"], r["match"]) for r in report["requests"]]
    assert [m for c, mode, m in matches if mode != "k=3"] == [True] * 6
    assert [m for c, mode, m in matches if mode == "k=3"] == [False, False, True]
    assert report["config"]["modes"] == ["k=0", "auto", "k=3"]
    out, err = capsys.readouterr()
    assert "# machine (sweep process): " in out and "# command: " in out
    assert "2 greedy outputs differ from k=0" in err


def test_a_run_stopped_after_a_cell_keeps_the_cells_it_measured(
    fake_service, tmp_path, monkeypatch
):
    _, address = fake_service
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "abc"}\n')
    out = tmp_path / "out.json"
    args = _parse([f"--address={address}", f"--dataset={data}", "--k=0,auto", f"--json={out}"])
    real_cell, cells = sweep.run_cell, []

    def stopped_after_one(*cell_args, **kwargs):
        if cells:
            raise KeyboardInterrupt  # the user stops the run during the second cell
        cells.append(cell_args)
        return real_cell(*cell_args, **kwargs)

    monkeypatch.setattr(sweep, "run_cell", stopped_after_one)
    with pytest.raises(KeyboardInterrupt):
        sweep.main(args)
    report = json.loads(out.read_text())
    assert [(c["concurrency"], c["mode"]) for c in report["summary"]["cells"]] == [(1, "k=0")]
    assert len(report["requests"]) == 1 and report["config"]["modes"] == ["k=0", "auto"]


def test_a_k_the_service_refuses_fails_before_any_cell(fake_service, tmp_path):
    router, address = fake_service
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "abc"}\n')
    args = _parse([f"--address={address}", f"--dataset={data}", "--k=0,9"])
    with pytest.raises(grpc.RpcError) as err:
        sweep.main(args)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert router.requests == []  # no streamed request ran


def test_request_record_json_has_rate():
    record = _record(1, 0, 0, [1, 2, 3, 4], latency=2.0).record()
    assert record["tokens_per_s"] == 2.0 and record["token_ids"] == [1, 2, 3, 4]
    failed = _record(1, 0, 0, [], code="UNAVAILABLE").record()
    assert failed["tokens_per_s"] is None
