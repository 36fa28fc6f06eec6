"""The draft and target sides on the static runner (models.runner: static): the same requests,
responses, session semantics and acceptance rules as specdec.worker.proposer and
specdec.worker.verifier, with the forwards, the greedy acceptance and the greedy draft's steps
run by specdec.worker.static.runner over a slot pool."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from specdec.config import SpecdecConfig
from specdec.device.calibration.results import Calibration
from specdec.models.loading import LoadedModel
from specdec.v1 import worker_pb2
from specdec.worker.kv_cache import ActiveSession, CacheBacking
from specdec.worker.proposer import Draft, DraftProposer
from specdec.worker.static.runner import CallClock, StaticRunner, VerifyJob, VerifyOutcome
from specdec.worker.static.shapes import invariant_shapes
from specdec.worker.static.slots import SlotAllocator, SlotLayout, slot_layout
from specdec.worker.verifier import TargetVerifier

log = logging.getLogger(__name__)


def layout_for(loaded: LoadedModel, config: SpecdecConfig) -> SlotLayout:
    """The slot pool a side of ``config`` allocates for ``loaded``: the verify width is
    k_max + 1 (the draft's catch-up runs at the same width)."""
    models = config.models
    return slot_layout(
        loaded.model.config,
        loaded.model.dtype,
        capacity_bytes=models.cache_capacity_bytes,
        max_batch_size=models.max_batch_size,
        width=config.speculation.max_speculative_tokens + 1,
        max_model_len=models.max_model_len,
    )


class _Slots:
    """What both static sides add to SessionModel: slot caches and the runner."""

    runner: StaticRunner
    layout: SlotLayout

    def cache_backing(self, loaded: LoadedModel, config: SpecdecConfig) -> CacheBacking:
        """Slots of the runner's pool; the store's byte bound is the pool's slots."""
        self.layout = layout_for(loaded, config)
        return SlotAllocator(self.layout)

    def _in_groups(self, requests: list, run: Callable[[list], list]) -> list:
        """``run`` over groups of at most the largest batch bucket's sessions: a forward holds
        no more (the in-process engine batches every concurrent request; a replica's
        serve.batch stops at max_batch_size already), and the pool has a slot for each."""
        size = self.runner.batch_buckets[-1]
        return [r for i in range(0, len(requests), size) for r in run(requests[i : i + size])]

    def run_batch(
        self, requests: list, run_distinct: Callable[[list], list], check=lambda request: None
    ) -> list:
        """SessionModel.run_batch, where a call the runner cannot run also gets its own
        ValueError (check_fits) before it touches a session, instead of failing its whole
        batch in a forward (and, on CUDA, an out-of-range token id is a device-side assert
        that ends the process's CUDA context)."""

        def checked(request) -> None:
            check(request)
            self.check_fits(request)

        return super().run_batch(requests, run_distinct, checked)

    def check_fits(self, request: worker_pb2.VerifyRequest | worker_pb2.ProposeRequest) -> None:
        """Raises ValueError unless the call's k is at most the verify width's (the target
        scores k + 1 rows in one forward; max_speculative_tokens), its session with its k
        drafts holds at most context_limit tokens (a slot holds no more: the router never
        asks more), its token ids index the model's embedding, and its drafts and q's ids the
        vocabulary."""
        session, drafts = request.session, []
        if isinstance(request, worker_pb2.VerifyRequest):
            drafts = list(request.draft_token_ids)
            k = len(drafts)
        else:
            k = request.num_speculative_tokens
        if k > self.runner.width - 1:
            raise ValueError(
                f"{k} draft tokens exceed max_speculative_tokens ({self.runner.width - 1}), "
                "the static runner's verify width"
            )
        length = session.prefix_len + len(session.new_token_ids) + k
        if length > self.context_limit:
            raise ValueError(
                f"a session of {length} tokens (committed and draft) passes the context limit "
                f"of {self.context_limit} (models.max_model_len)"
            )
        ids = list(session.new_token_ids)
        rows = self.runner.loaded.model.get_input_embeddings().num_embeddings
        if ids and (min(ids) < 0 or max(ids) >= rows):
            raise ValueError(f"token ids must lie in [0, {rows}), the model's embedding rows")
        # Drafts and q index the target's logits, which end at the vocabulary (the draft
        # never proposes past it); a sampled acceptance would fail on one that does not.
        vocab = self.loaded.vocab_size
        if drafts and (min(drafts) < 0 or max(drafts) >= vocab):
            raise ValueError(f"draft token ids must lie in [0, {vocab}), the vocabulary")
        q_ids = list(request.q.token_ids) if drafts else []
        if q_ids and (min(q_ids) < 0 or max(q_ids) >= vocab):
            raise ValueError(f"q token ids must lie in [0, {vocab}), the vocabulary")

    def prefill_chunk_forward(self, active: ActiveSession, token_ids: list[int]) -> None:
        """A chunk of a prompt into the session's slot (SessionModel.prefill_chunks)."""
        self.runner.prefill(active.entry, token_ids, 1)

    def _start_runner(self, loaded: LoadedModel, config: SpecdecConfig) -> None:
        self.runner = StaticRunner(loaded, self.layout, config.models.max_batch_size)
        self.sessions.capacity_bytes = self.layout.slot_bytes * self.layout.num_slots
        self.context_limit = min(loaded.context_limit, self.layout.context_limit)


class StaticVerifier(_Slots, TargetVerifier):
    """TargetVerifier on the static runner.

    Greedy output is bitwise the runner's own k = 0 output: every decode row runs in the same
    forward shape whatever k is, in batches of the buckets the runner keeps, and a rebuild
    replays the prompt's prefill. Sampled requests get their scored rows' logits on the host and
    the rejection sampler of specdec.worker.rejection, as in TargetVerifier.

    Args:
        loaded, config, calibration: as TargetVerifier (the calibration prices the device;
            the runner does not use its exact widths).
    """

    def __init__(
        self, loaded: LoadedModel, config: SpecdecConfig, calibration: Calibration | None = None
    ) -> None:
        super().__init__(loaded, config, calibration)
        self._start_runner(self.loaded, config)
        runner = self.runner
        generator = torch.Generator().manual_seed(0)
        runner.batch_buckets, runner.key_lens = invariant_shapes(runner, generator)
        log.info(
            "static runner: batch buckets %s, key lengths %s, %d slots of %d positions",
            runner.batch_buckets,
            runner.key_lens,
            self.layout.num_slots,
            self.layout.slot_len,
        )

    def _verify_distinct(
        self, requests: list[worker_pb2.VerifyRequest]
    ) -> list[worker_pb2.VerifyResponse]:
        """verify_batch over requests of distinct sessions, on the runner."""
        return self._in_groups(requests, self._verify_group)

    def _verify_group(
        self, requests: list[worker_pb2.VerifyRequest]
    ) -> list[worker_pb2.VerifyResponse]:
        def forward(live: list[tuple[worker_pb2.VerifyRequest, ActiveSession]]) -> list:
            return self.runner.verify([self._job(r, a) for r, a in live])

        return self._verify_pass(requests, forward, self._respond)

    def _job(self, request: worker_pb2.VerifyRequest, active: ActiveSession) -> VerifyJob:
        """Prefills the session's prompt if its slot lacks it (alone, as it first ran); the
        rest of its tokens go to the runner's fixed-width forwards."""
        drafts = list(request.draft_token_ids)
        tokens, entry = active.pending + drafts, active.entry
        prompt_todo = entry.prompt_left
        rest, head = tokens[prompt_todo:], None
        if prompt_todo:
            wanted = min(max(len(drafts) + 1 - len(rest), 1), prompt_todo)
            logits = self.runner.prefill(entry, tokens[:prompt_todo], wanted)
            head = logits if len(rest) < len(drafts) + 1 else None
        sampled = request.sampling.temperature > 0
        return VerifyJob(entry, rest, drafts, head, host_logits=sampled)

    def _respond(
        self, request: worker_pb2.VerifyRequest, active: ActiveSession, outcome: VerifyOutcome
    ) -> worker_pb2.VerifyResponse:
        if request.sampling.temperature > 0:
            return self._accept(request, active, outcome.logits)
        n = outcome.accepted
        active.entry.crop(len(active.committed) + n)
        return worker_pb2.VerifyResponse(
            num_accepted=n,
            token_ids=list(request.draft_token_ids)[:n] + [outcome.tokens[n]],
            logprobs=outcome.log_probs[: n + 1],
        )


class StaticProposer(_Slots, DraftProposer):
    """DraftProposer on the static runner: a greedy group's k steps are chained on the device
    (StaticRunner.chain) and read once; a sampled session drafts step by step on the host, as
    in DraftProposer, with each step's logits from the runner.

    Args:
        loaded, config, calibration: as DraftProposer.
    """

    def __init__(
        self, loaded: LoadedModel, config: SpecdecConfig, calibration: Calibration | None = None
    ) -> None:
        super().__init__(loaded, config, calibration)
        self._start_runner(self.loaded, config)

    def _propose_distinct(
        self, requests: list[worker_pb2.ProposeRequest]
    ) -> list[worker_pb2.ProposeResponse]:
        return self._in_groups(requests, super()._propose_distinct)

    def _step(self, feeds: list[tuple[ActiveSession, list[int]]]) -> list[torch.Tensor]:
        """Each session's [vocab] logits after its tokens, on the host."""
        _, _, logits = self.runner.catch_up([(active.entry, ids) for active, ids in feeds])
        return list(logits.cpu())

    def _draft_together(self, drafts: list[Draft]) -> None:
        if any(draft.generator is not None for draft in drafts):
            super()._draft_together(drafts)
            return
        clock = CallClock(self.runner.device)  # prices the catch-up apart from the steps
        entries = [draft.active.entry for draft in drafts]
        tokens, confidences, _ = self.runner.catch_up(
            [(draft.active.entry, draft.active.pending) for draft in drafts]
        )
        clock.stop()
        steps = max(draft.k for draft in drafts) - 1
        chained, chained_confidences = self.runner.chain(entries, tokens, max(steps, 0))
        picked = torch.cat([tokens[:, None], chained], 1).float()
        host = torch.stack([picked, torch.cat([confidences[:, None], chained_confidences], 1)])
        host = host.cpu()  # the call's one host sync
        catchup_s = clock.seconds()
        for i, draft in enumerate(drafts):
            draft.catchup_s = catchup_s
            for token, confidence in zip(host[0, i, : draft.k], host[1, i, : draft.k]):
                draft.tokens.append(int(token))
                draft.confidences.append(float(confidence))
                if draft.complete():
                    break
            # The chain fed every kept token but the last; the slot holds the rest, masked.
            draft.active.entry.cached_ids.extend(draft.tokens[:-1])


def proposer_class(config: SpecdecConfig) -> type[DraftProposer]:
    """The draft side models.runner asks for: StaticProposer or DraftProposer."""
    return StaticProposer if config.models.resolved_runner() == "static" else DraftProposer


def verifier_class(config: SpecdecConfig) -> type[TargetVerifier]:
    """The target side models.runner asks for: StaticVerifier or TargetVerifier."""
    return StaticVerifier if config.models.resolved_runner() == "static" else TargetVerifier
