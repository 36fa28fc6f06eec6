"""The draft side: proposes k tokens per round from the draft model."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch

from specdec.config import SpecdecConfig
from specdec.device.calibration.results import Calibration
from specdec.models.loading import LoadedModel
from specdec.v1 import worker_pb2
from specdec.worker.kv_cache import ActiveSession
from specdec.worker.packed import Segment, packed_forward, prepare_packing, supports_packing
from specdec.worker.sampling import processed_probs, request_generator, sample, truncate_top_n
from specdec.worker.session import PREFILLING, SessionModel, answer_alone

DRAFT_STREAM = "draft"
# A pipelined draft's draws (after assumed tokens): a stream of their own, so that no draw of
# a draft the router dropped is ever drawn again for a draft it verifies.
AHEAD_STREAM = "draft-ahead"


class DraftProposer(SessionModel):
    """Runs the draft model over session caches.

    Args:
        loaded, config: as SessionModel (the draft reads only the cache bound; each round's
            k and q truncation come with its ProposeRequest).
        calibration: as SessionModel.
    """

    def __init__(
        self, loaded: LoadedModel, config: SpecdecConfig, calibration: Calibration | None = None
    ) -> None:
        super().__init__(loaded, config, calibration)
        self._packing = supports_packing(loaded.model) is None
        if self._packing:
            prepare_packing(loaded.model)

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
        return answer_alone(self.propose_batch, request)

    def propose_batch(
        self, requests: list[worker_pb2.ProposeRequest]
    ) -> list[worker_pb2.ProposeResponse | Exception]:
        """propose() for several sessions at once: each draft step runs the sessions still
        drafting as one packed forward (specdec.worker.packed), one row each (the catch-up rows
        first), and a session leaves the batch when its k or its confidence stop ends its
        draft.

        Greedy sessions are drafted together. A sampled session is drafted alone: its draft
        distribution q then does not depend on its neighbours, whose rows would change the
        rounding of the shared GEMMs (and an int8 draft's activation scale), so its seed
        reproduces its output. Its output is exact either way.

        Returns:
            Per request, in order: its ProposeResponse (catchup_s: the catch-up forward's
            seconds, compute_s: the whole batch's, or at k = 0, all catch-up, catchup_s), the
            ValueError its input raised, the exception its forward raised on its own (as
            TargetVerifier.verify_batch), DEFERRED (a prefill past the batch's prefill
            budget, SessionModel.run_batch) or PREFILLING (a chunk of a long prompt ran,
            SessionModel.prefill_chunks; the last call's compute_s counts every chunk).
        """
        start = time.perf_counter()
        results = self.run_batch(requests, self._propose_distinct)
        elapsed = time.perf_counter() - start
        for request, response in zip(requests, results):
            if isinstance(response, worker_pb2.ProposeResponse) and not response.cache_miss:
                drafted = request.num_speculative_tokens > 0
                # compute_s holds the seconds of the prompt's earlier chunks (Draft.response)
                response.compute_s += elapsed if drafted else response.catchup_s
        return results

    def _propose_distinct(
        self, requests: list[worker_pb2.ProposeRequest]
    ) -> list[worker_pb2.ProposeResponse]:
        """propose_batch over requests of distinct sessions."""
        sessions = [request.session for request in requests]
        assumed = [list(request.assumed_token_ids) for request in requests]
        with self.checked_out(sessions, assumed) as actives:
            start = time.perf_counter()
            chunked = self.prefill_chunks(actives)
            chunks_s = time.perf_counter() - start
            drafts = [Draft(r, a) for r, a, c in zip(requests, actives, chunked) if a and not c]
            greedy = [d for d in drafts if d.generator is None]
            groups = [greedy] if greedy else []
            groups += [[d] for d in drafts if d.generator is not None]
            for group in groups:
                self._draft_together(group)
            for draft in drafts:  # the chunks ran ahead of the catch-up, as whole prompts did
                draft.catchup_s += chunks_s
        responses = iter(d.response() for d in drafts)
        return [_respond(a, more, responses) for a, more in zip(actives, chunked)]

    def _draft_together(self, drafts: list[Draft]) -> None:
        """Catches every session of ``drafts`` up and drafts until each one stops."""
        start = time.perf_counter()
        logits = self._step([(d.active, d.active.pending) for d in drafts])
        catchup_s = time.perf_counter() - start
        for draft in drafts:
            draft.catchup_s = catchup_s
        live = [d for d, row in zip(drafts, logits) if not d.take(row)]
        while live:
            logits = self._step([(d.active, d.tokens[-1:]) for d in live])
            live = [d for d, row in zip(live, logits) if not d.take(row)]

    def _step(self, feeds: list[tuple[ActiveSession, list[int]]]) -> list[torch.Tensor]:
        """Feeds each session its tokens; returns each one's [vocab] logits after its last.
        Prompts not yet cached run alone (their prefill), the rest packed when the model
        allows, else one after another."""
        alone = [not self._packing or a.entry.prompt_left > 0 for a, _ in feeds]
        packed = [Segment(a.entry, ids, 1) for (a, ids), solo in zip(feeds, alone) if not solo]
        together = iter(
            packed_forward(self.loaded.model, packed, self.loaded.vocab_size) if packed else ()
        )
        return [
            self.feed(active, ids, num_logits=1)[0] if solo else next(together)[0]
            for (active, ids), solo in zip(feeds, alone)
        ]


class Draft:
    """One session's draft in progress: the tokens so far and, when sampling, their q rows."""

    def __init__(self, request: worker_pb2.ProposeRequest, active: ActiveSession) -> None:
        self.request, self.active = request, active
        self.k, self.floor = request.num_speculative_tokens, request.min_draft_confidence
        sampling = request.sampling
        self.generator = None
        if sampling.temperature > 0:
            assumed = len(request.assumed_token_ids)
            stream = AHEAD_STREAM if assumed else DRAFT_STREAM
            position = len(active.committed) + assumed
            self.generator = request_generator(sampling.seed, stream, position)
        self.tokens: list[int] = []
        self.q_ids: list[torch.Tensor] = []
        self.q_probs: list[torch.Tensor] = []
        self.confidences: list[float] = []  # the draft's probability of each of its tokens
        self.catchup_s = 0.0

    def take(self, logits: torch.Tensor) -> bool:
        """Drafts the next token from the [vocab] logits after the last one (none at k = 0);
        True when the draft is complete (k tokens, or the confidence fell below the floor)."""
        if self.k == 0:
            return True
        sampling = self.request.sampling
        if self.generator is None:
            token = int(logits.argmax())
            confidence = _softmax_at(logits, token)
        else:
            probs = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            ids, values = truncate_top_n(probs[None], self.request.draft_top_n)
            j = sample(values[0], self.generator)
            token = int(ids[0, j])
            confidence = float(values[0, j])
            self.q_ids.append(ids[0])
            self.q_probs.append(values[0])
        self.tokens.append(token)
        self.confidences.append(confidence)
        return self.complete()

    def complete(self) -> bool:
        """k tokens drafted, or the product of their confidences fell below the floor."""
        return len(self.tokens) == self.k or math.prod(self.confidences) < self.floor

    def response(self) -> worker_pb2.ProposeResponse:
        entry = self.active.entry
        chunks_s, entry.prefill_chunks_s = entry.prefill_chunks_s, 0.0
        response = worker_pb2.ProposeResponse(
            compute_s=chunks_s,  # propose_batch adds the batch's seconds
            catchup_s=self.catchup_s,
            catchup_tokens=len(self.active.pending),
            token_ids=self.tokens,
            confidences=self.confidences,
        )
        if self.q_ids:
            _fill_sparse(response.q, torch.stack(self.q_ids), torch.stack(self.q_probs))
        return response


def _respond(active: ActiveSession | None, chunked: bool, drafted: Iterator) -> object:
    """A session's answer in a pass: PREFILLING, a cache_miss, or its draft's response."""
    if chunked:
        return PREFILLING
    return next(drafted) if active is not None else worker_pb2.ProposeResponse(cache_miss=True)


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
