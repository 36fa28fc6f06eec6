"""The target side: scores k draft tokens in one forward pass and decides which to keep."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdec.config import SpecdecConfig
from specdec.device.calibration.candidates import Candidate
from specdec.device.calibration.load import calibrate
from specdec.device.calibration.results import Calibration, ExactWidths
from specdec.device.exact_widths import use_row_wise_attention
from specdec.models.loading import LoadedModel
from specdec.v1 import worker_pb2
from specdec.worker.kv_cache import ActiveSession
from specdec.worker.packed import Segment, packed_forward, prepare_packing, supports_packing
from specdec.worker.rejection import verify_greedy, verify_sampled
from specdec.worker.sampling import processed_probs, request_generator, sparse_to_dense
from specdec.worker.session import PREFILLING, SessionModel, answer_alone

TARGET_STREAM = "target"


class TargetVerifier(SessionModel):
    """Runs the target model over session caches.

    Args:
        loaded: as SessionModel, in the dtype it will run in.
        config: the session cache bound (as SessionModel), k_max, and
            models.exact_widths: unless it is False, every decode forward is padded to
            one of the widths the device calibration found exact (``exact``), with row-wise
            attention, so a position's logits do not depend on k, and a rebuild replays the
            prompt's prefill (specdec.device.exact_widths explains why).
        calibration: what the replica measured at start-up (specdec.device.calibration.load);
            None measures it now, in the loaded dtype.
    Attributes:
        exact: the exact widths and their costs; None when exact widths are off
            (exact_widths: false) or the device has no exact-width set (logged).
    """

    def __init__(
        self, loaded: LoadedModel, config: SpecdecConfig, calibration: Calibration | None = None
    ) -> None:
        if calibration is None:
            loaded, calibration = calibrate(
                loaded,
                "target",
                [Candidate(_dtype_name(loaded.model.dtype))],
                max_speculative_tokens=config.speculation.max_speculative_tokens,
                automatic=False,
                exact_widths=config.models.measures_exact_widths(),
                max_batch_size=config.models.max_batch_size,
            )
        super().__init__(loaded, config, calibration)
        self.exact: ExactWidths | None = None
        self._packing = False
        if config.models.exact_widths is not False:
            use_row_wise_attention(loaded.model)
            self.exact = calibration.chosen.exact
            if self.exact is not None and supports_packing(loaded.model) is None:
                prepare_packing(loaded.model)
                self._packing = True

    def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        """Runs the pending committed tokens plus the k draft tokens in one forward pass.

        The k + 1 trailing positions give the target's distributions at each draft position and
        after the last one; speculative.verify_greedy / verify_sampled pick the accepted prefix and
        the token that follows it. With no draft tokens this is one plain decode step (and, on an
        empty cache, the prefill that yields the first token). The cache keeps the committed
        tokens and the accepted draft tokens; the rejected ones are cropped.

        Returned log-probabilities are under the target's raw distribution (before temperature,
        top-k and top-p).

        Raises:
            ValueError: a sampled request whose q does not hold one row per draft token (the
                session is left as it was).
        """
        return answer_alone(self.verify_batch, request)

    def verify_batch(
        self, requests: list[worker_pb2.VerifyRequest]
    ) -> list[worker_pb2.VerifyResponse | Exception]:
        """verify() for several sessions at once: their rows run packed in shared forwards
        (specdec.worker.packed), each session attending over its own cache, then each is
        accepted on its own (its own k, sampling parameters and seed).

        Greedy output is what verify() alone gives, bitwise, whatever shares the batch: rows
        run in the calibrated exact widths. Without exact widths (exact_widths off, or
        none found) or on a model packed_forward does not support, the sessions run one after
        another.

        Returns:
            Per request, in order: its VerifyResponse (compute_s: the whole batch's seconds,
            the time the call waited on the model), or the ValueError its input raised, which
            leaves that session as it was and the others unaffected, or the exception its
            forward raised on its own (the others then answer as usual, a cache_miss where the
            failed shared forward dropped their caches; SessionModel.run_batch), DEFERRED (a
            prefill past the batch's prefill budget) or PREFILLING (a chunk of a long prompt
            ran; SessionModel.prefill_chunks). A session named twice runs its later calls in
            later forwards, in order. A chunked prefill's compute_s counts its chunks too.
        """
        start = time.perf_counter()
        results = self.run_batch(requests, self._verify_distinct, _check_q)
        elapsed = time.perf_counter() - start
        for response in results:
            if isinstance(response, worker_pb2.VerifyResponse):
                response.compute_s += elapsed
        return results

    def _verify_distinct(
        self, requests: list[worker_pb2.VerifyRequest]
    ) -> list[worker_pb2.VerifyResponse]:
        """verify_batch over requests of distinct sessions."""

        def forward(live: list[tuple[worker_pb2.VerifyRequest, ActiveSession]]) -> list:
            jobs = [
                (a, a.pending + list(r.draft_token_ids), len(r.draft_token_ids) + 1)
                for r, a in live
            ]
            return self._forward_many(jobs)

        return self._verify_pass(requests, forward, self._accept)

    def _verify_pass(
        self,
        requests: list[worker_pb2.VerifyRequest],
        forward: Callable[[list[tuple[worker_pb2.VerifyRequest, ActiveSession]]], list],
        respond: Callable[
            [worker_pb2.VerifyRequest, ActiveSession, object], worker_pb2.VerifyResponse
        ],
    ) -> list[worker_pb2.VerifyResponse]:
        """One pass over distinct sessions: runs the next chunk of each long prompt
        (SessionModel.prefill_chunks), ``forward`` over the (request, session) pairs whose
        forwards run in this pass (one outcome each, in order), and ``respond`` to each with
        its outcome. Returns, in order: PREFILLING where a chunk ran, a cache_miss where the
        session missed, else ``respond``'s response, with the pass's sessions and rows (its
        chunks' too: they shared the batch's time) and, in compute_s, the seconds of the
        prompt's earlier chunks (verify_batch adds the batch's)."""
        with self.checked_out([request.session for request in requests]) as actives:
            chunked = self.prefill_chunks(actives)
            live = [(r, a) for r, a, c in zip(requests, actives, chunked) if a and not c]
            rows = sum(len(a.pending) + len(r.draft_token_ids) for r, a in live)
            rows += self.prefill_chunk * sum(chunked)
            outcomes = iter(forward(live))
            responses: list = []
            for request, active, more in zip(requests, actives, chunked):
                if more:
                    responses.append(PREFILLING)
                elif active is None:
                    responses.append(worker_pb2.VerifyResponse(cache_miss=True))
                else:
                    response = respond(request, active, next(outcomes))
                    entry = active.entry
                    response.compute_s, entry.prefill_chunks_s = entry.prefill_chunks_s, 0
                    responses.append(response)
        ran = sum(r is PREFILLING or not r.cache_miss for r in responses)
        for response in responses:
            if response is not PREFILLING and not response.cache_miss:
                response.batch_sessions, response.batch_rows = ran, rows
        return responses

    def _accept(
        self, request: worker_pb2.VerifyRequest, active: ActiveSession, logits: torch.Tensor
    ) -> worker_pb2.VerifyResponse:
        """Acceptance for one session from its [k + 1, vocab] logits; crops the rejected."""
        logits = logits.float()
        drafts = list(request.draft_token_ids)
        draft_ids = torch.tensor(drafts, dtype=torch.long)
        if request.sampling.temperature == 0:
            num_accepted, next_token = verify_greedy(draft_ids, logits)
        else:
            num_accepted, next_token = self._verify_sampled(
                request, draft_ids, logits, len(active.committed)
            )
        active.entry.crop(len(active.committed) + num_accepted)
        emitted = drafts[:num_accepted] + [next_token]
        # Row by row, each copied to fresh memory: a vectorized reduction rounds a row by its
        # alignment too, so a row's place in the batch must not decide its last bit.
        rows = enumerate(emitted)
        emitted_logprobs = torch.stack(
            [logits[i, token] - torch.logsumexp(logits[i].clone(), dim=0) for i, token in rows]
        )
        return worker_pb2.VerifyResponse(
            num_accepted=num_accepted, token_ids=emitted, logprobs=emitted_logprobs.tolist()
        )

    def _forward_many(self, jobs: list[tuple[ActiveSession, list[int], int]]) -> list[torch.Tensor]:
        """Per (session, token ids, num_logits): feed() in the shapes that keep every
        position's logits independent of k and of the other sessions. A prompt not yet cached
        runs alone as one prefill forward (as it first did, so a rebuild replays it); the
        positions after it run in exact widths (padded with copies of the last row, whose KV is
        cropped again), all sessions packed together when the model allows. Returns per job
        [num_logits, vocab] logits of its trailing positions."""
        heads, segments = [], []
        for active, token_ids, num_logits in jobs:
            prompt_todo = active.entry.prompt_left
            if self.exact is None:
                prompt_todo = len(token_ids)  # no exact widths: one plain forward
            rest = len(token_ids) - prompt_todo
            head = torch.empty(0, self.loaded.vocab_size)
            if prompt_todo:
                wanted = min(max(num_logits - rest, 1), prompt_todo)
                feed = self.feed_prompt if self.exact is not None else self.feed
                head = feed(active, token_ids[:prompt_todo], wanted)
            heads.append(head)
            segments.append(Segment(active.entry, token_ids[prompt_todo:], min(num_logits, rest)))
        tails = iter(self._forward_segments([s for s in segments if s.token_ids]))
        return [
            torch.cat([head, next(tails) if segment.token_ids else head[:0]])[-num_logits:]
            for head, segment, (_, _, num_logits) in zip(heads, segments, jobs)
        ]

    def _forward_segments(self, segments: list[Segment]) -> list[torch.Tensor]:
        """packed_forward in the exact widths; on a model it does not support, each session
        in its own padded forwards through the model's forward."""
        model, vocab_size = self.loaded.model, self.loaded.vocab_size
        if self._packing:
            return packed_forward(model, segments, vocab_size, self.exact)
        return [self._forward_alone(segment) for segment in segments]

    def _forward_alone(self, segment: Segment) -> torch.Tensor:
        entry, logits, start = segment.entry, [], 0
        for real, width in self.exact.chunks(len(segment.token_ids)):
            chunk = segment.token_ids[start : start + real]
            padded = chunk + [chunk[-1]] * (width - real)
            logits.append(self.feed_entry(entry, padded, num_logits=width)[:real])
            entry.crop(len(entry.cached_ids) - (width - real))
            start += real
        return torch.cat(logits)[len(segment.token_ids) - segment.num_logits :]

    def _verify_sampled(
        self,
        request: worker_pb2.VerifyRequest,
        draft_ids: torch.Tensor,
        logits: torch.Tensor,
        position: int,
    ) -> tuple[int, int]:
        sampling = request.sampling
        p = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        k = draft_ids.shape[0]
        q = torch.empty(0, p.shape[-1])
        if k:
            q_ids = torch.tensor(request.q.token_ids, dtype=torch.long).view(k, -1)
            q_probs = torch.tensor(request.q.probs, dtype=torch.float32).view(k, -1)
            q = sparse_to_dense(q_ids, q_probs, p.shape[-1])
        generator = request_generator(sampling.seed, TARGET_STREAM, position)
        return verify_sampled(draft_ids, q, p, generator)


def _check_q(request: worker_pb2.VerifyRequest) -> None:
    """Raises ValueError unless a sampled request's q holds one row per draft token."""
    k, q = len(request.draft_token_ids), request.q
    if request.sampling.temperature == 0 or k == 0:
        return
    if q.width == 0 or len(q.probs) != k * q.width or len(q.token_ids) != k * q.width:
        raise ValueError(f"q must hold {k} rows for {k} draft tokens")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
