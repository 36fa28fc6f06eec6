"""Chunked prefill (models.prefill_chunk_tokens): a prompt longer than a chunk prefills one
chunk per batch, the decode rows of other sessions run between its chunks, and greedy output
is the same bitwise however the chunks were interleaved, batched, cut short or rebuilt, on the
dynamic runner (float32, bfloat16) and the static one."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rebuilds import stream_evicting

from specdec import SamplingParams, SpeculativeEngine
from specdec.config import ConfigError, SpecdecConfig
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2
from specdec.worker.session import PREFILLING
from specdec.worker.static.sides import StaticVerifier

CHUNK = 16
# Prompts of several chunks each (about 100 tokens each with the tiny tokenizer).
LONG = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(3)]
GREEDY = SamplingParams(max_new_tokens=12)
STEPS = 10


@pytest.fixture(scope="module")
def static_engine(tiny_pair):
    static = {"runner": "static", "max_model_len": 192, "cache_capacity_bytes": 64 * 1024**2}
    return SpeculativeEngine.from_pretrained(*tiny_pair, **static)


@pytest.fixture(params=["float32", "bfloat16", "static"])
def chunked(request, monkeypatch):
    """An engine of the tiny pair whose sides prefill in chunks of CHUNK tokens: float32, and
    bfloat16 with a target of several exact-width sets (tests/width_sets.py), on the dynamic
    runner; float32 on the static one."""
    fixture = {"float32": "engine", "bfloat16": "width_set_engine", "static": "static_engine"}
    engine = request.getfixturevalue(fixture[request.param])
    for side in (engine.transport.proposer, engine.transport.verifier):
        monkeypatch.setattr(side.sessions, "prefill_chunk", CHUNK)
    return engine


class _Stream:
    """One greedy session on a side, as a router drives it: the committed ids and what the
    replica was sent."""

    def __init__(self, name: str, prompt: list[int]) -> None:
        self.name, self.prompt = name, prompt
        self.committed, self.known = list(prompt), 0
        self.logprobs: list[float] = []

    def tokens(self) -> worker_pb2.SessionTokens:
        tokens = worker_pb2.SessionTokens(
            session_id=self.name,
            prefix_len=self.known,
            new_token_ids=self.committed[self.known :],
            prompt_len=len(self.prompt),
        )
        self.known = len(self.committed)
        return tokens

    def verify(self) -> worker_pb2.VerifyRequest:
        return worker_pb2.VerifyRequest(session=self.tokens(), sampling=_greedy())

    def propose(self, k: int) -> worker_pb2.ProposeRequest:
        return worker_pb2.ProposeRequest(
            session=self.tokens(), num_speculative_tokens=k, sampling=_greedy()
        )

    def apply(self, response: worker_pb2.VerifyResponse) -> None:
        assert not response.cache_miss
        self.committed += response.token_ids
        self.logprobs += response.logprobs

    @property
    def output(self) -> list[int]:
        return self.committed[len(self.prompt) :]


def _greedy() -> worker_pb2.SamplingConfig:
    return worker_pb2.SamplingConfig(temperature=0.0, top_p=1.0)


def _answered(run_batch, request):
    """The call's answer, submitted again while it comes back PREFILLING (as a replica does)."""
    while (response := run_batch([request])[0]) is PREFILLING:
        pass
    return response


def _decode_alone(verifier, stream: _Stream) -> _Stream:
    while len(stream.output) < STEPS:
        stream.apply(_answered(verifier.verify_batch, stream.verify()))
    return stream


def test_a_long_prompt_prefills_in_chunks_while_another_session_decodes(chunked):
    verifier = chunked.transport.verifier
    encode = verifier.loaded.tokenizer.encode
    prompts = long_ids, short_ids = encode(LONG[0]), encode(PROMPTS[0])
    assert len(long_ids) > 3 * CHUNK and len(short_ids) <= CHUNK
    alone = [
        _decode_alone(verifier, _Stream(f"chunked-alone-{i}", p)) for i, p in enumerate(prompts)
    ]
    long, short = _Stream("chunked-long", long_ids), _Stream("chunked-short", short_ids)
    short.apply(verifier.verify_batch([short.verify()])[0])  # a prompt of one chunk: one call
    prefill, chunks = long.verify(), 0
    while (answers := verifier.verify_batch([prefill, short.verify()]))[0] is PREFILLING:
        chunks += 1
        # Whole chunks only, and the short session's decode step ran in every batch.
        assert len(verifier.sessions._entries["chunked-long"].cached_ids) == chunks * CHUNK
        short.apply(answers[1])
    assert chunks == (len(long_ids) - 1) // CHUNK  # the last chunk answers the call
    long.apply(answers[0])
    short.apply(answers[1])
    for stream in (long, short):
        _decode_alone(verifier, stream)
    for together, single in zip((long, short), alone):
        assert together.output == single.output, together.name
        assert together.logprobs == single.logprobs, together.name


def test_a_prefill_cut_short_or_rebuilt_replays_the_same_chunks(chunked):
    verifier = chunked.transport.verifier
    prompt = verifier.loaded.tokenizer.encode(LONG[1])
    expected = _decode_alone(verifier, _Stream("chunked-uncut", prompt))
    # Evicted after two chunks: the call starts again from the prompt's first token.
    cut = _Stream("chunked-cut", prompt)
    prefill = cut.verify()
    for _ in range(2):
        assert verifier.verify_batch([prefill])[0] is PREFILLING
    verifier.sessions.evict("chunked-cut")
    cut.apply(_answered(verifier.verify_batch, prefill))
    # A cache cropped into its prompt keeps its whole chunks and goes on from the last one.
    entry = verifier.sessions._entries["chunked-cut"]
    entry.crop(2 * CHUNK + 3)
    cut.known = 0  # the router resends the whole sequence, as after a miss
    resent = cut.verify()
    assert verifier.verify_batch([resent])[0] is PREFILLING
    assert len(entry.cached_ids) == 3 * CHUNK  # chunk 2 kept, chunk 3 run
    cut.apply(_answered(verifier.verify_batch, resent))
    _decode_alone(verifier, cut)
    assert cut.output == expected.output and cut.logprobs == expected.logprobs


def test_the_draft_prefills_in_chunks_too(chunked):
    proposer = chunked.transport.proposer
    encode = proposer.loaded.tokenizer.encode
    long_ids, short_ids = encode(LONG[2]), encode(PROMPTS[1])
    solo = _Stream("chunked-draft-solo", long_ids)
    _answered(proposer.propose_batch, solo.propose(0))
    solo.committed.append(7)
    expected = proposer.propose_batch([solo.propose(4)])[0]
    long, short = _Stream("chunked-draft-long", long_ids), _Stream("chunked-draft-short", short_ids)
    proposer.propose_batch([short.propose(0)])
    short.committed.append(7)
    prefill, chunks = long.propose(0), 0
    while (answers := proposer.propose_batch([prefill, short.propose(2)]))[0] is PREFILLING:
        chunks += 1
        assert len(answers[1].token_ids) == 2  # the short session drafted beside the chunk
        short.committed += list(answers[1].token_ids[:1])
    assert chunks == (len(long_ids) - 1) // CHUNK
    long.committed.append(7)
    got = proposer.propose_batch([long.propose(4)])[0]
    assert list(got.token_ids) == list(expected.token_ids)
    assert list(got.confidences) == list(expected.confidences)


def test_speculative_batched_and_rebuilt_output_equals_k0(chunked):
    prompts = LONG[:2]
    alone = [chunked.generate(p, GREEDY, 0) for p in prompts]
    expected = alone[0].token_ids, alone[0].logprobs
    for k in (3, "auto"):
        out = chunked.generate(prompts[0], GREEDY, k)
        assert (out.token_ids, out.logprobs) == expected, k
    transport = chunked.transport
    sides = (transport.proposer, transport.verifier)
    assert stream_evicting(chunked, prompts[0], GREEDY, 3, sides) == expected

    async def together():
        return await asyncio.gather(*(chunked.agenerate(p, GREEDY, 3) for p in prompts))

    for single, batched in zip(alone, asyncio.run(together())):
        assert (batched.token_ids, batched.logprobs) == (single.token_ids, single.logprobs)


def test_the_chunk_size_is_validated():
    with pytest.raises(ConfigError, match="prefill_chunk_tokens: must be at least 0, got -1"):
        SpecdecConfig.of(None, prefill_chunk_tokens=-1)
    assert SpecdecConfig.of(None).models.prefill_chunk_tokens == 512


def test_a_later_chunk_attends_in_one_masked_call_per_layer(tiny_pair, monkeypatch):
    # A chunk that extends the cache runs one SDPA call per layer under the causal mask (a row
    # loop over a chunk's hundreds of rows, each copying its key prefix, cost 3x the whole
    # prefill), and its logits are the whole prompt's prefill's up to float32 rounding: the
    # mask gives each row its own causal prefix.
    from transformers import DynamicCache

    from specdec.device import exact_widths
    from specdec.models.loading import load_model

    model = load_model(str(tiny_pair[1]), dtype="float32").model
    exact_widths.use_row_wise_attention(model)
    ids = torch.randint(300, (1, 2 * CHUNK), generator=torch.Generator().manual_seed(1))
    whole = model(input_ids=ids, cache=DynamicCache(config=model.config), logits_to_keep=2 * CHUNK)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :CHUNK], cache=cache, use_cache=True, logits_to_keep=1)
    calls = []
    sdpa = exact_widths.sdpa_attention_forward
    monkeypatch.setattr(
        exact_widths, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    with exact_widths.prompt_attention():
        chunk = model(input_ids=ids[:, CHUNK:], cache=cache, use_cache=True, logits_to_keep=CHUNK)
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(chunk.logits, whole.logits[:, CHUNK:], rtol=1e-5, atol=1e-5)


def test_a_session_released_between_chunks_ends_its_call(chunked):
    # The release (a cancelled request) arrives while the prompt prefills: the resubmitted
    # call ends as a miss and holds nothing, instead of starting the prompt again forever.
    verifier = chunked.transport.verifier
    stream = _Stream("chunked-released", verifier.loaded.tokenizer.encode(LONG[2]))
    prefill = stream.verify()
    assert verifier.verify_batch([prefill])[0] is PREFILLING
    verifier.release(worker_pb2.ReleaseRequest(session_id=stream.name))
    (response,) = verifier.verify_batch([prefill])
    assert response is not PREFILLING and response.cache_miss
    assert stream.name not in verifier.sessions._entries


def test_a_prompt_whose_chunks_pass_the_cache_bound_still_answers(chunked, monkeypatch):
    # Two chunks of the prompt hold more than the whole bound: the entry stays until the prompt
    # is prefilled (then the bound evicts it, and the next call rebuilds), as an unchunked
    # prefill did, instead of being dropped between chunks and starting over forever.
    verifier = chunked.transport.verifier
    prompt = verifier.loaded.tokenizer.encode(LONG[0])
    stream = _Stream("chunked-over-bound", prompt)
    prefill = stream.verify()
    assert verifier.verify_batch([prefill])[0] is PREFILLING
    one_chunk = verifier.sessions._entries[stream.name].nbytes
    monkeypatch.setattr(verifier.sessions, "capacity_bytes", one_chunk + 1)
    answers = [verifier.verify_batch([prefill])[0] for _ in range(len(prompt) // CHUNK)]
    assert answers[-1] is not PREFILLING and not answers[-1].cache_miss
    if not isinstance(verifier, StaticVerifier):  # its bound is slots: one holds any length
        assert stream.name not in verifier.sessions._entries  # evicted once answered
