"""Stop rules inside and across committed blocks, and the streamed text."""

from __future__ import annotations

import pytest

from specdec.decoding.stopping import LENGTH, STOP, StopChecker
from specdec.models.tiny import build_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _checker(tokenizer, max_new=100, stop=(), stop_ids=None):
    return StopChecker(tokenizer, max_new, stop_ids or {tokenizer.eos_token_id}, stop)


def _spanning_stop(tokenizer, ids):
    """(stop, i): the last two characters before token i and the first two of token i, chosen
    where that string first occurs exactly across the boundary (so token i completes it)."""
    for i in range(3, len(ids)):
        head, piece = tokenizer.decode(ids[:i]), tokenizer.decode([ids[i]])
        stop = head[-2:] + piece[:2]
        if len(piece) >= 2 and tokenizer.decode(ids[: i + 1]).find(stop) == len(head) - 2:
            return stop, i
    raise AssertionError("no spanning stop string in the test text")


def test_eos_inside_a_block_stops_there(tokenizer):
    ids = tokenizer.encode(TEXT)
    checker = _checker(tokenizer)
    delta = checker.append(ids[:2] + [tokenizer.eos_token_id] + ids[2:4], [-1.0] * 5)
    assert checker.token_ids == ids[:2] + [tokenizer.eos_token_id]
    assert checker.logprobs == [-1.0] * 3
    assert checker.finish_reason == STOP == delta.finish_reason
    assert checker.text == tokenizer.decode(ids[:2])


@pytest.mark.parametrize("block", [8, 1, 3])
def test_stop_string_spanning_two_tokens_trims_text_and_tokens(tokenizer, block):
    ids = tokenizer.encode(TEXT)
    stop, last = _spanning_stop(tokenizer, ids)
    checker = _checker(tokenizer, stop=[stop, "never-seen"])
    streamed = ""
    for i in range(0, len(ids), block):
        delta = checker.append(ids[i : i + block], [0.0] * len(ids[i : i + block]))
        streamed += delta.text
        assert stop not in streamed
        if delta.finish_reason:
            break
    full = tokenizer.decode(ids[: last + 1])
    assert checker.finish_reason == STOP
    assert checker.token_ids == ids[: last + 1]  # up to the token that completed the stop string
    assert checker.text == full[: full.index(stop)] == streamed
    assert len(checker.logprobs) == len(checker.token_ids)


def test_max_new_tokens_trims_a_block(tokenizer):
    ids = tokenizer.encode(TEXT)
    checker = _checker(tokenizer, max_new=3)
    delta = checker.append(ids[:5], [0.0] * 5)
    assert checker.token_ids == ids[:3] and delta.finish_reason == LENGTH
    assert checker.text == delta.text == tokenizer.decode(ids[:3])


def test_streamed_deltas_concatenate_to_the_text(tokenizer):
    ids = tokenizer.encode(TEXT + " Once upon a time")
    checker = _checker(tokenizer, max_new=len(ids), stop=["zzz"])
    streamed = "".join(
        checker.append(ids[i : i + 3], [0.0] * 3).text for i in range(0, len(ids), 3)
    )
    assert checker.finish_reason == LENGTH
    assert streamed == checker.text == tokenizer.decode(ids)


def test_incomplete_utf8_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("é")
    assert len(ids) == 2  # two byte tokens: the first alone decodes to U+FFFD
    checker = _checker(tokenizer)
    assert checker.append(ids[:1], [0.0]).text == ""
    assert checker.append(ids[1:], [0.0]).text == "é"


def test_append_after_finish_is_an_error(tokenizer):
    checker = _checker(tokenizer, max_new=1)
    checker.append([5], [0.0])
    with pytest.raises(RuntimeError):
        checker.append([5], [0.0])


def _final_prefix_text(tokenizer, ids, n):
    """The text of ids[:n] whose characters are final: the decode of the longest prefix
    ids[:j], j <= n, that does not end inside a character (decoded as U+FFFD)."""
    for j in range(n, -1, -1):
        text = tokenizer.decode(ids[:j], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            return text
    return ""


def _token_by_token(tokenizer, ids, stop, stop_ids, max_new):
    """(token_ids, text, finish_reason) decoding one token at a time with full decodes: the
    reference the block-wise, incremental StopChecker must equal."""
    for n in range(1, min(len(ids), max_new) + 1):
        if ids[n - 1] in stop_ids:
            return ids[:n], tokenizer.decode(ids[: n - 1], skip_special_tokens=True), STOP
        text = _final_prefix_text(tokenizer, ids, n)
        hits = [i for s in stop if (i := text.find(s)) >= 0]
        if hits:
            return ids[:n], text[: min(hits)], STOP
    n = min(len(ids), max_new)
    return (
        ids[:n],
        tokenizer.decode(ids[:n], skip_special_tokens=True),
        (LENGTH if n == max_new else None),
    )


def _tokenizers():
    from specdec.errors import ModelLoadError
    from specdec.models.loading import load_tokenizer

    found = [("tiny", build_tokenizer())]
    try:
        found.append(("bundled", load_tokenizer("bundled:target")))
    except ModelLoadError:
        print("the bundled pair is not on this machine: the tiny tokenizer alone")
    return found


@pytest.mark.parametrize("seed", range(3))
def test_blockwise_incremental_text_equals_token_by_token_full_decodes(seed):
    """Random completions (mixed scripts, byte-split characters, random token ids), random
    blocks, stop strings taken from the text, stop ids and max_new_tokens: the checker keeps the
    same tokens, text and finish reason as decoding token by token with full decodes, and its
    streamed deltas concatenate to its text."""
    import random

    rng = random.Random(seed)
    texts = ["naïve café, 世界 🙂 — done.", "def f(x):\n    return x ** 2  # über", TEXT]
    for name, tokenizer in _tokenizers():
        for case in range(40):
            if case % 2:
                ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
            else:
                ids = tokenizer.encode(rng.choice(texts))
            full = tokenizer.decode(ids, skip_special_tokens=True)
            stop = []
            if full and rng.random() < 0.7:
                at = rng.randrange(len(full))
                stop.append(full[at : at + rng.randint(1, 4)].replace("\ufffd", "") or "x")
            stop_ids = {rng.choice(ids)} if rng.random() < 0.3 else {-1}
            max_new = rng.randint(1, len(ids) + 2)
            checker = StopChecker(tokenizer, max_new, stop_ids, stop)
            streamed, i = "", 0
            while checker.finish_reason is None and i < len(ids):
                size = rng.randint(1, 5)
                streamed += checker.append(ids[i : i + size], [0.0] * size).text
                i += size
            expected = _token_by_token(tokenizer, ids, stop, stop_ids, max_new)
            got = (checker.token_ids, checker.text, checker.finish_reason)
            context = (name, ids, stop, stop_ids, max_new)
            if expected[2] is None:  # the completion ran out before any stop: text so far
                assert got[0] == expected[0] and expected[1].startswith(got[1]), context
                continue
            assert got == expected, context
            assert streamed == checker.text, context
