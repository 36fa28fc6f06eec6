"""The static runner's edges on the CPU: requests it cannot run (more drafts than its verify
width, sessions past its context limit, token ids outside the embedding) fail alone with a
clear error beside requests it serves, leaving no slot behind; a verify whose scored rows start
inside the prompt (VerifyJob.head) scores them as the runner's own k = 0 does; a slot is never
freed under a checkout that has found its entry."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.models.tiny import PROMPTS
from specdec.v1 import worker_pb2
from specdec.worker.kv_cache import SessionCacheStore
from specdec.worker.static.slots import SlotAllocator, SlotLayout

LIMIT = 64
STATIC = {"runner": "static", "max_model_len": LIMIT, "cache_capacity_bytes": 8 * 1024**2}


@pytest.fixture(scope="module")
def static_engine(tiny_pair):
    return SpeculativeEngine.from_pretrained(*tiny_pair, **STATIC)


def _session(session_id: str, ids: list[int], prefix_len: int = 0) -> worker_pb2.SessionTokens:
    prompt_len = len(ids) if prefix_len == 0 else 0
    return worker_pb2.SessionTokens(
        session_id=session_id, prefix_len=prefix_len, new_token_ids=ids, prompt_len=prompt_len
    )


def _verify(session_id: str, ids: list[int], drafts: list[int], prefix_len: int = 0):
    return worker_pb2.VerifyRequest(
        session=_session(session_id, ids, prefix_len), draft_token_ids=drafts
    )


def _sampled(session_id: str, ids: list[int], drafts: list[int], q_ids: list[list[int]], q_probs):
    request = _verify(session_id, ids, drafts)
    request.sampling.CopyFrom(worker_pb2.SamplingConfig(temperature=1.0, top_p=1.0, seed=1))
    request.q.CopyFrom(
        worker_pb2.SparseDistribution(
            width=len(q_ids[0]), token_ids=[t for row in q_ids for t in row], probs=q_probs
        )
    )
    return request


def _vocab(engine) -> int:
    return engine.transport.verifier.loaded.vocab_size


def _propose(session_id: str, ids: list[int], k: int, prefix_len: int = 0):
    return worker_pb2.ProposeRequest(
        session=_session(session_id, ids, prefix_len),
        num_speculative_tokens=k,
        sampling=worker_pb2.SamplingConfig(top_p=1.0),
    )


def _ids(engine, prompt: str) -> list[int]:
    return engine.transport.verifier.loaded.tokenizer.encode(prompt)


def _embedding_rows(engine) -> int:
    return engine.transport.verifier.loaded.model.get_input_embeddings().num_embeddings


BAD_VERIFIES = {
    "more drafts than the verify width": (lambda e: _verify("bad", [5, 6], [7] * 9), "draft"),
    "a prompt past the context limit": (lambda e: _verify("bad", [5] * (LIMIT + 1), []), "context"),
    "drafts past the context limit": (
        lambda e: _verify("bad", [5] * (LIMIT - 2), [7] * 3),
        "context",
    ),
    "a continued session past the limit": (
        lambda e: _verify("bad", [5, 6], [7] * 3, prefix_len=LIMIT - 3),
        "context",
    ),
    "a draft past the embedding": (lambda e: _verify("bad", [5], [_embedding_rows(e)]), "token"),
    "a negative token": (lambda e: _verify("bad", [5, -1], [7]), "token"),
    "a sampled draft past the vocabulary": (
        lambda e: _sampled("bad", [5, 6], [_vocab(e)], [[5]], [1.0]),
        "token",
    ),
    "q ids past the vocabulary": (
        lambda e: _sampled("bad", [5, 6], [7], [[7, _vocab(e)]], [0.5, 0.5]),
        "q",
    ),
    "negative q ids": (lambda e: _sampled("bad", [5, 6], [7], [[7, -3]], [0.5, 0.5]), "q"),
}


@pytest.mark.parametrize("case", list(BAD_VERIFIES))
def test_a_verify_the_runner_cannot_run_fails_alone(static_engine, case):
    """Before: the whole batch raised (an unclear RuntimeError or IndexError, or the runner's
    context-limit ValueError), so the good requests beside the bad one failed too."""
    make, match = BAD_VERIFIES[case]
    verifier = static_engine.transport.verifier
    good = [_verify("g0", _ids(static_engine, PROMPTS[0]), [5, 6, 7]), _verify("g1", [5, 6], [])]
    results = verifier.verify_batch([good[0], make(static_engine), good[1]])
    for name in ("g0", "g1", "bad"):
        verifier.release(worker_pb2.ReleaseRequest(session_id=name))
    assert isinstance(results[1], ValueError) and match in str(results[1])
    assert [type(r) for r in results[::2]] == [worker_pb2.VerifyResponse] * 2
    assert verifier.sessions._backing.free_slots == verifier.layout.num_slots


BAD_PROPOSALS = {
    "more drafts than the verify width": (lambda e: _propose("bad", [5, 6], 9), "draft"),
    "a prompt past the context limit": (lambda e: _propose("bad", [5] * (LIMIT + 1), 0), "context"),
    "drafts past the context limit": (lambda e: _propose("bad", [5] * (LIMIT - 2), 3), "context"),
    "a token past the embedding": (lambda e: _propose("bad", [_embedding_rows(e)], 2), "token"),
}


@pytest.mark.parametrize("case", list(BAD_PROPOSALS))
def test_a_proposal_the_runner_cannot_run_fails_alone(static_engine, case):
    make, match = BAD_PROPOSALS[case]
    proposer = static_engine.transport.proposer
    good = [_propose("g0", _ids(static_engine, PROMPTS[0]), 3), _propose("g1", [5, 6], 8)]
    results = proposer.propose_batch([good[0], make(static_engine), good[1]])
    for name in ("g0", "g1", "bad"):
        proposer.release(worker_pb2.ReleaseRequest(session_id=name))
    assert isinstance(results[1], ValueError) and match in str(results[1])
    assert [len(r.token_ids) for r in results[::2]] == [3, 8]
    assert proposer.sessions._backing.free_slots == proposer.layout.num_slots


def test_requests_at_the_context_limit_are_served(static_engine):
    """The largest session the router sends: the prompt one short of the limit, then drafts up
    to it."""
    verifier = static_engine.transport.verifier
    (at_limit,) = verifier.verify_batch([_verify("edge", [5] * (LIMIT - 4), [7] * 3)])
    verifier.release(worker_pb2.ReleaseRequest(session_id="edge"))
    assert isinstance(at_limit, worker_pb2.VerifyResponse)
    out = static_engine.generate([5] * (LIMIT - 1), SamplingParams(max_new_tokens=1), 8)
    assert len(out.token_ids) == 1


@pytest.mark.parametrize("k", [1, 3, 8])
def test_drafts_scored_from_inside_the_prompt_match_k0(static_engine, k):
    """A first verify that carries the prompt and drafts (a router that skipped the prefill
    round): the first scored row is the prompt's last, from its prefill (VerifyJob.head). With
    the target's own greedy tokens as drafts every one is accepted, and the tokens and
    log-probabilities are the runner's k = 0 output; a wrong second draft stops at one."""
    verifier = static_engine.transport.verifier
    prompt = _ids(static_engine, PROMPTS[1])
    expected = static_engine.generate(prompt, SamplingParams(max_new_tokens=k + 1), 0)
    right = list(expected.token_ids[:k])
    wrong = right[:1] + [(t + 1) % 300 for t in right[1:]]
    (full, stopped) = verifier.verify_batch(
        [_verify("right", prompt, right), _verify("wrong", prompt, wrong)]
    )
    for name in ("right", "wrong"):
        verifier.release(worker_pb2.ReleaseRequest(session_id=name))
    assert full.num_accepted == k
    assert list(full.token_ids) == expected.token_ids
    assert list(full.logprobs) == expected.logprobs
    assert stopped.num_accepted == min(k, 1)
    assert list(stopped.token_ids) == expected.token_ids[: min(k, 1) + 1]


class _HookedLock:
    """A lock that runs ``hook`` once, right after its first release: the moment another
    thread (the replica's event loop: release, the health check's expire) may take it."""

    def __init__(self, hook) -> None:
        self._lock, self._hook = threading.Lock(), hook

    def __enter__(self):
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()


@pytest.mark.parametrize("drop", ["expire", "release"])
def test_a_slot_is_not_freed_under_a_checkout_that_found_its_entry(drop):
    """A replica's checkout runs on its compute thread while the event loop expires idle
    sessions and handles releases. Before: an entry found by checkout but not yet marked in
    flight was dropped and its slot freed, and the call went on writing a slot the next new
    session was handed (two sessions in one slot: silently wrong tokens)."""
    layout = SlotLayout(1, 1, 1, torch.float32, context_limit=6, num_slots=2, width=2)
    backing = SlotAllocator(layout)
    now = [0.0]
    store = SessionCacheStore(2 * layout.slot_bytes, backing, idle_s=1.0, clock=lambda: now[0])
    first = store.checkout(_session("a", [1, 2]))
    store.commit(first)
    now[0] = 5.0  # "a" idles past idle_s, then its next call arrives

    def dropped_meanwhile() -> None:
        if drop == "expire":
            store.expire()
        else:
            store.release("a")

    store._lock = _HookedLock(dropped_meanwhile)
    active = store.checkout(_session("a", [3], prefix_len=2))
    other = store.checkout(_session("b", [4]))
    assert active is not None and other.entry.cache.slot != active.entry.cache.slot
    store.commit(active)
    store.commit(other)
    store.release("a")
    store.release("b")
    assert backing.free_slots == 2


def test_a_call_without_tokens_takes_no_slot():
    layout = SlotLayout(1, 1, 1, torch.float32, context_limit=6, num_slots=2, width=2)
    backing = SlotAllocator(layout)
    store = SessionCacheStore(2 * layout.slot_bytes, backing)
    with pytest.raises(ValueError, match="committed token"):
        store.checkout(_session("a", []))
    assert backing.free_slots == 2
