"""`specdec bench`'s order of runs (specdec.bench.speedup): plain generate interleaved."""

from __future__ import annotations

import argparse

from specdec.bench import speedup
from specdec.bench.datasets import BenchPrompt
from specdec.bench.figures import PLAIN, SPECULATIVE, TARGET_ONLY, Run


class _Plain:
    def __init__(self, order: list) -> None:
        self.order = order

    def run(self, prompt, max_new_tokens, sampling):
        self.order.append((prompt.id, PLAIN, max_new_tokens, sampling["seed"]))
        return Run(PLAIN, [1], "x", 1.0, 0.1)


def test_plain_generate_runs_right_after_the_service_modes_of_each_prompt(monkeypatch):
    # Each prompt's three runs come one after the other, so that a host's drift over the run
    # weighs on all three modes of a prompt alike; the plain run gets the same tokens and seed.
    order: list = []

    def service_run(client, prompt, mode, k, sampling, proposer):
        order.append((prompt.id, mode, sampling["max_new_tokens"], sampling["seed"]))
        return Run(mode, [1], "x", 1.0, 0.1)

    monkeypatch.setattr(speedup, "service_run", service_run)
    prompts = [BenchPrompt(id=f"p{i}", category="c", prompt=f"text {i}") for i in range(3)]
    args = argparse.Namespace(max_new_tokens=7, temperature=0.0, seed=10, k=None, proposer=None)
    results = speedup.run_service(None, prompts, args, _Plain(order))
    modes = (TARGET_ONLY, SPECULATIVE, PLAIN)
    assert order == [(f"p{i}", mode, 7, 10 + i) for i in range(3) for mode in modes]
    assert [sorted(r.runs) for r in results] == [sorted(modes)] * 3
    assert speedup.run_service(None, prompts[:1], args)[0].runs.keys() == {TARGET_ONLY, SPECULATIVE}


def test_one_speculative_mode_per_proposer_each_asking_for_it(monkeypatch):
    calls: list = []

    def service_run(client, prompt, mode, k, sampling, proposer):
        calls.append((prompt.id, mode, k, proposer))
        return Run(mode, [1], "x", 1.0, 0.1)

    monkeypatch.setattr(speedup, "service_run", service_run)
    prompts = [BenchPrompt(id=f"p{i}", category="c", prompt=f"text {i}") for i in range(2)]
    args = argparse.Namespace(
        max_new_tokens=7, temperature=0.0, seed=0, k=3, proposer=["ngram", "auto", "draft"]
    )
    results = speedup.run_service(None, prompts, args)
    modes = [
        (TARGET_ONLY, 0, None),
        ("speculative_ngram", 3, "ngram"),
        ("speculative_auto", 3, "auto"),
        ("speculative_draft", 3, "draft"),
    ]
    assert calls == [(f"p{i}", *mode) for i in range(2) for mode in modes]
    assert list(results[0].runs) == [mode for mode, _, _ in modes]


def test_the_header_says_which_calibration_a_replica_reused():
    from specdec.v1 import specdec_pb2

    info = specdec_pb2.ModelInfo(target_model="/m/t", draft_model="/m/d")
    info.target_calibration.MergeFrom(
        specdec_pb2.DeviceCalibration(device="cpu: X", dtype="float32+dnnl", automatic=True,
                                      seconds=281.4, reused=True)
    )  # fmt: skip
    info.draft_calibration.MergeFrom(
        specdec_pb2.DeviceCalibration(device="cpu: X", dtype="int8", automatic=True, seconds=56)
    )
    args = argparse.Namespace(
        dataset="humaneval", category=None, max_new_tokens=8, temperature=0.0, k=None
    )
    lines = speedup._header(args, info, 3, "cpu").splitlines()
    assert "# target replica: cpu: X; float32+dnnl (chosen by measurement; reused a " \
        "calibration of 281 s)" in lines  # fmt: skip
    assert "# draft replica: cpu: X; int8 (chosen by measurement)" in lines
