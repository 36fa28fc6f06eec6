"""Batched verify: sessions packed into shared forwards give each session its solo output."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdec import SpeculativeEngine
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2
from specdec.worker import packed
from specdec.worker import verifier as verifier_module
from specdec.worker.session import DEFERRED

NEW_TOKENS = 20


@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16-width-sets"])
def built(tiny_pair, request):
    """The tiny pair in each dtype; in bfloat16 also with a target of several exact-width sets
    (tests/width_sets.py), whose packed rows pad to several widths."""
    if request.param == "bfloat16-width-sets":
        return request.getfixturevalue("width_set_engine")
    draft, target = tiny_pair
    return SpeculativeEngine.from_pretrained(draft, target, dtype=request.param)


@dataclasses.dataclass
class _Session:
    """What a router holds for one session: the committed ids and what the replica knows."""

    name: str
    prompt: list[int]
    committed: list[int] = dataclasses.field(default_factory=list)
    known: int = 0  # committed tokens the replica was sent
    logprobs: list[float] = dataclasses.field(default_factory=list)
    temperature: float = 0.0

    def __post_init__(self) -> None:
        self.committed = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.committed[len(self.prompt) :]

    def request(self, drafts=(), q=None) -> worker_pb2.VerifyRequest:
        tokens = worker_pb2.SessionTokens(
            session_id=self.name,
            prefix_len=self.known,
            new_token_ids=self.committed[self.known :],
            prompt_len=len(self.prompt),
        )
        self.known = len(self.committed)
        sampling = worker_pb2.SamplingConfig(temperature=self.temperature, top_p=1.0, seed=7)
        return worker_pb2.VerifyRequest(
            session=tokens, draft_token_ids=list(drafts), sampling=sampling, q=q
        )

    def apply(self, response: worker_pb2.VerifyResponse) -> None:
        assert not response.cache_miss
        self.committed += response.token_ids
        self.logprobs += response.logprobs


def _sessions(built, tag: str, temperatures=(0.0,)) -> list[_Session]:
    tokenizer = built.target.tokenizer
    return [
        _Session(f"{tag}-{i}", tokenizer.encode(p), temperature=temperatures[i % len(temperatures)])
        for i, p in enumerate(PROMPTS)
    ]


def _solo(verifier, sessions: list[_Session]) -> None:
    """Target-only decoding, one session at a time."""
    for session in sessions:
        while len(session.output) < NEW_TOKENS:
            session.apply(verifier.verify(session.request()))


def _batched(verifier, sessions, references, rng, vocab) -> None:
    """All sessions at once, each greedy one with its own k each round and drafts that follow
    the solo output up to a random wrong token, so that acceptance varies by session and round.
    Sampled sessions draft nothing: their draws then come in the solo run's order."""
    k_max = 6
    while any(len(s.output) < NEW_TOKENS for s in sessions):
        live = [s for s in sessions if len(s.output) < NEW_TOKENS]
        requests = []
        for session, reference in ((s, references[s.name]) for s in live):
            k = 0 if session.temperature else rng.randint(0, k_max)
            done = len(session.output)
            drafts = list(reference[done : done + k]) + [0] * k
            drafts = drafts[:k]
            if k and rng.random() < 0.5:
                wrong = rng.randrange(k)
                drafts[wrong] = (drafts[wrong] + 1) % vocab
            requests.append(session.request(drafts))
        for session, response in zip(live, verifier.verify_batch(requests)):
            session.apply(response)


def test_batched_verify_gives_every_session_its_solo_output(built, sessions_per_forward):
    # Greedy and sampled sessions, at different points of their prompts and decodes, with
    # different k each round, share forwards. Every row runs in the calibrated exact widths,
    # so each session's tokens and logprobs are bitwise what it gets alone; a sampled session's
    # draws are keyed by its seed and position and its p is unchanged, so its tokens are too.
    # (Sampled output with drafts under batching: the distribution tests of the service.)
    verifier = built.transport.verifier
    vocab = verifier.loaded.vocab_size
    assert verifier._packing
    shared = sessions_per_forward(verifier_module)
    temperatures = (0.0, 0.0, 0.8)
    solo = _sessions(built, "solo", temperatures)
    _solo(verifier, solo)
    references = {s.name.replace("solo", "batch"): s.output for s in solo}
    batch = _sessions(built, "batch", temperatures)
    _batched(verifier, batch, references, random.Random(0), vocab)
    assert max(shared) == len(PROMPTS)  # every session shared the forwards of the first rounds
    for alone, together in zip(solo, batch):
        assert together.output[:NEW_TOKENS] == alone.output[:NEW_TOKENS], together.name
        assert together.logprobs[:NEW_TOKENS] == alone.logprobs[:NEW_TOKENS], together.name


def test_a_bad_request_in_a_batch_fails_alone_and_changes_nothing(built):
    verifier = built.transport.verifier
    good, bad = _sessions(built, "isolated")[:2]
    bad.temperature = 0.8
    expected = _sessions(built, "isolated-ref")[:1]
    _solo(verifier, expected)
    verifier.verify_batch([good.request(), bad.request()])  # both prefilled
    before = list(verifier.sessions._entries["isolated-1"].cached_ids)
    bad_request = bad.request([5, 6])  # sampled drafts without their q
    responses = verifier.verify_batch([good.request([expected[0].output[1]]), bad_request])
    assert isinstance(responses[1], ValueError) and "q must hold 2 rows" in str(responses[1])
    good.apply(responses[0])
    assert good.output == expected[0].output[: len(good.output)]
    assert verifier.sessions._entries["isolated-1"].cached_ids == before
    with pytest.raises(ValueError, match="q must hold"):
        verifier.verify(bad_request)


def test_a_session_named_twice_in_a_batch_runs_its_calls_in_order(built):
    verifier = built.transport.verifier
    (session,) = _sessions(built, "twice")[:1]
    (expected,) = _sessions(built, "twice-ref")[:1]
    _solo(verifier, [expected])
    first = session.request()
    second = worker_pb2.VerifyRequest(
        session=worker_pb2.SessionTokens(
            session_id=session.name, prefix_len=len(session.prompt), new_token_ids=[]
        )
    )
    responses = verifier.verify_batch([first, second])
    session.apply(responses[0])
    assert session.output == expected.output[:1]
    # The second call came before the first one's token was committed: it is a plain step
    # again from the same committed state, so it emits the same token.
    assert list(responses[1].token_ids) == expected.output[:1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_forward_of_one_session_is_the_model_forward_bitwise(tiny_pair, dtype):
    from transformers import DynamicCache

    from specdec.device.exact_widths import use_row_wise_attention
    from specdec.models.loading import load_model
    from specdec.worker.kv_cache import SessionEntry

    # The reference: the model's own forward with the attention every decode forward uses.
    name = str(dtype).removeprefix("torch.")
    reference = load_model(str(tiny_pair[1]), dtype=name).model
    use_row_wise_attention(reference)
    model = load_model(str(tiny_pair[1]), dtype=name).model
    packed.prepare_packing(model)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(300, (1, 9), generator=generator)
    new = torch.randint(300, (5,), generator=generator).tolist()
    caches = []
    for m in (reference, model):
        cache = DynamicCache(config=m.config)
        m(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        caches.append(cache)
    expected = reference(
        input_ids=torch.tensor([new]), cache=caches[0], use_cache=True, logits_to_keep=3
    ).logits[0, :, :300]
    entry = SessionEntry(cache=caches[1], cached_ids=prompt[0].tolist())
    (got,) = packed.packed_forward(model, [packed.Segment(entry, new, 3)], 300)
    assert torch.equal(got, expected)
    assert entry.cached_ids == prompt[0].tolist() + new
    assert caches[1].get_seq_length() == caches[0].get_seq_length()


def _propose_request(session: _Session, k: int, floor: float = 0.0) -> worker_pb2.ProposeRequest:
    verify = session.request()
    sampling = verify.sampling
    return worker_pb2.ProposeRequest(
        session=verify.session,
        num_speculative_tokens=k,
        sampling=sampling,
        draft_top_n=4,
        min_draft_confidence=floor,
    )


def test_batched_drafting_steps_sessions_together_until_each_stops(built, sessions_per_forward):
    # Greedy sessions with different k (and one with a confidence stop) are stepped together,
    # each leaving the batch at its own length; a sampled session drafts alone, so its draft is
    # the one it gets when it is the only call.
    proposer = built.transport.proposer
    from specdec.worker import proposer as proposer_module

    widths = sessions_per_forward(proposer_module)
    temperatures = (0.0, 0.0, 0.0, 0.9)
    sessions = _sessions(built, "draft", temperatures)[:4]
    ks = [3, 5, 1, 4]
    for session in sessions:  # prefill (each prompt alone), then a committed token to catch up
        proposer.propose(_propose_request(session, 0))
        session.committed.append(7)
    requests = [_propose_request(s, k) for s, k in zip(sessions, ks)]
    requests[1].min_draft_confidence = 0.999  # stops at the first token it is not sure of
    responses = proposer.propose_batch(requests)
    assert [len(r.token_ids) for r in responses[::2]] == [3, 1]
    assert 1 <= len(responses[1].token_ids) <= 5
    assert widths[0] == 3  # the greedy sessions' catch-up rows shared one forward
    assert responses[3].q.width == 4 and len(responses[3].q.probs) == 4 * 4
    # The sampled session's draft, proposed again alone from the same state, is the same.
    alone = _sessions(built, "draft-alone", temperatures)[3]
    proposer.propose(_propose_request(alone, 0))
    alone.committed.append(7)
    again = proposer.propose(_propose_request(alone, 4))
    assert list(again.token_ids) == list(responses[3].token_ids)
    assert list(again.q.probs) == list(responses[3].q.probs)


def test_a_call_without_committed_tokens_fails_alone(built):
    proposer = built.transport.proposer
    (session,) = _sessions(built, "empty-call")[:1]
    empty = worker_pb2.ProposeRequest(session=worker_pb2.SessionTokens(session_id="none"))
    responses = proposer.propose_batch([_propose_request(session, 2), empty])
    assert isinstance(responses[1], ValueError) and "new_token_ids" in str(responses[1])
    assert len(responses[0].token_ids) == 2
    assert "none" not in proposer.sessions._entries


def test_prefills_past_the_budget_wait_for_a_later_batch_and_change_nothing(built, monkeypatch):
    # One prefill per batch (budget 0): the other new prompts come back DEFERRED with no cache
    # entry, a live session's decode row runs with the first prefill, and a deferred session's
    # second call in the same batch waits with it. Resubmitted, every session decodes exactly
    # as it does alone.
    verifier = built.transport.verifier
    monkeypatch.setattr(verifier, "prefill_budget", 0)
    solo = _sessions(built, "budget-solo")[:4]
    _solo(verifier, solo)
    live, *new = _sessions(built, "budget")[:4]
    live.apply(verifier.verify(live.request()))
    requests = [new[0].request(), live.request(), new[1].request(), new[2].request()]
    later = worker_pb2.VerifyRequest(session=requests[2].session)  # new[1] named twice
    responses = verifier.verify_batch([*requests, later])
    assert [r is DEFERRED for r in responses] == [False, False, True, True, True]
    assert "budget-2" not in verifier.sessions._entries
    assert "budget-3" not in verifier.sessions._entries
    new[0].apply(responses[0])
    live.apply(responses[1])
    waiting = [(new[1], requests[2]), (new[2], requests[3])]
    while waiting:  # what a replica does: the deferred calls join the next batch
        responses = verifier.verify_batch([request for _, request in waiting])
        assert sum(r is not DEFERRED for r in responses) == 1
        for (session, _), response in zip(waiting, responses):
            if response is not DEFERRED:
                session.apply(response)
        waiting = [w for w, r in zip(waiting, responses) if r is DEFERRED]
    for session in [live, *new]:
        while len(session.output) < NEW_TOKENS:
            session.apply(verifier.verify(session.request()))
    for alone, budgeted in zip(solo, [live, *new]):
        assert budgeted.output == alone.output and budgeted.logprobs == alone.logprobs


def test_a_budget_fits_several_prefills_and_the_draft_defers_too(built, monkeypatch):
    proposer = built.transport.proposer
    sessions = _sessions(built, "draft-budget")[:3]
    lengths = [len(s.prompt) for s in sessions]
    monkeypatch.setattr(proposer, "prefill_budget", lengths[0] + lengths[1])
    responses = proposer.propose_batch([_propose_request(s, 2) for s in sessions])
    assert [r is DEFERRED for r in responses] == [False, False, True]
    assert all(len(r.token_ids) == 2 for r in responses[:2])
    assert "draft-budget-2" not in proposer.sessions._entries


def test_the_prefill_budget_comes_from_the_measured_prefill_cost(built):
    # models.batch_prefill_s (1 s by default) in tokens at this replica's measured seconds per
    # prompt token.
    for side in (built.transport.verifier, built.transport.proposer):
        per_token = side.calibration.chosen.prefill_s_per_token
        assert side.prefill_budget == int(1.0 / per_token)
