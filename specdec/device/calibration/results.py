"""What a calibration found: a candidate's measurement, a target's exact widths, the choice."""

from __future__ import annotations

import dataclasses
import functools

from specdec.device.calibration.candidates import Candidate

CACHE_TOKENS = 64  # cache length the cost forwards extend (attention is a small share here)


@dataclasses.dataclass(frozen=True)
class ExactWidths:
    """Widths whose forwards give every row bitwise the same result, and their costs.

    Attributes:
        widths: ascending; a decode forward of n rows runs as chunks(n): forwards of these
            widths, the last one padded.
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
        """[(real rows, padded width)] covering ``rows`` rows at the least predicted cost: full
        forwards first, the one padded forward last.

        A minimum-cost cover (a small unbounded knapsack over the widths, _cheapest_cover)
        rather than greedy widest-first: with costs linear in the width, 28 rows as 17 + 11 and
        as 14 + 14 cost the same, so a set's greedy split could price it above one of its own
        widths alone, and timing noise then made the calibration keep that single width
        (stop 58's CI: a [11 .. 17] set lost to 14). Every width of a set gives a row the same
        result, so any cover is exact; the cheapest one makes a set never dearer than a subset.
        """
        if rows <= 0:
            return []
        return list(_cheapest_cover(self, rows))

    def cost(self, width: int) -> float:
        if width <= len(self.forward_s):
            return self.forward_s[width - 1]
        return self.forward_s[-1] * width / len(self.forward_s)

    def rows_seconds(self, rows: int) -> float:
        """Predicted seconds to run ``rows`` rows through chunks()."""
        return sum(self.cost(width) for _, width in self.chunks(rows))


@functools.lru_cache(maxsize=4096)
def _cheapest_cover(exact: ExactWidths, rows: int) -> tuple[tuple[int, int], ...]:
    """ExactWidths.chunks: best[n] is the least cost of n rows, a forward of width w taking
    min(w, n) of them (taking fewer never helps: best is non-decreasing in n). O(rows x widths),
    once per (widths, costs, rows): the verifier asks for the same few row counts every round."""
    best, last = [0.0] + [float("inf")] * rows, [0] * (rows + 1)
    for n in range(1, rows + 1):
        for width in reversed(exact.widths):  # on a tie, the wider: fewer forwards
            cost = exact.cost(width) + best[max(n - width, 0)]
            if cost < best[n]:
                best[n], last[n] = cost, width
    out = []
    while rows > 0:
        width = last[rows]
        out.append((min(width, rows), width))
        rows -= min(width, rows)
    # The widest first and the padded one last, as the verifiers crop that one's padding.
    return tuple(sorted(out, key=lambda chunk: (chunk[0] < chunk[1], -chunk[1])))


@dataclasses.dataclass(frozen=True)
class DtypeMeasurement:
    """One candidate (a dtype and a GEMM), as measured.

    Attributes:
        forward_s: seconds of one forward over w positions, index w - 1 (measured, or, for a
            candidate stopped early as clearly slower, interpolated between measured widths).
        prefill_s_per_token: seconds per prompt token of a PREFILL_TOKENS-token prefill.
        exact: the target's exact widths (None: none found, or a draft).
        predicted_s: predicted_request_seconds of this candidate.
    """

    candidate: Candidate
    forward_s: tuple[float, ...]
    prefill_s_per_token: float
    exact: ExactWidths | None
    predicted_s: float
    cache_tokens: int = CACHE_TOKENS


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a replica measured at start-up (``candidates``) and what it chose (``candidate``)."""

    device: str
    candidate: Candidate
    automatic: bool
    candidates: tuple[DtypeMeasurement, ...]
    seconds: float
    reused: bool = False  # taken from a CalibrationCache (its exact widths checked again)

    @property
    def chosen(self) -> DtypeMeasurement:
        return next(c for c in self.candidates if c.candidate == self.candidate)

    def to_proto(self, message) -> None:
        """Fills a specdec.v1.DeviceCalibration message (a candidate's ``dtype`` in the display
        form, Candidate.__str__: "float32+dnnl")."""
        message.device, message.automatic = self.device, self.automatic
        message.dtype = str(self.candidate)
        message.seconds, message.reused = self.seconds, self.reused
        exact = self.chosen.exact
        message.exact_widths.extend(exact.widths if exact else ())
        for measured in self.candidates:
            message.candidates.add(
                dtype=str(measured.candidate),
                forward_s=measured.forward_s,
                cache_tokens=measured.cache_tokens,
                exact=measured.exact is not None,
                prefill_s_per_token=measured.prefill_s_per_token,
            )
