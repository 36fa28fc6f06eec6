"""The committed *_pb2 modules are exactly what grpcio-tools generates from protos/."""

from __future__ import annotations

import filecmp
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "protos").rglob("*.proto"))


def test_generated_code_matches_the_protos(tmp_path):
    args = [
        "protoc",
        f"-I{ROOT / 'protos'}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *map(str, PROTOS),
    ]
    assert protoc.main(args) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    for relative in generated:
        committed = ROOT / relative
        assert committed.exists(), f"{relative} is not committed; run `make protos`"
        assert filecmp.cmp(tmp_path / relative, committed, shallow=False), (
            f"{relative} drifted from protos/; run `make protos`"
        )
