"""Shared fixtures: tiny random model pairs built once per test session."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from forced_rounds import confidence_stop_choose

from specdec import SpeculativeEngine
from specdec.device.calibration_cache import CACHE_ENV
from specdec.models.tiny import save_pair

# The replicas and engines the tests start keep their calibrations in a folder of this test
# session only: the first of each model shape, setting and device measures, and later ones (the
# second replica, the next module's cluster, the next engine) reuse it after the exactness check,
# as a repeated deploy does. Nothing stored by an earlier run or by the user's own deploys is
# read. Ray workers inherit the variable from the cluster processes the tests start.
CALIBRATIONS = tempfile.mkdtemp(prefix="specdec-test-calibrations-")
os.environ[CACHE_ENV] = CALIBRATIONS
# Every test connects to the cluster it started, by address. Serve's driver-side handle router
# outlives a stopped cluster, and its next metrics push, through Ray's automatic ray.init(),
# started a stray local Ray instance in this process: the next module's deploy then found the
# process connected to it, and every later cluster test errored (stop 56, 143 errors).
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"


def pytest_unconfigure(config):
    shutil.rmtree(CALIBRATIONS, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(draft_dir, target_dir): a BPE tokenizer, a draft that agrees with the target often, and a
    target whose embedding is padded past the tokenizer (like Qwen's)."""
    return save_pair(tmp_path_factory.mktemp("tiny"), noise=0.05, pad_vocab=7)


@pytest.fixture(scope="session")
def tiny_pair_bf16(tmp_path_factory):
    """The tiny pair stored in bfloat16, as the bundled pair is: loaded in float32, every
    weight is a bfloat16 value, which the float32+bf16w GEMM needs."""
    return save_pair(
        tmp_path_factory.mktemp("tiny-bf16"), noise=0.05, pad_vocab=7, dtype="bfloat16"
    )


@pytest.fixture(scope="session")
def engine(tiny_pair):
    draft, target = tiny_pair
    return SpeculativeEngine.from_pretrained(draft, target)


@pytest.fixture(scope="session")
def width_set_engine(tiny_pair):
    """The tiny pair in bfloat16 with a target whose exact widths form several sets
    (tests/width_sets.py): the multi-width padding in half precision."""
    from width_sets import width_set_engine as build

    return build(*tiny_pair)


@pytest.fixture
def force_confidence_stop(monkeypatch):
    """force(k, floor): every adaptive (k "auto") round then drafts up to k tokens and stops on
    the draft's confidence at ``floor`` (forced_rounds.confidence_stop_choose)."""
    from specdec.decoding.k_policy import KController

    def force(k: int, floor: float) -> None:
        monkeypatch.setattr(KController, "choose", confidence_stop_choose(k, floor))

    return force


@pytest.fixture
def sessions_per_forward(monkeypatch):
    """spy(module) -> counts: spies on ``module``'s packed_forward (specdec.worker.packed), and
    ``counts`` gets each call's number of sessions."""

    def spy(module) -> list[int]:
        counts: list[int] = []
        real_forward = module.packed_forward

        def counting(model, segments, *args):
            counts.append(len(segments))
            return real_forward(model, segments, *args)

        monkeypatch.setattr(module, "packed_forward", counting)
        return counts

    return spy
