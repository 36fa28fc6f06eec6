"""Sampled output through the service follows the target's distribution, at every position.

Each request's sampled tokens are checked against the target's next-token distributions computed
apart from the service: transformers' own forward of the tiny target (float32) over the prompt
and the completion the service returned, then temperature, top-k and top-p in numpy as the API
defines them (top-k keeps the k highest scores, ties included; top-p keeps a token while the
mass of the tokens more likely than it is below top_p).

The test is the randomized probability integral transform: for a token x drawn from a discrete
distribution p, with the ids ordered by p (most likely first; the order depends only on what
came before), u = P(X before x) + V p(x), V uniform on [0, 1), is uniform on [0, 1), and
conditionally on everything drawn before it. So every sampled token of every request, first
round or later, among the draft's accepted tokens and the target's corrections, gives one
uniform u when the service is exact; the u's are tested per setting and together, by two tests
Bonferroni-combined (uniformity_p): Kolmogorov-Smirnov for any departure, and the mean of u for
a shift. Ordering by p makes a sampler that is too flat or too sharp push u up or down, which
the mean sees with far fewer samples than KS does. The same samples tested against
distributions a few percent away in total variation (temperature 15% high: 3-5% TV) must fail:
the test's power at this sample size (about 4,300 tokens; KS alone gave p 4-6e-4 there, too
near alpha to assert without flaking).

HTTP and gRPC share one sampler: the same seed gives the same tokens (text and log-probs) on
both APIs, and different seeds differ.
"""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest
import torch
from scipy import stats
from test_openai_api import _post, http_base_url

from specdec.client import build_request
from specdec.decoding.request import encode_prompt
from specdec.models.tiny import PROMPTS

pytestmark = pytest.mark.integration

REQUESTS = 64  # per setting
TOKENS = 24  # per request
ALPHA = 1e-3
# The subtle bug the test must catch: temperatures this much too high (3-5% total variation).
HOTTER = 1.15
# (temperature, top_k, top_p, num_speculative_tokens, proposer): a fixed k drafts every round;
# `auto` picks k round by round. (Lookup's point-mass proposals find no match in the tiny
# model's random text; tests/unit/test_sampling_exactness.py covers them.)
SETTINGS = {
    "t1-draft-k3": (1.0, 0, 1.0, 3, "draft"),
    "t0.7-topk20-auto": (0.7, 20, 1.0, None, "auto"),
    "t1.2-topp0.9-draft-k2": (1.2, 0, 0.9, 2, "draft"),
}


def processed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """[positions, V] sampling distributions from raw logits, in float64."""
    scores = logits.astype(np.float64) / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = np.sort(scores, axis=-1)[:, -top_k][:, None]
        scores = np.where(scores >= kth, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        for row in probs:
            order = np.argsort(-row, kind="stable")
            before = np.cumsum(row[order]) - row[order]
            row[order[before >= top_p]] = 0.0
            row /= row.sum()
    return probs


@pytest.fixture(scope="module")
def client(served):
    return served[0]


@pytest.fixture(scope="module")
def target(tiny_pair):
    """(transformers model of the tiny target in float32, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_pair[1])


def uniformity_p(u: np.ndarray) -> float:
    """The p-value of u ~ uniform on [0, 1): the smaller of a Kolmogorov-Smirnov test's and a
    z-test of the mean's (a sum of n uniforms is normal to within far less than alpha here),
    doubled (Bonferroni: the size stays at most alpha)."""
    ks = stats.kstest(u, "uniform").pvalue
    z = (u.mean() - 0.5) / np.sqrt(1 / (12 * len(u)))
    return min(1.0, 2 * min(ks, 2 * stats.norm.sf(abs(z))))


def _next_token_logits(target, prompt: str, completion: list[int]) -> np.ndarray:
    """[len(completion), V] the target's logits before each completion token."""
    model, tokenizer = target
    ids = encode_prompt(tokenizer, prompt) + completion
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    start = len(ids) - len(completion) - 1
    return logits[start : start + len(completion), : len(tokenizer)]


def _pit(logits: np.ndarray, tokens: list[int], setting, rng) -> tuple[np.ndarray, int]:
    """(u per token, tokens the reference gives probability 0)."""
    temperature, top_k, top_p = setting[:3]
    probs = processed(logits, temperature, top_k, top_p)
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranked = np.take_along_axis(probs, order, axis=-1)
    before_ranked = np.cumsum(ranked, axis=-1) - ranked
    before = np.empty_like(probs)
    np.put_along_axis(before, order, before_ranked, axis=-1)
    rows = np.arange(len(tokens))
    p = probs[rows, tokens]
    return before[rows, tokens] + rng.random(len(tokens)) * p, int((p == 0).sum())


def _sample(client, setting, seed: int, prompt: str | None = None):
    temperature, top_k, top_p, k, proposer = setting
    prompt = prompt or PROMPTS[seed % len(PROMPTS)]
    request = build_request(
        prompt,
        max_new_tokens=TOKENS,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        num_speculative_tokens=k,
        proposer=proposer,
        logprobs=True,
    )
    return prompt, client.generate(request, timeout_s=120)


def test_sampled_tokens_follow_the_targets_distribution_at_every_position(client, target):
    rng = np.random.default_rng(0)
    pooled, pooled_bad = [], []
    for i, (name, setting) in enumerate(SETTINGS.items()):
        # Seeds of their own per setting: shared seeds share the service's draws, and
        # correlated settings would pool into a test weaker than its size and not of its alpha.
        seeds = range(10_000 * (i + 1), 10_000 * (i + 1) + REQUESTS)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            samples = list(pool.map(lambda s, setting=setting: _sample(client, setting, s), seeds))
        us, bad, distances, impossible, drafted = [], [], [], 0, 0
        hotter = (setting[0] * HOTTER, *setting[1:])  # a subtle bug: the temperature too high
        for prompt, response in samples:
            tokens = list(response.token_ids)
            logits = _next_token_logits(target, prompt, tokens)
            u, zero = _pit(logits, tokens, setting, rng)
            us.append(u)
            impossible += zero
            bad.append(_pit(logits, tokens, hotter, rng)[0])
            p, q = (processed(logits, *s[:3]) for s in (setting, hotter))
            distances.append(0.5 * np.abs(p - q).sum(axis=-1))
            drafted += response.stats.draft_tokens  # every proposer's
        u, tv = np.concatenate(us), float(np.concatenate(distances).mean())
        p_value = uniformity_p(u)
        print(f"{name}: {len(u)} tokens, p {p_value:.3g}; {HOTTER:g}x hotter: TV {tv:.3f}")
        assert drafted > 0, f"{name}: no round verified a proposal, nothing speculative tested"
        assert impossible == 0, f"{name}: {impossible} tokens outside the top-k/top-p support"
        assert p_value > ALPHA, f"{name}: tokens do not follow the target (p {p_value:.3g})"
        pooled.append(u)
        pooled_bad.append(np.concatenate(bad))
    p_all = uniformity_p(np.concatenate(pooled))
    p_bad = uniformity_p(np.concatenate(pooled_bad))
    print(f"all: {sum(map(len, pooled))} tokens, p {p_all:.3g}; {HOTTER:g}x hotter p {p_bad:.3g}")
    assert p_all > ALPHA, f"sampled tokens do not follow the target (p {p_all:.3g})"
    assert p_bad < ALPHA, f"no power: a temperature {HOTTER:g}x too high passed (p {p_bad:.3g})"


def _http_completion(prompt: str, seed: int, temperature: float, k: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": temperature,
        "seed": seed,
        "num_speculative_tokens": k,
        "logprobs": 0,
    }
    status, answer = _post(f"{http_base_url()}/completions", json.dumps(body).encode())
    assert status == 200, answer
    return json.loads(answer)["choices"][0]


def test_the_same_seed_samples_the_same_tokens_over_http_and_grpc(client):
    """Seeded sampling is one sampler behind both APIs: at a fixed k (the draws depend on which
    positions were drafted, docs/api.md), equal text and log-probabilities for a seed; and it
    samples: different seeds give different completions."""
    for prompt in PROMPTS[:2]:
        texts = set()
        for seed in range(4):
            _, response = _sample(client, (1.0, 0, 1.0, 3, "draft"), seed, prompt)
            http = _http_completion(prompt, seed, 1.0, 3)
            assert http["text"] == response.text, (prompt, seed)
            logprobs = http["logprobs"]["token_logprobs"]
            assert np.allclose(logprobs, list(response.logprobs)), (prompt, seed)
            texts.add(response.text)
        assert len(texts) > 1, f"four seeds gave one completion of {prompt!r}: {texts}"
