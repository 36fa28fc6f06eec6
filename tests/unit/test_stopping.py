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
