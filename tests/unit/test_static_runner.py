"""The static runner (specdec.worker.static) on the CPU: the code a GPU captures as CUDA graphs,
run eagerly. Greedy output through it equals its own k = 0 output bitwise (tokens and
log-probabilities) at every k, in batches and after rebuilds; its k = 0 output equals the dynamic
runner's in float32 token for token; the captured region compiles whole; the slot store keeps
the LRU semantics without ever freeing a slot a call still writes."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from rebuilds import stream_evicting

from specdec import SamplingParams, SpeculativeEngine
from specdec.config import ConfigError, SpecdecConfig
from specdec.models.shapes import load_shape
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2
from specdec.worker.kv_cache import SessionCacheStore
from specdec.worker.static.runner import VERIFY
from specdec.worker.static.shapes import invariant_shapes
from specdec.worker.static.sides import StaticProposer, StaticVerifier
from specdec.worker.static.slots import SlotAllocator, SlotLayout, SlotPool, slot_layout

GREEDY = SamplingParams(max_new_tokens=24)
STATIC = {"runner": "static", "max_model_len": 192, "cache_capacity_bytes": 64 * 1024**2}


@pytest.fixture(scope="module")
def static_engine(tiny_pair):
    return SpeculativeEngine.from_pretrained(*tiny_pair, **STATIC)


@pytest.fixture(scope="module")
def static_bf16_engine(tiny_pair_bf16):
    return SpeculativeEngine.from_pretrained(*tiny_pair_bf16, dtype="bfloat16", **STATIC)


def test_the_runner_setting_picks_the_static_sides(static_engine, engine):
    transport = static_engine.transport
    assert isinstance(transport.verifier, StaticVerifier)
    assert isinstance(transport.proposer, StaticProposer)
    assert not isinstance(engine.transport.verifier, StaticVerifier)  # auto on a CPU: dynamic
    assert SpecdecConfig.of(None, device="cuda").models.resolved_runner() == "static"
    with pytest.raises(ConfigError, match="runner"):
        SpecdecConfig.of(None, runner="graphs")


@pytest.mark.parametrize("name", ["static_engine", "static_bf16_engine"])
def test_speculative_output_equals_the_runners_own_k0_bitwise(request, name):
    engine = request.getfixturevalue(name)
    accepted = 0
    for prompt in PROMPTS:
        expected = engine.generate(prompt, GREEDY, 0)
        for k in (1, 3, 8, "auto"):
            out = engine.generate(prompt, GREEDY, k)
            assert out.token_ids == expected.token_ids, (prompt, k)
            assert out.logprobs == expected.logprobs, (prompt, k)
            accepted += out.stats.accepted_tokens
    assert accepted > 0  # the drafts were verified, not all rejected


def test_static_k0_equals_the_dynamic_runner_in_float32(static_engine, engine):
    """Different attention arithmetic (a masked call over the slot against row-wise calls
    over each prefix), so logits differ in the last bits; the greedy tokens agree."""
    for prompt in PROMPTS:
        static = static_engine.generate(prompt, GREEDY, 0)
        dynamic = engine.generate(prompt, GREEDY, 0)
        assert static.token_ids == dynamic.token_ids, prompt
        assert static.logprobs == pytest.approx(dynamic.logprobs, abs=1e-4), prompt


@pytest.mark.parametrize("name", ["static_engine", "static_bf16_engine"])
def test_requests_batched_together_get_what_each_gets_alone(request, name):
    _assert_batched_equals_alone(request.getfixturevalue(name), GREEDY)


def _assert_batched_equals_alone(engine: SpeculativeEngine, params: SamplingParams) -> None:
    """Every prompt at k = 3 alone, then all of them at once (sharing batches: some verify
    forward served several sessions): bitwise equal."""
    alone = [engine.generate(p, params, 3) for p in PROMPTS]
    verifier = engine.transport.verifier
    sizes = []

    def counted(requests):
        sizes.append(len(requests))
        return type(verifier).verify_batch(verifier, requests)

    async def together():
        return await asyncio.gather(*(engine.agenerate(p, params, 3) for p in PROMPTS))

    verifier.verify_batch = counted
    try:
        outputs = asyncio.run(together())
    finally:
        del verifier.verify_batch
    assert max(sizes) > 1, sizes
    for prompt, single, batched in zip(PROMPTS, alone, outputs):
        assert batched.token_ids == single.token_ids, prompt
        assert batched.logprobs == single.logprobs, prompt


def test_a_rebuilt_slot_continues_bitwise_as_the_uninterrupted_one(static_bf16_engine):
    engine = static_bf16_engine
    proposer, verifier = engine.transport.proposer, engine.transport.verifier
    rebuilds = verifier.sessions.rebuilds
    for prompt in PROMPTS[:4]:
        expected = stream_evicting(engine, prompt, GREEDY, 0, ())
        for k in (3, "auto"):
            both = stream_evicting(engine, prompt, GREEDY, k, (proposer, verifier))
            assert both == expected, (prompt, k, "both evicted")
            target = stream_evicting(engine, prompt, GREEDY, k, (verifier,))
            assert target == expected, (prompt, k, "target evicted")
    assert verifier.sessions.rebuilds > rebuilds


def test_every_released_session_gives_its_slot_back(static_engine):
    """Each side holds a slot while a request streams (else "gives back" would hold of a pool
    that never handed one out), and every slot is free once the request has ended (the round
    loop released them)."""
    sides = (static_engine.transport.verifier, static_engine.transport.proposer)
    held = []

    async def stream(prompt):
        async for _ in static_engine.generate_stream(prompt, GREEDY, 3):
            held.append(tuple(s.layout.num_slots - s.sessions._backing.free_slots for s in sides))

    for prompt in PROMPTS[:3]:
        asyncio.run(stream(prompt))
        for side in sides:
            assert side.sessions._backing.free_slots == side.layout.num_slots
    assert (1, 1) in held, held


def test_the_captured_step_compiles_whole(static_engine):
    """The region a GPU captures (forward, greedy outcome) compiles with fullgraph=True: no
    graph break, so no host sync or data-dependent Python inside; and it computes what the
    eager step does."""
    runner = static_engine.transport.verifier.runner
    size, width = runner.batch_buckets[0], runner.width
    key = (VERIFY, size, width, runner.key_lens[0])
    inputs = (
        torch.randint(100, (size, width)),
        torch.arange(width).repeat(size, 1) + 3,
        torch.full((size,), runner.pool.scratch),
        torch.zeros(size, dtype=torch.long),
        torch.full((size, width - 1), -1),
    )
    step = functools.partial(runner._step, key)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.inference_mode():
        eager = step(*inputs)
        traced = compiled(*inputs)
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)


def test_a_prompt_past_the_context_limit_is_refused(static_engine):
    limit = static_engine.limits.context_limit
    assert limit == 192  # max_model_len, below the tiny model's own limit
    with pytest.raises(ValueError, match="prompt"):
        static_engine.generate(list(range(5, 5 + limit)), GREEDY, 0)
    assert static_engine.generate(PROMPTS[0], GREEDY, 3).token_ids  # still serving


def _layout(slots: int) -> SlotLayout:
    return SlotLayout(1, 1, 1, torch.float32, context_limit=6, num_slots=slots, width=2)


def _tokens(session_id: str, ids: list[int], prefix_len: int = 0) -> worker_pb2.SessionTokens:
    return worker_pb2.SessionTokens(session_id=session_id, prefix_len=prefix_len, new_token_ids=ids)


def test_a_new_session_takes_the_least_recently_used_idle_slot():
    backing = SlotAllocator(_layout(2))
    store = SessionCacheStore(2 * backing.layout.slot_bytes, backing)
    for name in ("a", "b"):
        store.commit(store.checkout(_tokens(name, [1, 2])))
    in_flight = store.checkout(_tokens("b", [3], prefix_len=2))
    third = store.checkout(_tokens("c", [4]))  # evicts "a", the idle one; "b" is in flight
    assert {third.entry.cache.slot} == {0, 1} - {in_flight.entry.cache.slot}
    with pytest.raises(RuntimeError, match="in flight"):
        store.checkout(_tokens("d", [5]))  # both slots held by calls in flight
    store.commit(in_flight)
    store.commit(third)
    assert store.stats().evictions == 1 and store.stats().sessions == 2


def test_a_slot_is_freed_only_when_no_call_writes_it():
    backing = SlotAllocator(_layout(2))
    store = SessionCacheStore(2 * backing.layout.slot_bytes, backing)
    active = store.checkout(_tokens("a", [1, 2]))
    store.release("a")  # released while its call still runs
    assert backing.free_slots == 1
    store.commit(active)  # the call ends: the slot comes back, the entry is not stored
    assert backing.free_slots == 2 and store.stats().sessions == 0
    failed = store.checkout(_tokens("b", [1]))
    store.abort(failed)
    assert backing.free_slots == 2 and store.stats().sessions == 0
    with pytest.raises(RuntimeError, match="twice"):
        backing.free(failed.entry.cache)


def test_a_bucket_that_rounds_a_row_otherwise_is_dropped(static_engine):
    """invariant_shapes on a step whose 2-session forwards perturb the logits in the last bit
    (as a GEMM kernel chosen by row count would): bucket 2 goes, the others stay."""
    runner = static_engine.transport.verifier.runner
    real_step, kept = runner.graphs._step, list(runner.batch_buckets)

    def perturbed(key, *inputs):
        outputs = real_step(key, *inputs)
        if key[1] == 2:
            logits = outputs[-1]
            return (*outputs[:-1], torch.nextafter(logits, logits + 1))
        return outputs

    runner.graphs._step = perturbed
    try:
        buckets, key_lens = invariant_shapes(runner, torch.Generator().manual_seed(1))
    finally:
        runner.graphs._step = real_step
    assert buckets == [b for b in kept if b != 2] and key_lens == runner.key_lens


def test_the_slot_pool_of_a_14b_target_is_sized_from_its_config_alone():
    """Qwen2.5-Coder-14B-Instruct's shipped config.json, no weights: 48 layers of 8 key/value
    heads of 128 in bfloat16, 192 KiB a token; the shipped gpu.yaml's 20 GiB and 16 sessions."""
    config = load_shape("qwen2.5-coder-14b-instruct")
    capacity = 20 * 1024**3
    layout = slot_layout(
        config, torch.bfloat16, capacity_bytes=capacity, max_batch_size=16, width=9
    )
    assert layout.bytes_per_token == 48 * 2 * 8 * 128 * 2
    assert layout.num_slots >= 16 and layout.total_bytes <= capacity
    assert layout.context_limit % 256 == 0
    assert 4096 <= layout.context_limit <= config.max_position_embeddings
    pool = SlotPool(layout, "meta")  # sized, never allocated
    held = sum(t.numel() * t.element_size() for t in pool.keys + pool.values)
    assert held == layout.total_bytes
    with pytest.raises(ValueError, match="cache_capacity_bytes"):
        slot_layout(
            config,
            torch.bfloat16,
            capacity_bytes=capacity,
            max_batch_size=16,
            width=9,
            max_model_len=config.max_position_embeddings,
        )
    with pytest.raises(ValueError, match="max_model_len"):
        slot_layout(
            config,
            torch.bfloat16,
            capacity_bytes=capacity,
            max_batch_size=1,
            width=9,
            max_model_len=config.max_position_embeddings + 1,
        )


def test_more_requests_than_slots_evict_and_rebuild_exactly(tiny_pair):
    """Four slots a side and eight concurrent requests: batches split at the largest bucket,
    sessions idle between rounds lose their slots to others and rebuild, and every output is
    what the request gets alone."""
    engine = SpeculativeEngine.from_pretrained(
        *tiny_pair, runner="static", max_model_len=64, max_batch_size=4
    )
    layout = engine.transport.verifier.layout
    engine = SpeculativeEngine.from_pretrained(
        *tiny_pair,
        runner="static",
        max_model_len=64,
        max_batch_size=4,
        cache_capacity_bytes=layout.slot_bytes * 5,  # four slots and the scratch one
    )
    verifier = engine.transport.verifier
    assert verifier.layout.num_slots == 4
    _assert_batched_equals_alone(engine, SamplingParams(max_new_tokens=40))
    assert verifier.sessions.stats().evictions > 0 and verifier.sessions.rebuilds > 0
