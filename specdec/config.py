"""specdec's settings: one frozen object per concern, parsed once and passed whole.

The Serve application's flat ``args`` (deployments/config/*.yaml) become a SpecdecConfig through
SpecdecConfig.from_args, SpeculativeEngine's keyword arguments through SpecdecConfig.of; the
round loop, proposer, verifier, router and deployments read that object and repeat no default.
Every default lives here only, with its unit and meaning in the docstring under the field.
docs/configuration.md, the configuration reference, is generated from those docstrings (``python -m
specdec.config_reference --write``), and tests/unit/test_config.py fails when the two drift.

This module imports neither Ray nor torch: the CLI and the deploy code parse a config without
loading a model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from specdec.config_fields import Section, at_least, require
from specdec.config_service import ServiceConfig
from specdec.errors import ConfigError

log = logging.getLogger(__name__)

# The Serve application's name: the route prefix of the HTTP API, the gRPC `application`
# metadata, and the name the deploy and the tools look the application up by.
APPLICATION = "specdec"

AUTO = "auto"  # a dtype or GEMM the replica chooses by measurement
PLAIN = "plain"  # PyTorch's own F.linear
MODEL_DTYPES = (AUTO, "float32", "bfloat16", "float16", "int8")
MODEL_GEMMS = (AUTO, PLAIN, "wm", "dnnl", "bf16w")
RUNNERS = (AUTO, "dynamic", "static")  # models.runner
# Who proposes a round's tokens (speculation.proposer, a request's `proposer`).
PROPOSERS = (AUTO, "draft", "ngram", "none")
# The GEMMs (specdec.device.gemm) each dtype runs; `auto` measures those the device has.
DTYPE_GEMMS = {
    "float32": (PLAIN, "wm", "dnnl", "bf16w"),
    "bfloat16": (PLAIN, "dnnl"),
    "float16": (PLAIN,),
    "int8": (PLAIN,),
}
CPU_ONLY = ("int8", "dnnl", "bf16w")  # the dtypes and GEMMs that run on a CPU only
SIDES = ("draft", "target")
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:\d+)?")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """models: which draft and target to load, in what dtype, where, and their caches."""

    draft_model: str | None = None
    """The draft model: a local Hugging Face directory, a `.gguf` file, `bundled:draft`, a
    Hugging Face Hub id (`Qwen/Qwen2.5-Coder-0.5B-Instruct`, downloaded into the Hub cache;
    `HF_TOKEN`, `HF_HUB_OFFLINE` and `HF_HOME` apply) or a folder's URI (`s3://...`,
    `gs://...`, `file://...`: copied once into the models cache); `~` and environment
    variables are expanded (specdec.models.sources). Required in the Serve application's
    args."""

    target_model: str | None = None
    """The target model, as `draft_model` (`bundled:target` for the bundled pair)."""

    draft_revision: str | None = None
    """The Hub revision of a Hub-id `draft_model`: a branch, tag or commit (null: `main`). Pin
    a commit so that every replica loads the same weights."""

    target_revision: str | None = None
    """The Hub revision of a Hub-id `target_model`, as `draft_revision`."""

    dtype: str = "float32"
    """The target's dtype, and the draft's unless `draft_dtype` is set: `auto`, `float32`,
    `bfloat16`, `float16` or `int8` (CPU only). `auto` (the shipped configs' choice): each
    replica measures its forward cost by width in every candidate dtype at start-up (float32
    and bfloat16 on a CPU, bfloat16 and float16 on a GPU; a CPU draft also int8), each with
    the GEMMs `gemm` allows, and runs in the fastest one whose target output stays exact and,
    for the target, whose prefill (the time to first token) is within 10% of the fastest
    candidate's (specdec.device.calibration; GetModelInfo reports what it measured). A bundled
    model is stored once in bfloat16 (float16 has its own conversion) and loaded from there in
    any dtype. The old form that named dtype and GEMM in one string (`float32+dnnl`) is still
    read as the two settings (`dtype: float32`, `gemm: dnnl`), with a warning."""

    gemm: str | None = None
    """How the target's linear layers compute (specdec.device.gemm), and the draft's unless
    `draft_dtype` or `draft_gemm` is set: `plain` (PyTorch's F.linear), `wm` (float32 only:
    weight-major GEMMs for 2-64 rows), `dnnl` (float32, or bfloat16 on a CPU with AVX-512 or
    AVX-NE-CONVERT; CPU only: oneDNN on weights reordered once), `bf16w` (float32 only, CPU
    only: float32 arithmetic on weights stored in bfloat16, for models whose weights are
    bfloat16 values, like the bundled pair; x86-64 with AVX2 and FMA, a C++ compiler and
    ninja), or `auto`: the replica measures every GEMM its device has for the dtype (on a
    CPU, float32's `dnnl` and `bf16w` and a target's `wm`, bfloat16's `dnnl`) with the dtypes
    `dtype` allows, and keeps the fastest exact one as for `dtype: auto`. Null: `auto` where
    `dtype` is `auto`, else `plain`. With `dtype: auto` only `auto` or `plain`: a fixed GEMM
    runs fixed dtypes."""

    draft_dtype: str | None = None
    """The draft's dtype (null: `dtype`). The draft only steers proposals, so a cheaper one
    (`int8` halves a CPU draft step) changes speed, never the output."""

    draft_gemm: str | None = None
    """The draft's GEMM, as `gemm` (null: `gemm` where `draft_dtype` is null too, else as a
    null `gemm` is for `draft_dtype`)."""

    device: str = "cpu"
    """Where both models run: `cpu`, `cuda`, `cuda:N` (or `mps`, `xpu`)."""

    cache_capacity_bytes: int = 2 * 1024**3
    """Bound of one model's session KV caches (an LRU), in bytes of key and value tensors: per
    replica, or per model in SpeculativeEngine. An evicted session is rebuilt from its token
    ids: slower, never wrong."""

    cache_idle_s: float = 600.0
    """Seconds after which a session cache no call has used is dropped (0: never): a session
    stranded on a replica when the replica set changed under its request, or whose release was
    lost, frees its memory then instead of waiting for the LRU. A live session idle that long
    is rebuilt from its token ids on its next call."""

    calibration_cache: str | None = None
    """Folder where replicas keep their start-up calibrations (specdec.device.calibration_cache):
    a replica whose model architecture, settings and device match a stored one reuses it after
    checking its exact widths again (seconds instead of minutes on a CPU). Null:
    `$SPECDEC_CALIBRATION_CACHE`, else `~/.cache/specdec/calibration`; an empty string: measure
    at every start. Delete the folder to measure again (e.g. after a start on a busy host)."""

    exact_widths: bool | None = None
    """Pad every target decode forward to an exact width, so that greedy output cannot depend
    on k through rounding: the target replica measures at start-up which forward widths give a
    row bitwise the same result (wherever it sits in the call) and pads to the cheapest that
    fits; a rebuilt session replays its prefill and then runs in those widths. Null or true:
    on; false: plain forwards of k + 1 positions (faster where padding costs, exact only up to
    the device's rounding). Formerly `fixed_shape_verify`, still read with a warning."""

    max_batch_size: int = 8
    """Calls a draft or target replica runs as one batch of packed forwards
    (specdec.worker.packed): the calls that arrived while the previous batch ran, up to this
    many sessions (Ray Serve's `serve.batch`). 1: one session at a time. Greedy output is the
    same either way. The target's start-up calibration prices its exact widths for batches up
    to this size as well as for a lone request."""

    batch_prefill_s: float = 1.0
    """Seconds of prompt prefill one batch may hold beyond its first prefill, converted to
    tokens by the replica's measured prefill cost per token: further new prompts wait for the
    next batch, so that a burst of them cannot stall every live session's decode rows behind
    all their prefills (on a 2-core CPU, 8 prompts held one batch for over 50 s). A GPU
    prefills thousands of tokens in that time; a CPU one prompt per batch. 0: one prefill
    per batch."""

    prefill_chunk_tokens: int = 512
    """Chunked prefill: a prompt longer than this many tokens prefills in chunks of this many
    (the last one shorter), one chunk per batch, so the decode rows of other sessions run
    between its chunks instead of waiting for the whole prompt (a 2,000-token prompt holds a
    2-core CPU for tens of seconds). Chunks start at fixed positions from the prompt's first
    token, so a prompt prefills the same way every time and greedy output does not depend on
    it; bitwise equality with transformers' `generate` (float32, plain GEMMs) holds for
    prompts up to this length. 0: every prompt in one forward."""

    runner: str = AUTO
    """How a replica runs its model's forwards: `dynamic` (per-session growing caches, the
    calibrated exact widths and row-wise attention: the CPU path), `static` (specdec.worker.static:
    a preallocated pool of KV slots, every decode forward at one fixed width per batch bucket,
    CUDA graphs on a GPU, greedy acceptance and the draft's chained steps on the device), or
    `auto`: `static` on a CUDA device, `dynamic` elsewhere. Greedy output is exact either way."""

    max_model_len: int | None = None
    """The static runner's context limit in tokens (prompt and output): each KV slot holds this
    many positions plus one verify width. Null: the model's own limit, lowered until
    `max_batch_size` slots fit in `cache_capacity_bytes` (rounded down to a multiple of 256)."""

    batch_wait_fraction: float = 1.0
    """How long a replica holds a batch open for more calls, as a fraction of its last batch's
    seconds. It closes the batch as soon as the calls of all sessions that called it lately are
    in, so a lone request never waits; without any wait (0) concurrent streams keep alternating
    instead of sharing forwards (specdec.deployments.batching)."""

    stuck_forward_s: float = 300.0
    """Seconds one batch of forwards may run on a draft or target replica before its health
    check fails (a hung device or a deadlock), so that Serve replaces it
    (specdec.worker.compute_health). Above the longest legitimate batch: a long prompt's
    prefill on a CPU can take a minute, and `batch_prefill_s` bounds the rest of a batch's.
    Serve checks every `health_check_period_s` (a deployment option, 10 s by default) and
    replaces a replica after 3 failed checks in a row."""

    max_forward_failures: int = 3
    """Batches in a row whose forwards raised (a device error, not a request's own invalid
    input) after which a draft or target replica's health check fails and the replica refuses
    new calls, which the router sends to another replica, until Serve replaces it
    (specdec.worker.compute_health). A batch without a forward error resets the count; a
    failing row fails only its own call."""

    simulated_costs: str | None = None
    """A JSON cost table (specdec.device.simulated) that draft and target replicas hold each
    forward to, while their real models still compute the tokens: measures the service's
    orchestration, batching and overlap at GPU timescales on a machine without a GPU. The
    replicas report the table's costs to the router and label every figure `simulated`
    (ModelInfo.simulated_costs). `benchmarks/costs/` holds tables. CPU devices only; null:
    real costs."""

    def revision_for(self, side: str) -> str | None:
        """The Hub revision of the "draft" or "target" side's model (None: main)."""
        return self.draft_revision if side == "draft" else self.target_revision

    def for_side(self, side: str) -> tuple[str | None, str]:
        """(model, dtype) that the "draft" or "target" side loads."""
        if side == "draft":
            return self.draft_model, self.draft_dtype or self.dtype
        return self.target_model, self.dtype

    def resolved_runner(self) -> str:
        """`static` or `dynamic`: the runner setting with `auto` resolved by device."""
        if self.runner != AUTO:
            return self.runner
        return "static" if self.device.startswith("cuda") else "dynamic"

    def measures_exact_widths(self) -> bool:
        """Whether a replica's calibration measures exact widths: the dynamic runner's, unless
        `exact_widths` is false (the static runner measures its own shapes at start-up,
        specdec.worker.static.shapes)."""
        return self.exact_widths is not False and self.resolved_runner() == "dynamic"

    def gemm_for(self, side: str) -> str:
        """The GEMM setting of the "draft" or "target" side, its null resolved: `auto`,
        `plain`, `wm`, `dnnl` or `bf16w`."""
        if side == "draft" and self.draft_gemm is not None:
            return self.draft_gemm
        if side == "draft" and self.draft_dtype is not None:
            return default_gemm(self.draft_dtype)
        return self.gemm if self.gemm is not None else default_gemm(self.dtype)

    def _check(self) -> None:
        for name in ("draft_model", "target_model"):
            require(name, getattr(self, name) != "", "must not be empty")
        for name in ("draft_revision", "target_revision"):
            require(name, getattr(self, name) != "", "must be a branch, tag or commit, or null")
        for dtype_name, gemm_name in _DTYPE_AND_GEMM.values():
            self._read_combined(dtype_name, gemm_name)
        require(
            "device",
            _DEVICE.fullmatch(self.device) is not None,
            f"must be cpu, cuda, cuda:N, mps or xpu, got {self.device!r}",
        )
        for side, (dtype_name, gemm_name) in _DTYPE_AND_GEMM.items():
            for name, allowed in ((dtype_name, MODEL_DTYPES), (gemm_name, MODEL_GEMMS)):
                value = getattr(self, name)
                require(
                    name,
                    value is None or value in allowed,
                    f"must be one of {list(allowed)}, got {value!r}",
                )
                require(
                    name,
                    self.device.startswith("cpu") or value not in CPU_ONLY,
                    f"{value} runs on the CPU only, device is {self.device!r}",
                )
            # the GEMM setting the side's GEMM comes from (a null one is valid with any dtype)
            named = gemm_name if getattr(self, gemm_name) is not None else "gemm"
            _check_pair(named, self.for_side(side)[1], self.gemm_for(side))
        require(
            "simulated_costs",
            self.simulated_costs is None
            or (self.simulated_costs != "" and not self.device.startswith("cuda")),
            "must name a cost table file, on a CPU device (it stands in for a GPU)",
        )
        at_least("cache_capacity_bytes", self.cache_capacity_bytes, 1)
        at_least("cache_idle_s", self.cache_idle_s, 0)
        at_least("max_batch_size", self.max_batch_size, 1)
        require(
            "runner", self.runner in RUNNERS, f"must be one of {list(RUNNERS)}, got {self.runner!r}"
        )
        if self.max_model_len is not None:
            at_least("max_model_len", self.max_model_len, 1)
        at_least("batch_prefill_s", self.batch_prefill_s, 0)
        at_least("prefill_chunk_tokens", self.prefill_chunk_tokens, 0)
        stuck_s = self.stuck_forward_s
        require("stuck_forward_s", stuck_s > 0, f"must be > 0 seconds, got {stuck_s}")
        at_least("max_forward_failures", self.max_forward_failures, 1)
        require(
            "batch_wait_fraction",
            0 <= self.batch_wait_fraction <= 1,
            f"must be within [0, 1], got {self.batch_wait_fraction}",
        )

    def _read_combined(self, dtype_name: str, gemm_name: str) -> None:
        """Reads the old combined form of a dtype setting (``float32+dnnl``) as the dtype and
        GEMM settings it stands for, and warns naming them."""
        value = getattr(self, dtype_name)
        if value is None or "+" not in value:
            return
        dtype, _, gemm = value.partition("+")
        combined = [f"{d}+{g}" for d, gemms in DTYPE_GEMMS.items() for g in gemms if g != PLAIN]
        require(
            dtype_name,
            value in combined,
            f"must be one of {list(MODEL_DTYPES)} (or, deprecated, {combined}), got {value!r}",
        )
        require(
            dtype_name,
            self.device.startswith("cpu") or gemm not in CPU_ONLY,
            f"{value} runs on the CPU only, device is {self.device!r}",
        )
        given = getattr(self, gemm_name)
        require(
            gemm_name,
            given in (None, gemm),
            f"{dtype_name} {value!r} names the GEMM {gemm!r} already, got {given!r}",
        )
        new = f"{dtype_name}: {dtype} and {gemm_name}: {gemm}"
        log.warning("%s: %s is deprecated: write %s", dtype_name, value, new)
        object.__setattr__(self, dtype_name, dtype)
        object.__setattr__(self, gemm_name, gemm)


@dataclasses.dataclass(frozen=True)
class SpeculationConfig(Section):
    """speculation: how each request's rounds draft and verify."""

    max_speculative_tokens: int = 8
    """k_max, in tokens: the most draft tokens one round may propose, and the largest
    `num_speculative_tokens` a request may ask for (at least 1)."""

    draft_top_n: int = 64
    """When sampling, the draft draws each token from its N most likely tokens and sends that
    sparse distribution q to the target; N in tokens, 0 for the whole vocabulary. Output stays
    exact for any N."""

    dynamic_draft_length: bool = True
    """Adaptive rounds (k `auto`) draft up to `max_speculative_tokens` tokens and stop where the
    draft's confidence says one more token no longer pays; false drafts exactly the chosen k.
    A request's fixed k always drafts exactly k."""

    concurrent_prefill: bool = True
    """Prefill the draft while the target prefills (right when they run on separate devices);
    false leaves the draft's prefill to its first round, after the first token and once no
    other request of the router waits for its own (right when both share a CPU's cores, where
    running both at once slows the target's prefills, the time to first token, as much as it
    saves)."""

    alternate_phases: bool = False
    """The router never runs a draft call beside a verify call: the calls of all its requests
    alternate in phases, every waiting draft call together, then every waiting verify call
    together (specdec.decoding.phases). Right when draft and target share a CPU's cores, where
    overlapping forwards take each other's cores and break each side's batches up; false (the
    calls overlap, the rounds of different requests pipeline) when they run on separate
    devices."""

    proposer: str = AUTO
    """Who proposes each round's tokens for a request that does not say (its `proposer`):
    `auto` picks per round, by measured goodput, between the draft model, n-gram lookup in the
    request's own text (no accelerator, no extra call) and no proposal; `draft` the draft model
    (n-gram lookup only while the draft side is unavailable); `ngram` n-gram lookup only (the
    draft model is never called); `none` plain target decoding. A request's fixed
    `num_speculative_tokens` drafts that many with the draft model under `auto`."""

    ngram_max_n: int = 4
    """The longest n-gram, in tokens, that n-gram lookup matches at the end of the request's
    text; it tries the longest first, down to `ngram_min_n`, and proposes the tokens that
    followed the latest earlier occurrence (prompt lookup; Saxena 2023)."""

    ngram_min_n: int = 2
    """The shortest n-gram, in tokens, that n-gram lookup matches (at least 1)."""

    shared_ngram_bytes: int = 0
    """Size in bytes of a router-wide index over recent completions that every request's
    n-gram lookup reads after its own text (SuffixDecoding-style; Oliaro et al. 2024), the
    oldest forgotten first. 0 (the default) keeps each request to its own prompt and output.
    Turn it on only where any request may see text from any other: a proposal that the target
    accepts is text another request generated."""

    mixed_rounds: bool = True
    """Under `proposer: auto`, whether a round that calls the draft model may also verify an
    n-gram tail after the draft's tokens in the same forward, where its price says it pays
    (docs/engine.md, "Mixed rounds")."""

    pipelined_drafting: bool = False
    """While the target verifies a round, the draft drafts the next one as if the whole round
    is accepted (PEARL, Liu et al. 2025): it runs the round's tokens, drafts one more (its
    guess of the target's bonus token) and k after it. Where the target then accepts every
    token and its bonus token is that guess, the next round's tokens are already there and
    the round skips its draft call; otherwise they are dropped and the draft rolls back to the
    committed tokens. Exact either way (docs/engine.md, "Pipelined drafting"). Pays where draft
    and target run on separate devices and the draft's compute and call are a large share of a
    round; off where they share cores. Not with `alternate_phases`."""

    def _check(self) -> None:
        at_least("max_speculative_tokens", self.max_speculative_tokens, 1)
        at_least("draft_top_n", self.draft_top_n, 0)
        require(
            "proposer",
            self.proposer in PROPOSERS,
            f"must be one of {list(PROPOSERS)}, got {self.proposer!r}",
        )
        at_least("ngram_min_n", self.ngram_min_n, 1)
        at_least("ngram_max_n", self.ngram_max_n, self.ngram_min_n)
        at_least("shared_ngram_bytes", self.shared_ngram_bytes, 0)
        require(
            "pipelined_drafting",
            not (self.pipelined_drafting and self.alternate_phases),
            "cannot be on with alternate_phases (a pipelined draft runs beside a verify)",
        )


@dataclasses.dataclass(frozen=True)
class SpecdecConfig:
    """Every setting, one concern per field; built by from_args (the Serve application) or of
    (SpeculativeEngine). Settings have flat names, unique across the concerns.

    Raises:
        ConfigError naming the setting (a concern that is not of its class).
    """

    models: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    speculation: SpeculationConfig = dataclasses.field(default_factory=SpeculationConfig)
    service: ServiceConfig = dataclasses.field(default_factory=ServiceConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            require(name, isinstance(value, cls), f"must be a {cls.__name__}, got {value!r}")

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> SpecdecConfig:
        """Parses the Serve application's flat ``args`` (the keys are the settings' names).

        ``draft_model`` and ``target_model`` are required; ``~`` and environment variables in
        them are expanded here.

        Raises:
            ConfigError naming the first unknown, missing or invalid setting.
        """
        if args is None:
            args = {}
        require("args", isinstance(args, Mapping), f"must be a mapping, got {args!r}")
        config = cls().with_settings(**{str(key): value for key, value in args.items()})
        paths = {}
        for name in ("draft_model", "target_model"):
            value = getattr(config.models, name)
            require(name, value is not None, "required (a model directory, id or .gguf path)")
            paths[name] = os.path.expandvars(os.path.expanduser(value))
        return config.with_settings(**paths)

    @classmethod
    def of(
        cls,
        config: SpecdecConfig | ModelConfig | SpeculationConfig | ServiceConfig | None = None,
        **settings: Any,
    ) -> SpecdecConfig:
        """The whole config from a whole one, one concern (the others default) or None (all
        default), with the named flat ``settings`` replaced.

        Raises:
            ConfigError naming an unknown or invalid setting, or a config of another type.
        """
        if config is None:
            config = cls()
        elif not isinstance(config, cls):
            name = next((n for n, c in SECTIONS.items() if isinstance(config, c)), None)
            require("config", name is not None, f"must be a config object, got {config!r}")
            config = cls(**{name: config})
        return config.with_settings(**settings) if settings else config

    def with_settings(self, **settings: Any) -> SpecdecConfig:
        """A copy with the named flat settings replaced (each routed to its concern).

        Raises:
            ConfigError naming the first unknown or invalid setting.
        """
        settings = _renamed(settings)
        unknown = sorted(set(settings) - set(_SECTION_OF))
        if unknown:
            others = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
            raise ConfigError(
                unknown[0], f"unknown setting{others}; known: {', '.join(_SECTION_OF)}"
            )
        changed = {}
        for name in SECTIONS:
            own = {k: v for k, v in settings.items() if _SECTION_OF[k] == name}
            if own:
                changed[name] = dataclasses.replace(getattr(self, name), **own)
        return dataclasses.replace(self, **changed)

    def to_args(self) -> dict[str, Any]:
        """The flat settings, as from_args reads them."""
        return {
            field.name: getattr(getattr(self, section), field.name)
            for section, cls in SECTIONS.items()
            for field in dataclasses.fields(cls)
        }


SECTIONS: dict[str, type[Section]] = {
    field.name: field.default_factory for field in dataclasses.fields(SpecdecConfig)
}
_SECTION_OF: dict[str, str] = {
    field.name: section for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)
}


# Settings that were renamed: old name -> new name. The old name is still read, with a warning.
RENAMED = {"fixed_shape_verify": "exact_widths"}


def _renamed(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with each old name of RENAMED read as its new name (warning once per call).

    Raises:
        ConfigError: a setting given under both its old and its new name.
    """
    for old, new in RENAMED.items():
        if old in settings:
            require(old, new not in settings, f"is the old name of {new}: give only {new}")
            log.warning("%s is deprecated: it is now called %s", old, new)
            settings = {(new if k == old else k): v for k, v in settings.items()}
    return settings


_DTYPE_AND_GEMM = {"target": ("dtype", "gemm"), "draft": ("draft_dtype", "draft_gemm")}


def default_gemm(dtype: str) -> str:
    """What a null GEMM setting means for ``dtype``: `auto` for `auto`, else `plain`."""
    return AUTO if dtype == AUTO else PLAIN


def _check_pair(name: str, dtype: str, gemm: str) -> None:
    """Raises ConfigError naming the GEMM setting ``name`` unless ``gemm`` runs ``dtype`` (a
    fixed GEMM runs fixed dtypes: with `auto`, only `auto` or `plain`)."""
    runs = [AUTO, PLAIN] if dtype == AUTO else [AUTO, *DTYPE_GEMMS[dtype]]
    require(name, gemm in runs, f"must be one of {runs} with dtype {dtype}, got {gemm!r}")
