"""The target side: scores k draft tokens in one forward pass and decides which to keep."""

from __future__ import annotations

import time

import torch

from specdec.config import SpecdecConfig
from specdec.decoding.rejection import verify_greedy, verify_sampled
from specdec.decoding.sampling import processed_probs, request_generator, sparse_to_dense
from specdec.models.fixed_shape import (
    WidthCalibration,
    calibrate_fixed_width,
    use_row_wise_attention,
)
from specdec.models.loading import LoadedModel
from specdec.models.session import SessionModel
from specdec.v1 import worker_pb2

TARGET_STREAM = "target"


HALF_PRECISION = (torch.bfloat16, torch.float16)


class TargetVerifier(SessionModel):
    """Runs the target model over session caches.

    Args:
        loaded: as SessionModel.
        config: the session cache bound (as SessionModel), and the fixed width: when
            models.fixed_shape_verify is True, or None and the loaded target is in half
            precision, every decode forward runs exactly ``fixed_width`` positions (the smallest
            width >= speculation.max_speculative_tokens + 1 that calibrate_fixed_width measured
            to be position-invariant on this device), the real ones first and copies of
            the last one after them, with row-wise attention, so that a position's logits do not
            depend on k (specdec.models.fixed_shape explains why bfloat16 needs it). Causal
            attention keeps the padding out of the real positions, and the padding's KV is
            cropped. ``fixed_width`` is None when off.
    """

    def __init__(self, loaded: LoadedModel, config: SpecdecConfig) -> None:
        super().__init__(loaded, config)
        fixed_shape = config.models.fixed_shape_verify
        if fixed_shape is None:
            fixed_shape = loaded.model.dtype in HALF_PRECISION
        self.fixed_width: int | None = None
        self.calibration: WidthCalibration | None = None
        if fixed_shape:
            use_row_wise_attention(loaded.model)
            self.calibration = calibrate_fixed_width(
                loaded.model, loaded.vocab_size, config.speculation.max_speculative_tokens + 1
            )
            self.fixed_width = self.calibration.width

    def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse:
        """Runs the pending committed tokens plus the k draft tokens in one forward pass.

        The k + 1 trailing positions give the target's distributions at each draft position and
        after the last one; speculative.verify_greedy / verify_sampled pick the accepted prefix and
        the token that follows it. With no draft tokens this is one plain decode step (and, on an
        empty cache, the prefill that yields the first token). The cache keeps the committed
        tokens and the accepted draft tokens; the rejected ones are cropped.

        Returned log-probabilities are under the target's raw distribution (before temperature,
        top-k and top-p).
        """
        start = time.perf_counter()
        with self.session(request.session) as active:
            if active is None:
                return worker_pb2.VerifyResponse(cache_miss=True)
            drafts = list(request.draft_token_ids)
            k = len(drafts)
            logits = self._forward(active, active.pending + drafts, num_logits=k + 1).float()
            draft_ids = torch.tensor(drafts, dtype=torch.long)
            sampling = request.sampling
            if sampling.temperature == 0:
                num_accepted, next_token = verify_greedy(draft_ids, logits)
            else:
                num_accepted, next_token = self._verify_sampled(
                    request, draft_ids, logits, len(active.committed)
                )
            active.entry.crop(len(active.committed) + num_accepted)
        emitted = drafts[:num_accepted] + [next_token]
        logprobs = torch.log_softmax(logits[: num_accepted + 1], dim=-1)
        emitted_logprobs = logprobs[torch.arange(num_accepted + 1), torch.tensor(emitted)]
        return worker_pb2.VerifyResponse(
            num_accepted=num_accepted,
            token_ids=emitted,
            logprobs=emitted_logprobs.tolist(),
            compute_s=time.perf_counter() - start,
        )

    def _forward(self, active, token_ids: list[int], num_logits: int) -> torch.Tensor:
        """feed(), padded to the fixed width in decode rounds (not in a prefill or rebuild,
        whose single forward is the same whatever k is)."""
        width = self.fixed_width
        rebuilding = len(active.pending) == len(active.committed)
        if width is None or rebuilding or len(token_ids) >= width:
            return self.feed(active, token_ids, num_logits)
        real = len(token_ids)
        logits = self.feed(active, token_ids + [token_ids[-1]] * (width - real), num_logits=width)
        return logits[real - num_logits : real]

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
            if request.q.width == 0 or len(request.q.probs) != k * request.q.width:
                raise ValueError(f"q must hold {k} rows for {k} draft tokens")
            q_ids = torch.tensor(request.q.token_ids, dtype=torch.long).view(k, -1)
            q_probs = torch.tensor(request.q.probs, dtype=torch.float32).view(k, -1)
            q = sparse_to_dense(q_ids, q_probs, p.shape[-1])
        generator = request_generator(sampling.seed, TARGET_STREAM, position)
        return verify_sampled(draft_ids, q, p, generator)
