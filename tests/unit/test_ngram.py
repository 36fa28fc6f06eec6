"""N-gram lookup (specdec.decoding.ngram), the per-round proposer choice and mixed rounds'
n-gram tails (specdec.decoding.proposers)."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch

from specdec.config import SpeculationConfig
from specdec.decoding.acceptance import AcceptanceEstimator
from specdec.decoding.costs import CostModel, CostPrior, RoundTiming
from specdec.decoding.k_policy import PROBE_EVERY, KController, RoundPlan
from specdec.decoding.ngram import NgramIndex, RequestNgrams, SharedNgrams
from specdec.decoding.proposers import (
    DRAFT,
    NGRAM,
    NGRAM_PROBE_EVERY,
    NONE,
    Proposal,
    ProposerChoice,
)
from specdec.decoding.round_loop import with_point_masses
from specdec.v1 import worker_pb2
from specdec.worker.sampling import sparse_to_dense

# --- the indexes -------------------------------------------------------------------------------


def _reference_propose(tokens, min_n, max_n, k):
    """The definition, by brute force: the longest n-gram ending ``tokens`` that occurred
    earlier, its latest earlier occurrence, and up to k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # occurrence tokens[end - n : end]
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k], n
    return [], 0


@pytest.mark.parametrize("seed", range(20))
def test_lookup_is_the_latest_occurrence_of_the_longest_match(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 80))]
    index = NgramIndex(2, 4)
    index.extend(tokens[:5])
    index.extend(tokens[5:])
    for k in (1, 3, 8):
        assert index.propose(tokens, k) == _reference_propose(tokens, 2, 4, k)


def test_lookup_never_matches_the_context_with_itself():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7])
    assert index.propose([5, 6, 7], 4) == ([], 0)
    index.extend([5, 6])
    assert index.propose([5, 6, 7, 5, 6], 4) == ([7, 5, 6], 2)


def test_a_request_reads_another_request_only_through_the_shared_index():
    shared = SharedNgrams(10**6, 2, 3)
    first = RequestNgrams([1, 2], 2, 3, shared)
    first.commit([3, 4, 5, 6])
    first.finish()  # its completion [3, 4, 5, 6] enters the shared index
    alone = RequestNgrams([9, 3, 4], 2, 3, None)
    assert alone.propose(4) == ([], 0)
    reader = RequestNgrams([9, 3, 4], 2, 3, shared)
    assert reader.propose(4) == ([5, 6], 2)
    reader.commit([5, 9, 3])  # its own text matches [9, 3] -> 4 and wins over the shared
    assert reader.propose(2) == ([4, 5], 2)


def test_the_shared_index_forgets_the_oldest_completion_and_never_spans_two():
    shared = SharedNgrams(8 * 220 * 2, 2, 3)  # 8 tokens
    assert shared.capacity_tokens == 8
    shared.add([1, 2, 3, 4, 5])
    assert shared.propose([1, 2], 3) == ([3, 4, 5], 2)
    shared.add([6, 7, 8, 9])  # 9 overwrites 1 (position 0)
    assert shared.propose([1, 2], 3) == ([3, 4, 5], 2)  # what follows [1, 2] is still held
    assert shared.propose([8, 3, 4], 3) == ([5, 6, 7], 2)  # continuations may run on
    assert shared.propose([5, 6], 2) == ([], 0)  # [5, 6] spans two completions: not indexed
    shared.add([10, 11])  # overwrites 2 and 3: [1, 2]'s continuation is gone, and its key
    assert shared.propose([1, 2], 3) == ([], 0)
    assert shared.propose([3, 4], 3) == ([5, 6, 7], 2)
    assert len(shared) <= shared.capacity_tokens * 2


def test_the_shared_index_stays_within_its_bytes():
    bound = 4 * 1024**2
    shared = SharedNgrams(bound, 2, 4)
    rng = random.Random(0)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(400):  # about 3x its capacity of tokens, ids of a real vocabulary
            shared.add([rng.randrange(150_000) for _ in range(rng.randrange(50, 200))])
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.3 * bound < used - base <= bound
    assert len(shared) <= shared.capacity_tokens * 3


def test_a_bound_below_one_token_is_refused():
    with pytest.raises(ValueError, match="shared_ngram_bytes"):
        SharedNgrams(100, 2, 4)


# --- the choice --------------------------------------------------------------------------------


def _costs(verify_s, step_s=0.05, k_max=8, mixed_rounds=True):
    """A CostModel whose verify of k tokens took verify_s(k) and draft step step_s (measured)."""
    config = SpeculationConfig(
        max_speculative_tokens=k_max, dynamic_draft_length=False, mixed_rounds=mixed_rounds
    )
    costs = CostModel(config, CostPrior([verify_s(k) for k in range(k_max + 1)], step_s))
    for k in range(k_max + 1):
        for _ in range(10):
            timing = RoundTiming(
                verify_s=verify_s(k),
                draft_s=step_s * k,
                catchup_s=step_s if k else 0.0,
                catchup_tokens=1 if k else 0,
            )
            costs.observe(k, timing)
    return costs, config


def _choice(
    proposer, tokens, draft_rate=0.8, ngram_rate=0.8, fixed_k=None, verify=None, mixed_rounds=True
):
    """A request's ProposerChoice over ``tokens``, its draft's and its 2-gram matches'
    acceptance rates estimated at draft_rate and ngram_rate."""
    costs, config = _costs(verify or (lambda k: 0.1), mixed_rounds=mixed_rounds)
    controller = KController(costs, config, fixed_k=fixed_k)
    controller.acceptance = AcceptanceEstimator(draft_rate)
    costs.traffic.pooled_ngram_acceptance = _Pooled(ngram_rate)
    return ProposerChoice(proposer, controller, RequestNgrams(tokens, 2, 4))


class _Pooled:
    def __init__(self, rate):
        self.rate = rate

    def observe(self, k, num_accepted):
        pass


REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # ends with [1, 2]: lookup proposes 3, 4, 5, ...
FRESH = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # no match


def test_none_and_fixed_k_zero_propose_nothing():
    assert _choice("none", REPEATING).choose(100, 0, True, True).source == NONE
    assert _choice("auto", REPEATING, fixed_k=0).choose(100, 0, True, True).source == NONE
    assert not _choice("auto", REPEATING, fixed_k=0).uses_draft


def test_ngram_proposes_its_match_and_nothing_without_one():
    proposal = _choice("ngram", REPEATING).choose(100, 0, True, True)
    assert proposal.source == NGRAM and proposal.tokens == tuple(REPEATING[2:])[: proposal.plan.k]
    assert proposal.plan.k >= 1 and proposal.ngram_n == 2
    assert _choice("ngram", FRESH).choose(100, 0, True, True).source == NONE


def test_the_proposal_respects_the_tokens_left_and_a_fixed_k():
    assert len(_choice("ngram", REPEATING).choose(2, 0, True, True).tokens) <= 2
    assert len(_choice("ngram", REPEATING, fixed_k=1).choose(100, 0, True, True).tokens) == 1


@pytest.mark.parametrize("proposer", ["auto", "draft"])
def test_a_draft_that_cannot_be_called_falls_back_to_ngram_lookup(proposer):
    down = _choice(proposer, REPEATING).choose(100, 0, draft_available=False, draft_ready=False)
    assert down.source == NGRAM and down.without_draft
    pending = _choice(proposer, REPEATING).choose(100, 0, draft_available=True, draft_ready=False)
    assert pending.source == NGRAM and not pending.without_draft  # prefill still running
    fresh = _choice(proposer, FRESH).choose(100, 0, draft_available=False, draft_ready=False)
    assert fresh.source == NONE and fresh.without_draft


def test_draft_uses_the_draft_model_whenever_it_answers():
    """Lookup would win here (auto takes it), yet ``draft`` drafts with the model where
    drafting pays, and proposes nothing, never lookup, where it does not."""
    assert (
        _choice("auto", REPEATING, draft_rate=0.8, ngram_rate=1.0).choose(100, 0, True, True).source
        == NGRAM
    )
    paying = _choice("draft", REPEATING, draft_rate=0.8, ngram_rate=1.0).choose(100, 0, True, True)
    assert paying.source == DRAFT and paying.plan.k >= 1
    unpaying = _choice("draft", REPEATING, draft_rate=0.2, ngram_rate=1.0)
    assert unpaying.choose(100, 0, True, True).source == NONE


def test_auto_takes_the_proposer_of_the_higher_goodput():
    # A flat verify: n-gram tokens cost nothing, draft tokens a step each.
    good_ngram = _choice("auto", REPEATING, draft_rate=0.6, ngram_rate=0.9)
    assert good_ngram.choose(100, 0, True, True).source == NGRAM
    bad_ngram = _choice("auto", REPEATING, draft_rate=0.9, ngram_rate=0.05)
    proposal = bad_ngram.choose(100, 0, True, True)
    assert proposal.source == DRAFT and proposal.plan.k >= 2
    assert _choice("auto", FRESH, draft_rate=0.9).choose(100, 0, True, True).source == DRAFT


def test_auto_with_a_fixed_k_drafts_with_the_draft_model():
    choice = _choice("auto", REPEATING, draft_rate=0.1, ngram_rate=1.0, fixed_k=3)
    assert choice.choose(100, 0, True, True) == (DRAFT, RoundPlan(3), (), 0, False)


def test_ngram_lookup_is_cut_where_more_tokens_cost_more_than_they_bring():
    # A verify that grows 50% a token (float32 on an AVX2 CPU) and acceptance 0.3: one token.
    choice = _choice("ngram", REPEATING, ngram_rate=0.3, verify=lambda k: 0.1 * (1 + 0.5 * k))
    assert choice.choose(100, 0, True, True).source == NONE
    choice = _choice("ngram", REPEATING, ngram_rate=0.9, verify=lambda k: 0.1 * (1 + 0.05 * k))
    assert len(choice.choose(100, 0, True, True).tokens) >= 3


def test_a_passed_over_match_is_verified_again_after_the_probe_interval():
    choice = _choice("auto", REPEATING, draft_rate=0.95, ngram_rate=0.0)
    sources = [choice.choose(100, 0, True, True).source for _ in range(NGRAM_PROBE_EVERY + 1)]
    assert sources[:NGRAM_PROBE_EVERY] == [DRAFT] * NGRAM_PROBE_EVERY
    assert sources[NGRAM_PROBE_EVERY] == NGRAM


def _after_rounds(choice, ngram_rounds, plain_rounds, probe_due=False):
    """``choice`` after ``ngram_rounds`` n-gram rounds (3 tokens proposed, all accepted: 4
    committed for one verify) and ``plain_rounds`` k = 0 rounds, with a draft catch-up of 0.02
    s a token measured; ``probe_due``: then as many k = 0 rounds as make a draft probe due."""
    choice.costs.observe(1, RoundTiming(verify_s=0.1, catchup_s=2.0, catchup_tokens=100))
    lookup = Proposal(NGRAM, RoundPlan(3), (3, 4, 5), 2)
    for _ in range(ngram_rounds):
        choice.observe_ngram(lookup, 3)
    for _ in range(plain_rounds):
        choice.observe_plain()
    for _ in range(PROBE_EVERY if probe_due else 0):
        choice._controller.observe(0, 0, RoundTiming(verify_s=0.1))
    return choice


@pytest.mark.parametrize("probe_due", [False, True], ids=["priced", "probe"])
def test_auto_starts_the_draft_only_where_its_rounds_repay_the_start(probe_due):
    """Lookup rounds here commit a token per 0.025 s, k = 0 rounds per 0.1 s; the draft's
    rounds cost 0.068 s a token at acceptance 0.95 (k = 8: a catch-up and 7 steps of 0.05 s,
    a 0.1 s verify), 0.056 s at best (every token accepted). A start on a 100-token lag
    (0.02 s a token left) beats k = 0 but not lookup: in a round without a match ``auto``
    decodes plain instead, probe or not, and calls the draft on a steady lag; ``draft``
    starts it."""
    lagging = _after_rounds(_choice("auto", FRESH, draft_rate=0.95), 20, 2, probe_due)
    assert lagging.choose(100, 100, True, True).source == NONE
    steady = _after_rounds(_choice("auto", FRESH, draft_rate=0.95), 20, 2, probe_due)
    assert steady.choose(100, 2, True, True).source == DRAFT
    draft_only = _after_rounds(_choice("draft", FRESH, draft_rate=0.95), 20, 2, probe_due)
    assert draft_only.choose(100, 100, True, True).source == DRAFT


@pytest.mark.parametrize("probe_due", [False, True], ids=["priced", "probe"])
def test_a_start_that_rounds_without_lookup_repay_is_made(probe_due):
    """Where lookup rarely matched (most tokens from k = 0 rounds), the draft's rounds save
    0.03-0.04 s a token: a 100-token start (0.02 s a token left) is made, a 1000-token one
    (0.2 s) is not."""
    choice = _after_rounds(_choice("auto", FRESH, draft_rate=0.95), 1, 30, probe_due)
    assert choice.choose(100, 100, True, True).source == DRAFT
    assert choice.choose(100, 1000, True, True).source == NONE


def test_a_new_requests_first_start_is_weighed_against_its_neighbours_lookup():
    """Before rounds of its own without the draft, a request's start is weighed against the
    router's recent ones (RequestTraffic.pooled_draft_free): after a neighbour's lookup rounds,
    a new request with a 100-token lag decodes plain in its first round (no match) instead of
    starting the draft; on a router without lookup rounds it starts it."""
    neighbour = _after_rounds(_choice("auto", FRESH, draft_rate=0.95), 20, 2)
    newcomer = ProposerChoice(
        "auto",
        KController(
            neighbour.costs, neighbour._controller.config, acceptance=AcceptanceEstimator(0.95)
        ),
        RequestNgrams(FRESH, 2, 4),
    )
    assert newcomer.choose(100, 100, True, True).source == NONE
    alone = _after_rounds(_choice("auto", FRESH, draft_rate=0.95), 0, 0)
    assert alone.choose(100, 100, True, True).source == DRAFT
    # Requests that asked for k = 0 consult no lookup: their rounds leave the pool as it was.
    for proposer, fixed_k in (("none", None), ("auto", 0), ("draft", None)):
        asked = ProposerChoice(
            proposer,
            KController(neighbour.costs, neighbour._controller.config, fixed_k=fixed_k),
            RequestNgrams(FRESH, 2, 4),
        )
        for _ in range(200):
            asked.observe_plain()
    assert newcomer.choose(100, 100, True, True).source == NONE
    # From its third round without the draft, its own rounds (here no match in any) decide.
    for rounds, expected in ((2, NONE), (3, DRAFT)):
        while newcomer._draft_free.rounds < rounds:
            newcomer.observe_plain()
        assert newcomer.choose(100, 100, True, True).source == expected


# --- mixed rounds: an n-gram tail after the draft model's tokens -------------------------------


def test_lookup_continues_the_text_followed_by_unverified_drafts():
    ngrams = RequestNgrams([10, 11, 12, 13, 14, 10], 2, 4)
    # The match (10, 11) spans the request's last token and the draft's token.
    assert ngrams.propose(3, after=[11]) == ([12, 13, 14], 2)
    assert ngrams.propose(3, after=[99]) == ([], 0)
    assert ngrams.propose(3) == ([], 0)  # (14, 10) never occurred before the end


def test_a_tail_that_costs_nothing_follows_likely_drafts():
    choice = _choice("auto", REPEATING, draft_rate=0.8, ngram_rate=0.8)  # a flat verify
    tail = choice.tail([3, 4], [0.9, 0.9], limit=100)
    assert tail.source == NGRAM and tail.ngram_n == 4
    assert tail.tokens == (5, 6, 7, 8, 1, 2)  # up to k_max = 8 tokens with the drafts
    assert len(choice.tail([3, 4], [0.9, 0.9], limit=4).tokens) == 2  # the tokens left


@pytest.mark.parametrize("proposer, fixed_k", [("draft", None), ("ngram", None), ("auto", 2)])
def test_only_an_adaptive_auto_round_takes_a_tail(proposer, fixed_k):
    choice = _choice(proposer, REPEATING, fixed_k=fixed_k)
    assert choice.tail([3, 4], [0.9, 0.9], limit=100).source == NONE


def test_mixed_rounds_off_takes_no_tail():
    choice = _choice("auto", REPEATING, mixed_rounds=False)
    assert choice.tail([3, 4], [0.9, 0.9], limit=100).source == NONE


def test_a_tail_is_priced_at_the_chance_the_drafts_are_all_accepted():
    # Each token of the verify costs 5% more: worth it only where the tail is likely reached.
    verify = lambda k: 0.1 * (1 + 0.05 * k)  # noqa: E731
    sure = _choice("auto", REPEATING, ngram_rate=0.9, verify=verify)
    assert sure.tail([3, 4], [1.0, 1.0], limit=100).source == NGRAM
    unlikely = _choice("auto", REPEATING, ngram_rate=0.9, verify=verify)
    assert unlikely.tail([3, 4], [0.01, 0.01], limit=100).source == NONE
    # Without confidences, the draft's acceptance rate stands for them: 0.05^2.
    low = _choice("auto", REPEATING, draft_rate=0.05, ngram_rate=0.9, verify=verify)
    assert low.tail([3, 4], [], limit=100).source == NONE
    # Reached for sure but rarely accepted, against a verify growing 50% a token.
    steep = _choice("auto", REPEATING, ngram_rate=0.05, verify=lambda k: 0.1 * (1 + 0.5 * k))
    assert steep.tail([3, 4], [1.0, 1.0], limit=100).source == NONE


def test_a_mixed_rounds_q_is_the_drafts_rows_then_point_masses():
    q = worker_pb2.SparseDistribution(
        width=3, token_ids=[4, 1, 0, 2, 3, 4], probs=[0.5, 0.3, 0.2, 0.6, 0.4, 0.0]
    )
    rows = with_point_masses(q, [1, 7])
    dense = sparse_to_dense(
        torch.tensor(list(rows.token_ids)).view(4, 3), torch.tensor(list(rows.probs)).view(4, 3), 8
    )
    expected = torch.zeros(4, 8)
    expected[0, [4, 1, 0]] = torch.tensor([0.5, 0.3, 0.2])
    expected[1, [2, 3]] = torch.tensor([0.6, 0.4])
    expected[2, 1] = expected[3, 7] = 1.0
    assert torch.equal(dense, expected)
    alone = with_point_masses(None, [5, 6])
    assert (alone.width, list(alone.token_ids), list(alone.probs)) == (1, [5, 6], [1.0, 1.0])
