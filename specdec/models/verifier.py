"""The target side: scores k draft tokens in one forward pass and decides which to keep."""

from __future__ import annotations

import time

import torch

from specdec.config import SpecdecConfig
from specdec.decoding.rejection import verify_greedy, verify_sampled
from specdec.decoding.sampling import processed_probs, request_generator, sparse_to_dense
from specdec.models.calibration import Calibration, ExactWidths, calibrate
from specdec.models.fixed_shape import use_row_wise_attention
from specdec.models.kv_cache import ActiveSession
from specdec.models.loading import LoadedModel
from specdec.models.session import SessionModel
from specdec.v1 import worker_pb2

TARGET_STREAM = "target"


class TargetVerifier(SessionModel):
    """Runs the target model over session caches.

    Args:
        loaded: as SessionModel, in the dtype it will run in.
        config: the session cache bound (as SessionModel), k_max, and
            models.fixed_shape_verify: unless it is False, every decode forward is padded to
            one of the widths the device calibration found exact (``exact``), with row-wise
            attention, so a position's logits do not depend on k, and a rebuild replays the
            prompt's prefill (specdec.models.fixed_shape explains why).
        calibration: what the replica measured at start-up (specdec.models.calibration);
            None measures it now, in the loaded dtype.
    Attributes:
        exact: the exact widths and their costs; None when fixed shapes are off or the device
            has no exact class (logged).
    """

    def __init__(
        self, loaded: LoadedModel, config: SpecdecConfig, calibration: Calibration | None = None
    ) -> None:
        if calibration is None:
            loaded, calibration = calibrate(
                loaded,
                "target",
                [_dtype_name(loaded.model.dtype)],
                max_speculative_tokens=config.speculation.max_speculative_tokens,
                automatic=False,
                exact_widths=config.models.fixed_shape_verify is not False,
            )
        super().__init__(loaded, config, calibration)
        self.exact: ExactWidths | None = None
        if config.models.fixed_shape_verify is not False:
            use_row_wise_attention(loaded.model)
            self.exact = calibration.chosen.exact

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
        # Row by row, each copied to fresh memory: a vectorized reduction rounds a row by its
        # alignment too, so a row's place in the batch must not decide its last bit.
        rows = enumerate(emitted)
        emitted_logprobs = torch.stack(
            [logits[i, token] - torch.logsumexp(logits[i].clone(), dim=0) for i, token in rows]
        )
        return worker_pb2.VerifyResponse(
            num_accepted=num_accepted,
            token_ids=emitted,
            logprobs=emitted_logprobs.tolist(),
            compute_s=time.perf_counter() - start,
        )

    def _forward(self, active: ActiveSession, token_ids: list[int], num_logits: int):
        """feed() in the shapes that keep every position's logits independent of k: a prompt
        not yet cached runs as one prefill forward (as it first did, so a rebuild replays it),
        the positions after it in exact widths, padded with copies of the last token whose KV
        is cropped again. Returns [num_logits, vocab] logits of the trailing positions."""
        if self.exact is None:
            return self.feed(active, token_ids, num_logits)
        prompt_todo = max(active.entry.prompt_len - len(active.entry.cached_ids), 0)
        logits = []
        if prompt_todo:
            wanted = max(num_logits - (len(token_ids) - prompt_todo), 1)
            logits.append(self.feed(active, token_ids[:prompt_todo], min(wanted, prompt_todo)))
        start, rest = prompt_todo, len(token_ids) - prompt_todo
        for real, width in self.exact.chunks(rest) if rest else ():
            chunk = token_ids[start : start + real]
            out = self.feed(active, chunk + [chunk[-1]] * (width - real), num_logits=width)
            active.entry.crop(len(active.entry.cached_ids) - (width - real))
            logits.append(out[:real])
            start += real
        return torch.cat(logits)[-num_logits:]

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
