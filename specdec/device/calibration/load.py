"""The entry points of a calibration: load_calibrated (load a model, then reuse a stored
calibration or measure one) and calibrate (measure every candidate, keep the chosen one)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import torch

from specdec.config import AUTO, default_gemm
from specdec.device.calibration import choice
from specdec.device.calibration.candidates import Candidate, configured
from specdec.device.calibration.casting import cast_model, return_freed_memory
from specdec.device.calibration.host import one_at_a_time, while_none_measures
from specdec.device.calibration.measure import DRAFT_WIDTHS, EXTRA_WIDTHS, measure_candidate
from specdec.device.calibration.results import Calibration, DtypeMeasurement
from specdec.device.calibration_cache import CalibrationCache
from specdec.device.exact_widths import use_row_wise_attention, whole_forward_exact
from specdec.device.gemm import PLAIN, set_gemm
from specdec.device.hardware import describe_device
from specdec.models.loading import LoadedModel, load_model

log = logging.getLogger(__name__)

HALF_DTYPES = ("bfloat16", "float16")


def load_calibrated(
    spec: str,
    role: str,
    dtype: str,
    *,
    gemm: str | None = None,
    device: str = "cpu",
    max_speculative_tokens: int,
    exact_widths: bool = True,
    max_batch_size: int = 1,
    cache: CalibrationCache | None = None,
    revision: str | None = None,
) -> tuple[LoadedModel, Calibration]:
    """Loads a model (specdec.models.loading.load_model) and calibrates it in the candidates of
    the ``dtype`` and ``gemm`` settings (candidates.configured; ``gemm`` None: its null, see
    specdec.config.default_gemm): the one configured, or, where either is ``auto``, the fastest
    of several (of several dtypes: loaded in the dtype load_dtype gives, each candidate a cast
    of it). ``exact_widths`` and ``max_batch_size`` as for calibrate.

    With a ``cache`` (specdec.device.calibration_cache), a calibration made before for the same
    architecture, settings and device is reused instead of measured (minutes on a CPU), once
    its exact widths pass the whole-model check on this model again; a new one is stored. A
    replica that waited for another's measurement on this host (host.one_at_a_time) looks again
    before measuring, so replicas of one model starting together measure once.

    Raises:
        ModelLoadError: as load_model.
    """
    gemm = default_gemm(dtype) if gemm is None else gemm
    automatic = AUTO in (dtype, gemm)
    candidates = configured(dtype, gemm, role, device)
    casts = _casts(candidates)
    if role != "target":
        max_batch_size = 1  # only a target's widths are priced for batches

    def from_cache() -> tuple[Calibration | None, tuple[LoadedModel, Calibration] | None]:
        """(the stored entry or None, the model with it if it passes the exactness check)."""
        stored = cache.load(key) if cache else None
        reused = stored and _reuse(
            loaded, role, stored, max_speculative_tokens, exact_widths, cast=casts
        )
        return stored, reused

    with while_none_measures(device):
        loaded = load_model(
            spec, dtype=load_dtype(candidates, device), device=device, revision=revision
        )
        key = cache and cache.key(
            loaded.model,
            role,
            candidates,
            device=device,
            max_speculative_tokens=max_speculative_tokens,
            exact_widths=exact_widths,
            max_batch_size=max_batch_size,
        )
        stored, result = from_cache()
    if not result:
        with one_at_a_time(device):
            if stored is None:
                # A replica of the same model on this host may have stored one while this one
                # waited for the lock (two replicas starting together measured twice).
                stored, result = from_cache()
            if not result:
                result = calibrate(
                    loaded,
                    role,
                    candidates,
                    max_speculative_tokens=max_speculative_tokens,
                    automatic=automatic,
                    exact_widths=exact_widths,
                    max_batch_size=max_batch_size,
                )
                if cache:
                    cache.save(key, result[1])
    return_freed_memory()
    return result


def _casts(candidates: Sequence[Candidate]) -> bool:
    """Whether ``candidates`` span several dtypes: the model is then loaded in load_dtype's
    dtype and each dtype is a cast of it (casting.cast_model); else all run the model as
    loaded."""
    return len({c.dtype for c in candidates}) > 1


def load_dtype(candidates: Sequence[Candidate], device: str | torch.device) -> str:
    """The dtype a model is loaded in to be calibrated as ``candidates`` (non-empty) on
    ``device``: their one dtype; of several, float32 on a CPU (its candidates include float32
    itself and int8, which quantizes float32 weights), elsewhere the first half-precision one
    (bfloat16 of a GPU's bfloat16 and float16), so that no float32 copy of the weights ever
    exists, on the device or on the host before it (load_model passes the dtype to
    from_pretrained): a 14B target is 59 GB in float32, too much for an 80 GB GPU beside its KV
    cache. The other half dtype is then a cast of it, equal to loading it directly for weights
    stored in bfloat16 (Qwen2.5's checkpoints; a bundled model loads its bfloat16 conversion
    whatever the dtype); weights stored in float16 or float32 lose bits through bfloat16, so
    serve those with a fixed ``dtype``."""
    dtypes = [c.dtype for c in candidates]
    if len(set(dtypes)) == 1:
        return dtypes[0]
    if torch.device(device).type == "cpu":
        return "float32"
    return next((d for d in dtypes if d in HALF_DTYPES), "float32")


def _reuse(
    loaded: LoadedModel,
    role: str,
    stored: Calibration,
    max_speculative_tokens: int,
    exact_widths: bool,
    *,
    cast: bool,
) -> tuple[LoadedModel, Calibration] | None:
    """``loaded`` set up as ``stored`` chose (dtype, GEMM, row-wise attention; ``cast``: the
    chosen dtype is a cast of ``loaded``, see load_dtype), or None when its exact widths fail the
    whole-model check here (the caller measures again)."""
    start = time.perf_counter()
    chosen = stored.candidate
    model = cast_model(loaded.model, chosen.dtype) if cast else loaded.model
    target = role == "target"
    set_gemm(model, chosen.gemm, max_speculative_tokens + 1 if target else 1)
    exact = stored.chosen.exact
    if target and exact_widths:
        use_row_wise_attention(model)
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            if exact is None or not whole_forward_exact(
                model, loaded.vocab_size, exact.widths, generator
            ):
                log.warning("the stored %s calibration has no exact widths here: measuring", role)
                set_gemm(loaded.model, PLAIN)
                return None
    log.info(
        "%s runs in %s on %s (%s; reused a calibration measured in %.1f s, checked in %.1f s)",
        role,
        chosen,
        stored.device,
        "chosen by measurement" if stored.automatic else "configured",
        stored.seconds,
        time.perf_counter() - start,
    )
    return dataclasses.replace(loaded, model=model), dataclasses.replace(stored, reused=True)


def calibrate(
    loaded: LoadedModel,
    role: str,
    candidates: Sequence[Candidate],
    *,
    max_speculative_tokens: int,
    automatic: bool,
    exact_widths: bool = True,
    max_batch_size: int = 1,
) -> tuple[LoadedModel, Calibration]:
    """Measures ``loaded`` as each candidate and returns it as the fastest exact one.

    Args:
        loaded: the model, loaded in load_dtype's dtype: when the candidates span several
            dtypes, float32 on a CPU, the first half dtype elsewhere (each other dtype is a
            cast of it: exact for weights stored in bfloat16), else their one dtype.
        role: "draft" or "target"; only a target's exact widths are measured, and only a target
            gets row_wise_attention (which its exact-width forwards need).
        candidates: e.g. candidates.candidates(role, device), or the one configured.
        max_speculative_tokens: k_max; target widths 1 .. k_max + 1 + EXTRA_WIDTHS are measured.
        automatic: whether the candidate was chosen (dtype or gemm: auto) rather than
            configured.
        exact_widths: measure a target's exact widths (and switch it to row-wise attention);
            False when the verifier will not pad (exact_widths: false): start-up is
            shorter and every candidate counts.
        max_batch_size: the most sessions one batched forward of the replica holds
            (models.max_batch_size); a target's exact widths are priced at loads up to it
            (choice.seconds_per_token).
    Returns:
        (the model as the chosen candidate, Calibration). The log says what was measured.
    Raises:
        ValueError: no candidates, or a single one whose GEMM set_gemm refuses for this model
            or machine (of several, such a candidate is skipped and logged).
    """
    if not candidates:
        raise ValueError("calibrate needs at least one candidate")
    start = time.perf_counter()
    target = role == "target"
    needs_exact = target and exact_widths
    max_width = max_speculative_tokens + 1 + EXTRA_WIDTHS if target else DRAFT_WIDTHS
    results: list[tuple[DtypeMeasurement, torch.nn.Module]] = []
    rows_hint = max_speculative_tokens + 1 if target else 1
    casts: dict[str, torch.nn.Module] = {}  # the candidates of one dtype share one model
    for candidate in candidates:
        if candidate.dtype not in casts:
            set_gemm(loaded.model, PLAIN)  # plain weights again: a cast deep-copies them
            casts[candidate.dtype] = (
                cast_model(loaded.model, candidate.dtype) if _casts(candidates) else loaded.model
            )
        model = casts[candidate.dtype]
        try:
            set_gemm(model, candidate.gemm, rows_hint)
        except ValueError as err:  # a GEMM this model or machine cannot run exactly
            if len(candidates) == 1:
                raise
            log.info("%s %s: skipped: %s", role, candidate, err)
            continue
        if needs_exact:
            use_row_wise_attention(model)
        measured = measure_candidate(
            model,
            loaded.vocab_size,
            candidate,
            target=target,
            exact_widths=needs_exact,
            max_width=max_width,
            rival=functools.partial(
                choice.rival, [r for r, _ in results], needs_exact=needs_exact, ttft=target
            ),
            max_batch_size=max_batch_size,
        )
        measured = dataclasses.replace(
            measured,
            predicted_s=choice.predicted_request_seconds(measured, max_speculative_tokens, target),
        )
        log.info(
            "%s %s: forward by width %s s, prefill %.4f s/token, exact widths %s, "
            "predicted %.1f s per request",
            role,
            candidate,
            [round(s, 4) for s in measured.forward_s],
            measured.prefill_s_per_token,
            measured.exact.widths if measured.exact else None,
            measured.predicted_s,
        )
        results.append((measured, model))
    usable = [r for r in results if choice.usable(r[0], needs_exact)] or results
    floor = min(r.prefill_s_per_token for r, _ in results) if target else None
    chosen, model = choice.choose(usable, floor)
    set_gemm(model, chosen.candidate.gemm, rows_hint)
    calibration = Calibration(
        device=describe_device(loaded.device),
        candidate=chosen.candidate,
        automatic=automatic,
        candidates=tuple(r for r, _ in results),
        seconds=time.perf_counter() - start,
    )
    log.info(
        "%s runs in %s on %s (%s; measured in %.1f s)",
        role,
        chosen.candidate,
        calibration.device,
        "chosen by measurement" if automatic else "configured",
        calibration.seconds,
    )
    return dataclasses.replace(loaded, model=model), calibration
