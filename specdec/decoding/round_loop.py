"""The round loop: drives one request's speculative rounds through a draft and a target.

It is written once and runs over two transports: in-process calls (SpeculativeEngine) and Ray
Serve deployment handles (the router deployment). Each round is at most two calls: ``propose``
on the draft (unless n-gram lookup in the router proposed the round's tokens, or none are
proposed), then ``verify`` on the target; the loop commits what the target returns, applies the
stop rules, and chooses the next round's proposer and k (specdec.decoding.proposers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Collection
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from specdec.config import SpeculationConfig
from specdec.decoding.costs import CostModel, RoundTiming
from specdec.decoding.degrade import DraftAvailability
from specdec.decoding.k_policy import KController, RoundPlan
from specdec.decoding.ngram import RequestNgrams, SharedNgrams
from specdec.decoding.phases import SIDES, PhaseGate
from specdec.decoding.proposers import DRAFT, NGRAM, NONE, Proposal, ProposerChoice
from specdec.decoding.request import PreparedRequest
from specdec.decoding.stats import SpeculationStats, StatsRecorder
from specdec.decoding.stopping import Delta, StopChecker
from specdec.v1 import worker_pb2


class Transport(Protocol):
    """How the loop reaches the draft and target sides."""

    async def propose(self, request: worker_pb2.ProposeRequest) -> worker_pb2.ProposeResponse: ...

    async def verify(self, request: worker_pb2.VerifyRequest) -> worker_pb2.VerifyResponse: ...

    async def release(self, session_id: str, sides: Collection[str] = SIDES) -> None:
        """Drops the session on ``sides`` (of "draft", "target"); must not raise."""


@dataclasses.dataclass
class Completion:
    """The finished request."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]
    prompt_tokens: int
    stats: SpeculationStats

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class _Ahead:
    """A pipelined draft (SpeculationConfig.pipelined_drafting), sent while the target
    verifies a round: ``task`` gives its ProposeResponse (None: the call failed or missed),
    drafted after the committed length ``base`` plus the round's tokens ``assumed``."""

    task: asyncio.Future
    base: int
    assumed: list[int]


class RoundLoop:
    """Runs one request. Iterate ``run()`` for one Delta per round; then read ``completion``.

    Args:
        transport: the draft and target sides.
        tokenizer: detokenizes the completion for the stop rules and the text.
        request: the validated request.
        costs: measured step costs, shared across requests.
        config: k_max, the draft's q truncation, the dynamic draft length and whether the draft
            prefills with the target (specdec.config.SpeculationConfig).
        draft: whether the draft side may be called, shared by all requests; a propose that
            fails with any error makes the round go on at k = 0 (the target alone: still exact)
            and is reported to it. None: a breaker of this request's own.
        phases: where draft and target share cores (SpeculationConfig.alternate_phases), the
            router's PhaseGate, shared by all its requests: this request's draft and verify
            calls run in its alternating phases. None: calls run as they come.
        shared_ngrams: the router's index over recent completions
            (SpeculationConfig.shared_ngram_bytes), read by this request's n-gram lookup and
            given its completion; None: the request reads only its own text.
        draft_wait_s: the longest a round waits for a draft call that carries the whole
            sequence (the router's ServiceConfig.draft_timeout_s; _draft_for_round); None: as
            long as the call takes (the in-process engine).
    """

    def __init__(
        self,
        transport: Transport,
        tokenizer: PreTrainedTokenizerBase,
        request: PreparedRequest,
        costs: CostModel,
        config: SpeculationConfig,
        draft: DraftAvailability | None = None,
        phases: PhaseGate | None = None,
        shared_ngrams: SharedNgrams | None = None,
        draft_wait_s: float | None = None,
    ) -> None:
        self._transport = transport
        self._draft_wait_s = draft_wait_s
        self._phases = phases
        self._draft = draft or DraftAvailability()
        self._request = request
        self._config = config
        params = request.params
        self._sampling = worker_pb2.SamplingConfig(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=request.seed,
        )
        self._checker = StopChecker(
            tokenizer, request.max_new_tokens, request.stop_token_ids, params.stop
        )
        self._controller = KController(costs, config, fixed_k=request.num_speculative_tokens)
        self._ngrams = RequestNgrams(
            request.prompt_ids, config.ngram_min_n, config.ngram_max_n, shared_ngrams
        )
        self._choices = ProposerChoice(request.proposer, self._controller, self._ngrams)
        self._recorder = StatsRecorder(config.max_speculative_tokens)
        self._ids = list(request.prompt_ids)  # the committed sequence: prompt + completion
        self._known = {"draft": 0, "target": 0}  # committed length each side has confirmed
        # Of the tokens committed since the draft's last call, those it already ran as draft
        # tokens (all accepted ones but the last drafted): its cache holds them.
        self._draft_ran = 0
        self._draft_prefill: asyncio.Future | None = None
        # Pipelined drafting: off where draft and verify calls alternate in phases.
        self._pipelined = config.pipelined_drafting and phases is None
        self._ahead: _Ahead | None = None
        self._called: list[str] = []  # the sides sent a call for this session, in order
        self.completion: Completion | None = None

    async def run(self) -> AsyncIterator[Delta]:
        """Yields each round's Delta; releases the session however it ends, on each side that
        was sent a call for it (a target-only request never calls the draft side, not even to
        release: it must not wait on a draft pool that is gone)."""
        self._controller.costs.traffic.request_started(self._controller)
        try:
            delta = await self._prefill()
            yield delta
            while delta.finish_reason is None:
                delta = await self._round()
                yield delta
            self._finish()
        finally:
            self._controller.costs.traffic.request_ended(self._controller)
            if self._draft_prefill is not None:
                self._draft_prefill.cancel()
            self._drop_ahead()
            # Shielded: a cancelled request must still free both caches.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                if self._called:
                    release = self._transport.release(self._request.session_id, self._called)
                    await asyncio.shield(release)

    async def complete(self) -> Completion:
        """Runs every round (run() to its end) and returns the completion. Raises as run();
        a cancelled caller still releases the session (run()'s finally, reached by aclosing)."""
        async with contextlib.aclosing(self.run()) as deltas:
            async for _ in deltas:
                pass
        return self.completion

    async def _prefill(self) -> Delta:
        """Builds both caches concurrently; the target's prefill also yields the first token.

        The draft's prefill runs beside it and is never waited for: the first token goes out
        when the target has it, and rounds run at k = 0 until the draft's cache is built (or
        its prefill failed, see DraftAvailability).
        """
        if self._choices.uses_draft and self._config.concurrent_prefill and self._draft.available():
            self._draft_prefill = asyncio.ensure_future(self._propose(0))
        traffic = self._controller.costs.traffic
        traffic.prefill_started()
        try:
            verified, _ = await self._verify([], None)
        finally:
            traffic.prefill_ended()
        self._recorder.prefill(verified.compute_s)
        return self._commit(verified)

    async def _draft_prefilled(self) -> bool:
        """Whether the draft's prefill (if one was started) has ended; lets it run one step
        first, so an in-process draft (which never yields) always has, unless its prompt
        prefills in chunks (one per turn of the event loop: rounds run at k = 0 meanwhile)."""
        task = self._draft_prefill
        if task is None:
            return True
        if not task.done():
            await asyncio.wait([task], timeout=0)
            if not task.done():
                return False
        self._draft_prefill = None
        response, _ = task.result()
        if response is not None:
            self._recorder.draft_prefill(response.compute_s)
        return True

    async def _draft_ready(self) -> bool:
        """Whether this round may draft: the draft's prefill, if one runs beside the target's,
        has ended; and, where the draft prefills after the first token (concurrent_prefill
        false: draft and target share cores), its first call, which carries the whole prompt,
        waits until no other request of this router is waiting for its first token.

        Why: a draft prefill beside the target's prefills takes their cores. In a burst of 8
        requests on the AMX Xeon, the first request to get its first token started its draft
        (about 120 prompt tokens, then 6 draft steps) while the other 7 prefilled, and the
        next first token came 2.3 s after it instead of 0.6 s: TTFT p50 5.1 s against 2.7 s
        at k = 0 (specdec sweep, 8 streams)."""
        if not await self._draft_prefilled():
            return False
        if self._config.concurrent_prefill or self._known["draft"] > 0:
            return True
        return self._controller.costs.traffic.prefills_pending == 0

    async def _round(self) -> Delta:
        choice = await self._choose()
        start = time.perf_counter()
        proposal, draft_rebuilt, overlapped = worker_pb2.ProposeResponse(), False, False
        tail, limit = Proposal(NONE, RoundPlan(0)), self._checker.remaining - 1
        if choice.source == DRAFT:
            response, draft_rebuilt, overlapped = await self._draft_for_round(choice.plan)
            if response is None:  # no draft: n-gram lookup stands in this round
                choice = self._choices.fallback(limit)._replace(without_draft=True)
            else:
                proposal = response
                tail = self._choices.tail(response.token_ids, response.confidences, limit)
        drafted_s = time.perf_counter() - start
        drafts, q = self._proposed(choice, proposal, tail)
        if proposal.token_ids:
            self._draft_ahead(drafts, choice.plan)
        verified, target_rebuilt = await self._verify(drafts, q)
        ngram = choice.source == NGRAM
        # An overlapped round's draft ran during the last verify: what it waited for the draft
        # (its answer in flight, or nothing) is the draft's share of this round's path.
        on_path_s = min(drafted_s, proposal.compute_s) if overlapped else proposal.compute_s
        timing = RoundTiming(
            verify_s=verified.compute_s,
            draft_s=proposal.compute_s,
            catchup_s=proposal.catchup_s,
            catchup_tokens=proposal.catchup_tokens,
            overhead_s=time.perf_counter() - start - on_path_s - verified.compute_s,
            draft_rebuilt=draft_rebuilt,
            target_rebuilt=target_rebuilt,
            batch_sessions=verified.batch_sessions,
            batch_rows=verified.batch_rows,
            draft_free=ngram,
            ngram_tail=len(tail.tokens),
            overlapped=overlapped,
        )
        self._observe(choice, tail, proposal, verified.num_accepted, timing)
        self._recorder.round(
            len(drafts),
            verified.num_accepted,
            timing.draft_s,
            timing.verify_s,
            timing.overhead_s,
            without_draft=choice.without_draft,
            ngram=ngram,
            ngram_tail=len(tail.tokens),
            overlapped=overlapped,
        )
        return self._commit(verified)

    def _observe(
        self,
        choice: Proposal,
        tail: Proposal,
        proposal: worker_pb2.ProposeResponse,
        accepted: int,
        timing: RoundTiming,
    ) -> None:
        """Tells the controller and the proposer choice what a round's proposals achieved: the
        draft model's ``proposal`` (then ``tail``'s tokens from lookup, reached only if all of
        the draft's were accepted), ``accepted`` of the round's tokens in all."""
        if choice.source == NGRAM:
            self._controller.observe(len(choice.tokens), accepted, timing)
            self._choices.observe_ngram(choice, accepted)
            return
        drafted = len(proposal.token_ids)
        if drafted:
            self._draft_ran = min(accepted, drafted - 1)
        else:
            self._choices.observe_plain()
        self._controller.observe(drafted, min(accepted, drafted), timing, proposal.confidences)
        if tail.tokens and accepted >= drafted:
            self._choices.observe_ngram(tail, accepted - drafted, tail=True)

    async def _draft_for_round(
        self, plan: RoundPlan
    ) -> tuple[worker_pb2.ProposeResponse | None, bool, bool]:
        """(response, rebuilt, overlapped): the round's propose, as _propose, or the pipelined
        draft's tokens (overlapped) where the last round was accepted as it assumed
        (_landed_ahead). Its first call for this session carries the whole
        sequence (the draft's prefill, where it did not run beside the target's); the round
        waits for that one at most draft_wait_s, after which it runs on in the background as
        the draft's prefill (its drafts dropped) and this round goes without the draft, as
        rounds do while a concurrent prefill runs. A draft that slow is one the breaker takes
        as down (specdec.decoding.degrade), as it does a decode round's propose past
        draft_timeout_s: the router's other requests stop calling it until a check answers.
        Why: such a call may take call_timeout_s (a long prompt on a busy CPU), and where the
        draft pool had died unnoticed the round waited all of it: 120 s as shipped on the
        local cluster, for a request that needs no draft to be answered."""
        ahead = await self._landed_ahead(plan.k)
        if ahead is not None:
            return ahead, False, True
        call = self._propose(plan.k, plan.min_draft_confidence)
        if self._known["draft"] > 0 or self._draft_wait_s is None:
            return *(await call), False
        task = asyncio.ensure_future(call)
        done, _ = await asyncio.wait({task}, timeout=self._draft_wait_s)
        if task in done:
            return *task.result(), False
        self._draft_prefill = task
        self._draft.failed(TimeoutError(f"no draft answer in {self._draft_wait_s:g} s"))
        return None, False, False

    def _draft_ahead(self, drafts: list[int], plan: RoundPlan) -> None:
        """Pipelined drafting: sends, beside this round's verify of ``drafts``, a propose that
        assumes them accepted and drafts the bonus token's guess and plan.k more (fewer near
        the length limit). One draft call per request at a time: none while one is in flight,
        none before the draft's cache is built."""
        k = min(plan.k, self._checker.remaining - len(drafts) - 2)
        if not self._pipelined or self._ahead is not None or self._known["draft"] == 0 or k < 1:
            return
        request = worker_pb2.ProposeRequest(
            num_speculative_tokens=k + 1,
            sampling=self._sampling,
            draft_top_n=self._config.draft_top_n,
            min_draft_confidence=plan.min_draft_confidence,
            assumed_token_ids=drafts,
        )
        sent = self._set_session(request, self._known["draft"])  # now: the verify commits next
        task = asyncio.ensure_future(self._send_ahead(request, sent))
        self._ahead = _Ahead(task, sent, list(drafts))

    async def _send_ahead(
        self, request: worker_pb2.ProposeRequest, sent: int
    ) -> worker_pb2.ProposeResponse | None:
        """The pipelined propose's call. A miss is not rebuilt here (the next round's own
        propose does that); a failure tells the breaker, as any draft call's does."""
        response = await self._guarded(self._transport.propose(request))
        if response is None or response.cache_miss:
            return None
        self._known["draft"] = sent
        return response

    async def _landed_ahead(self, k: int) -> worker_pb2.ProposeResponse | None:
        """The pipelined draft's next tokens, at most k, where the round it assumed was
        accepted whole with its guess as the bonus token (and nothing committed since); None
        otherwise, its tokens then counted wasted. Waits for the pipelined call in flight, so
        that the draft's calls of one session stay in order.

        Exact: on a hit its tokens were drawn from the draft's q after exactly the committed
        tokens, in a draw stream of their own (DraftProposer's AHEAD_STREAM), so they are a
        draft like any other (Leviathan et al. 2023, section 2.3, holds for any q it reports)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        response = await ahead.task
        if response is None:
            return None
        tokens = list(response.token_ids)
        hit = len(tokens) > 1 and self._ids[ahead.base :] == [*ahead.assumed, tokens[0]]
        used = min(k, len(tokens) - 1) if hit else 0
        self._recorder.wasted(len(tokens) - used - hit)
        return _rows(response, 1, 1 + used) if used else None

    def _drop_ahead(self) -> None:
        """Cancels a pipelined draft still in flight (the request ended); counts the tokens of
        one that answered as wasted."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        if ahead.task.done() and not ahead.task.cancelled() and ahead.task.result() is not None:
            self._recorder.wasted(len(ahead.task.result().token_ids))
        ahead.task.cancel()

    async def _choose(self) -> Proposal:
        """This round's proposal (ProposerChoice.choose), from whether the draft can be
        called now."""
        draft_lag = len(self._ids) - self._known["draft"] - self._draft_ran
        available = self._choices.uses_draft and self._draft.available()
        ready = available and await self._draft_ready()
        return self._choices.choose(self._checker.remaining - 1, draft_lag, available, ready)

    def _proposed(
        self, choice: Proposal, proposal: worker_pb2.ProposeResponse, tail: Proposal
    ) -> tuple[list[int], worker_pb2.SparseDistribution | None]:
        """The tokens the round verifies and, when sampling, the q they were drawn from: the
        draft's for its tokens, and for n-gram tokens (a whole lookup round, or a mixed
        round's tail) a point mass on each (q(x) = 1: the target accepts x with probability
        p(x), else samples from p without x; Leviathan et al. 2023, section 2.3, for a
        deterministic draft)."""
        looked_up = list(choice.tokens if choice.source == NGRAM else tail.tokens)
        drafts = [*proposal.token_ids, *looked_up]
        if self._sampling.temperature == 0:
            return drafts, None
        q = proposal.q if proposal.HasField("q") else None
        return drafts, with_point_masses(q, looked_up) if looked_up else q

    def _commit(self, verified: worker_pb2.VerifyResponse) -> Delta:
        delta = self._checker.append(list(verified.token_ids), list(verified.logprobs))
        self._ids.extend(delta.token_ids)
        self._ngrams.commit(delta.token_ids)
        return delta

    async def _propose(
        self, k: int, min_confidence: float = 0.0
    ) -> tuple[worker_pb2.ProposeResponse | None, bool]:
        """(response, rebuilt), or (None, False) when the draft side failed: the draft is an
        optimisation, so any error of its call only takes this round (and, through the shared
        DraftAvailability, the next ones) to k = 0."""
        request = worker_pb2.ProposeRequest(
            num_speculative_tokens=k,
            sampling=self._sampling,
            draft_top_n=self._config.draft_top_n,
            min_draft_confidence=min_confidence,
        )
        answered = await self._guarded(self._call("draft", self._transport.propose, request))
        return answered or (None, False)

    async def _guarded(self, call):
        """What the draft call ``call`` returns, or None when it failed, which it tells the
        shared DraftAvailability (as a success, too): every draft failure degrades, none
        fails."""
        try:
            answered = await call
        except Exception as err:  # noqa: BLE001 - every draft failure degrades, none fails
            self._draft.failed(err)
            return None
        self._draft.succeeded()
        return answered

    async def _verify(
        self, drafts: list[int], q: worker_pb2.SparseDistribution | None
    ) -> tuple[worker_pb2.VerifyResponse, bool]:
        request = worker_pb2.VerifyRequest(draft_token_ids=drafts, sampling=self._sampling)
        if q is not None:
            request.q.CopyFrom(q)
        return await self._call("target", self._transport.verify, request)

    async def _call(self, side: str, method, request) -> tuple:
        """Sends the tokens committed since the side's last call; on a cache miss, resends the
        whole committed sequence so the replica rebuilds the session.

        Returns (response, rebuilt): rebuilt when the full sequence had to be resent, so the
        response's compute_s includes the rebuild (not a steady-state cost).
        """
        known = self._known[side]
        sent = self._set_session(request, known)
        if side not in self._called:
            self._called.append(side)
        response = await self._in_phase(side, method, request)
        rebuilt = bool(response.cache_miss and known)
        if rebuilt:
            sent = self._set_session(request, 0)
            response = await self._in_phase(side, method, request)
        if response.cache_miss:
            raise RuntimeError(
                f"{side} replica refused a full-sequence call for session "
                f"{self._request.session_id}"
            )
        # What the call carried, not len(self._ids): the draft's prefill runs while rounds
        # commit tokens.
        self._known[side] = sent
        return response, rebuilt

    async def _in_phase(self, side: str, method, request):
        """method(request), within ``side``'s phase of the PhaseGate when there is one."""
        if self._phases is None:
            return await method(request)
        async with self._phases.call(side):
            return await method(request)

    def _set_session(self, request, prefix_len: int) -> int:
        """Writes the call's SessionTokens; prompt_len lets a target replica that rebuilds replay
        the prompt's prefill as the one forward it was. Returns the committed length sent."""
        request.session.CopyFrom(
            worker_pb2.SessionTokens(
                session_id=self._request.session_id,
                prefix_len=prefix_len,
                new_token_ids=self._ids[prefix_len:],
                prompt_len=len(self._request.prompt_ids),
            )
        )
        return len(self._ids)

    def _finish(self) -> None:
        checker = self._checker
        self._ngrams.finish()
        self.completion = Completion(
            token_ids=list(checker.token_ids),
            text=checker.text,
            finish_reason=checker.finish_reason,
            logprobs=list(checker.logprobs),
            prompt_tokens=len(self._request.prompt_ids),
            stats=self._recorder.finish(len(checker.token_ids)),
        )


def _rows(
    response: worker_pb2.ProposeResponse, start: int, stop: int
) -> worker_pb2.ProposeResponse:
    """``response`` cut to its draft tokens [start, stop): their ids, confidences and q rows."""
    cut = worker_pb2.ProposeResponse(
        token_ids=response.token_ids[start:stop],
        confidences=response.confidences[start:stop],
        compute_s=response.compute_s,
    )
    if response.HasField("q"):
        width = response.q.width
        cut.q.width = width
        cut.q.token_ids.extend(response.q.token_ids[start * width : stop * width])
        cut.q.probs.extend(response.q.probs[start * width : stop * width])
    return cut


def with_point_masses(
    q: worker_pb2.SparseDistribution | None, token_ids: list[int]
) -> worker_pb2.SparseDistribution:
    """``q`` (the draft's [rows, width] rows, or None) followed by one row per token of
    ``token_ids`` that puts all its mass on that token: the token at probability 1, then
    width - 1 other ids at 0 (distinct, as the verifier scatters rows into a dense one)."""
    width = q.width if q is not None else 1
    rows = worker_pb2.SparseDistribution(width=width)
    if q is not None:
        rows.token_ids.extend(q.token_ids)
        rows.probs.extend(q.probs)
    for token in token_ids:
        others = [i for i in range(width) if i != token][: width - 1]
        rows.token_ids.extend([token, *others])
        rows.probs.extend([1.0] + [0.0] * (width - 1))
    return rows
