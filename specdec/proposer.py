"""The draft side: proposes k tokens per round from the draft model."""

from __future__ import annotations

import time

import torch

from specdec.sampling import processed_probs, request_generator, sample, truncate_top_n
from specdec.session_model import SessionModel
from specdec.v1 import worker_pb2

DRAFT_STREAM = "draft"


class DraftProposer(SessionModel):
    """Runs the draft model over session caches (see SessionModel for the arguments)."""

    def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        """Catches the session up on the committed tokens, then drafts k tokens autoregressively.

        Greedy (temperature 0) drafts the argmax. Otherwise token i is drawn from q_i, the draft's
        distribution after the request's temperature / top-k / top-p, truncated to its
        ``draft_top_n`` most likely tokens; q is returned sparse ([k, N]) because the target
        needs the exact distribution each token was drawn from.

        k = 0 is prefill: it only builds the cache. The k-th draft token is not run through the
        model; its KV is computed next round if the target accepts it.
        """
        start = time.perf_counter()
        with self.session(request.session) as active:
            if active is None:
                return worker_pb2.ProposeResponse(cache_miss=True)
            k = request.num_speculative_tokens
            logits = self.feed(active, active.pending, num_logits=1)[0]
            if k == 0:
                return worker_pb2.ProposeResponse(compute_s=time.perf_counter() - start)
            sampling = request.sampling
            generator = None
            if sampling.temperature > 0:
                generator = request_generator(sampling.seed, DRAFT_STREAM, len(active.committed))
            tokens, q_ids, q_probs = [], [], []
            for i in range(k):
                if generator is None:
                    token = int(logits.argmax())
                else:
                    probs = processed_probs(logits, sampling.temperature, sampling.top_k,
                                            sampling.top_p)
                    ids, values = truncate_top_n(probs[None], request.draft_top_n)
                    token = int(ids[0, sample(values[0], generator)])
                    q_ids.append(ids[0])
                    q_probs.append(values[0])
                tokens.append(token)
                if i + 1 < k:
                    logits = self.feed(active, [token], num_logits=1)[0]
        response = worker_pb2.ProposeResponse(token_ids=tokens)
        if q_ids:
            _fill_sparse(response.q, torch.stack(q_ids), torch.stack(q_probs))
        response.compute_s = time.perf_counter() - start
        return response


def _fill_sparse(message: worker_pb2.SparseDistribution, ids: torch.Tensor,
                 probs: torch.Tensor) -> None:
    """Writes [rows, N] sparse rows into a SparseDistribution message."""
    message.width = ids.shape[1]
    message.token_ids.extend(ids.flatten().tolist())
    message.probs.extend(probs.flatten().tolist())
