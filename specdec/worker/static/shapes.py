"""Which of the static runner's shapes compute a row identically: measured on the device at
start-up, as the dynamic runner's calibration measures its exact widths.

The target's greedy output is exact only if a position's logits do not depend on what shares
its forward. The static runner fixes the width, so two things remain that can vary: the batch
bucket (a GEMM over B x W rows may take another kernel, or split its rows otherwise, for another
B) and the key length (an attention kernel may split a longer key range, or reduce it in
another order). invariant_shapes keeps the batch buckets and key lengths that give every row
bitwise the result of the widest bucket and the longest key length, which are always kept:
with nothing else left, every forward runs at those, which costs padding and never exactness.

Two checks, both needed. The linear layers are compared at the row counts B x W
(specdec.device.exact_widths.measure_exact_width_sets, with its power against rare rounding
splits in half precision), and whole verify forwards (attention, norms, the greedy outcome's
reductions) are compared with a probe session at the first and the last row of each bucket.
"""

from __future__ import annotations

import torch

from specdec.device.exact_widths import measure_exact_width_sets
from specdec.worker.kv_cache import SessionEntry
from specdec.worker.static.runner import VERIFY, StaticRunner
from specdec.worker.static.slots import SlotCache


@torch.inference_mode()
def invariant_shapes(
    runner: StaticRunner, generator: torch.Generator, trials: int = 2
) -> tuple[list[int], list[int]]:
    """(batch buckets, key lengths) of ``runner`` whose verify forwards give a row bitwise what
    the widest bucket at the longest key length gives it.

    Uses the pool's first slots as scratch: call it before any session is stored.
    """
    buckets, key_lens = runner.batch_buckets, runner.key_lens
    sets = measure_exact_width_sets(
        runner.loaded.model, 0, generator=generator, widths=[b * runner.width for b in buckets]
    )
    widest = buckets[-1] * runner.width
    gemm_set = next((s for s in sets if widest in s), [widest])
    kept = [b for b in buckets if b * runner.width in gemm_set]
    entries = [SessionEntry(cache=SlotCache(slot)) for slot in range(buckets[-1])]
    vocab = runner.loaded.vocab_size
    # As long as the shortest key length holds: a kernel that splits the key range shows only
    # in rows whose keys span the split, so the probe's rows attend over all they can.
    prefix_len = max(min(key_lens[0] - runner.width, runner.layout.context_limit), 1)
    for _ in range(trials):
        for entry in entries:
            entry.cached_ids.clear()
            prefix = torch.randint(vocab, (prefix_len,), generator=generator).tolist()
            runner.prefill(entry, prefix, 1)
        blocks = torch.randint(vocab, (len(entries), runner.width), generator=generator).tolist()
        reference = _probe(runner, entries, blocks, buckets[-1], key_lens[-1], prefix_len)
        kept = [
            b
            for b in kept
            if _agrees(_probe(runner, entries, blocks, b, key_lens[-1], prefix_len), reference)
        ]
        key_lens = [
            n
            for n in key_lens
            if _probe(runner, entries, blocks, buckets[-1], n, prefix_len) == reference
        ]
    return kept, key_lens


def _agrees(probe: list, reference: list) -> bool:
    return probe == reference[: len(probe)]


def _probe(
    runner: StaticRunner,
    entries: list[SessionEntry],
    blocks: list[list[int]],
    batch: int,
    key_len: int,
    prefix_len: int,
) -> list[tuple[bytes, ...]]:
    """The outputs (logits, tokens, log-probabilities) of sessions 0 and 1 of ``entries`` in
    one verify forward of ``batch`` sessions: session 0 at the last row, session 1 at the
    first (alone in a bucket of one, only session 0)."""
    order = list(range(1, batch)) + [0]
    for entry in entries:
        del entry.cached_ids[prefix_len:]
    chosen = [(entries[i], blocks[i]) for i in order]
    outputs = runner.run(VERIFY, chosen, runner.width, [0] * batch, [[]] * batch, key_len)
    rows = [batch - 1] + ([0] if batch > 1 else [])
    picked = (outputs[3], outputs[0], outputs[1])  # logits, tokens, log-probabilities
    return [tuple(out[row].float().cpu().numpy().tobytes() for out in picked) for row in rows]
