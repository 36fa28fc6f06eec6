"""The soak's exactness reference: the undisturbed output of every (prompt, new tokens) of its
request mix, the target alone in process, and where a served output leaves it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specdec.bench.soak_load import NEW_TOKENS


def compute_references(
    draft: Path, target: Path, dtype: str, prompts: Sequence[str]
) -> dict[tuple[int, int], list[int]]:
    """{(prompt index, max_new_tokens): token ids} of the target alone (k = 0, greedy), in
    process, in ``dtype``: the undisturbed output every greedy request must equal."""
    from specdec import SamplingParams, SpeculativeEngine

    engine = SpeculativeEngine.from_pretrained(draft, target, dtype=dtype)
    return {
        (i, n): list(engine.generate(prompt, SamplingParams(max_new_tokens=n), 0).token_ids)
        for i, prompt in enumerate(prompts)
        for n in NEW_TOKENS
    }


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first token where ``got`` and ``want`` differ (length counts); None if
    equal."""
    if list(got) == list(want):
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
