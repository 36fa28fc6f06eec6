"""The requests of one engine or router: how many are in flight, the batch they share, whose
turn it is to measure the draft, and their pooled acceptance.

Under load a target replica verifies many sessions in one batch (specdec.worker.packed), so a
round is priced in the batch it will run in: B sessions, B the requests in flight, scaled by the
sessions per batch each of them brought lately (RequestTraffic.batch_load). In a batch, E(k) is
the mean over the requests in flight (RequestTraffic.batch_expected_tokens). The draft's costs
are kept by the load they were measured at (RequestTraffic.draft_load), and at a load not yet
measured only one request at a time drafts (RequestTraffic.take_turn; CostModel.may_draft).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Protocol

from specdec.decoding.acceptance import (
    POOL_DECAY,
    AcceptanceEstimator,
    DraftFreeRounds,
    PooledAcceptance,
    mean_expected_tokens,
)
from specdec.decoding.windows import WindowMedian

# At a load whose draft costs are not measured yet, one request at a time drafts to measure them
# (CostModel.may_draft); another may try once this long has passed without a measurement
# (the first request's round failed, or it ended).
EXPLORE_S = 30.0
# How long the batch a round is priced in remembers a request that ended (batch_load):
# under steady load another request takes its place within milliseconds (a client's next call),
# and a request that chose its k alone in that gap drafted for a lone round, k = 7-12 where 2 in
# flight choose 5, while the new request's prefill waited for that draft phase (AMX Xeon, 2
# streams: TTFT p50 1.56 s against 1.16 s at fixed k = 4). Shorter than one lone round (0.5-1.2
# s on the 2-core CPUs), so a burst's last request is priced alone from its next round on.
LOAD_HOLD_S = 0.5


class Member(Protocol):
    """A request in flight, as the traffic sees it (a KController): its acceptance estimate."""

    @property
    def acceptance(self) -> AcceptanceEstimator: ...


class RequestTraffic:
    """The requests of one engine or router, shared by all of them (thread-safe).

    Args:
        clock: seconds, monotonic (tests inject one): the held load and the draft turns expire
            by it, and the batch medians keep samples younger than MAX_AGE_S.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._batch_sessions = WindowMedian(clock)
        # sessions per verify batch / requests in flight here, when each batch was reported
        self._batch_share = WindowMedian(clock)
        self._members: dict[int, Member] = {}  # by id: the requests in flight (choose)
        self._in_flight = 0  # requests running on this engine or router now
        # (when, in_flight) at each change; the first entry is the count in force LOAD_HOLD_S ago
        self._in_flight_changes: collections.deque[tuple[float, int]] = collections.deque(
            [(clock(), 0)]
        )
        self._prefilling = 0  # of those, requests waiting for their first token
        # load bucket -> (when, the KController) of the request measuring it (take_turn)
        self._exploring: dict[int, tuple[float, object]] = {}
        # Each KController's acceptance prior: the acceptance of these requests' recent rounds.
        self.pooled_acceptance = PooledAcceptance()
        # The same for the rounds proposed by n-gram lookup (specdec.decoding.proposers).
        self.pooled_ngram_acceptance = PooledAcceptance()
        # What these requests' rounds without the draft committed: a new request's prior.
        self.pooled_draft_free = DraftFreeRounds(POOL_DECAY)

    def observe_batch(self, batch_sessions: int) -> None:
        """Records the sessions that shared a round's verify batch (0 or 1: a lone verify)."""
        with self._lock:
            self._batch_sessions.add(max(batch_sessions, 1))
            self._batch_share.add(max(batch_sessions, 1) / max(self._in_flight, 1))

    def take_turn(self, owner: object, bucket: int) -> bool:
        """Whether the request ``owner`` (its KController) may draft at the unmeasured load
        ``bucket`` (windows.load_bucket): only the request that asked first, until a round
        measures it, the request gives its turn back (release_turn), or EXPLORE_S passes."""
        with self._lock:
            turn = self._exploring.get(bucket)
            if turn and turn[1] is not owner and self._clock() - turn[0] < EXPLORE_S:
                return False
            self._exploring[bucket] = (self._clock(), owner)
            return True

    def release_turn(self, owner: object) -> None:
        """Gives back the turns of take_turn that ``owner`` holds: its round drafted nothing
        after all (the draft's prefill not done yet, no draft replica), or its request ended."""
        with self._lock:
            for bucket, (_, holder) in list(self._exploring.items()):
                if holder is owner:
                    del self._exploring[bucket]

    def request_started(self, owner: Member | None = None) -> None:
        """A request of this engine or router began (RoundLoop.run); see in_flight. ``owner``:
        its KController, whose acceptance then counts in batch_expected_tokens until
        request_ended(owner)."""
        with self._lock:
            self._in_flight += 1
            self._in_flight_changed()
            if owner is not None:
                self._members[id(owner)] = owner

    def request_ended(self, owner: object | None = None) -> None:
        """A request that request_started counted has ended, however it ended; ``owner``: its
        KController, whose turns of take_turn are given back."""
        if owner is not None:
            self.release_turn(owner)
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._in_flight_changed()
            if owner is not None:
                self._members.pop(id(owner), None)

    def prefill_started(self) -> None:
        """A request of this engine or router began its target prefill (RoundLoop); see
        prefills_pending."""
        with self._lock:
            self._prefilling += 1

    def prefill_ended(self) -> None:
        """The prefill that prefill_started counted has ended, however it ended."""
        with self._lock:
            self._prefilling = max(0, self._prefilling - 1)

    @property
    def prefills_pending(self) -> int:
        """Requests of this engine or router waiting for their first token now (RoundLoop
        starts no draft beside them where draft and target share cores)."""
        return self._prefilling

    @property
    def in_flight(self) -> int:
        """Requests running on this engine or router now: a load that the verify batches show
        only a few rounds later (KController.choose prices a draft's start with it)."""
        return self._in_flight

    def draft_load(self) -> int:
        """The load the draft's costs are kept and priced at: the requests in flight on this
        engine or router (at least 1). The same in choose and observe, so the round that
        measures a load is the one priced at it; the verify batch does not tell it (requests
        out of step verify one at a time while the others draft)."""
        return max(self._in_flight, 1)

    @property
    def batch_sessions(self) -> float:
        """Sessions per verify batch lately (the median of the last WINDOW rounds; 1 before)."""
        return self._batch_sessions.value or 1.0

    @property
    def batch_load(self) -> float:
        """The sessions a round starting now is priced in: the most requests in flight here at
        any moment of the last LOAD_HOLD_S seconds (a request that ended counts a little longer,
        as under steady load another one takes its place at once), times the sessions per verify
        batch that each request in flight brought lately, if more than one (the median of
        batch_sessions / in_flight over the last WINDOW rounds: other routers' sessions share a
        target replica's batches too).

        Why not batch_sessions itself: its median follows the load WINDOW / 2 rounds late.
        After a burst of 8 streams on the AMX Xeon, the last request alone was still priced in
        batches of 3 sessions and drafted 3 tokens a round where alone it drafts up to 12; and
        a burst's first rounds would be priced alone (KController.choose)."""
        share = max(self._batch_share.value or 1.0, 1.0)
        with self._lock:
            held = self._held_in_flight()
        return max(held, 1) * share

    def _in_flight_changed(self) -> None:
        """Records the new in_flight for _held_in_flight (under self._lock)."""
        self._in_flight_changes.append((self._clock(), self._in_flight))
        self._held_in_flight()  # drops the changes older than the hold

    def _held_in_flight(self) -> int:
        """The most requests in flight at any moment of the last LOAD_HOLD_S seconds (under
        self._lock)."""
        changes, horizon = self._in_flight_changes, self._clock() - LOAD_HOLD_S
        while len(changes) > 1 and changes[1][0] <= horizon:
            changes.popleft()
        return max(count for _, count in changes)

    def batch_acceptance_rates(self) -> list[float] | None:
        """The acceptance rate of each request in flight (those started with their
        KController); None with fewer than 2 such requests."""
        with self._lock:
            rates = [member.acceptance.rate for member in self._members.values()]
        return rates if len(rates) >= 2 else None

    def batch_expected_tokens(self, k: int) -> float | None:
        """The mean over the requests in flight (batch_acceptance_rates) of the tokens a round
        drafting k commits, E(k) at each one's acceptance rate; None with fewer than 2 such
        requests."""
        rates = self.batch_acceptance_rates()
        return None if rates is None else mean_expected_tokens(rates, k)
