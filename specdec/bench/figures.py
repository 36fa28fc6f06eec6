"""The benchmark's arithmetic: runs, the predicted bound, the summary and its table.

Every speedup names its baseline (DESIGN.md, "Baselines"): ``vs plain`` divides by
``plain_generate`` (the target alone with transformers' ``generate``, in its fastest dtype on this
machine) and ``vs k=0`` by ``target_only`` (the service's own k = 0 path).

The bound (predicted_bound) is the decode-phase speedup over plain decoding predicted from the
speculative run's acceptance per draft position and the step costs each replica measured in
isolation at start-up (its DeviceCalibration), never from the measured rounds: so ``share`` (the
measured decode tokens/s over the predicted one) shows everything the isolated costs leave out:
transport, scheduling, contention and the gap between a calibration forward and a served one.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from specdec.bench.datasets import BenchPrompt
from specdec.decoding.stats import SpeculationStats

TARGET_ONLY, SPECULATIVE, HF_ASSISTED = "target_only", "speculative", "hf_assisted"
PLAIN, ENGINE = "plain_generate", "engine"
BASELINES = {"plain": PLAIN, "k0": TARGET_ONLY}  # key suffix -> the mode it divides by
MODE_ORDER = (PLAIN, TARGET_ONLY, SPECULATIVE, ENGINE, HF_ASSISTED)  # the table's rows


def speculative_mode(proposer: str | None) -> str:
    """The mode name of the service's speculative runs with a request's ``proposer``
    (specdec.config.PROPOSERS): ``speculative`` when unset (the service's default),
    ``speculative_<proposer>`` otherwise."""
    return SPECULATIVE if proposer is None else f"{SPECULATIVE}_{proposer}"


def is_speculative(mode: str) -> bool:
    """Whether ``mode`` is one of the service's speculative modes (speculative_mode)."""
    return mode == SPECULATIVE or mode.startswith(SPECULATIVE + "_")


def _mode_rank(mode: str) -> int:
    """The table's row order: MODE_ORDER, every speculative mode in the place of
    ``speculative``, unknown modes last."""
    mode = SPECULATIVE if is_speculative(mode) else mode
    return MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)


@dataclasses.dataclass
class Run:
    """One prompt in one mode.

    Attributes:
        token_ids: the completion's token ids (a final EOS included, as the service keeps it).
        tokens_per_second: completion tokens / seconds from the request's start to its end.
        ttft_s: seconds to the first token.
        stats: speculation stats (the service's or the in-process engine's; None for the
            transformers baselines).
    """

    mode: str
    token_ids: list[int]
    text: str
    tokens_per_second: float
    ttft_s: float
    stats: SpeculationStats | None = None

    @property
    def seconds(self) -> float:
        return len(self.token_ids) / self.tokens_per_second if self.tokens_per_second else 0.0

    @property
    def decode_seconds(self) -> float:
        """Seconds after the first token."""
        return max(self.seconds - self.ttft_s, 1e-9)

    def record(self) -> dict[str, Any]:
        out = {
            "mode": self.mode,
            "completion_tokens": len(self.token_ids),
            "tokens_per_second": self.tokens_per_second,
            "ttft_s": self.ttft_s,
            "text": self.text,
            "token_ids": self.token_ids,
        }
        if self.stats is not None:
            out["stats"] = self.stats.as_dict()
        return out


# --- the bound ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Isolated step costs from the replicas' start-up calibration, seconds.

    Attributes:
        plain_step_s: one target forward over 1 position in the target's fastest measured dtype
            (what plain decoding pays per token).
        plain_dtype: that dtype.
        draft_forward_s: draft forward over w positions in the draft's dtype, index w - 1.
        verify_forward_s: target forward over w positions in the target's dtype, index w - 1.
        exact_widths: the widths the verifier pads a decode forward to (empty: not padded).
    """

    plain_step_s: float
    plain_dtype: str
    draft_forward_s: tuple[float, ...]
    verify_forward_s: tuple[float, ...]
    exact_widths: tuple[int, ...] = ()

    def draft_s(self, width: int) -> float:
        return _cost(self.draft_forward_s, width)

    def verify_s(self, rows: int) -> float:
        """Seconds of one verify over ``rows`` positions, padded as the verifier pads."""
        if not self.exact_widths:
            return _cost(self.verify_forward_s, rows)
        from specdec.device.calibration.results import ExactWidths

        return ExactWidths(self.exact_widths, self.verify_forward_s).rows_seconds(rows)


def _cost(forward_s: Sequence[float], width: int) -> float:
    """forward_s[width - 1], extended linearly in the width past the measured ones."""
    if width <= len(forward_s):
        return forward_s[width - 1]
    return forward_s[-1] * width / len(forward_s)


def step_costs(info) -> StepCosts | None:
    """StepCosts from a specdec.v1.ModelInfo, or None when either replica reported no
    calibration (an older replica): the bound is then not claimed."""
    target = _chosen_costs(info.target_calibration)
    draft = _chosen_costs(info.draft_calibration)
    if target is None or draft is None:
        return None
    plain = min(
        (c for c in info.target_calibration.candidates if c.forward_s),
        key=lambda c: c.forward_s[0],
    )
    return StepCosts(
        plain_step_s=plain.forward_s[0],
        plain_dtype=plain.dtype,
        draft_forward_s=draft,
        verify_forward_s=target,
        exact_widths=tuple(info.target_calibration.exact_widths),
    )


def _chosen_costs(calibration) -> tuple[float, ...] | None:
    for candidate in calibration.candidates:
        if candidate.dtype == calibration.dtype and candidate.forward_s:
            return tuple(candidate.forward_s)
    return None


@dataclasses.dataclass(frozen=True)
class Bound:
    """A predicted decode phase: tokens committed per round and the isolated cost of a round."""

    tokens_per_round: float
    round_s: float
    plain_step_s: float

    @property
    def speedup(self) -> float:
        """Predicted decode-phase speedup over plain decoding."""
        return self.tokens_per_round * self.plain_step_s / self.round_s

    @property
    def tokens_per_second(self) -> float:
        """Predicted decode-phase tokens/s."""
        return self.tokens_per_round / self.round_s


def predicted_bound(stats: SpeculationStats, costs: StepCosts | None) -> Bound | None:
    """The decode-phase speedup over plain decoding that a run's acceptance allows, priced with
    isolated step costs (Leviathan et al. 2023, section 3.1, with measured quantities in place of
    its i.i.d. acceptance model: code drafts are accepted in bursts).

    From the per-position counters, the decode rounds that drafted exactly j tokens number
    n_j = drafted[j-1] - drafted[j] (n_0 = decode rounds - drafted[0]), and position i was
    accepted in a share acc_i = accepted[i] / drafted[i] of the rounds that drafted it. Then

        tokens per round = 1 + sum_i acc_i * drafted[i] / rounds     (bonus/correction + accepted)
        cost(0)          = verify(1)                                 (plain target step)
        cost(j >= 1)     = catch-up_j + (j - 1) * draft(1) + verify(j + 1)
        catch-up_j       = (1 - acc_{j-1}) * draft(1) + acc_{j-1} * draft(2)
        bound            = tokens per round * t_plain_step / (sum_j n_j cost(j) / rounds)

    as the round loop runs (specdec.decoding.costs): the draft's catch-up forward over the
    1 committed token its cache lacks (2 after a full acceptance; acc_{j-1} stands in for the
    share of j-token rounds accepted in full) gives the first draft token, j - 1 one-position
    steps the rest, and the target verifies the pending token plus the j drafts in one forward
    (padded to an exact width where the replica found some). draft(w) and verify(w) are the
    replicas' forward_s by width, t_plain_step the target's 1-position forward in its fastest
    dtype. Orchestration is left out on purpose.

    Args:
        stats: one run's stats, or a sum of runs' (SpeculationStats.total).
        costs: step_costs(ModelInfo); None (no calibration) gives None.
    Returns:
        The Bound, or None without costs or without a decode round.
    """
    rounds = stats.decode_rounds
    if costs is None or rounds == 0:
        return None
    drafted = list(stats.drafted_per_position) + [0]
    accepted = list(stats.accepted_per_position)
    acc = [accepted[i] / drafted[i] if drafted[i] else 0.0 for i in range(len(accepted))]
    tokens = 1.0 + sum(a * d / rounds for a, d in zip(acc, drafted))
    seconds = (rounds - drafted[0]) * costs.verify_s(1)
    for j in range(1, len(drafted)):
        n_j = drafted[j - 1] - drafted[j]
        if n_j:
            full = acc[j - 1]
            catchup = (1 - full) * costs.draft_s(1) + full * costs.draft_s(2)
            seconds += n_j * (catchup + (j - 1) * costs.draft_s(1) + costs.verify_s(j + 1))
    if seconds <= 0:
        return None
    return Bound(tokens, seconds / rounds, costs.plain_step_s)


# --- per prompt and summary ---------------------------------------------------------------------


@dataclasses.dataclass
class PromptResult:
    prompt: BenchPrompt
    runs: dict[str, Run]

    def record(self, greedy: bool, costs: StepCosts | None = None) -> dict[str, Any]:
        """The prompt's runs with, per mode, its speedup and (greedy) its token-for-token
        equality against each baseline that ran, and the bound where it has stats."""
        out: dict[str, Any] = {
            "id": self.prompt.id,
            "category": self.prompt.category,
            "modes": {m: r.record() for m, r in self.runs.items()},
        }
        for mode, run in self.runs.items():
            entry = out["modes"][mode]
            for suffix, base_mode in BASELINES.items():
                base = self.runs.get(base_mode)
                if base is None or base_mode == mode:
                    continue
                entry[f"speedup_vs_{suffix}"] = _ratio(
                    run.tokens_per_second, base.tokens_per_second
                )
                if greedy:
                    entry[f"exact_vs_{suffix}"] = run.token_ids == base.token_ids
            bound = predicted_bound(run.stats, costs) if run.stats is not None else None
            entry["predicted_speedup"] = bound.speedup if bound else None
        return out


def summarize(
    results: Sequence[PromptResult], greedy: bool, costs: StepCosts | None = None
) -> dict[str, dict[str, Any]]:
    """Per mode: aggregate tokens/s (all tokens / all seconds), median TTFT, speedups against
    each baseline that ran (``speedup_vs_plain``, ``speedup_vs_k0``, their decode-phase and
    median-per-prompt forms), the speculation figures from summed stats, the bound and its share
    (predicted_bound; None without calibration), the proposed and accepted tokens by proposer
    (``draft``: the draft model, ``ngram``: n-gram lookup), the exact-match shares (greedy),
    and on the first speculative row the service's share of the in-process engine's tokens/s."""
    modes = sorted(results[0].runs, key=_mode_rank)  # stable: proposers in the order run
    summary = {}
    for mode in modes:
        runs = [r.runs[mode] for r in results]
        row: dict[str, Any] = {
            "prompts": len(runs),
            "tokens": sum(len(r.token_ids) for r in runs),
            "tokens_per_second": _aggregate_tps(runs),
            "ttft_s": statistics.median(r.ttft_s for r in runs),
        }
        for suffix, base_mode in BASELINES.items():
            if base_mode in modes:
                row.update(_versus(runs, [r.runs[base_mode] for r in results], suffix, greedy))
        if mode in BASELINES.values():
            row.pop(f"exact_vs_{_suffix(mode)}", None)
        if all(r.stats is not None for r in runs):
            row.update(_speculation_figures(runs, costs))
        summary[mode] = row
    first = first_speculative(summary)
    if first is not None and ENGINE in summary:
        # The engine runs the first speculative mode's proposer (specdec.bench.speedup).
        engine_tps = summary[ENGINE]["tokens_per_second"]
        summary[first]["engine_tokens_per_second"] = engine_tps
        summary[first]["service_share_of_engine"] = _ratio(
            summary[first]["tokens_per_second"], engine_tps
        )
    return summary


def first_speculative(modes) -> str | None:
    """The first of ``modes`` (names, or a summary keyed by them) that is_speculative."""
    return next((m for m in modes if is_speculative(m)), None)


def _suffix(mode: str) -> str:
    return next(s for s, m in BASELINES.items() if m == mode)


def _versus(runs: Sequence[Run], base: Sequence[Run], suffix: str, greedy: bool) -> dict:
    """Speedups of ``runs`` over the baseline runs ``base`` (same prompts), keys named by
    ``suffix``; greedy: the share of outputs equal to the baseline's token for token."""
    out = {
        f"speedup_vs_{suffix}": _ratio(_aggregate_tps(runs), _aggregate_tps(base)),
        f"median_prompt_speedup_vs_{suffix}": statistics.median(
            _ratio(r.tokens_per_second, b.tokens_per_second) for r, b in zip(runs, base)
        ),
        f"decode_speedup_vs_{suffix}": _ratio(_decode_tps(runs), _decode_tps(base)),
    }
    if greedy:
        out[f"exact_vs_{suffix}"] = sum(
            r.token_ids == b.token_ids for r, b in zip(runs, base)
        ) / len(runs)
    return out


def _speculation_figures(runs: Sequence[Run], costs: StepCosts | None) -> dict[str, Any]:
    total = SpeculationStats.total(r.stats for r in runs)
    bound = predicted_bound(total, costs)
    return {
        "acceptance_rate": total.acceptance_rate,
        "tokens_per_round": total.mean_accepted_tokens,
        "mean_k": total.mean_k,
        "overhead_ms_per_round": 1e3 * total.orchestration_s_per_round,
        "acceptance_per_position": total.acceptance_per_position,
        "predicted_speedup": bound.speedup if bound else None,
        "predicted_tokens_per_round": bound.tokens_per_round if bound else None,
        "predicted_round_s": bound.round_s if bound else None,
        "share_of_bound": _ratio(_decode_tps(runs), bound.tokens_per_second) if bound else None,
        "ngram_rounds": total.ngram_rounds,
        "mixed_rounds": total.mixed_rounds,
        "proposed_tokens": _by_proposer(total.draft_tokens, total.ngram_draft_tokens),
        "proposed_accepted_tokens": _by_proposer(
            total.accepted_tokens, total.ngram_accepted_tokens
        ),
    }


def _by_proposer(tokens: int, ngram_tokens: int) -> dict[str, int]:
    """A counter of every proposer split into the draft model's share and n-gram lookup's."""
    return {"draft": tokens - ngram_tokens, "ngram": ngram_tokens}


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _timing(run: Run) -> SpeculationStats:
    """A run's tokens and times as stats, so its rates are the SpeculationStats figures (the
    transformers baselines have no stats of their own)."""
    return SpeculationStats(
        completion_tokens=len(run.token_ids), wall_time_s=run.seconds, ttft_s=run.ttft_s
    )


def _aggregate_tps(runs: Sequence[Run]) -> float:
    """All tokens / all seconds of the runs, tokens/s."""
    return SpeculationStats.total(map(_timing, runs)).tokens_per_second


def _decode_tps(runs: Sequence[Run]) -> float:
    """All tokens after the first / all seconds after the first token, tokens/s."""
    return SpeculationStats.total(map(_timing, runs)).decode_tokens_per_second


# --- the table ----------------------------------------------------------------------------------

COLUMNS = (
    # header, width, summary key (None: the mode), format ("x": a speedup)
    ("mode", 17, None, "s"),  # speculative_ngram
    ("tok/s", 7, "tokens_per_second", ".2f"),
    ("TTFT ms", 8, "ttft_ms", ".0f"),
    ("vs plain", 8, "speedup_vs_plain", ".2fx"),
    ("vs k=0", 7, "speedup_vs_k0", ".2fx"),
    ("accept", 7, "acceptance_rate", ".2f"),
    ("tok/rnd", 8, "tokens_per_round", ".2f"),
    ("mean k", 7, "mean_k", ".2f"),
    ("bound", 7, "predicted_speedup", ".2fx"),
    ("share", 6, "share_of_bound", ".0%"),
    ("ovh ms", 7, "overhead_ms_per_round", ".1f"),
)
EXACT_COLUMNS = (("=k=0", 6, "exact_vs_k0", ".0%"), ("=plain", 7, "exact_vs_plain", ".0%"))


def format_table(summary: dict[str, dict[str, Any]], greedy: bool) -> str:
    """The summary as a fixed-width text table, one row per mode ("-": not measured, or no
    such baseline in this run)."""
    columns = COLUMNS + (EXACT_COLUMNS if greedy else ())

    def cell(value, width, spec):
        if value is None:
            text = "-"
        elif spec.endswith("x"):
            text = format(value, spec[:-1]) + "x"
        else:
            text = format(value, spec)
        return text.ljust(width) if spec == "s" else text.rjust(width)

    lines = [
        " ".join(
            name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w, _, _) in enumerate(columns)
        )
    ]
    lines.append("-" * len(lines[0]))
    for mode, row in summary.items():
        values = {**row, "ttft_ms": row["ttft_s"] * 1e3}
        lines.append(
            " ".join(
                cell(mode if key is None else values.get(key), width, spec)
                for _, width, key, spec in columns
            )
        )
    return "\n".join(lines)


def legend(summary: dict[str, dict[str, Any]], describe: dict[str, str]) -> str:
    """Lines under the table naming each speedup's baseline (``describe``: mode -> what it
    ran), the bound's source, and the service's share of the in-process engine."""
    lines = []
    for suffix, name in (("plain", "vs plain"), ("k0", "vs k=0")):
        mode = BASELINES[suffix]
        if mode in summary:
            lines.append(f"# {name}: tokens/s over {mode} ({describe.get(mode, mode)})")
        else:
            lines.append(f"# {name}: not measured ({mode} did not run)")
    lines.append(
        "# bound: decode-phase speedup over plain decoding predicted from acceptance per draft "
        "position and the replicas' isolated step costs; share: measured decode tok/s / "
        "predicted ('-': the replicas reported no calibration)"
    )
    for mode, row in summary.items():
        if is_speculative(mode) and "proposed_tokens" in row:
            proposed, accepted = row["proposed_tokens"], row["proposed_accepted_tokens"]
            by = ", ".join(f"{p} {proposed[p]} ({accepted[p]})" for p in proposed)
            lines.append(f"# {mode}: proposed (accepted) tokens by proposer: {by}")
    first = first_speculative(summary)
    spec = summary.get(first, {})
    if spec.get("service_share_of_engine") is not None:
        lines.append(
            f"# service share of the in-process engine: {spec['service_share_of_engine']:.0%} "
            f"({first} {spec['tokens_per_second']:.2f} tok/s through the service, engine "
            f"{spec['engine_tokens_per_second']:.2f} tok/s in this process)"
        )
    return "\n".join(lines)
