"""python -m specdec.bench.gemm_bench: every path it times computes the same product."""

from __future__ import annotations

import argparse

import torch

from specdec.bench import gemm_bench
from specdec.device import bf16_weights


def test_every_timed_path_computes_x_times_w_transposed():
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(48, 32, generator=generator).bfloat16().float() for _ in range(2)]
    for rows in (1, 3, 13):
        x = torch.randn(rows, 32, generator=generator)
        calls = gemm_bench.paths(weights, x)
        assert {"F.linear", "weight-major"} <= set(calls)
        assert ("bf16-weights" in calls) == bf16_weights.available()
        for layer, weight in enumerate(weights):
            expected = x.double() @ weight.double().t()
            for name, call in calls.items():
                out = call(layer)
                assert out.shape == (rows, 48), name
                torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_table_has_a_row_per_count_and_names_the_cpu(capsys):
    parser = argparse.ArgumentParser()
    gemm_bench.add_cli_args(parser)
    args = parser.parse_args(
        ["--shape", "64x32", "--rows", "1,5", "--repeats", "1", "--layers", "2"]
    )
    assert gemm_bench.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# cpu: ")
    body = lines[3:]
    assert [line.split()[0] for line in body] == ["1", "5"]
    assert all(line.split()[1].endswith("=") for line in body)  # F.linear equals itself
