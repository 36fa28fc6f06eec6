"""Start-up measurements on a replica's own device: forward cost by width, exact widths, dtype.

Costs differ by an order of magnitude between machines of the same size (DESIGN.md, "Speed"):
on an AMX CPU a 13-row bfloat16 forward of the target costs about one row's; on an AVX2-only
CPU, where bfloat16 is emulated, ten rows' worth, while float32 costs four. A CPU GEMM's cost
is not even monotonic in the rows (one 2-core AVX-512 machine: a float32 MLP projection took
5.3 ms for 13 rows and 3.6 ms for 16). So nothing here is assumed: a replica measures, for
each candidate dtype,

- ``forward_s[w - 1]``: the seconds of one forward over w positions extending a cache of
  CACHE_TOKENS positions, w = 1 .. max_width, and the prefill cost per prompt token;
- for the target, which widths give bitwise the same row results as each other
  (specdec.device.exact_widths.measure_width_classes), the class whose forwards cover a
  lone request's 1 .. k_max + 1 rows and batches of up to max_batch_size sessions cheapest,
  and a whole-model check of it;

and ``dtype: auto`` keeps the candidate whose predicted request time is lowest
(predicted_request_seconds), among those with an exact class for the target and, for a
target, a prefill within PREFILL_MARGIN of the fastest candidate's (the time to first token).
The verifier pads each decode forward to the cheapest exact width that fits
(ExactWidths.width_for), the controller prices rounds from ``forward_s``, and GetModelInfo
reports all of it.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import itertools
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from specdec.decoding.acceptance import expected_tokens
from specdec.device.exact_widths import (
    half_precision_rows,
    measure_width_classes,
    use_row_wise_attention,
    whole_forward_exact,
)
from specdec.device.gemm import (
    WEIGHT_MAJOR,
    bf16_weights_candidate,
    onednn_candidate,
    set_gemm,
    split_candidate,
)
from specdec.device.hardware import describe_device
from specdec.models.loading import INT8, LoadedModel, load_model, quantize_int8

if TYPE_CHECKING:
    from specdec.device.calibration_cache import CalibrationCache

log = logging.getLogger(__name__)

AUTO = "auto"
CACHE_TOKENS = 64  # cache length the cost forwards extend (attention is a small share here)
PREFILL_TOKENS = 32  # prompt length of the measured prefill
TYPICAL_PROMPT_TOKENS = 128  # the request predicted_request_seconds prices
TYPICAL_NEW_TOKENS = 128
# The acceptances a target candidate (its dtype, GEMM and width class) is priced at: it must
# serve plain decoding (acceptance 0, when speculation does not pay) as well as long drafts.
CLASS_ACCEPTANCES = (0.0, 0.5, 0.7, 0.9)
DRAFT_WIDTHS = 3  # a draft forward is one row (a draft step) or two or three (catch-up)
EXTRA_WIDTHS = 4  # widths measured past k_max + 1: a wider forward may cost less
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
# Each cost is the minimum of this many timings, in passes over all widths: with one timing,
# a busy 2-core host put the bundled target in bfloat16 (whose 32-token prefill then took 4x
# float32's) in one run and float32 in the next.
TIMING_REPEATS = 2
HALF_DTYPES = ("bfloat16", "float16")  # a target's class in these needs a longer check
HALF_CLASS_MAX_PASSES = 4  # at most this many max_width-row blocks per width (_exact_widths)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ExactWidths:
    """Widths whose forwards give every row bitwise the same result, and their costs.

    Attributes:
        widths: ascending; a decode forward of n rows is padded to width_for(n), or split into
            forwards of these widths when n exceeds the largest.
        forward_s: forward_s[w - 1] = measured seconds of a w-position forward.
    """

    widths: tuple[int, ...]
    forward_s: tuple[float, ...]

    def width_for(self, rows: int) -> int:
        """The cheapest exact width >= rows (rows <= max(widths))."""
        fits = [w for w in self.widths if w >= rows]
        if not fits:
            raise ValueError(f"{rows} rows exceed the widest exact width {self.widths[-1]}")
        return min(fits, key=lambda w: (self.cost(w), w))

    def chunks(self, rows: int) -> list[tuple[int, int]]:
        """[(real rows, padded width)] covering ``rows`` rows: full forwards of the widest width,
        then the cheapest width for the rest."""
        widest, out = self.widths[-1], []
        while rows > widest:
            out.append((widest, widest))
            rows -= widest
        out.append((rows, self.width_for(rows)))
        return out

    def cost(self, width: int) -> float:
        if width <= len(self.forward_s):
            return self.forward_s[width - 1]
        return self.forward_s[-1] * width / len(self.forward_s)

    def rows_seconds(self, rows: int) -> float:
        """Predicted seconds to run ``rows`` rows through chunks()."""
        return sum(self.cost(width) for _, width in self.chunks(rows))


@dataclasses.dataclass(frozen=True)
class DtypeMeasurement:
    """One candidate dtype, as measured.

    Attributes:
        forward_s: seconds of one forward over w positions, index w - 1 (measured, or, for a
            candidate stopped early as clearly slower, interpolated between measured widths).
        prefill_s_per_token: seconds per prompt token of a PREFILL_TOKENS-token prefill.
        exact: the target's exact widths (None: none found, or a draft).
        predicted_s: predicted_request_seconds of this candidate.
    """

    dtype: str
    forward_s: tuple[float, ...]
    prefill_s_per_token: float
    exact: ExactWidths | None
    predicted_s: float
    cache_tokens: int = CACHE_TOKENS


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a replica measured at start-up and what it chose."""

    device: str
    dtype: str
    automatic: bool
    candidates: tuple[DtypeMeasurement, ...]
    seconds: float
    reused: bool = False  # taken from a CalibrationCache (its exact widths checked again)

    @property
    def chosen(self) -> DtypeMeasurement:
        return next(c for c in self.candidates if c.dtype == self.dtype)

    def to_proto(self, message) -> None:
        """Fills a specdec.v1.DeviceCalibration message."""
        message.device, message.dtype, message.automatic = self.device, self.dtype, self.automatic
        message.seconds, message.reused = self.seconds, self.reused
        exact = self.chosen.exact
        message.exact_widths.extend(exact.widths if exact else ())
        for candidate in self.candidates:
            message.candidates.add(
                dtype=candidate.dtype,
                forward_s=candidate.forward_s,
                cache_tokens=candidate.cache_tokens,
                exact=candidate.exact is not None,
                prefill_s_per_token=candidate.prefill_s_per_token,
            )


def candidate_dtypes(role: str, device: str | torch.device) -> list[str]:
    """The dtypes ``auto`` tries, in order: float32 and bfloat16 (a CPU), bfloat16 and float16
    (a GPU); on a CPU also each with oneDNN's reordered weights ("float32+dnnl",
    "bfloat16+dnnl"; specdec.device.gemm, where onednn_available says the build and CPU have
    it) and float32 on bfloat16-stored weights ("float32+bf16w", where bf16_weights.available();
    a model with weights that are not bfloat16 values skips it), a target also float32 with
    weight-major GEMMs ("float32+wm"), a draft also int8 (its output never depends on the
    draft's numerics).

    The order matters twice: the first candidate is the default that a later one must beat by
    CHOICE_MARGIN, and a candidate measured after a much faster one is cut short
    (SLOWER_CUTOFF), so the likely winner of each dtype comes first: a target's "+dnnl" (the
    2-core AVX2 EPYC: bundled target 37 s per typical request against float32's 72 s; every
    width exact; the AVX-512 BF16 EPYC: a bfloat16 MLP 1.5x F.linear's speed, gemm module),
    then "+bf16w" (the same float32 products at half the weight bytes). A draft's come last:
    int8 quantization finds the Linear layers by type, which the other GEMMs change."""
    if torch.device(device).type != "cpu":
        return ["bfloat16", "float16"]
    float32, bfloat16 = onednn_candidate("float32"), onednn_candidate("bfloat16")
    bf16w = bf16_weights_candidate()
    if role == "draft":
        return ["float32", INT8, "bfloat16", *float32, *bfloat16, *bf16w]
    return [*float32, *bf16w, "float32", "float32" + WEIGHT_MAJOR, *bfloat16, "bfloat16"]


def load_calibrated(
    spec: str,
    role: str,
    dtype: str,
    *,
    device: str = "cpu",
    max_speculative_tokens: int,
    exact_widths: bool = True,
    max_batch_size: int = 1,
    cache: CalibrationCache | None = None,
) -> tuple[LoadedModel, Calibration]:
    """Loads a model (specdec.models.loading.load_model) and calibrates it: in ``dtype``, or,
    for ``dtype="auto"``, in the fastest of candidate_dtypes(role, device) (loaded in float32,
    each candidate a cast of it). ``exact_widths`` and ``max_batch_size`` as for calibrate.

    With a ``cache`` (specdec.device.calibration_cache), a calibration made before for the same
    architecture, settings and device is reused instead of measured (minutes on a CPU), once
    its exact widths pass the whole-model check on this model again; a new one is stored. A
    replica that waited for another's measurement on this host (``_one_at_a_time``) looks again
    before measuring, so replicas of one model starting together measure once.

    Raises:
        ModelLoadError: as load_model.
    """
    automatic = dtype == AUTO
    dtypes = candidate_dtypes(role, device) if automatic else [dtype]
    if role != "target":
        max_batch_size = 1  # only a target's widths are priced for batches

    def from_cache() -> tuple[Calibration | None, tuple[LoadedModel, Calibration] | None]:
        """(the stored entry or None, the model with it if it passes the exactness check)."""
        stored = cache.load(key) if cache else None
        return stored, stored and _reuse(loaded, role, stored, max_speculative_tokens, exact_widths)

    with _while_none_measures(device):
        loaded = load_model(
            spec, dtype="float32" if automatic else split_candidate(dtype)[0], device=device
        )
        key = cache and cache.key(
            loaded.model,
            role,
            dtypes,
            device=device,
            max_speculative_tokens=max_speculative_tokens,
            exact_widths=exact_widths,
            max_batch_size=max_batch_size,
        )
        stored, result = from_cache()
    if not result:
        with _one_at_a_time(device):
            if stored is None:
                # A replica of the same model on this host may have stored one while this one
                # waited for the lock (two replicas starting together measured twice).
                stored, result = from_cache()
            if not result:
                result = calibrate(
                    loaded,
                    role,
                    dtypes,
                    max_speculative_tokens=max_speculative_tokens,
                    automatic=automatic,
                    exact_widths=exact_widths,
                    max_batch_size=max_batch_size,
                )
                if cache:
                    cache.save(key, result[1])
    _return_freed_memory()
    return result


def _reuse(
    loaded: LoadedModel,
    role: str,
    stored: Calibration,
    max_speculative_tokens: int,
    exact_widths: bool,
) -> tuple[LoadedModel, Calibration] | None:
    """``loaded`` set up as ``stored`` chose (dtype, GEMM, row-wise attention), or None when its
    exact widths fail the whole-model check here (the caller measures again)."""
    start = time.perf_counter()
    base, gemm = split_candidate(stored.dtype)
    model = _cast(loaded.model, base) if stored.automatic else loaded.model
    target = role == "target"
    set_gemm(model, gemm, max_speculative_tokens + 1 if target else 1)
    exact = stored.chosen.exact
    if target and exact_widths:
        use_row_wise_attention(model)
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            if exact is None or not whole_forward_exact(
                model, loaded.vocab_size, exact.widths, generator
            ):
                log.warning("the stored %s calibration has no exact widths here: measuring", role)
                set_gemm(loaded.model, "")
                return None
    log.info(
        "%s runs in %s on %s (%s; reused a calibration measured in %.1f s, checked in %.1f s)",
        role,
        stored.dtype,
        stored.device,
        "chosen by measurement" if stored.automatic else "configured",
        stored.seconds,
        time.perf_counter() - start,
    )
    return dataclasses.replace(loaded, model=model), dataclasses.replace(stored, reused=True)


def _return_freed_memory() -> None:
    """Hands the heap the losing candidates freed back to the OS (glibc's malloc_trim; a no-op
    elsewhere). glibc keeps freed chunks under its mmap threshold, which grows to 32 MiB as
    big tensors come and go, so a replica kept its calibration peak: measured on the bundled
    pair, the draft replica held 5.1 GB after choosing int8 and 1.6 GB after the trim, the
    target 8.5 GB and 7.5 GB; without it the bench's in-process baseline no longer fit beside
    the local cluster on a 24 GiB machine."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    gc.collect()
    trim(0)


@contextlib.contextmanager
def _one_at_a_time(device: str | torch.device) -> Iterator[None]:
    """Holds the host-wide lock exclusively while a CPU replica measures: replicas sharing the
    cores (a local cluster) measured each other's load otherwise, and the bundled target picked
    bfloat16 in one run and float32 in the next on the same machine. GPUs measure on their own
    device."""
    with _host_lock(device, exclusive=True):
        yield


@contextlib.contextmanager
def _while_none_measures(device: str | torch.device) -> Iterator[None]:
    """Holds the host-wide lock shared while a CPU replica loads its model and checks a stored
    calibration: several may do that at once, but not while one measures (_one_at_a_time).
    Measured need: the bundled draft's int8 step timed 0.29 s (0.04 s alone) while the
    target loaded beside it, and the draft replica chose bfloat16 (0.10 s a step)."""
    with _host_lock(device, exclusive=False):
        yield


@contextlib.contextmanager
def _host_lock(device: str | torch.device, *, exclusive: bool) -> Iterator[None]:
    """flock on one file in the temp folder: a readers-writer lock among this host's
    processes (a no-op for GPUs and where fcntl is missing)."""
    if torch.device(device).type != "cpu":
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path = os.path.join(tempfile.gettempdir(), "specdec-calibration.lock")
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def calibrate(
    loaded: LoadedModel,
    role: str,
    dtypes: Sequence[str],
    *,
    max_speculative_tokens: int,
    automatic: bool,
    exact_widths: bool = True,
    max_batch_size: int = 1,
) -> tuple[LoadedModel, Calibration]:
    """Measures ``loaded`` in each dtype and returns it in the fastest exact one.

    Args:
        loaded: the model, loaded in float32 when several dtypes are tried (each candidate is a
            cast of it: exact for weights stored in bfloat16 or float16), else in dtypes[0].
        role: "draft" or "target"; only a target's exact widths are measured, and only a target
            gets row_wise_attention (which its fixed-width forwards need).
        dtypes: candidates, e.g. candidate_dtypes(role, device), or the one configured.
        max_speculative_tokens: k_max; target widths 1 .. k_max + 1 + EXTRA_WIDTHS are measured.
        automatic: whether the dtype was chosen (dtype: auto) rather than configured.
        exact_widths: measure a target's exact widths (and switch it to row-wise attention);
            False when the verifier will not pad (fixed_shape_verify: false): start-up is
            shorter and every candidate counts.
        max_batch_size: the most sessions one batched forward of the replica holds
            (models.max_batch_size); a target's exact widths are priced at loads up to it
            (_seconds_per_token).
    Returns:
        (the model in the chosen dtype, Calibration). The log says what was measured.
    Raises:
        ValueError: no dtypes, or a single one whose GEMM set_gemm refuses for this model or
            machine (of several, such a candidate is skipped and logged).
    """
    if not dtypes:
        raise ValueError("calibrate needs at least one dtype")
    start = time.perf_counter()
    target = role == "target"
    needs_exact = target and exact_widths
    max_width = max_speculative_tokens + 1 + EXTRA_WIDTHS if target else DRAFT_WIDTHS
    results: list[tuple[DtypeMeasurement, torch.nn.Module]] = []
    rows_hint = max_speculative_tokens + 1 if target else 1
    casts: dict[str, torch.nn.Module] = {}  # the candidates of one base dtype share one model
    for dtype in dtypes:
        base, gemm = split_candidate(dtype)
        if base not in casts:
            set_gemm(loaded.model, "")  # plain weights again: a cast deep-copies them
            casts[base] = loaded.model if len(dtypes) == 1 else _cast(loaded.model, base)
        model = casts[base]
        try:
            set_gemm(model, gemm, rows_hint)
        except ValueError as err:  # a GEMM this model or machine cannot run exactly
            if len(dtypes) == 1:
                raise
            log.info("%s %s: skipped: %s", role, dtype, err)
            continue
        if needs_exact:
            use_row_wise_attention(model)
        measured = _measure(
            model,
            loaded.vocab_size,
            dtype,
            target=target,
            exact_widths=needs_exact,
            max_width=max_width,
            rival=functools.partial(
                _rival, [r for r, _ in results], needs_exact=needs_exact, ttft=target
            ),
            max_batch_size=max_batch_size,
        )
        measured = dataclasses.replace(
            measured,
            predicted_s=predicted_request_seconds(measured, max_speculative_tokens, target),
        )
        log.info(
            "%s %s: forward by width %s s, prefill %.4f s/token, exact widths %s, "
            "predicted %.1f s per request",
            role,
            dtype,
            [round(s, 4) for s in measured.forward_s],
            measured.prefill_s_per_token,
            measured.exact.widths if measured.exact else None,
            measured.predicted_s,
        )
        results.append((measured, model))
    usable = [r for r in results if _usable(r[0], needs_exact)] or results
    floor = min(r.prefill_s_per_token for r, _ in results) if target else None
    chosen, model = _choose(usable, floor)
    set_gemm(model, split_candidate(chosen.dtype)[1], rows_hint)
    calibration = Calibration(
        device=describe_device(loaded.device),
        dtype=chosen.dtype,
        automatic=automatic,
        candidates=tuple(r for r, _ in results),
        seconds=time.perf_counter() - start,
    )
    log.info(
        "%s runs in %s on %s (%s; measured in %.1f s)",
        role,
        chosen.dtype,
        calibration.device,
        "chosen by measurement" if automatic else "configured",
        calibration.seconds,
    )
    return dataclasses.replace(loaded, model=model), calibration


def _choose(
    usable: list[tuple[DtypeMeasurement, torch.nn.Module]],
    prefill_floor: float | None = None,
) -> tuple[DtypeMeasurement, torch.nn.Module]:
    """The fastest candidate, unless it beats the first one by less than CHOICE_MARGIN; with a
    ``prefill_floor`` (seconds per prompt token: the fastest candidate's prefill, usable or
    not), only among those whose prefill is within PREFILL_MARGIN of it, if any is."""
    usable = [r for r in usable if _prefills_fast(r[0], prefill_floor)] or usable
    fastest = min(usable, key=lambda r: r[0].predicted_s)
    first = usable[0]
    if fastest[0].predicted_s * (1 + CHOICE_MARGIN) > first[0].predicted_s:
        return first
    return fastest


def _usable(measured: DtypeMeasurement, needs_exact: bool) -> bool:
    """Whether ``measured`` may be chosen: it has exact widths, or none are needed."""
    return measured.exact is not None or not needs_exact


def _prefills_fast(measured: DtypeMeasurement, prefill_floor: float | None) -> bool:
    """Whether ``measured`` prefills within PREFILL_MARGIN of ``prefill_floor`` (None: no bound)."""
    return prefill_floor is None or (
        measured.prefill_s_per_token <= (1 + PREFILL_MARGIN) * prefill_floor
    )


def _rival(
    done: Sequence[DtypeMeasurement], prefill_s_per_token: float, needs_exact: bool, ttft: bool
) -> DtypeMeasurement | None:
    """The candidate measured so far (``done``) that a new one, prefilling at
    ``prefill_s_per_token``, has to beat: the usable one predicted fastest, and for a target
    (``ttft``) only among those whose prefill stays within PREFILL_MARGIN of the fastest
    prefill, the new one's included. None when there is none: the new candidate is then
    measured in full (never cut short), since it may be the only one fast enough to prefill."""
    usable = [r for r in done if _usable(r, needs_exact)]
    if ttft:
        floor = min([prefill_s_per_token, *(r.prefill_s_per_token for r in done)])
        usable = [r for r in usable if _prefills_fast(r, floor)]
    return min(usable, key=lambda r: r.predicted_s, default=None)


def predicted_request_seconds(
    measured: DtypeMeasurement, max_speculative_tokens: int, target: bool
) -> float:
    """Seconds a typical request would take in this dtype: a TYPICAL_PROMPT_TOKENS prefill and
    TYPICAL_NEW_TOKENS tokens, decoded (target) at _seconds_per_token (the best fixed k, each
    round's verify covered by exact widths, averaged over CLASS_ACCEPTANCES), draft time
    excluded (it is the same whatever the target's dtype); a draft decodes one row per token.

    This is the dtype choice's yardstick, not a forecast: the controller prices the real rounds.
    Measured case: the bundled target's weight-major float32 (specdec.device.gemm) costs 0.41 s
    at every width 2-17 on a 2-core AVX-512 Xeon, F.linear's 0.25 s at 2 rows and 0.89 s at 13;
    at acceptance 0.7 alone the two tie, but weight-major would make plain decoding 1.6x slower.
    """
    prefill = measured.prefill_s_per_token * TYPICAL_PROMPT_TOKENS
    if not target:
        return prefill + measured.forward_s[0] * TYPICAL_NEW_TOKENS
    exact = measured.exact or ExactWidths(
        tuple(range(1, len(measured.forward_s) + 1)), measured.forward_s
    )
    return prefill + _seconds_per_token(exact, max_speculative_tokens) * TYPICAL_NEW_TOKENS


def _cast(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """A copy of a float32 model in ``dtype`` (int8: dynamically quantized), equal to
    ``copy.deepcopy(model).to(dtype)`` (or quantize_int8 of the deepcopy) without ever holding
    a second float32 set of weights: each floating parameter and buffer is cast on its own
    (bfloat16, float16) or shared with ``model`` (int8: quantization reads the float weights and
    packs its own). Measured need: the bundled target's bfloat16 candidate peaked at 2x its
    float32 size (12.4 GB) through a whole-model deepcopy, and Ray's memory monitor killed the
    local cluster's Serve controller on a 24 GiB machine; now it peaks at 1.5x."""
    if dtype == "float32":
        return model
    quantize = dtype == INT8
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.is_floating_point():
            memo[id(tensor)] = tensor if quantize else _converted(tensor, _DTYPES[dtype])
    copied = copy.deepcopy(model, memo)
    if quantize:
        quantize_int8(copied)
    return copied


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``; a Parameter stays a Parameter (as Module.to leaves it)."""
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(tensor.detach().to(dtype), requires_grad=tensor.requires_grad)
    return tensor.to(dtype)


@torch.inference_mode()
def _measure(
    model: torch.nn.Module,
    vocab_size: int,
    dtype: str,
    *,
    target: bool,
    exact_widths: bool,
    max_width: int,
    rival: Callable[[float], DtypeMeasurement | None],
    max_batch_size: int = 1,
) -> DtypeMeasurement:
    """One candidate's costs (and a target's exact widths), measured on ``model`` as it is set
    up. ``rival`` maps this candidate's prefill seconds per token to the candidate it has to
    beat (_rival): a candidate clearly slower than it (SLOWER_CUTOFF), or for a target one that
    prefills more than PREFILL_MARGIN slower (it could not be chosen), is cut short and gets no
    exactness measurement. Measured case: the bundled target's emulated bfloat16 on an AVX2-only
    CPU prefills at 3x float32+dnnl's time a token (57 ms against 19), while its 1-row forward
    is the cheapest (0.10 s against 0.16), so only the prefill rules it out early."""
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
        guess = DtypeMeasurement(dtype, tuple(costs), prefill_per_token, None, math.inf)
        return best is not None and (
            predicted_request_seconds(guess, k_max, target) > SLOWER_CUTOFF * best.predicted_s
            or (target and not _prefills_fast(guess, best.prefill_s_per_token))
        )

    costs, cut = _forward_costs(model, cache, vocab_size, max_width, generator, hopeless)
    measured = DtypeMeasurement(dtype, tuple(costs), prefill_per_token, None, math.inf)
    # Exact widths only cost more than all widths, so a candidate already slower with every
    # width allowed (or cut short as hopeless) cannot win: skip its (long) exactness measurement.
    optimistic = predicted_request_seconds(measured, k_max, target)
    if exact_widths and not cut and (best is None or optimistic < best.predicted_s):
        half = split_candidate(dtype)[0] in HALF_DTYPES
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
    """The width class with the lowest _seconds_per_token (at loads up to ``max_batch_size``
    sessions) that also passes the whole-model check (a class of the linear layers'
    measurement, or one width of such a class alone, since other operators may still tell
    widths apart); None when none does.

    A half-precision (``half``) class of several widths is checked for half_precision_rows rows
    at each of its widths, and only kept when that takes at most HALF_CLASS_MAX_PASSES blocks
    of max_width rows per width: otherwise single widths only. Measured cases: the tiny test
    target's bfloat16 linear layers measure [1, 2], [3 .. 8], [9 .. 17] on an AVX-512 BF16
    EPYC, but its q_proj and o_proj give 3-row and 8-row calls different outputs about once in
    a thousand 8-token blocks (and the 1- and 2-row calls differ on the AMX Xeon), which it
    would take about 18,000 rows a width to see; the bundled target's [2 .. 17] passes 36."""
    classes = measure_width_classes(model, max_width, generator=generator)
    rows = half_precision_rows(model) if half else 0
    checkable = rows <= HALF_CLASS_MAX_PASSES * max_width
    singles = [(w,) for c in classes for w in c if len(c) > 1 or not checkable]
    if not checkable:
        log.info("a %d-row check per width is too long: single exact widths only", rows)
        classes = []
    k_max = max_width - 1 - EXTRA_WIDTHS
    options = sorted(
        (ExactWidths(tuple(widths), tuple(costs)) for widths in [*classes, *singles]),
        key=lambda e: _seconds_per_token(e, k_max, max_batch_size),
    )
    for option in options:
        if whole_forward_exact(model, vocab_size, option.widths, generator, rows_per_width=rows):
            return option
        log.info("width class %s failed the whole-model check", option.widths)
    log.warning("no exact width class among %s: greedy output may depend on k", classes)
    return None


def _seconds_per_token(exact: ExactWidths, k_max: int, max_batch_size: int = 1) -> float:
    """Mean over CLASS_ACCEPTANCES and the loads of _batch_loads(max_batch_size) of the seconds
    per token at the best fixed k, s sessions of k + 1 rows sharing the forwards: a class must
    serve plain decoding (acceptance 0: one row per token, padded) as well as long drafts, and
    a lone request as well as a full batch.

    Measured cases: the bundled target in float32 costs 0.26 s at 1-2 rows and 0.61 s at 16,
    and a class of widths 16-17 alone, cheapest for 13-row verifies, made every plain step
    cost 2.4x. In bfloat16 on the AMX Xeon (one exact width: 193 ms at 1 row, 192 at 7, 204
    at 12, 227 at 17), priced alone the width was 7; then 4 sessions at k = 3 took three
    forwards, and 4 streams ran auto at 1.01x k = 0 (7.8 against 7.7 tokens/s). Priced at
    loads 1-8 it is 12 or 13, as the start-up's timings fall; set to 12, 4 streams ran auto at
    1.39x k = 0 (10.4 against 7.5), one stream 3.2 tokens/s at k = 0 against 3.4 and 8.4 with
    auto against 7.9 (specdec sweep; README.md at f1f89f8, "Under load")."""
    loads = _batch_loads(max_batch_size)
    total = 0.0
    for sessions in loads:
        for acceptance in CLASS_ACCEPTANCES:
            total += min(
                exact.rows_seconds(sessions * (k + 1)) / (sessions * expected_tokens(acceptance, k))
                for k in range(k_max + 1)
            )
    return total / (len(loads) * len(CLASS_ACCEPTANCES))


def _batch_loads(max_batch_size: int) -> list[int]:
    """The sessions per batch a width is priced at: 1, the powers of two below
    ``max_batch_size``, and max_batch_size itself."""
    loads = {1, max(max_batch_size, 1)}
    loads.update(2**i for i in range(max_batch_size.bit_length()) if 2**i < max_batch_size)
    return sorted(loads)


def _timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
