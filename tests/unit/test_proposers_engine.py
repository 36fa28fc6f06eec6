"""The proposers through the in-process engine: greedy output equals the target alone whoever
proposes, `ngram` never calls the draft model, and the shared index is the only way one
request's text reaches another's proposals."""

from __future__ import annotations

import pytest
from forced_rounds import confidence_stop_choose, unpriced_tail

from specdec import SamplingParams, SpeculativeEngine
from specdec.decoding.k_policy import KController
from specdec.decoding.proposers import ProposerChoice
from specdec.models.tiny import PROMPTS

GREEDY = SamplingParams(max_new_tokens=48)
# Prompts that repeat themselves, so n-gram lookup has matches from the first round; plus the
# tiny pair's own prompts, whose gibberish completions repeat often enough.
REPEATING = [
    "a b c d e f a b c d e f a b c",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    *PROMPTS[:3],
]


@pytest.fixture(scope="module")
def target_only(engine):
    return {p: engine.generate(p, GREEDY, num_speculative_tokens=0) for p in REPEATING}


@pytest.mark.parametrize("proposer", ["auto", "draft", "ngram", "none"])
def test_greedy_output_equals_the_target_alone_for_every_proposer(engine, target_only, proposer):
    stats = []
    for prompt in REPEATING:
        out = engine.generate(prompt, GREEDY, proposer=proposer)
        expected = target_only[prompt]
        assert out.token_ids == expected.token_ids, (prompt, proposer)
        assert out.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        stats.append(out.stats)
    ngram_tokens = sum(s.ngram_draft_tokens for s in stats)
    model_tokens = sum(s.draft_tokens for s in stats) - ngram_tokens
    if proposer == "ngram":
        assert ngram_tokens > 0 and model_tokens == 0
        assert sum(s.ngram_accepted_tokens for s in stats) > 0
    if proposer == "draft":
        assert ngram_tokens == 0 and model_tokens > 0
    if proposer == "none":
        assert ngram_tokens == 0 and model_tokens == 0
    for s in stats:
        assert s.ngram_accepted_tokens <= s.ngram_draft_tokens
        assert s.ngram_rounds <= s.decode_rounds


@pytest.mark.parametrize("k", [1, 3])
def test_a_fixed_k_bounds_the_ngram_proposal(engine, target_only, k):
    for prompt in REPEATING[:2]:
        out = engine.generate(prompt, GREEDY, num_speculative_tokens=k, proposer="ngram")
        assert out.token_ids == target_only[prompt].token_ids
        assert out.stats.ngram_rounds > 0
        assert out.stats.ngram_draft_tokens <= k * out.stats.ngram_rounds


def test_mixed_rounds_keep_greedy_output_equal_to_the_target_alone(
    engine, target_only, monkeypatch
):
    """Every round drafts 2 tokens and verifies up to 3 lookup tokens after them (both forced:
    the real plan and tail are priced, and the shared engine's costs by then may price either
    out): the draft's cache then lags by the accepted tail, and catches up."""
    monkeypatch.setattr(KController, "choose", confidence_stop_choose(k=2, floor=0.0))
    monkeypatch.setattr(ProposerChoice, "tail", unpriced_tail(3))
    stats = []
    for prompt in REPEATING:
        out = engine.generate(prompt, GREEDY, proposer="auto")
        assert out.token_ids == target_only[prompt].token_ids, prompt
        stats.append(out.stats)
    assert sum(s.mixed_rounds for s in stats) > 0
    assert sum(s.ngram_accepted_tokens for s in stats) > 0
    for s in stats:
        assert s.ngram_accepted_tokens <= s.ngram_draft_tokens <= s.draft_tokens
        assert s.mixed_rounds + s.ngram_rounds <= s.decode_rounds
        if s.mixed_rounds:  # the draft model proposed the head of each mixed round
            assert s.draft_tokens - s.ngram_draft_tokens >= s.mixed_rounds


def test_ngram_never_calls_the_draft_model(engine, monkeypatch):
    calls = []
    propose = engine.transport.propose

    async def counting(request):
        calls.append(request)
        return await propose(request)

    monkeypatch.setattr(engine.transport, "propose", counting)
    engine.generate(REPEATING[0], GREEDY, proposer="ngram")
    engine.generate(REPEATING[0], GREEDY, proposer="none")
    assert calls == []
    engine.generate(REPEATING[0], GREEDY, proposer="draft")
    assert calls


def test_the_shared_index_holds_completions_only_when_turned_on(tiny_pair, engine):
    assert engine.shared_ngrams is None
    shared = SpeculativeEngine.from_pretrained(*tiny_pair, shared_ngram_bytes=2**20)
    first = shared.generate(PROMPTS[0], GREEDY, proposer="ngram")
    assert len(shared.shared_ngrams) > 0
    # A second request with the same prompt can now copy the first one's completion. At a
    # fixed k every match is proposed whole (under auto, measured costs price each one).
    again = shared.generate(PROMPTS[0], GREEDY, 4, proposer="ngram")
    assert again.token_ids == first.token_ids
    assert again.stats.ngram_accepted_tokens >= len(first.token_ids) // 2
