"""Speculative sampling through the engine follows the target's distribution.

Completion position 1 comes from the target's prefill; positions 2 and 3 come from the first
speculative round (with k = 1, position 3 is the bonus token whenever position 2 is accepted;
with k = 2 both are draft positions). Their empirical distributions over thousands of seeded
samples are compared, by a chi-square goodness-of-fit test, with the exact marginals of
target-only sampling, computed by enumerating every prefix with the target model (vocabulary of
32). The draft is far from the target (total variation about 0.5), so rejections are frequent and
a wrong residual shows. Seeds are fixed, so the test is deterministic. Requests run
NEIGHBOURS at a time through the engine's batching, so the distributions are those of a
request with concurrent neighbours (and at a fixed k each sampled request is bitwise its solo self:
test_neighbours_change_no_sampled_token). The seeds' groups are split across two worker
processes (the ``sampled`` fixture), each running its requests as this process would.

The same tests run with the draft truncating q to its top TOP_N tokens (below the vocabulary):
the verifier then sees a sparse q with most tokens at probability 0, and exactness must hold
for that q too; a broken variant that reports the untruncated q for draws made from the
truncated one must fail.

N-gram lookup's proposals (specdec.decoding.ngram) are deterministic: q is a point mass on each
proposed token. NGRAM_PROMPT is a cycle through the whole vocabulary, so whatever the first
token, lookup proposes the two that followed it in the prompt; the far target rarely agrees, so
most rounds take the residual p without x, and keeping the proposals unchecked must fail. A
mixed round (ProposerChoice.tail) verifies the draft's token and then lookup's next one, with
the draft's q row and a point mass in one q.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from unittest import mock

import numpy as np
import pytest
import torch
from forced_rounds import confidence_stop_choose, unpriced_tail
from scipy import stats

from specdec import SamplingParams, SpeculativeEngine
from specdec.decoding import round_loop
from specdec.decoding.k_policy import KController
from specdec.decoding.proposers import ProposerChoice
from specdec.models.tiny import save_pair
from specdec.worker import proposer, rejection, verifier
from specdec.worker.sampling import processed_probs

N = 2000
PROMPT = "w1 w2 w3"
VOCAB = 32
END = VOCAB  # extra category: the completion ended (EOS) before this position
TOP_N = 4  # the truncating draft's q: 4 of the 32 tokens
NEIGHBOURS = 8  # requests served together: their verify calls share batched forwards


NGRAM_PROMPT = " ".join(f"w{i}" for i in range(VOCAB - 1)) + " w0"
ENGINES = {
    "far_engine": {},
    "ngram_engine": {"proposer": "ngram", "ngram_min_n": 1},
    "mixed_engine": {"proposer": "auto", "ngram_min_n": 1},
    "truncating_engine": {"draft_top_n": TOP_N},
    # the static runner (specdec.worker.static): sampled rows go through the host's sampler
    "static_engine": {"runner": "static", "max_model_len": 64, "cache_capacity_bytes": 2**24},
    # drafted by the target itself (SELF_DRAFTED): at temperature 0.5 its guess of the bonus
    # token is right for about a fifth of the seeds, so a fifth take the pipelined path
    "pipelined_engine": {"pipelined_drafting": True},
}
SELF_DRAFTED = {"pipelined_engine"}
PROMPTS = {"ngram_engine": NGRAM_PROMPT, "mixed_engine": NGRAM_PROMPT}  # the others: PROMPT
# Completion positions (1-based) counted: the first round's, and for pipelined drafting those
# of the round after it, whose token a pipelined draft proposes (with k = 1: position 4 after
# the first round's draft token at 2 and its bonus at 3; one more token lets that round draft).
POSITIONS = {"pipelined_engine": (3, 4)}  # the others: (2, 3)
NEW_TOKENS = {"pipelined_engine": 5}  # the others: 4
WORKERS = 2  # processes sharing the seeds: each request's forwards run one thread at a time


@pytest.fixture(scope="module")
def far_pair(tmp_path_factory):
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    return save_pair(tmp_path_factory.mktemp("far"), noise=0.8, word_level=True, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def far_engine(far_pair):
    return SpeculativeEngine.from_pretrained(*far_pair, **ENGINES["far_engine"])


@pytest.fixture(scope="module")
def sampled(far_pair, far_engine):
    """sampled(engine_name, k, params, variant=None) -> (counts, drafted): _counts of seeds
    0 .. N - 1, their groups of NEIGHBOURS split across WORKERS processes of their own (the
    tiny models run one thread; the seeds decide every draw, so the split changes no sample).
    ``variant`` names a change _variant makes in the workers for that call. far_engine comes
    first so that its calibration is stored for the workers to reuse."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(WORKERS, context, _start_worker, (far_pair,)) as pool:

        def sample(engine_name, k, params, variant=None):
            groups = range(0, N, NEIGHBOURS)
            shares = [groups[i::WORKERS] for i in range(WORKERS)]
            jobs = [
                pool.submit(_worker_counts, engine_name, k, params, share, variant)
                for share in shares
            ]
            counts, drafted = zip(*(job.result() for job in jobs))
            return sum(counts), sum(drafted)

        yield sample


_WORKER: dict = {}


def _start_worker(pair) -> None:
    torch.set_num_threads(1)
    _WORKER["pair"] = pair


def _worker_counts(engine_name, k, params, group_starts, variant):
    """In a worker: _counts of the NEIGHBOURS seeds from each of ``group_starts``."""
    if engine_name not in _WORKER:
        draft, target = _WORKER["pair"]
        draft = target if engine_name in SELF_DRAFTED else draft
        _WORKER[engine_name] = SpeculativeEngine.from_pretrained(
            draft, target, **ENGINES[engine_name]
        )
    seeds = [s for start in group_starts for s in range(start, min(start + NEIGHBOURS, N))]
    prompt = PROMPTS.get(engine_name, PROMPT)
    new_tokens = NEW_TOKENS.get(engine_name, 4)
    with _variant(variant):
        completions = _completions(_WORKER[engine_name], k, params, seeds, prompt, new_tokens)
    return _counts(completions, POSITIONS.get(engine_name, (2, 3)))


def _variant(name):
    """The change a test makes for one run: a defect the tests must catch, or a forced plan;
    several joined by "+"."""
    if name is not None and "+" in name:
        stack = contextlib.ExitStack()
        for part in name.split("+"):
            stack.enter_context(_variant(part))
        return stack
    if name == "wrong_residual":  # resampling from p after a rejection
        return mock.patch.object(rejection, "residual_distribution", lambda p, q: p)
    if name == "untruncated_q":
        return mock.patch.object(proposer, "truncate_top_n", _untruncated_q)
    if name == "accept_all":  # every proposed token kept without its acceptance test
        return mock.patch.object(verifier, "verify_sampled", _accept_all)
    if name == "confidence_stop":  # up to 2 tokens, stopping after the first when q(x1) < 0.05
        return mock.patch.object(KController, "choose", confidence_stop_choose(k=2, floor=0.05))
    if name == "mixed":  # one draft token, then lookup's next token in the same round
        return _variant("one_draft_token+one_lookup_token")
    if name == "one_draft_token":
        return mock.patch.object(KController, "choose", confidence_stop_choose(k=1, floor=0.0))
    if name == "one_lookup_token":
        return mock.patch.object(ProposerChoice, "tail", unpriced_tail(1))
    if name == "zero_point_mass":  # a point-mass row written with q(x) = 0
        return mock.patch.object(round_loop, "with_point_masses", _zero_point_masses)
    assert name is None, name
    return contextlib.nullcontext()


def _completions(engine, k, params, seeds, prompt=PROMPT, new_tokens=4):
    """The completions of ``prompt`` for ``seeds``, NEIGHBOURS requests at a time sharing
    batches; max_new_tokens ``new_tokens`` (4: the first round may draft 2, as k is capped by
    the tokens left)."""

    async def together(group):
        requests = [
            SamplingParams(max_new_tokens=new_tokens, seed=seed, **params) for seed in group
        ]
        return await asyncio.gather(*(engine.agenerate(prompt, r, k) for r in requests))

    seeds = list(seeds)
    groups = [seeds[i : i + NEIGHBOURS] for i in range(0, len(seeds), NEIGHBOURS)]
    return [out for group in groups for out in asyncio.run(together(group))]


def _counts(completions, positions=(2, 3)):
    """([2, VOCAB + 1] counts of the tokens at the two completion ``positions`` (1-based),
    [3]: how often each of the first two draft positions was proposed, and the overlapped
    rounds (pipelined drafting) of all completions)."""
    counts = np.zeros((len(positions), VOCAB + 1))
    rounds = np.zeros(3)
    for out in completions:
        tokens = out.token_ids
        for row, position in enumerate(positions):
            counts[row, tokens[position - 1] if len(tokens) >= position else END] += 1
        rounds[:2] += out.stats.drafted_per_position[:2]
        rounds[2] += out.stats.overlapped_rounds
    return counts, rounds


@torch.inference_mode()
def _exact(engine, params, prompt=PROMPT, positions=(2, 3)):
    """[len(positions), VOCAB + 1] exact target-only marginals of the completion ``positions``
    (1-based) after ``prompt``, by enumerating every prefix (END: the completion ended with EOS
    before that position)."""
    prompt = engine.tokenizer.encode(prompt)
    eos = engine.tokenizer.eos_token_id
    alive = torch.ones(1, dtype=torch.float64)  # P(prefix and no EOS in it), prefixes in order
    ended = 0.0
    marginals = {}
    for position in range(1, max(positions) + 1):
        prefixes = itertools.product(range(VOCAB), repeat=position - 1)
        joint = alive[:, None] * _next_probs(engine, prompt, list(prefixes), params)
        marginals[position] = torch.cat([joint.sum(0), torch.tensor([ended])])
        ended += float(joint[:, eos].sum())
        joint[:, eos] = 0.0
        alive = joint.flatten()
    return torch.stack([marginals[p] for p in positions]).numpy()


def _next_probs(engine, prompt, prefixes, params, chunk=4096):
    """[len(prefixes), VOCAB] the target's processed next-token distribution after each."""
    rows = []
    for start in range(0, len(prefixes), chunk):
        ids = torch.tensor([prompt + list(p) for p in prefixes[start : start + chunk]])
        logits = engine.target.model(ids).logits[:, -1, :VOCAB]
        top_k, top_p = params.get("top_k", 0), params.get("top_p", 1.0)
        rows.append(processed_probs(logits, params["temperature"], top_k, top_p).double())
    return torch.cat(rows)


def _fit_pvalue(observed, probs):
    """Chi-square goodness of fit; categories expected fewer than 5 times are pooled."""
    expected = probs / probs.sum() * observed.sum()
    rare = expected < 5
    observed = np.append(observed[~rare], observed[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    keep = expected > 0
    return stats.chisquare(observed[keep], expected[keep]).pvalue


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_name, params, ks",
    [
        ("far_engine", {"temperature": 1.0}, (1, 2)),
        ("far_engine", {"temperature": 1.0, "top_k": 5}, (2,)),
        ("far_engine", {"temperature": 0.8, "top_p": 0.7}, (1,)),
        ("truncating_engine", {"temperature": 1.0}, (1, 2)),
    ],
    ids=["whole-q-temperature", "whole-q-top_k", "whole-q-top_p", "truncated-q-temperature"],
)
def test_speculative_sampling_matches_target_only_sampling(
    far_engine, sampled, engine_name, params, ks
):
    """With q the draft's whole distribution, and with q truncated to the draft's top 4 tokens
    of a 32-token vocabulary (draft_top_n below the vocabulary). Both engines hold the same
    target, so far_engine gives the exact marginals of either. The truncated q runs at
    temperature 1 only: truncation happens after the draft's top-k/top-p processing, so that
    processing reaches the verifier as it does for the whole q (checked above), and each
    further case costs 2,000 requests (about 14 s on a 2-core EPYC)."""
    exact = _exact(far_engine, params)
    for k in ks:
        counts, _ = sampled(engine_name, k, params)
        for position in range(2):
            pvalue = _fit_pvalue(counts[position], exact[position])
            assert pvalue > 1e-3, (k, position, pvalue)


@pytest.mark.slow
def test_static_runner_sampling_matches_target_only_sampling(far_engine, sampled):
    """The static runner's verify hands a sampled session's scored rows to the rejection
    sampler and drafts it step by step: its output follows the target's distribution too."""
    params = {"temperature": 1.0}
    exact = _exact(far_engine, params)
    counts, _ = sampled("static_engine", 2, params)
    for position in range(2):
        pvalue = _fit_pvalue(counts[position], exact[position])
        assert pvalue > 1e-3, (position, pvalue)


@pytest.mark.slow
def test_sampling_with_the_draft_confidence_stop_matches_target_only(far_engine, sampled):
    """Rounds draft up to 2 tokens and stop after the first when q(x1) < 0.05: the draft's
    block length then depends on its own draws, which must leave the output exact."""
    params = {"temperature": 1.0}
    exact = _exact(far_engine, params)
    counts, drafted = sampled("far_engine", "auto", params, variant="confidence_stop")
    assert 0.2 < drafted[1] / drafted[0] < 0.8  # both block lengths were common
    for position in range(2):
        pvalue = _fit_pvalue(counts[position], exact[position])
        assert pvalue > 1e-3, (position, pvalue)


@pytest.mark.slow
def test_the_test_catches_a_wrong_residual(far_engine, sampled):
    """The same test, run against resampling from p after a rejection, must fail."""
    params = {"temperature": 1.0}
    exact = _exact(far_engine, params)
    broken, _ = sampled("far_engine", 1, params, variant="wrong_residual")
    assert _fit_pvalue(broken[0], exact[0]) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 8}])
def test_ngram_proposals_sample_the_target_distribution(far_engine, sampled, params):
    """A point-mass q (n-gram lookup's proposals, two per round) keeps the output exact; the
    first round proposed two tokens for nearly every seed (the prompt holds every token)."""
    exact = _exact(far_engine, params, NGRAM_PROMPT)
    counts, proposed = sampled("ngram_engine", 2, params)
    assert proposed[1] > 0.9 * N
    for position in range(2):
        pvalue = _fit_pvalue(counts[position], exact[position])
        assert pvalue > 1e-3, (position, pvalue)


def _accept_all(draft_ids, q, p, generator):
    """The broken acceptance: every proposed token kept, the bonus token drawn from p."""
    k = draft_ids.shape[0]
    return k, int(torch.multinomial(p[k], 1, generator=generator))


@pytest.mark.slow
def test_the_ngram_test_catches_proposals_kept_unchecked(far_engine, sampled):
    """The same test, run against keeping n-gram tokens without their acceptance test (as if a
    deterministic proposal needed none), must fail: it has power. (Resampling from p after a
    rejection barely differs here: p(x) is small for the far target, so p without x is close
    to p.)"""
    params = {"temperature": 1.0}
    exact = _exact(far_engine, params, NGRAM_PROMPT)
    broken, _ = sampled("ngram_engine", 2, params, variant="accept_all")
    assert min(_fit_pvalue(broken[row], exact[row]) for row in range(2)) < 1e-6


@pytest.mark.slow
def test_mixed_rounds_sample_the_target_distribution(far_engine, sampled):
    """A mixed round, one draft token then lookup's next token verified in the same forward
    (the draft's q row, then a point mass), keeps the output exact; and the test has power
    against a point mass written as q(x) = 0, which keeps the tail's token unchecked."""
    params = {"temperature": 1.0}
    exact = _exact(far_engine, params, NGRAM_PROMPT)
    counts, proposed = sampled("mixed_engine", "auto", params, variant="mixed")
    assert proposed[1] > 0.9 * N  # the first round had its tail for nearly every seed
    for position in range(2):
        pvalue = _fit_pvalue(counts[position], exact[position])
        assert pvalue > 1e-3, (position, pvalue)
    broken, _ = sampled("mixed_engine", "auto", params, variant="mixed+zero_point_mass")
    assert _fit_pvalue(broken[1], exact[1]) < 1e-6


@pytest.mark.slow
def test_pipelined_sampling_matches_target_only_sampling(far_engine, sampled):
    """Pipelined drafting (k = 1): the second round's token (position 4) comes from a draft
    drafted during the first round's verify, for the seeds whose first round was accepted
    whole with the draft's guess as its bonus token (a fifth of them here); the output stays
    exact at positions 3 and 4.

    Power: the acceptance test is the same as in the tests above, which show theirs. Against
    a bug of the pipelined path itself, such as its tokens taken one too early (the guess
    proposed again with its own q row), this marginal has little at N: it moved the repeat
    rate of positions 3-4 from 7.3% to 10% (600 seeds), which the chi-square does not see.
    test_pipelined.py catches that bug by the greedy acceptance it costs."""
    params = {"temperature": 0.5}
    exact = _exact(far_engine, params, positions=POSITIONS["pipelined_engine"])
    counts, rounds = sampled("pipelined_engine", 1, params)
    assert rounds[2] > N / 10  # overlapped rounds: a tenth of the seeds or more
    for row in range(2):
        pvalue = _fit_pvalue(counts[row], exact[row])
        assert pvalue > 1e-3, (row, pvalue)


def _zero_point_masses(q, token_ids):
    """The broken mixed round's q: each point-mass row puts probability 0 on its token."""
    rows = _real_point_masses(q, token_ids)
    for row in range(len(token_ids)):
        rows.probs[(len(rows.probs) // rows.width - 1 - row) * rows.width] = 0.0
    return rows


_real_point_masses = round_loop.with_point_masses


def _untruncated_q(probs, top_n):
    """The broken draft: draws from its top-N tokens (multinomial normalises the weights) but
    reports their untruncated probabilities, as if q were the whole distribution."""
    width = probs.shape[-1] if top_n <= 0 else min(top_n, probs.shape[-1])
    values, ids = torch.topk(probs, width, dim=-1)
    return ids, values


@pytest.mark.slow
def test_the_truncated_test_catches_an_untruncated_q(far_engine, sampled):
    """The same test, with the verifier seeing the untruncated q of the tokens the draft drew
    from its truncated one, must fail: the truncated tests have power."""
    assert TOP_N < VOCAB
    params = {"temperature": 1.0}
    exact = _exact(far_engine, params)
    broken, _ = sampled("truncating_engine", 2, params, variant="untruncated_q")
    assert min(_fit_pvalue(broken[row], exact[row]) for row in range(2)) < 1e-6


def test_neighbours_change_no_sampled_token(far_engine, sessions_per_forward):
    """A sampled request served with 7 neighbours (their verify rows in the same forwards)
    draws the tokens it draws alone, seed for seed, at a fixed k; and the neighbours did share
    forwards. (With k auto a round's k depends on the load the controller sees, so a seed's
    draws do too: there the distribution tests above are the claim; greedy output is the same
    either way.)"""
    from specdec.worker import verifier

    shared = sessions_per_forward(verifier)
    cases = [(1, {"temperature": 1.0}), (2, {"temperature": 1.0}), ("auto", {"temperature": 0})]
    for k, params in cases:
        together = _completions(far_engine, k, params, range(2 * NEIGHBOURS))
        alone = [
            far_engine.generate(PROMPT, SamplingParams(max_new_tokens=4, seed=seed, **params), k)
            for seed in range(2 * NEIGHBOURS)
        ]
        assert [c.token_ids for c in together] == [c.token_ids for c in alone], k
        assert [c.logprobs for c in together] == [c.logprobs for c in alone], k
    assert max(shared) > 1
