"""The GPU path's exactness: the tiny pair on a CUDA device, in every dtype the GPU config can
run (``auto`` chooses between bfloat16 and float16 there).

Each check runs with the dynamic (calibrated) runner and with the static one (KV slots, fixed
widths, CUDA graphs). Skipped where torch sees no CUDA device, as on CI; on a GPU machine:
``python -m pytest tests/gpu`` (also the last stage of ``python tests/gpu/check.py``).
What holds on a CPU must hold here too: cuBLAS picks its kernels by the number of rows, so a
row's logits may depend on the width of the forward that computed it, and only the calibrated
exact widths keep speculative, target-only and rebuilt sessions bitwise equal.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from rebuilds import stream_evicting

from specdec import SamplingParams, SpeculativeEngine
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the GPU path is checked on a GPU machine (python -m pytest tests/gpu)",
)

GREEDY = SamplingParams(max_new_tokens=32)
DTYPES = ["auto", "bfloat16", "float16", "float32"]
# The calibrated CPU path, and the static runner that `runner: auto` picks on cuda.
RUNNERS = ["dynamic", "static"]


@pytest.fixture(
    scope="module",
    params=[(d, r) for r in RUNNERS for d in DTYPES],
    ids=[f"{d}-{r}" for r in RUNNERS for d in DTYPES],
)
def cuda_engine(request, tiny_pair):
    draft, target = tiny_pair
    dtype, runner = request.param
    return SpeculativeEngine.from_pretrained(
        draft, target, device="cuda", dtype=dtype, runner=runner
    )


def test_calibration_measures_the_gpu_and_chooses_a_half_dtype_for_auto(cuda_engine):
    if cuda_engine.config.models.runner == "static":
        pytest.skip("the start-up calibration is the dynamic runner's")
    verifier, proposer = cuda_engine.transport.verifier, cuda_engine.transport.proposer
    for side in (verifier, proposer):
        assert side.calibration.device.startswith("cuda: "), side.calibration.device
    for loaded in (cuda_engine.target, cuda_engine.draft):
        assert next(loaded.model.parameters()).device.type == "cuda"
    assert verifier.calibration.chosen.exact is not None
    if verifier.calibration.automatic:
        assert str(verifier.calibration.candidate) in ("bfloat16", "float16")


@pytest.mark.parametrize("k", [1, 3, 7, "auto"])
def test_speculative_output_equals_target_only_bitwise(cuda_engine, k):
    for prompt in PROMPTS:
        expected = cuda_engine.generate(prompt, GREEDY, 0)
        out = cuda_engine.generate(prompt, GREEDY, k)
        assert out.token_ids == expected.token_ids, (prompt, k)
        assert out.logprobs == expected.logprobs, (prompt, k)


def test_a_rebuilt_session_continues_bitwise_as_the_uninterrupted_one(cuda_engine):
    proposer, verifier = cuda_engine.transport.proposer, cuda_engine.transport.verifier
    rebuilds = verifier.sessions.rebuilds
    for prompt in PROMPTS[:4]:
        expected = stream_evicting(cuda_engine, prompt, GREEDY, 0, ())
        for k in (3, "auto"):
            both = stream_evicting(cuda_engine, prompt, GREEDY, k, (proposer, verifier))
            assert both == expected, (prompt, k, "both evicted")
            target = stream_evicting(cuda_engine, prompt, GREEDY, k, (verifier,))
            assert target == expected, (prompt, k, "target evicted")
    assert verifier.sessions.rebuilds > rebuilds


def test_requests_batched_together_get_what_each_gets_alone(cuda_engine):
    alone = [cuda_engine.generate(p, GREEDY, 3) for p in PROMPTS]

    async def together():
        return await asyncio.gather(*(cuda_engine.agenerate(p, GREEDY, 3) for p in PROMPTS))

    for prompt, single, batched in zip(PROMPTS, alone, asyncio.run(together())):
        assert batched.token_ids == single.token_ids, prompt
        assert batched.logprobs == single.logprobs, prompt


def test_sampled_output_is_reproducible_by_seed(cuda_engine):
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
    first = cuda_engine.generate(PROMPTS[1], params, 4)
    assert cuda_engine.generate(PROMPTS[1], params, 4).token_ids == first.token_ids
    assert max(first.token_ids) < cuda_engine.limits.vocab_size


def test_target_only_equals_hugging_face_greedy_generate_in_float32(tiny_pair):
    # The target alone, decoded by transformers one row at a time: the user's baseline. In
    # float32 with TF32 off (torch's default for matmuls) the widths agree on these prompts.
    engine = SpeculativeEngine.from_pretrained(*tiny_pair, device="cuda", dtype="float32")
    model, tokenizer = engine.target.model, engine.tokenizer
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to("cuda")
        reference = model.generate(
            ids,
            max_new_tokens=GREEDY.max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :]
        out = engine.generate(prompt, GREEDY, 4).token_ids
        assert out == reference[: len(out)].tolist(), prompt
