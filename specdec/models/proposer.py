"""The draft side: proposes k tokens per round from the draft model."""

from __future__ import annotations

import time

import torch

from specdec.decoding.sampling import processed_probs, request_generator, sample, truncate_top_n
from specdec.models.kv_cache import ActiveSession
from specdec.models.session import SessionModel
from specdec.v1 import worker_pb2

DRAFT_STREAM = "draft"


class DraftProposer(SessionModel):
    """Runs the draft model over session caches.

    Args:
        loaded, config: as SessionModel (the draft reads only the cache bound; each round's
            k and q truncation come with its ProposeRequest).
    """

    def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse:
        """Catches the session up on the committed tokens, then drafts up to k tokens.

        Greedy (temperature 0) drafts the argmax. Otherwise token i is drawn from q_i, the draft's
        distribution after the request's temperature / top-k / top-p, truncated to its
        ``draft_top_n`` most likely tokens; q is returned sparse ([drafted, N]) because the
        target needs the exact distribution each token was drawn from.

        With ``min_draft_confidence`` c > 0 the draft stops early, after the first token at which
        the product of its probabilities of this round's tokens (its estimate that the whole block
        is accepted) falls below c: long blocks where the draft is sure, short ones where it is
        not (dynamic draft length; cf. the confidence stop of Hugging Face's assisted generation
        and EAGLE-2's confidence-ordered drafts, Li et al. 2024). The stop depends only on the
        draft's own tokens and distributions, so sampled output stays exact (the acceptance test
        of each position is unchanged; Leviathan et al. 2023, section 2.3). Greedy confidence is
        the draft's softmax probability at temperature 1.

        k = 0 is prefill: it only builds the cache. The last draft token is not run through the
        model; its KV is computed next round if the target accepts it.

        The response's catchup_s and catchup_tokens time the catch-up (the feed of the committed
        tokens the cache lacked, whose logits give the first draft token) apart from the k - 1
        draft steps after it, so the controller prices each separately (all of a k = 0 call is
        catch-up).
        """
        start = time.perf_counter()
        with self.session(request.session) as active:
            if active is None:
                return worker_pb2.ProposeResponse(cache_miss=True)
            k = request.num_speculative_tokens
            pending = active.pending
            logits = self.feed(active, pending, num_logits=1)[0]
            catchup_s = time.perf_counter() - start
            response = worker_pb2.ProposeResponse(catchup_s=catchup_s, catchup_tokens=len(pending))
            if k == 0:
                response.compute_s = catchup_s
                return response
            tokens, q_ids, q_probs = self._draft(active, logits, request)
        response.token_ids.extend(tokens)
        if q_ids:
            _fill_sparse(response.q, torch.stack(q_ids), torch.stack(q_probs))
        response.compute_s = time.perf_counter() - start
        return response

    def _draft(
        self, active: ActiveSession, logits: torch.Tensor, request: worker_pb2.ProposeRequest
    ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """Drafts from ``logits`` ([vocab]) on; returns the tokens and, when sampling, each
        token's sparse q row (ids [N], probs [N])."""
        sampling, k = request.sampling, request.num_speculative_tokens
        floor = request.min_draft_confidence
        generator = None
        if sampling.temperature > 0:
            generator = request_generator(sampling.seed, DRAFT_STREAM, len(active.committed))
        tokens, q_ids, q_probs = [], [], []
        confidence = 1.0
        while True:
            if generator is None:
                token = int(logits.argmax())
                if floor > 0:
                    confidence *= _softmax_at(logits, token)
            else:
                probs = processed_probs(
                    logits, sampling.temperature, sampling.top_k, sampling.top_p
                )
                ids, values = truncate_top_n(probs[None], request.draft_top_n)
                j = sample(values[0], generator)
                token = int(ids[0, j])
                confidence *= float(values[0, j])
                q_ids.append(ids[0])
                q_probs.append(values[0])
            tokens.append(token)
            if len(tokens) == k or confidence < floor:
                return tokens, q_ids, q_probs
            logits = self.feed(active, [token], num_logits=1)[0]


def _softmax_at(logits: torch.Tensor, index: int) -> float:
    """softmax(logits)[index] without materialising the distribution."""
    logits = logits.float()
    return float(torch.exp(logits[index] - torch.logsumexp(logits, dim=0)))


def _fill_sparse(
    message: worker_pb2.SparseDistribution, ids: torch.Tensor, probs: torch.Tensor
) -> None:
    """Writes [rows, N] sparse rows into a SparseDistribution message."""
    message.width = ids.shape[1]
    message.token_ids.extend(ids.flatten().tolist())
    message.probs.extend(probs.flatten().tolist())
