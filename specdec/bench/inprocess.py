"""The bench's in-process modes, on the service's own model files and token ids.

- ``engine``: specdec.engine.SpeculativeEngine in this process, the service's dtypes and k.
- ``plain_generate``: the target alone with transformers' ``generate`` (greedy, or sampling
  with the same temperature), in the dtype measured fastest here for the run's requests
  (choose_dtype over predicted_request_s).
- ``hf_assisted``: ``generate(assistant_model=...)``, the target in plain_generate's dtype, the
  draft in the service's draft dtype (an int8 draft is the same dynamically quantized int8
  draft), with the assistant settings measured fastest on the first prompt (HF_SETTINGS).

Each loads after the service runs are done and frees its models before the next one loads
(close), so memory holds one mode's models at a time; a mode whose models do not fit in the
memory available is skipped with a printed reason (fits_in_memory).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specdec.bench.datasets import BenchPrompt
from specdec.bench.figures import ENGINE, HF_ASSISTED, PLAIN, Run

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 4}  # int8 loads as float32
MEMORY_MARGIN = 1.3  # activations, KV caches, allocator slack over the weights
RAY_MEMORY_THRESHOLD = 0.95  # Ray's default memory_usage_threshold (its memory monitor)
DTYPE_PICK_TOKENS = 16  # new tokens of the timed generate that picks plain_generate's dtype
# Assisted-generation settings tried on the first prompt (set on the assistant's
# generation_config, where transformers reads them). "defaults" is transformers 5's: a constant
# 20-token block cut by a 0.4 confidence stop; "heuristic" the schedule transformers used by
# default before (start at 5, +2 after a full acceptance, -1 otherwise); "constant k_max" a fixed
# block of the service's k_max with no confidence stop (what the service does at fixed k).
HF_SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
    },
    "heuristic": {
        "num_assistant_tokens": 5,
        "num_assistant_tokens_schedule": "heuristic",
        "assistant_confidence_threshold": 0.4,
    },
    "constant k_max": {
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    },
}
HF_TUNE_TOKENS = 32  # new tokens of each timed assisted run


def say(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


def candidate_dtypes(device: str, gemms: bool = False) -> list[str]:
    """What plain_generate tries: float32 and bfloat16 on a CPU, bfloat16 and float16 on a GPU;
    with ``gemms``, on a CPU also the service's GEMM candidates where the CPU has them (each
    dtype on oneDNN's reordered weights, "float32+dnnl" and "bfloat16+dnnl", and float32 on
    bfloat16-stored weights, "float32+bf16w": specdec.device.gemm), so that a speedup over it
    is speculation's alone."""
    if device.startswith("cuda"):
        return ["bfloat16", "float16"]
    dtypes = ["float32", "bfloat16"]
    if not gemms:
        return dtypes
    from specdec.device.calibration.candidates import bf16_weights_candidates, onednn_candidates

    switched = [*(c for d in dtypes for c in onednn_candidates(d)), *bf16_weights_candidates()]
    return dtypes + [str(c) for c in switched]


def dtype_bytes(candidate: str) -> int:
    """Bytes a weight takes once loaded as ``candidate`` ("bfloat16+dnnl" and "float32+bf16w":
    bfloat16's 2)."""
    from specdec.device.calibration.candidates import Candidate
    from specdec.device.gemm import BF16_WEIGHTS

    parsed = Candidate.parse(candidate)
    if parsed.gemm == BF16_WEIGHTS:
        return DTYPE_BYTES["bfloat16"]
    return DTYPE_BYTES.get(parsed.dtype, 4)


def predicted_request_s(seconds: float, ttft_s: float, tokens: int, max_new_tokens: int) -> float:
    """Seconds a request of ``max_new_tokens`` would take, from a timed generate of ``tokens``
    new tokens that took ``seconds``, ``ttft_s`` of them to the first token: the prefill plus
    max_new_tokens - 1 decode steps at the timed rate.

    A dtype's prefill and decode step can rank apart: under AVX2 emulation on an AVX-512 BF16
    EPYC, bfloat16 prefilled at 50 ms a token against float32's 15-24 but decoded faster, so a
    short timed generate picks float32, while a 128-token request runs faster in bfloat16.
    """
    if tokens < 2:
        return seconds
    return ttft_s + (max_new_tokens - 1) * decode_step_s(seconds, ttft_s, tokens)


def decode_step_s(seconds: float, ttft_s: float, tokens: int) -> float:
    """Seconds per decode step of a timed generate (as predicted_request_s; 1 token: its
    time after the first token, which is 0 or near it)."""
    return (seconds - ttft_s) / max(tokens - 1, 1)


def choose_dtype(
    candidates: Sequence[str], measure: Callable[[str], float | None]
) -> tuple[str, dict[str, float | None]]:
    """Times each candidate with ``measure`` (seconds; None: it could not run) and returns the
    fastest with every timing. Ties go to the earlier candidate.

    Raises:
        RuntimeError: no candidate could run.
    """
    timings = {dtype: measure(dtype) for dtype in candidates}
    usable = [d for d in candidates if timings[d] is not None]
    if not usable:
        raise RuntimeError(f"no dtype of {list(candidates)} could run: {timings}")
    return min(usable, key=lambda d: timings[d]), timings


# --- memory -------------------------------------------------------------------------------------


def memory_available(device: str) -> int | None:
    """Bytes free for new models: on a GPU its free memory; on a CPU MemAvailable from
    /proc/meminfo less the headroom Ray's memory monitor keeps (ray_monitor_headroom), since a
    local cluster (`specdec serve --local`) shares this memory; None when unknown."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    meminfo = _meminfo_bytes()
    if "MemAvailable" not in meminfo:
        return None
    headroom = ray_monitor_headroom(meminfo.get("MemTotal", 0))
    return max(meminfo["MemAvailable"] - headroom, 0)


def ray_monitor_headroom(total_bytes: int) -> int:
    """Bytes Ray's memory monitor wants free on a node of ``total_bytes``: it kills workers
    (the Serve controller and replicas among them) once used memory passes
    RAY_memory_usage_threshold of the total (default RAY_MEMORY_THRESHOLD). A bench that loaded
    its models up to MemAvailable set it off on a 24 GiB CPU node: float32 plain_generate plus
    the assistant of hf_assisted beside the service's two replicas."""
    # Ray's own spelling: its raylet reads RAY_<config name> for every RAY_CONFIG setting.
    variable = "RAY_memory_usage_threshold"  # noqa: SIM112
    try:
        threshold = float(os.environ.get(variable, RAY_MEMORY_THRESHOLD))
    except ValueError:
        threshold = RAY_MEMORY_THRESHOLD
    return int(total_bytes * (1.0 - min(max(threshold, 0.0), 1.0)))


def _meminfo_bytes() -> dict[str, int]:
    """/proc/meminfo's kB fields in bytes (empty where there is none)."""
    fields = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return fields


def model_bytes(spec: str, dtype: str) -> int | None:
    """Bytes the weights of the model at ``spec`` take once loaded in ``dtype``: its weight
    files' size scaled from their stored dtype (config.json) to ``dtype``; None when unknown
    (a GGUF file, a cached id)."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        return None
    files = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin")]
    if not files:
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    stored = DTYPE_BYTES.get(config.get("torch_dtype") or config.get("dtype"), 4)
    return sum(p.stat().st_size for p in files) * dtype_bytes(dtype) // stored


def fits_in_memory(mode: str, models: Sequence[tuple[str, str]], device: str) -> bool:
    """Whether ``models`` ([(path, dtype)]) fit in the memory available with MEMORY_MARGIN;
    prints why not (or that it cannot tell, and goes ahead)."""
    sizes = [model_bytes(spec, dtype) for spec, dtype in models]
    free = memory_available(device)
    if free is None or any(s is None for s in sizes):
        say(f"{mode}: cannot estimate its memory here; loading anyway")
        return True
    need = int(sum(sizes) * MEMORY_MARGIN)
    if need > free:
        say(
            f"{mode} skipped: its models need about {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB available ({device})"
        )
        return False
    return True


def free_memory(device: str) -> None:
    """Collects freed models now (the caller dropped its references)."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# --- generate -----------------------------------------------------------------------------------


def load_as(spec: str, candidate: str, device: str, rows_hint: int = 1):
    """load_model in a calibration candidate's dtype ("bfloat16+dnnl": bfloat16), its linear
    layers on the candidate's GEMM (specdec.device.gemm.set_gemm; oneDNN's weights reordered
    for calls of about ``rows_hint`` rows), as a replica that chose it runs them.

    Raises:
        ModelLoadError: as load_model; ValueError: as set_gemm.
    """
    from specdec.device.calibration.candidates import Candidate
    from specdec.device.gemm import set_gemm
    from specdec.models.loading import load_model

    parsed = Candidate.parse(candidate)
    loaded = load_model(spec, dtype=parsed.dtype, device=device)
    set_gemm(loaded.model, parsed.gemm, rows_hint)
    return loaded


@contextlib.contextmanager
def _quiet_transformers():
    """generate() warns about arguments every call; the bench's own output is the point."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class FirstTokenClock:
    """A generate() streamer that only notes when the first new token arrives (TTFT)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._puts = 0

    def put(self, value) -> None:
        self._puts += 1  # the first put is the prompt
        if self._puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def prompt_ids(tokenizer, prompt: BenchPrompt) -> list[int]:
    """The prompt's token ids exactly as the router encodes them."""
    from specdec.decoding.request import encode_prompt

    fields = prompt.request_fields()
    return encode_prompt(tokenizer, fields.get("prompt"), fields.get("messages"))


def generate(
    target, ids: list[int], max_new_tokens: int, sampling: dict[str, Any], mode: str, **extra
) -> Run:
    """One ``target.model.generate`` call (a specdec LoadedModel) on ``ids``: greedy at
    temperature 0, else sampling at the request's temperature / top-p / top-k, seeded; no
    repetition penalty or other default of the model's generation config; stops at the target's
    EOS ids as the service does. ``extra`` goes to generate (e.g. ``assistant_model``)."""
    import torch

    temperature = sampling.get("temperature") or 0.0
    kwargs: dict[str, Any] = {"do_sample": temperature > 0, "repetition_penalty": 1.0}
    if temperature > 0:
        kwargs.update(
            temperature=temperature,
            top_p=sampling.get("top_p") or 1.0,
            top_k=sampling.get("top_k") or 0,
        )
        torch.manual_seed(sampling.get("seed") or 0)
    device = target.model.device
    clock = FirstTokenClock()
    with torch.inference_mode(), _quiet_transformers():
        out = target.model.generate(
            torch.tensor([ids], device=device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(target.eos_token_ids),
            pad_token_id=target.tokenizer.pad_token_id,
            streamer=clock,
            **kwargs,
            **extra,
        )
        token_ids = [int(t) for t in out[0, len(ids) :]]  # EOS kept, as the service keeps it
    seconds = time.perf_counter() - clock.start
    text = target.tokenizer.decode(token_ids, skip_special_tokens=True)
    ttft = (clock.first or time.perf_counter()) - clock.start
    return Run(mode, token_ids, text, len(token_ids) / seconds, ttft)


# --- the modes ----------------------------------------------------------------------------------


class PlainGenerate:
    """The target alone with transformers' generate, in the dtype measured fastest here.

    Args:
        target_model: the service's target model files.
        device: "cpu" or "cuda[:N]".
        first_prompt: the prompt the dtype pick times (DTYPE_PICK_TOKENS new tokens after a
            2-token warm-up generate, per candidate_dtypes).
        max_new_tokens: the run's new tokens per request; the dtype picked is the one whose
            timed generate predicts the shortest such request (predicted_request_s).
    Attributes:
        dtype: the chosen dtype; timings: each candidate's predicted request, in seconds.
        pick: per candidate, (time to first token, seconds per decode step) of its timed
            generate.
    """

    def __init__(
        self,
        target_model: str,
        device: str,
        first_prompt: BenchPrompt,
        max_new_tokens: int,
        gemms: bool = False,
    ) -> None:
        loaded: dict[str, Any] = {}
        self.pick: dict[str, tuple[float, float]] = {}

        def measure(dtype: str) -> float | None:
            loaded.clear()  # one candidate in memory at a time
            free_memory(device)
            try:
                model = load_as(target_model, dtype, device)
            except Exception as err:  # noqa: BLE001 - a dtype the device lacks is skipped
                say(f"plain_generate: {dtype} cannot load here ({err})")
                return None
            loaded[dtype] = model
            ids = prompt_ids(model.tokenizer, first_prompt)
            greedy = {"temperature": 0.0}
            generate(model, ids, 2, greedy, PLAIN)  # warm-up: first-call kernel set-up
            timed = generate(
                model, ids, DTYPE_PICK_TOKENS, greedy, PLAIN, min_new_tokens=DTYPE_PICK_TOKENS
            )
            tokens = len(timed.token_ids)
            seconds = tokens / timed.tokens_per_second
            self.pick[dtype] = (timed.ttft_s, decode_step_s(seconds, timed.ttft_s, tokens))
            return predicted_request_s(seconds, timed.ttft_s, tokens, max_new_tokens)

        self.dtype, self.timings = choose_dtype(candidate_dtypes(device, gemms), measure)
        self.target = loaded.pop(self.dtype, None)
        loaded.clear()
        if self.target is None:  # the fastest was not the last one measured
            free_memory(device)
            self.target = load_as(target_model, self.dtype, device)
        say(
            f"plain_generate: a {max_new_tokens}-token request on the first prompt, predicted "
            f"from {DTYPE_PICK_TOKENS} timed greedy tokens: {self.pick_text()}; using {self.dtype}"
        )

    def pick_text(self) -> str:
        """Each candidate's predicted request and what it came from, in words."""
        return ", ".join(
            f"{d} -"
            if s is None
            else f"{d} {s:.1f} s (TTFT {self.pick[d][0] * 1e3:.0f} ms, "
            f"{self.pick[d][1] * 1e3:.0f} ms a token)"
            for d, s in self.timings.items()
        )

    def run(self, prompt: BenchPrompt, max_new_tokens: int, sampling: dict[str, Any]) -> Run:
        ids = prompt_ids(self.target.tokenizer, prompt)
        return generate(self.target, ids, max_new_tokens, sampling, PLAIN)

    def close(self) -> None:
        self.target = None


class HFAssisted:
    """Hugging Face assisted generation (``generate(assistant_model=...)``) in this process.

    Args:
        target: the target, loaded (plain_generate's, in its fastest dtype), or None to load
            ``target_model`` in ``target_dtype``.
        draft_model, draft_dtype: the service's draft files and dtype (an int8 draft is quantized
            exactly as the draft replica's, a "+dnnl" one runs the replica's GEMM: load_as).
        k_max: the service's k_max (the "constant k_max" setting's block).
        device: "cpu" or "cuda[:N]".
    Attributes:
        setting: the HF_SETTINGS name in use; settings_timings: seconds per setting when tuned.
    """

    def __init__(
        self,
        target,
        draft_model: str,
        draft_dtype: str,
        *,
        k_max: int,
        device: str,
        target_model: str | None = None,
        target_dtype: str | None = None,
    ) -> None:
        from specdec.models.loading import check_same_tokenizer

        self.target = target or load_as(target_model, target_dtype, device, rows_hint=k_max + 1)
        self.draft = load_as(draft_model, draft_dtype, device)
        check_same_tokenizer(self.draft.tokenizer, self.target.tokenizer)
        self.k_max = k_max
        self.setting = "defaults"
        self.settings_timings: dict[str, float] = {}

    def settings(self, name: str) -> dict[str, Any]:
        values = dict(HF_SETTINGS[name])
        values.setdefault("num_assistant_tokens", self.k_max)
        return values

    def tune(self, prompt: BenchPrompt, max_new_tokens: int) -> None:
        """Keeps the HF_SETTINGS entry fastest on one greedy run of ``prompt`` (after a
        warm-up under the first setting)."""
        tokens = min(max_new_tokens, HF_TUNE_TOKENS)
        greedy = {"temperature": 0.0}
        self.run(prompt, tokens, greedy)
        for name in HF_SETTINGS:
            self.setting = name
            self.settings_timings[name] = self.run(prompt, tokens, greedy).seconds
        self.setting = min(self.settings_timings, key=self.settings_timings.get)
        timings = ", ".join(f"{n} {s:.2f} s" for n, s in self.settings_timings.items())
        say(f"hf_assisted: {tokens} greedy tokens of the first prompt took {timings}")

    def describe(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in self.settings(self.setting).items())
        return f"{self.setting} ({values})"

    def run(self, prompt: BenchPrompt, max_new_tokens: int, sampling: dict[str, Any]) -> Run:
        # Set before every call: the heuristic schedule writes its block size back into the
        # assistant's generation_config.
        for key, value in self.settings(self.setting).items():
            setattr(self.draft.model.generation_config, key, value)
        ids = prompt_ids(self.target.tokenizer, prompt)
        return generate(
            self.target,
            ids,
            max_new_tokens,
            sampling,
            HF_ASSISTED,
            assistant_model=self.draft.model,
        )

    def close(self) -> None:
        self.target = self.draft = None


class EngineMode:
    """specdec.engine.SpeculativeEngine in this process: the service's models, dtypes, k_max and
    k, a request's ``proposer`` (None: the engine's default), the engine's default settings
    otherwise."""

    def __init__(self, info, device: str, k: int | None, proposer: str | None = None) -> None:
        from specdec.engine import SpeculativeEngine

        # The replicas' chosen dtypes (and GEMM), measured again here like a replica does.
        self.engine = SpeculativeEngine.from_pretrained(
            info.draft_model,
            info.target_model,
            dtype=info.target_dtype,
            draft_dtype=info.draft_dtype,
            device=device,
            max_speculative_tokens=info.max_speculative_tokens,
        )
        self.k = "auto" if k is None else k
        self.proposer = proposer

    def run(self, prompt: BenchPrompt, max_new_tokens: int, sampling: dict[str, Any]) -> Run:
        from specdec.decoding.sampling import SamplingParams

        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=sampling.get("temperature") or 0.0,
            seed=sampling.get("seed"),
        )
        fields = prompt.request_fields()
        out = self.engine.generate(
            fields.get("prompt"),
            params,
            self.k,
            messages=fields.get("messages"),
            proposer=self.proposer,
        )
        stats = out.stats
        return Run(ENGINE, out.token_ids, out.text, stats.tokens_per_second, stats.ttft_s, stats)

    def close(self) -> None:
        self.engine = None
