"""The static runner: sessions' forwards over a slot pool in a few fixed shapes.

Every decode forward of a model runs ``batch x width`` positions: ``width`` is fixed per call
kind (the verify width k_max + 1 for the target's verify and the draft's catch-up, 1 for a
draft step) and k = 0 runs it too; the batch is padded to a bucket (a power of two up to
models.max_batch_size) and the key length to a bucket (CONTEXT_ROUNDING x a power of two, up to
the slot length). A shape key (kind, batch, width, key length) is one CUDA graph on a GPU
(specdec.worker.static.graphs). A session's rows that do not fit one forward (a rebuild's
replay) run in earlier forwards of the same shape, its last rows in the final one; its prompt
runs alone as one prefill forward, eagerly, as it first did, so a rebuilt slot holds bitwise
what the uninterrupted one held.

Exactness. A position's logits are the same whatever shares its forward if the shapes a row
can meet compute it identically: the width never changes, and measure_invariant_shapes keeps
only the batch buckets and key lengths whose forwards give a row bitwise the result of the
widest batch and the longest key length, measured on this device at start-up (GEMM kernels
choose their tiling by the number of rows; an attention kernel may split a long key range).

Acceptance. A verify returns, per session, the target's greedy tokens and their
log-probabilities from the first scored row on and how many drafts match (forward.greedy_outcome,
on the device), and, for a sampled session, its logits rows on the host for the rejection
sampler. A greedy draft chains its k steps on the device (each step's argmax is the next
step's input) and the host reads all k tokens once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from specdec.models.loading import LoadedModel
from specdec.worker.kv_cache import SessionEntry
from specdec.worker.packed import supports_packing
from specdec.worker.static.forward import (
    STATIC_ATTENTION,
    draft_next,
    greedy_outcome,
    static_forward,
)
from specdec.worker.static.graphs import StepGraphs
from specdec.worker.static.slots import CONTEXT_ROUNDING, SlotCache, SlotLayout, SlotPool

VERIFY, DRAFT = "verify", "draft"


@dataclasses.dataclass
class VerifyJob:
    """One session's part of a verify.

    Attributes:
        entry: the session's cache entry (a SlotCache); its cached_ids grow by ``rows``.
        rows: the tokens to run after the cached ones (pending committed tokens, then drafts).
        drafts: the k draft tokens (the last k of ``head`` rows + ``rows``).
        head: [h, V] logits rows that precede ``rows`` (the prompt prefill's last rows, when
            the scored rows begin inside the prompt), or None.
        host_logits: return the k + 1 scored rows' logits on the host (a sampled session).
    """

    entry: SessionEntry
    rows: list[int]
    drafts: list[int]
    head: torch.Tensor | None = None
    host_logits: bool = False


@dataclasses.dataclass
class VerifyOutcome:
    """tokens, log_probs: the target's greedy token at each scored row and its
    log-probability; accepted: leading drafts equal to them; logits: [k + 1, V] on the host
    when asked for."""

    tokens: list[int]
    log_probs: list[float]
    accepted: int
    logits: torch.Tensor | None = None


class StaticRunner:
    """One model's forwards over a slot pool, in fixed shapes (captured as CUDA graphs on a GPU).

    Args:
        loaded: the model, in the dtype it serves in, on its device.
        layout: the slot pool's shape (specdec.worker.static.slots.slot_layout); its width is
            the verify width.
        max_batch_size: the widest batch bucket.
        capture: record CUDA graphs (None: on a CUDA device).
    Raises:
        ValueError: the model is not Llama-like (specdec.worker.packed.supports_packing).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        layout: SlotLayout,
        max_batch_size: int,
        capture: bool | None = None,
    ) -> None:
        reason = supports_packing(loaded.model)
        if reason is not None:
            raise ValueError(f"the static runner needs a Llama-like model: {reason}")
        loaded.model.set_attn_implementation(STATIC_ATTENTION)
        self.loaded, self.layout = loaded, layout
        self.device = loaded.model.device
        self.pool = SlotPool(layout, self.device)
        self.width = layout.width
        self.batch_buckets = _powers_of_two_up_to(1, max_batch_size)
        self.key_lens = _powers_of_two_up_to(CONTEXT_ROUNDING, layout.slot_len)
        if capture is None:
            capture = self.device.type == "cuda"
        self.graphs = StepGraphs(self._step, capture)

    # -- the captured step ---------------------------------------------------------------

    def _step(self, key: tuple, ids, positions, slots, first, drafts) -> tuple[torch.Tensor, ...]:
        kind, _, _, key_len = key
        model, vocab = self.loaded.model, self.loaded.vocab_size
        logits = static_forward(model, self.pool, ids, positions, slots, key_len)
        if kind == VERIFY:
            return (*greedy_outcome(logits, first, drafts, vocab), logits)
        return (*draft_next(logits, first, vocab), logits)

    def run(
        self,
        kind: str,
        batch: list[tuple[SessionEntry, list[int]]],
        width: int,
        first: list[int] | None = None,
        drafts: list[list[int]] | None = None,
        key_len: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """One forward of ``batch`` (each session's entry and its 1..width tokens, which its
        cached_ids then record), padded to a batch bucket, the width and a key-length bucket.

        Args:
            kind: VERIFY (outputs: greedy_outcome's tokens, log_probs, accepted, then logits)
                or DRAFT (draft_next's tokens and confidences, then logits).
            first: per session, VERIFY's first scored row or DRAFT's last real row (0 if None).
            drafts: per session, VERIFY's draft tokens (none if None).
            key_len: the key length (None: the smallest kept bucket that holds every row).
        Returns:
            The step's outputs, [bucket, ...] (rows past len(batch) are padding); on a GPU the
            graph's static tensors, valid until the next call of the same shape.
        Raises:
            ValueError: a session's rows would pass its slot.
        """
        size = self._bucket(self.batch_buckets, len(batch), "batch")
        ids = [[0] * width for _ in range(size)]
        positions = [list(range(width)) for _ in range(size)]
        slots = [self.pool.scratch] * size
        longest = width
        for b, (entry, tokens) in enumerate(batch):
            start = len(entry.cached_ids)
            if start + width > self.layout.slot_len:
                raise ValueError(
                    f"a session of {start + len(tokens)} tokens passes the context limit "
                    f"of {self.layout.context_limit} (models.max_model_len)"
                )
            ids[b] = tokens + tokens[-1:] * (width - len(tokens))
            positions[b] = list(range(start, start + width))
            slots[b] = entry.cache.slot
            entry.cached_ids.extend(tokens)
            longest = max(longest, start + width)
        rows = [0] * size if first is None else first + [0] * (size - len(first))
        padded = [d + [-1] * (width - 1 - len(d)) for d in drafts or []]
        padded += [[-1] * (width - 1)] * (size - len(padded))
        key_len = key_len or self._bucket(self.key_lens, longest, "key length")
        inputs = self._to_device([ids, positions, slots, rows, padded], size, width)
        return self.graphs((kind, size, width, key_len), *inputs)

    def _to_device(self, lists: list[list], size: int, width: int) -> list[torch.Tensor]:
        """The host's ids, positions, slots, rows and drafts as device tensors of shapes [size,
        width], [size, width], [size], [size], [size, width - 1], in one copy: a synchronous
        copy per tensor would make the host wait for the device's queue each time."""
        flat = [v for values in lists for v in _flatten(values)]
        host = torch.tensor(flat, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory().to(self.device, non_blocking=True)
        shapes = [(size, width), (size, width), (size,), (size,), (size, width - 1)]
        out, start = [], 0
        for shape in shapes:
            count = shape[0] * (shape[1] if len(shape) > 1 else 1)
            out.append(host[start : start + count].view(shape))
            start += count
        return out

    # -- prefill -------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, entry: SessionEntry, tokens: list[int], num_logits: int) -> torch.Tensor:
        """Runs a prompt alone in one eager forward of its own width into the session's slot.

        Returns:
            [num_logits, vocab] logits of its last positions (model dtype, on the device).
        Raises:
            ValueError: the prompt passes the context limit.
        """
        start = len(entry.cached_ids)
        if start + len(tokens) > self.layout.context_limit:
            raise ValueError(
                f"a prompt of {start + len(tokens)} tokens passes the context limit of "
                f"{self.layout.context_limit} (models.max_model_len)"
            )
        device = self.device
        key_len = self._bucket(self.key_lens, start + len(tokens), "key length")
        # The lm_head runs on the prompt's last rows only, as many whatever num_logits is (a
        # prompt's logits must not depend on how many a call asks for: k decides that).
        logits = static_forward(
            self.loaded.model,
            self.pool,
            torch.tensor([tokens], device=device),
            torch.arange(start, start + len(tokens), device=device)[None],
            torch.tensor([entry.cache.slot], device=device),
            key_len,
            last_rows=max(num_logits, min(len(tokens), self.width)),
        )
        entry.cached_ids.extend(tokens)
        return logits[0, -num_logits:, : self.loaded.vocab_size]

    # -- verify --------------------------------------------------------------------------

    @torch.inference_mode()
    def verify(self, jobs: list[VerifyJob]) -> list[VerifyOutcome]:
        """Runs every job's rows in forwards of the verify width (earlier rows in earlier
        forwards, the last <= width rows of every job in one final forward) and scores each
        job's k + 1 last positions.

        Returns:
            Per job, its VerifyOutcome (one host sync for all of them).
        """
        finals, results = self._run_waves(jobs), []
        outcomes = self._outcomes(jobs, finals)
        # Token ids are exact in float32 (< 2^24): one tensor, one copy to the host.
        host = [torch.cat([o[0].float(), o[1], o[2].float()[None]]) for o in outcomes]
        values = torch.stack(host).cpu() if host else torch.empty(0)
        for job, outcome, row in zip(jobs, outcomes, values):
            k = len(job.drafts)
            results.append(
                VerifyOutcome(
                    [int(t) for t in row[: k + 1]],
                    row[self.width : self.width + k + 1].tolist(),
                    int(row[-1]),
                    outcome[3].cpu() if job.host_logits else None,
                )
            )
        return results

    def _run_waves(self, jobs: list[VerifyJob]) -> tuple[torch.Tensor, ...] | None:
        """Runs the jobs' rows; returns the final forward's outputs (None when no job has rows)."""
        chunks = [_chunks_from_end(job.rows, self.width) for job in jobs]
        depth = max((len(c) for c in chunks), default=0)
        outputs = None
        for wave in range(depth - 1, -1, -1):  # the deepest (earliest) rows first
            batch, first, drafts = [], [], []
            for job, pieces in zip(jobs, chunks):
                if len(pieces) > wave:
                    piece = pieces[len(pieces) - 1 - wave]
                    batch.append((job.entry, piece))
                    first.append(max(len(piece) - len(job.drafts) - 1, 0))
                    drafts.append(job.drafts if wave == 0 else [])
            outputs = self.run(VERIFY, batch, self.width, first, drafts)
        return outputs

    def _outcomes(self, jobs: list[VerifyJob], finals) -> list[tuple[torch.Tensor, ...]]:
        """Per job (tokens [W], log_probs [W], accepted [], scored logits [k + 1, V])."""
        outcomes, row = [], 0
        for job in jobs:
            k = len(job.drafts)
            last = len(job.rows[-self.width :])  # the final forward's real rows of this job
            if job.rows and last >= k + 1 and job.head is None:
                scored = finals[3][row, last - k - 1 : last, : self.loaded.vocab_size]
                outcomes.append((finals[0][row], finals[1][row], finals[2][row], scored))
            else:
                tail = finals[3][row, :last] if job.rows else None
                outcomes.append(self._outcome_of_rows(job, tail))
            row += 1 if job.rows else 0
        return outcomes

    def _outcome_of_rows(self, job: VerifyJob, tail: torch.Tensor | None) -> tuple:
        """greedy_outcome of scored rows that came (partly) from a prefill, in the shape of the
        smallest verify bucket, so each row is reduced as a verify forward reduces it."""
        vocab = self.loaded.vocab_size
        parts = [job.head] if job.head is not None else []
        parts += [tail[:, :vocab]] if tail is not None else []
        k = len(job.drafts)
        scored = torch.cat(parts)[-(k + 1) :]
        size = self.batch_buckets[0]
        logits = scored.new_zeros(size, self.width, scored.shape[-1])
        logits[0, : k + 1] = scored
        drafts = torch.full((size, self.width - 1), -1, device=scored.device)
        drafts[0, :k] = torch.tensor(job.drafts, device=scored.device, dtype=torch.long)
        first = torch.zeros(size, dtype=torch.long, device=scored.device)
        tokens, log_probs, accepted = greedy_outcome(logits, first, drafts, vocab)
        return tokens[0], log_probs[0], accepted[0], scored

    # -- draft ---------------------------------------------------------------------------

    @torch.inference_mode()
    def catch_up(
        self, feeds: list[tuple[SessionEntry, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feeds each session its pending tokens (a prompt not yet cached as its prefill, the
        rest in forwards of the verify width) and picks its greedy next token.

        Returns:
            tokens [n], confidences [n] (draft_next) and logits [n, vocab] after each session's
            last token, on the device.
        """
        picked: list = [None] * len(feeds)
        jobs = []
        for i, (entry, tokens) in enumerate(feeds):
            if entry.prompt_left:  # the prompt, or its last chunk
                logits = self.prefill(entry, tokens, 1)[None]
                last = torch.zeros(1, dtype=torch.long, device=self.device)
                token, confidence = draft_next(logits, last, self.loaded.vocab_size)
                picked[i] = (token[0], confidence[0], logits[0, 0])
            else:
                jobs.append(i)
        chunks = [_chunks_from_end(feeds[i][1], self.width) for i in jobs]
        for wave in range(max((len(c) for c in chunks), default=0) - 1, -1, -1):
            members = [(i, c[len(c) - 1 - wave]) for i, c in zip(jobs, chunks) if len(c) > wave]
            batch = [(feeds[i][0], piece) for i, piece in members]
            out = self.run(DRAFT, batch, self.width, [len(p) - 1 for _, p in members])
            if wave == 0:
                for b, (i, piece) in enumerate(members):
                    row = out[2][b, len(piece) - 1, : self.loaded.vocab_size]
                    picked[i] = (out[0][b].clone(), out[1][b].clone(), row.clone())
        tokens, confidences, logits = zip(*picked)
        return torch.stack(tokens), torch.stack(confidences), torch.stack(logits)

    @torch.inference_mode()
    def chain(
        self, entries: list[SessionEntry], tokens: torch.Tensor, steps: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``steps`` greedy draft steps chained on the device: each step feeds every session
        the token the last one picked (``tokens`` [n] at first) at its next position.

        The sessions' cached_ids are not extended: the caller records the tokens it keeps
        (the slots hold all of them; positions past cached_ids are masked).

        Returns:
            tokens, confidences: [n, steps] (device).
        """
        n = len(entries)
        size = self._bucket(self.batch_buckets, n, "batch")
        starts = [len(e.cached_ids) for e in entries] + [0] * (size - n)
        slots = [e.cache.slot for e in entries] + [self.pool.scratch] * (size - n)
        key_len = self._bucket(self.key_lens, max(starts) + steps, "key length")
        device = self.device
        ids = torch.zeros(size, 1, dtype=torch.long, device=device)
        ids[:n, 0] = tokens
        positions = torch.tensor(starts, device=device)[:, None]
        slot_ids = torch.tensor(slots, device=device)
        last = torch.zeros(size, dtype=torch.long, device=device)
        none = torch.full((size, self.width - 1), -1, device=device)
        picked, confidences = [], []
        for _ in range(steps):
            out = self.graphs((DRAFT, size, 1, key_len), ids, positions, slot_ids, last, none)
            picked.append(out[0][:n].clone())
            confidences.append(out[1][:n].clone())
            ids = out[0][:, None].clone()
            positions = positions + 1
        if not picked:
            empty = torch.empty(n, 0, device=device)
            return empty.long(), empty
        return torch.stack(picked, 1), torch.stack(confidences, 1)

    # -- shapes --------------------------------------------------------------------------

    @torch.inference_mode()
    def benchmark_forward(self, batch: int, width: int, repeats: int = 20) -> float:
        """Seconds per forward of ``batch`` sessions x ``width`` positions, replayed on the
        scratch slot (as the service would run it: captured on a GPU), after one warm-up."""
        entries = [_scratch_entry(self.pool.scratch) for _ in range(batch)]
        kind = VERIFY if width > 1 else DRAFT

        def once() -> None:
            for entry in entries:
                entry.cached_ids.clear()
            self.run(kind, [(e, [0] * width) for e in entries], width)

        return self._seconds_per_call(once, repeats)

    @torch.inference_mode()
    def benchmark_draft(self, batch: int, k: int, repeats: int = 10) -> float:
        """Seconds for a catch-up of one token and ``k - 1`` chained steps of ``batch``
        sessions on the scratch slot: a greedy draft of k tokens."""
        entries = [_scratch_entry(self.pool.scratch) for _ in range(batch)]

        def once() -> None:
            for entry in entries:
                entry.cached_ids[:] = [0]
            tokens, _, _ = self.catch_up([(e, [0]) for e in entries])
            self.chain(entries, tokens, k - 1)

        return self._seconds_per_call(once, repeats)

    def _seconds_per_call(self, once: Callable[[], None], repeats: int) -> float:
        """Mean seconds of ``once`` over ``repeats`` calls after one warm-up, device work
        included."""
        once()
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(repeats):
            once()
        synchronize(self.device)
        return (time.perf_counter() - start) / repeats

    def _bucket(self, buckets: list[int], size: int, what: str) -> int:
        for bucket in buckets:
            if bucket >= size:
                return bucket
        raise ValueError(f"a {what} of {size} exceeds the largest bucket, {buckets[-1]}")


def _flatten(values: list) -> list[int]:
    return [v for row in values for v in row] if values and isinstance(values[0], list) else values


def _chunks_from_end(tokens: list[int], width: int) -> list[list[int]]:
    """``tokens`` cut into pieces of ``width`` from the end (the first piece may be shorter),
    so that the last piece holds the last min(len, width) tokens."""
    ends = list(range(len(tokens), 0, -width))[::-1]
    return [tokens[max(end - width, 0) : end] for end in ends]


def _powers_of_two_up_to(smallest: int, largest: int) -> list[int]:
    """smallest, 2 x smallest, ... below ``largest``, then ``largest``."""
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def _scratch_entry(scratch: int) -> SessionEntry:
    return SessionEntry(cache=SlotCache(scratch))


class CallClock:
    """Seconds from its creation to stop() of the work a call queues on a device, read once
    the call has synced with the host anyway: CUDA events on a GPU, so timing a part of a call
    costs no sync of its own; the host's clock elsewhere, where every forward is synchronous."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._events[0].record()
        self._start, self._stop = time.perf_counter(), 0.0

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._stop = time.perf_counter()

    def seconds(self) -> float:
        """The measured seconds (on a GPU, after the call's host sync)."""
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1000
        return self._stop - self._start


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op off CUDA, where every call is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
