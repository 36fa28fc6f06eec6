"""The in-process engine on tiny random models: exactness, stop rules, limits, caches, errors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rebuilds import stream_evicting

from specdec import InvalidRequestError, ModelLoadError, SamplingParams, SpeculativeEngine
from specdec import engine as engine_module
from specdec.config import SpecdecConfig
from specdec.models.loading import load_model
from specdec.models.tiny import PROMPTS, save_pair

GREEDY = SamplingParams(max_new_tokens=40)


def _target_only(engine, prompt, params=GREEDY):
    return engine.generate(prompt, params, num_speculative_tokens=0)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_output_equals_target_only(engine, k):
    for prompt in PROMPTS:
        expected = _target_only(engine, prompt)
        out = engine.generate(prompt, GREEDY, num_speculative_tokens=k)
        assert out.token_ids == expected.token_ids, (prompt, k)
        assert out.text == expected.text
        assert out.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_target_only_equals_hugging_face_greedy_generate(engine):
    model, tokenizer = engine.target.model, engine.tokenizer
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        reference = model.generate(
            ids,
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :]
        # Our target-only path may stop at EOS earlier; compare up to its length.
        out = engine.generate(prompt, GREEDY, num_speculative_tokens=0).token_ids
        assert out == reference[: len(out)].tolist()


def test_adaptive_k_is_exact_too(engine):
    for prompt in PROMPTS:
        assert engine.generate(prompt, GREEDY).token_ids == _target_only(engine, prompt).token_ids


def test_padding_ids_are_never_emitted(engine):
    assert engine.target.model.config.vocab_size > engine.limits.vocab_size
    for prompt in PROMPTS:
        out = engine.generate(prompt, SamplingParams(max_new_tokens=30, temperature=1.5, seed=1), 4)
        assert max(out.token_ids) < engine.limits.vocab_size


def test_identical_draft_accepts_everything_plus_a_bonus_token(tiny_pair):
    _, target = tiny_pair
    engine = SpeculativeEngine.from_pretrained(target, target)
    k = 4
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=1 + 5 * 6), k)
    assert out.finish_reason == "length"
    stats = out.stats
    assert stats.accepted_tokens == stats.draft_tokens == 6 * k
    assert stats.acceptance_rate == 1.0
    assert stats.accepted_per_position[:k] == [6] * k
    assert stats.rounds == 7  # prefill + 6 rounds of k + 1 tokens


def _check_stats_invariants(out, k):
    s = out.stats
    assert 0 <= s.accepted_tokens <= s.draft_tokens
    assert 1 <= s.mean_accepted_tokens <= k + 1
    per_position = s.accepted_per_position
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert sum(per_position) == s.accepted_tokens
    if out.finish_reason == "length":  # nothing trimmed by a stop rule
        assert len(out.token_ids) == s.accepted_tokens + s.rounds
    assert len(out.logprobs) == len(out.token_ids)
    assert s.ttft_s > 0 and s.tokens_per_second > 0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_stats_invariants(engine, k):
    for prompt in PROMPTS:
        for params in (GREEDY, SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)):
            _check_stats_invariants(engine.generate(prompt, params, k), k)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_max_new_tokens_is_never_exceeded(tiny_pair, max_new_tokens):
    _, target = tiny_pair
    engine = SpeculativeEngine.from_pretrained(target, target)  # every block fully accepted
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=max_new_tokens), 8)
    assert len(out.token_ids) == max_new_tokens and out.finish_reason == "length"
    assert (
        out.token_ids
        == _target_only(engine, PROMPTS[0], SamplingParams(max_new_tokens=max_new_tokens)).token_ids
    )


def test_prompt_one_token_short_of_the_context_limit_ends_cleanly(tmp_path):
    draft, target = save_pair(tmp_path, noise=0.05, context_limit=32)
    engine = SpeculativeEngine.from_pretrained(draft, target)
    prompt = list(range(10, 10 + 31))
    out = engine.generate(prompt, SamplingParams(max_new_tokens=20), 8)
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    assert (
        out.token_ids == _target_only(engine, prompt, SamplingParams(max_new_tokens=20)).token_ids
    )
    near = engine.generate(prompt[:-5], SamplingParams(max_new_tokens=20), 8)
    assert len(near.token_ids) == 6 and near.finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.generate(prompt + [10], SamplingParams(max_new_tokens=20), 8)


def test_eos_inside_an_accepted_block_stops_there(tiny_pair):
    _, target = tiny_pair
    engine = SpeculativeEngine.from_pretrained(target, target)
    free = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=30), 0).token_ids
    stop_id = free[5]  # treat the 6th greedy token as a stop token: it lies inside a k=8 block
    out = engine.generate(
        PROMPTS[1], SamplingParams(max_new_tokens=30, stop_token_ids=[stop_id]), 8
    )
    first = free.index(stop_id)
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    assert out.text == engine.tokenizer.decode(
        free[:first], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def test_stop_string_spanning_accepted_tokens_stops_and_trims(tiny_pair):
    _, target = tiny_pair
    engine = SpeculativeEngine.from_pretrained(target, target)
    free = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=30), 0)
    text = free.text
    stop = text[8:11]  # three characters from the middle of the completion
    out = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=30, stop=[stop]), 8)
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert stop in engine.tokenizer.decode(out.token_ids) and len(out.logprobs) == len(
        out.token_ids
    )


def test_streamed_deltas_concatenate_to_the_text(engine):
    import asyncio

    async def collect():
        return [d async for d in engine.generate_stream(PROMPTS[3], GREEDY, 4)]

    deltas = asyncio.run(collect())
    assert "".join(d.text for d in deltas) == engine.generate(PROMPTS[3], GREEDY, 4).text
    assert deltas[-1].finish_reason is not None and all(
        d.finish_reason is None for d in deltas[:-1]
    )


def test_same_seed_same_output_and_different_seeds_differ(engine):
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed)

    a = engine.generate(PROMPTS[0], params(11), 4)
    assert engine.generate(PROMPTS[0], params(11), 4).token_ids == a.token_ids
    outputs = {tuple(engine.generate(PROMPTS[0], params(s), 4).token_ids) for s in range(5)}
    assert len(outputs) == 5


def test_evicting_a_session_mid_request_gives_the_same_output(engine):
    """Drop both caches after every round: each call misses and is rebuilt from full ids."""
    sides = (engine.transport.proposer, engine.transport.verifier)
    rebuilds = engine.transport.verifier.sessions.rebuilds
    evicted = stream_evicting(engine, PROMPTS[4], GREEDY, 3, sides)
    assert evicted[0] == stream_evicting(engine, PROMPTS[4], GREEDY, 3, ())[0]
    assert engine.transport.verifier.sessions.rebuilds > rebuilds


def test_caches_are_released_after_each_request(engine):
    """Each side holds the request's session while it streams (else "released" would hold of
    a store that keeps nothing), and neither holds it once the request has ended."""
    sides = (engine.transport.proposer, engine.transport.verifier)
    held = []

    async def stream():
        async for _ in engine.generate_stream(PROMPTS[0], GREEDY, 4):
            held.append(tuple(side.cache_stats().sessions for side in sides))

    for _ in range(2):
        asyncio.run(stream())
        for side in sides:
            stats = side.cache_stats()
            assert stats.sessions == 0 and stats.bytes == 0
    assert (1, 1) in held, held


def test_small_cache_capacity_evicts_least_recently_used(tiny_pair):
    from specdec.v1 import worker_pb2

    draft, target = tiny_pair
    engine = SpeculativeEngine.from_pretrained(draft, target)
    verifier = engine.transport.verifier
    ids = engine.tokenizer.encode(PROMPTS[0])
    for name in ("a", "b", "c"):
        verifier.verify(
            worker_pb2.VerifyRequest(
                session=worker_pb2.SessionTokens(session_id=name, new_token_ids=ids * 4)
            )
        )
        if name == "a":  # room for two sessions of this size, not three
            verifier.sessions.capacity_bytes = int(verifier.cache_stats().bytes * 2.5)
    stats = verifier.cache_stats()
    assert stats.sessions == 2
    assert stats.bytes <= stats.capacity_bytes and stats.evictions >= 1
    assert "c" in verifier.sessions._entries and "a" not in verifier.sessions._entries
    miss = verifier.verify(
        worker_pb2.VerifyRequest(
            session=worker_pb2.SessionTokens(
                session_id="a", prefix_len=len(ids) * 4, new_token_ids=[5]
            )
        )
    )
    assert miss.cache_miss


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "hi", "num_speculative_tokens": 9}, "num_speculative_tokens"),
        ({"prompt": "hi", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"prompt": "hi", "params": SamplingParams(max_new_tokens=10_000)}, "max_new_tokens"),
        ({"prompt": [999_999]}, "prompt"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"prompt": "hi", "proposer": "medusa"}, "proposer"),
        ({"prompt": "hi", "proposer": 1}, "proposer"),
    ],
)
def test_invalid_requests_raise_value_error_naming_the_field(engine, kwargs, field):
    with pytest.raises(ValueError) as err:
        engine.generate(**kwargs)
    assert err.value.field == field


def test_chat_messages_use_the_chat_template(engine):
    messages = [{"role": "user", "content": "hello"}]
    out = engine.generate(
        messages=messages, params=SamplingParams(max_new_tokens=5), num_speculative_tokens=2
    )
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert out.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert out.token_ids == engine.generate(text, SamplingParams(max_new_tokens=5), 0).token_ids


def test_draft_with_a_different_tokenizer_is_refused(tiny_pair, tmp_path):
    _, target = tiny_pair
    other_draft, _ = save_pair(tmp_path, vocab_size=300)
    with pytest.raises(ModelLoadError, match="share a tokenizer"):
        SpeculativeEngine.from_pretrained(other_draft, target)


def test_missing_model_is_a_clear_error_naming_it(tmp_path):
    """A Hub id that cannot be fetched (no such repository, or no network, as here) names the
    id and its revision (tests/unit/test_model_sources.py covers each cause)."""
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model@main: "):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(tmp_path / "missing.gguf")


def test_a_call_finishing_after_its_release_does_not_store_the_session_again(engine):
    """A cancelled request releases its session while a forward may still be running; the
    late commit must not bring the entry back (it would leak until evicted)."""
    from specdec.v1 import worker_pb2

    verifier = engine.transport.verifier
    tokens = worker_pb2.SessionTokens(
        session_id="late", new_token_ids=engine.tokenizer.encode(PROMPTS[0])
    )
    with verifier.session(tokens) as active:
        verifier.feed(active, active.pending, num_logits=1)
        verifier.release(worker_pb2.ReleaseRequest(session_id="late"))
    assert verifier.cache_stats().sessions == 0


def test_draft_prefilled_by_its_first_propose_gives_the_same_output(engine):
    concurrent = engine.config
    engine.config = concurrent.with_settings(concurrent_prefill=False)
    try:
        for prompt in PROMPTS[:4]:
            sequential = engine.generate(prompt, GREEDY, num_speculative_tokens=3)
            assert sequential.stats.prefill_draft_time_s == 0.0  # the draft did not prefill
            assert sequential.stats.draft_tokens > 0
            assert sequential.token_ids == _target_only(engine, prompt).token_ids
    finally:
        engine.config = concurrent


def _propose(proposer, prompt_ids, session_id, k, floor, temperature=0.0):
    from specdec.v1 import worker_pb2

    request = worker_pb2.ProposeRequest(
        session=worker_pb2.SessionTokens(session_id=session_id, new_token_ids=prompt_ids),
        num_speculative_tokens=k,
        min_draft_confidence=floor,
        draft_top_n=16,
        sampling=worker_pb2.SamplingConfig(temperature=temperature, top_p=1.0, seed=3),
    )
    response = proposer.propose(request)
    proposer.release(worker_pb2.ReleaseRequest(session_id=session_id))
    return response


@torch.inference_mode()
def test_greedy_draft_stops_after_the_token_where_its_confidence_falls_below_the_floor(engine):
    proposer, vocab = engine.transport.proposer, engine.limits.vocab_size
    prompt_ids = engine.tokenizer.encode(PROMPTS[1])
    # The draft's greedy continuation and the running product of its probabilities, computed
    # here without a KV cache.
    sequence, products = list(prompt_ids), [1.0]
    for _ in range(8):
        logits = engine.draft.model(torch.tensor([sequence])).logits[0, -1, :vocab]
        probs = torch.softmax(logits.float(), dim=0)
        sequence.append(int(probs.argmax()))
        products.append(products[-1] * float(probs.max()))
    continuation = sequence[len(prompt_ids) :]
    whole = _propose(proposer, prompt_ids, "all", 8, 0.0)
    assert list(whole.token_ids) == continuation
    # Each token's confidence, reported for the router's calibration of the stop: the running
    # products above are those of these values.
    reported = torch.tensor(list(whole.confidences), dtype=torch.float64).cumprod(0).tolist()
    assert reported == pytest.approx(products[1:], rel=1e-5)
    for stop in (1, 3, 6):
        # Above the product after stop tokens, at or below the one before it.
        floor = (products[stop - 1] + products[stop]) / 2
        drafted = _propose(proposer, prompt_ids, f"stop{stop}", 8, floor).token_ids
        assert list(drafted) == continuation[:stop], (stop, products)


def test_sampled_draft_stop_follows_the_probabilities_it_sends(engine):
    proposer = engine.transport.proposer
    prompt_ids = engine.tokenizer.encode(PROMPTS[2])
    lengths = set()
    for floor in (0.05, 0.2, 0.5):
        response = _propose(proposer, prompt_ids, f"s{floor}", 8, floor, temperature=1.0)
        tokens = list(response.token_ids)
        q_ids = torch.tensor(response.q.token_ids).view(len(tokens), response.q.width)
        q_probs = torch.tensor(response.q.probs).view(len(tokens), response.q.width)
        chosen = [float(q_probs[i][q_ids[i] == t][0]) for i, t in enumerate(tokens)]
        assert list(response.confidences) == pytest.approx(chosen, rel=1e-6)
        running = torch.tensor(chosen, dtype=torch.float64).cumprod(0)
        assert (running[:-1] >= floor).all()
        assert len(tokens) == 8 or running[-1] < floor
        lengths.add(len(tokens))
    assert len(lengths) > 1  # the floors really changed how far the draft went


FLOOR = 1e-5


def test_greedy_output_with_the_confidence_stop_equals_target_only(engine, force_confidence_stop):
    expected = [_target_only(engine, prompt).token_ids for prompt in PROMPTS]
    # Tiny random models are unsure (top probability ~0.03), so products fall fast.
    force_confidence_stop(k=4, floor=FLOOR)
    k = 4
    drafted = []
    for prompt, reference in zip(PROMPTS, expected):
        out = engine.generate(prompt, GREEDY)
        assert out.token_ids == reference, prompt
        drafted.append(out.stats.drafted_per_position)
    # Some rounds stopped early and some drafted all k: both paths ran.
    first, last = sum(d[0] for d in drafted), sum(d[k - 1] for d in drafted)
    assert 0 < last < first


def test_the_proposer_keyword_reaches_the_prepared_request(engine, monkeypatch):
    prepared = []
    real = engine_module.RoundLoop

    def recording(transport, tokenizer, request, *args, **kwargs):
        prepared.append(request)
        return real(transport, tokenizer, request, *args, **kwargs)

    monkeypatch.setattr(engine_module, "RoundLoop", recording)
    params = SamplingParams(max_new_tokens=3)
    engine.generate("def f", params, proposer="ngram")
    engine.generate("def f", params)  # unset: the engine's speculation.proposer
    monkeypatch.setattr(engine, "config", SpecdecConfig.of(engine.config, proposer="draft"))
    engine.generate("def f", params)
    engine.generate("def f", params, proposer="none")

    async def stream():
        async for _ in engine.generate_stream("def f", params, proposer="ngram"):
            pass

    asyncio.run(stream())
    assert [r.proposer for r in prepared] == ["ngram", "auto", "draft", "none", "ngram"]
