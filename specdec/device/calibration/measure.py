"""Measuring one candidate on a model set up in it: forward seconds by width (timed in repeated
passes, cut short with the rest interpolated once a few widths show it cannot win), prefill
seconds per token, and for a target the cheapest exact-width set that passes the whole-model
check."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from specdec.device.calibration import choice
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.results import CACHE_TOKENS, DtypeMeasurement, ExactWidths
from specdec.device.exact_widths import (
    half_precision_rows,
    measure_exact_width_sets,
    whole_forward_exact,
)

log = logging.getLogger(__name__)

PREFILL_TOKENS = 32  # prompt length of the measured prefill
DRAFT_WIDTHS = 3  # a draft forward is one row (a draft step) or two or three (catch-up)
EXTRA_WIDTHS = 4  # widths measured past k_max + 1: a wider forward may cost less
# Each cost is the minimum of this many timings, in passes over all widths: with one timing,
# a busy 2-core host put the bundled target in bfloat16 (whose 32-token prefill then took 4x
# float32's) in one run and float32 in the next.
TIMING_REPEATS = 2
HALF_DTYPES = ("bfloat16", "float16")  # a target's exact-width set in these needs a longer check
HALF_SET_MAX_PASSES = 4  # at most this many max_width-row blocks per width (_exact_widths)


@torch.inference_mode()
def measure_candidate(
    model: torch.nn.Module,
    vocab_size: int,
    candidate: Candidate,
    *,
    target: bool,
    exact_widths: bool,
    max_width: int,
    rival: Callable[[float], DtypeMeasurement | None],
    max_batch_size: int = 1,
) -> DtypeMeasurement:
    """One candidate's costs (and a target's exact widths), measured on ``model`` as it is set
    up. ``rival`` maps this candidate's prefill seconds per token to the candidate it has to
    beat (choice.rival): a candidate clearly slower than it (SLOWER_CUTOFF), or for a target
    one that prefills more than PREFILL_MARGIN slower (it could not be chosen), is cut short
    (choice.hopeless) and gets no exactness measurement. Measured case: the bundled target's
    emulated bfloat16 on an AVX2-only CPU prefills at 3x float32+dnnl's time a token (57 ms
    against 19), while its 1-row forward is the cheapest (0.10 s against 0.16), so only the
    prefill rules it out early."""
    generator = torch.Generator().manual_seed(0)
    device = model.device
    prompt = torch.randint(vocab_size, (1, CACHE_TOKENS), generator=generator).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt[:, :1], cache=cache, use_cache=True, logits_to_keep=1)  # warm-up
    prefill_s, cache = math.inf, None
    for _ in range(TIMING_REPEATS):
        seconds, cache = _timed_prefill(model, prompt[:, :PREFILL_TOKENS])
        prefill_s = min(prefill_s, seconds)
    model(input_ids=prompt[:, PREFILL_TOKENS:], cache=cache, use_cache=True, logits_to_keep=1)
    prefill_per_token = prefill_s / PREFILL_TOKENS
    best = rival(prefill_per_token)

    k_max = max_width - 1 - EXTRA_WIDTHS

    def hopeless(costs: list[float]) -> bool:
        guess = DtypeMeasurement(candidate, tuple(costs), prefill_per_token, None, math.inf)
        return choice.hopeless(guess, best, k_max, target)

    costs, cut = _forward_costs(model, cache, vocab_size, max_width, generator, hopeless)
    measured = DtypeMeasurement(candidate, tuple(costs), prefill_per_token, None, math.inf)
    # Exact widths only cost more than all widths, so a candidate already slower with every
    # width allowed (or cut short as hopeless) cannot win: skip its (long) exactness measurement.
    optimistic = choice.predicted_request_seconds(measured, k_max, target)
    if exact_widths and not cut and (best is None or optimistic < best.predicted_s):
        half = candidate.dtype in HALF_DTYPES
        exact = _exact_widths(model, vocab_size, costs, max_width, generator, half, max_batch_size)
        measured = dataclasses.replace(measured, exact=exact)
    return measured


def _timed_prefill(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, DynamicCache]:
    """(seconds, the new cache) of one prefill forward of ``ids`` ([1, n])."""
    cache = DynamicCache(config=model.config)
    seconds = _timed(
        model.device,
        lambda: model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1),
    )
    return seconds, cache


def _forward_costs(
    model: torch.nn.Module,
    cache: DynamicCache,
    vocab_size: int,
    max_width: int,
    generator: torch.Generator,
    hopeless: Callable[[list[float]], bool],
) -> tuple[list[float], bool]:
    """Seconds per forward of 1 .. max_width positions over ``cache``: the minimum of
    TIMING_REPEATS passes over all widths. Width 1, the powers of two and max_width come first;
    when ``hopeless`` says so of their costs, with the other widths interpolated, that estimate
    is returned as it is. Returns (costs, whether they were cut short)."""
    device = model.device

    def cost(width: int) -> float:
        ids = torch.randint(vocab_size, (1, width), generator=generator).to(device)
        seconds = _timed(
            device, lambda: model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        )
        cache.crop(-width)
        return seconds

    coarse = sorted(
        {1, max_width, *(2**i for i in range(max_width.bit_length()))}
        & set(range(1, max_width + 1))
    )
    measured = {width: cost(width) for width in coarse}
    estimate = _interpolated(measured, max_width)
    if hopeless(estimate):
        return estimate, True
    for repeat in range(TIMING_REPEATS):  # passes, so a busy spell spares some timings
        for width in range(1, max_width + 1):
            if repeat > 0 or width not in coarse:
                measured[width] = min(measured.get(width, math.inf), cost(width))
    return [measured[w] for w in range(1, max_width + 1)], False


def _interpolated(measured: dict[int, float], max_width: int) -> list[float]:
    """Costs of widths 1 .. max_width, linear between the measured ones (which include 1 and
    max_width)."""
    known = sorted(measured)
    out = []
    for width in range(1, max_width + 1):
        low = max(w for w in known if w <= width)
        high = min(w for w in known if w >= width)
        share = 0.0 if high == low else (width - low) / (high - low)
        out.append(measured[low] + share * (measured[high] - measured[low]))
    return out


def _exact_widths(
    model: torch.nn.Module,
    vocab_size: int,
    costs: list[float],
    max_width: int,
    generator: torch.Generator,
    half: bool,
    max_batch_size: int = 1,
) -> ExactWidths | None:
    """The exact-width set with the lowest choice.seconds_per_token (at loads up to
    ``max_batch_size`` sessions) that also passes the whole-model check (a set of the linear
    layers' measurement, or one width of such a set alone, since other operators may still tell
    widths apart); None when none does.

    A half-precision (``half``) set of several widths is checked for half_precision_rows rows
    at each of its widths, and only kept when that takes at most HALF_SET_MAX_PASSES blocks of
    max_width rows per width: otherwise single widths only. Measured cases: the tiny test
    target's bfloat16 linear layers measure [1, 2], [3 .. 8], [9 .. 17] on an AVX-512 BF16
    EPYC, but its q_proj and o_proj give 3-row and 8-row calls different outputs about once in
    a thousand 8-token blocks (and the 1- and 2-row calls differ on the AMX Xeon), which it
    would take about 18,000 rows a width to see; the bundled target's [2 .. 17] passes 36."""
    sets = measure_exact_width_sets(model, max_width, generator=generator)
    rows = half_precision_rows(model) if half else 0
    checkable = rows <= HALF_SET_MAX_PASSES * max_width
    singles = [(w,) for s in sets for w in s if len(s) > 1 or not checkable]
    if not checkable:
        log.info("a %d-row check per width is too long: single exact widths only", rows)
        sets = []
    k_max = max_width - 1 - EXTRA_WIDTHS
    options = sorted(
        (ExactWidths(tuple(widths), tuple(costs)) for widths in [*sets, *singles]),
        key=lambda e: choice.seconds_per_token(e, k_max, max_batch_size),
    )
    for option in options:
        if whole_forward_exact(model, vocab_size, option.widths, generator, rows_per_width=rows):
            return option
        log.info("exact-width set %s failed the whole-model check", option.widths)
    log.warning("no exact-width set among %s: greedy output may depend on k", sets)
    return None


def _timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
