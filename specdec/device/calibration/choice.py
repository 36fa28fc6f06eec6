"""Choosing among measured candidates: the yardstick (predicted request seconds, a target's exact
widths priced at the batches it runs), the rival a new candidate must beat, and the margins
that keep a noise-sized gain or a slower time to first token from deciding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.decoding.acceptance import expected_tokens
from specdec.device.calibration.results import DtypeMeasurement, ExactWidths

TYPICAL_PROMPT_TOKENS = 128  # the request predicted_request_seconds prices
TYPICAL_NEW_TOKENS = 128
# The acceptances a target candidate (its dtype, GEMM and exact widths) is priced at: it must
# serve plain decoding (acceptance 0, when speculation does not pay) as well as long drafts.
PRICED_ACCEPTANCES = (0.0, 0.5, 0.7, 0.9)
# A candidate whose prediction from a few widths (1, powers of two, the widest; the rest
# interpolated) is this much slower than the best so far is not measured further: it cannot win,
# and on an emulating CPU each forward costs seconds.
SLOWER_CUTOFF = 1.15  # above CHOICE_MARGIN: a cut candidate could not have replaced the best
# A later candidate replaces the first usable one (float32 on a CPU, bfloat16 on a GPU) only
# when predicted this much faster: on a busy host, timings of near-equal candidates swapped
# (the bundled target chose float32+wm in one run and float32 in the next).
CHOICE_MARGIN = 0.1
# A target candidate whose prefill costs more than this over the fastest candidate's prefill is
# not chosen while another usable one is within it: the prefill is the time to first token, and
# a user without us prefills in the fastest dtype (the service's target: TTFT within 10% of
# plain `generate`'s). Measured case, the 2-core AVX-512 BF16 EPYC: the bundled target's
# float32+dnnl was predicted 10.5 s per typical request against bfloat16's 12.1 s, but
# prefilled at 11.3 ms a token against 8.1, and served a TTFT of 1.45-1.59x `generate`'s.
PREFILL_MARGIN = 0.1


def choose(
    options: list[tuple[DtypeMeasurement, torch.nn.Module]],
    prefill_floor: float | None = None,
) -> tuple[DtypeMeasurement, torch.nn.Module]:
    """The fastest of the usable candidates ``options``, unless it beats the first one by less
    than CHOICE_MARGIN; with a ``prefill_floor`` (seconds per prompt token: the fastest
    candidate's prefill, usable or not), only among those whose prefill is within
    PREFILL_MARGIN of it, if any is."""
    options = [r for r in options if prefills_fast(r[0], prefill_floor)] or options
    fastest = min(options, key=lambda r: r[0].predicted_s)
    first = options[0]
    if fastest[0].predicted_s * (1 + CHOICE_MARGIN) > first[0].predicted_s:
        return first
    return fastest


def usable(measured: DtypeMeasurement, needs_exact: bool) -> bool:
    """Whether ``measured`` may be chosen: it has exact widths, or none are needed."""
    return measured.exact is not None or not needs_exact


def prefills_fast(measured: DtypeMeasurement, prefill_floor: float | None) -> bool:
    """Whether ``measured`` prefills within PREFILL_MARGIN of ``prefill_floor`` (None: no bound)."""
    return prefill_floor is None or (
        measured.prefill_s_per_token <= (1 + PREFILL_MARGIN) * prefill_floor
    )


def rival(
    done: Sequence[DtypeMeasurement], prefill_s_per_token: float, needs_exact: bool, ttft: bool
) -> DtypeMeasurement | None:
    """The candidate measured so far (``done``) that a new one, prefilling at
    ``prefill_s_per_token``, has to beat: the usable one predicted fastest, and for a target
    (``ttft``) only among those whose prefill stays within PREFILL_MARGIN of the fastest
    prefill, the new one's included. None when there is none: the new candidate is then
    measured in full (never cut short), since it may be the only one fast enough to prefill."""
    candidates = [r for r in done if usable(r, needs_exact)]
    if ttft:
        floor = min([prefill_s_per_token, *(r.prefill_s_per_token for r in done)])
        candidates = [r for r in candidates if prefills_fast(r, floor)]
    return min(candidates, key=lambda r: r.predicted_s, default=None)


def hopeless(
    guess: DtypeMeasurement, best: DtypeMeasurement | None, k_max: int, target: bool
) -> bool:
    """Whether a candidate, from a first estimate of its costs (``guess``), cannot be chosen
    over ``best`` (its rival): predicted more than SLOWER_CUTOFF slower, or, for a target,
    prefilling more than PREFILL_MARGIN slower."""
    return best is not None and (
        predicted_request_seconds(guess, k_max, target) > SLOWER_CUTOFF * best.predicted_s
        or (target and not prefills_fast(guess, best.prefill_s_per_token))
    )


def predicted_request_seconds(
    measured: DtypeMeasurement, max_speculative_tokens: int, target: bool
) -> float:
    """Seconds a typical request would take in this candidate: a TYPICAL_PROMPT_TOKENS prefill
    and TYPICAL_NEW_TOKENS tokens, decoded (target) at seconds_per_token (the best fixed k,
    each round's verify covered by exact widths, averaged over PRICED_ACCEPTANCES), draft time
    excluded (it is the same whatever the target's candidate); a draft decodes one row per
    token.

    This is the candidate choice's yardstick, not a forecast: the controller prices the real
    rounds. Measured case: the bundled target's weight-major float32 (specdec.device.gemm)
    costs 0.41 s at every width 2-17 on a 2-core AVX-512 Xeon, F.linear's 0.25 s at 2 rows and
    0.89 s at 13; at acceptance 0.7 alone the two tie, but weight-major would make plain
    decoding 1.6x slower.
    """
    prefill = measured.prefill_s_per_token * TYPICAL_PROMPT_TOKENS
    if not target:
        return prefill + measured.forward_s[0] * TYPICAL_NEW_TOKENS
    exact = measured.exact or ExactWidths(
        tuple(range(1, len(measured.forward_s) + 1)), measured.forward_s
    )
    return prefill + seconds_per_token(exact, max_speculative_tokens) * TYPICAL_NEW_TOKENS


def seconds_per_token(exact: ExactWidths, k_max: int, max_batch_size: int = 1) -> float:
    """Mean over PRICED_ACCEPTANCES and the loads of batch_loads(max_batch_size) of the seconds
    per token at the best fixed k, s sessions of k + 1 rows sharing the forwards: an exact-width
    set must serve plain decoding (acceptance 0: one row per token, padded) as well as long
    drafts, and a lone request as well as a full batch.

    Measured cases: the bundled target in float32 costs 0.26 s at 1-2 rows and 0.61 s at 16,
    and an exact-width set of widths 16-17 alone, cheapest for 13-row verifies, made every
    plain step cost 2.4x. In bfloat16 on the AMX Xeon (one exact width: 193 ms at 1 row, 192
    at 7, 204 at 12, 227 at 17), priced alone the width was 7; then 4 sessions at k = 3 took
    three forwards, and 4 streams ran auto at 1.01x k = 0 (7.8 against 7.7 tokens/s). Priced
    at loads 1-8 it is 12 or 13, as the start-up's timings fall; set to 12, 4 streams ran auto
    at 1.39x k = 0 (10.4 against 7.5), one stream 3.2 tokens/s at k = 0 against 3.4 and 8.4
    with auto against 7.9 (specdec sweep; README.md at f1f89f8, "Under load")."""
    loads = batch_loads(max_batch_size)
    total = 0.0
    for sessions in loads:
        for acceptance in PRICED_ACCEPTANCES:
            total += min(
                exact.rows_seconds(sessions * (k + 1)) / (sessions * expected_tokens(acceptance, k))
                for k in range(k_max + 1)
            )
    return total / (len(loads) * len(PRICED_ACCEPTANCES))


def batch_loads(max_batch_size: int) -> list[int]:
    """The sessions per batch a width is priced at: 1, the powers of two below
    ``max_batch_size``, and max_batch_size itself."""
    loads = {1, max(max_batch_size, 1)}
    loads.update(2**i for i in range(max_batch_size.bit_length()) if 2**i < max_batch_size)
    return sorted(loads)
