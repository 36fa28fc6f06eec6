"""How a model replica sizes its next batch: wait for the sessions that are active, briefly.

With no wait at all, batches of concurrent requests never form on their own: two streams whose
calls arrive apart keep alternating (one call runs, the other arrives during it and runs next,
alone, while the first one's next call arrives during that), so each forward serves one session
and the two only share the device. A fixed wait would tax every lone request instead.

So the replica counts the sessions that called it lately (``active``) and sets Serve's batch
queue (serve.batch) to close a batch as soon as that many calls are in, or after at most
``wait_fraction`` of its last batch's seconds: a lone session never waits (a batch of one is
full at once), concurrent streams fall into step after one short wait, and a session that is
busy elsewhere (drafting) costs its neighbours at most that fraction of a forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

ACTIVE_FLOOR_S = 0.5  # a session counts as active this long after its last call at least
ACTIVE_BATCHES = 4  # ... or this many of the last batch's durations (a round is a few calls)


class BatchSizer:
    """The next batch's size and wait from the sessions seen lately.

    Args:
        max_batch_size: the most sessions a batch may hold (models.max_batch_size).
        wait_fraction: the longest wait for more calls after a batch's first, as a fraction of
            the last batch's seconds (models.batch_wait_fraction); 0 never waits.
        clock: seconds, monotonic (tests inject one).
    """

    def __init__(
        self,
        max_batch_size: int,
        wait_fraction: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_batch_size, self.wait_fraction = max_batch_size, wait_fraction
        self._clock = clock
        self._last_seen: dict[str, float] = {}
        self._batch_s = 0.0

    def observe(self, session_ids: Iterable[str], batch_s: float) -> None:
        """Records a batch: the sessions it served and its seconds."""
        now = self._clock()
        for session_id in session_ids:
            self._last_seen[session_id] = now
        self._batch_s = batch_s

    def release(self, session_id: str) -> None:
        """A session ended: it will not call again."""
        self._last_seen.pop(session_id, None)

    def active(self) -> int:
        """Sessions that called within the activity window (and forgets the others)."""
        horizon = self._clock() - max(ACTIVE_FLOOR_S, ACTIVE_BATCHES * self._batch_s)
        self._last_seen = {s: t for s, t in self._last_seen.items() if t >= horizon}
        return len(self._last_seen)

    def next_batch(self) -> tuple[int, float]:
        """(max_batch_size, batch_wait_timeout_s) for Serve's queue: close the batch once the
        active sessions' calls are in, or after wait_fraction of the last batch's seconds."""
        size = min(self.max_batch_size, max(1, self.active()))
        return size, self.wait_fraction * self._batch_s if size > 1 else 0.0
