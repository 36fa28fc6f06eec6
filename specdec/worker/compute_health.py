"""Whether a replica's compute path works: a watchdog over the batches of its compute thread.

A replica runs every forward on one compute thread, and Serve's periodic health check runs on
its event loop, which stays free while a forward runs. So the check cannot see a broken device
by itself: a hung forward (a deadlock, a device that stopped answering) or a sticky device error
(a CUDA error poisons the process's context; every later forward raises) would leave the replica
HEALTHY while it fails or stalls every call sent to it. The replica therefore records when the
batch on its compute thread began and whether each batch's forwards raised, and its health check
asks this watchdog, which answers in microseconds without touching the device:

- stuck: the running batch began more than ``stuck_after_s`` seconds ago;
- failing: the last ``max_failures`` batches in a row had a forward that raised (a call's own
  bad input is a ValueError and counts for nothing; any batch without a forward error resets
  the count).

Either one makes ``check`` raise ComputeUnhealthy: Serve's health check then fails and, after
its threshold of failed checks, Serve replaces the replica; meanwhile the replica refuses new
calls with the same error, which the router retries elsewhere. A replica that failed
``max_failures`` batches stays unhealthy (no batch runs on it to clear that); a stuck one is
healthy again if its batch does end before Serve replaces it. Imports neither Ray nor torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specdec.errors import ComputeUnhealthy


class ComputeWatchdog:
    """Counts a replica's failed batches and times its running one (see the module docstring).

    Calls come from one thread (the replica's event loop); nothing here locks.

    Args:
        stuck_after_s: seconds one batch may run before the replica counts as stuck
            (models.stuck_forward_s), > 0.
        max_failures: batches in a row whose forwards raised before the replica counts as
            failing (models.max_forward_failures), >= 1.
        clock: seconds, monotonic (tests inject one).
    Raises:
        ValueError: stuck_after_s <= 0 or max_failures < 1.
    """

    def __init__(
        self,
        stuck_after_s: float,
        max_failures: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not stuck_after_s > 0:
            raise ValueError(f"stuck_after_s must be > 0 seconds, got {stuck_after_s}")
        if max_failures < 1:
            raise ValueError(f"max_failures must be at least 1, got {max_failures}")
        self.stuck_after_s, self.max_failures = stuck_after_s, max_failures
        self._clock = clock
        self._started: float | None = None  # when the running batch began; None: none runs
        self.failures = 0  # batches in a row whose forwards raised
        self.last_error = ""  # the last forward error, for the health check's message

    def started(self) -> None:
        """A batch began on the compute thread."""
        self._started = self._clock()

    def ended(self, error: BaseException | None = None) -> None:
        """The running batch ended; ``error``: the first error a forward of it raised (None
        when none did, which resets the count of failed batches)."""
        self._started = None
        if error is None:
            self.failures = 0
            return
        self.failures += 1
        self.last_error = f"{type(error).__name__}: {error}"

    def problem(self) -> str | None:
        """Why the compute path counts as broken, or None while it works."""
        if self._started is not None:
            running_s = self._clock() - self._started
            if running_s > self.stuck_after_s:
                return (
                    f"compute thread stuck: its batch has run {running_s:.1f} s, more than "
                    f"models.stuck_forward_s ({self.stuck_after_s:g} s)"
                )
        if self.failures >= self.max_failures:
            return (
                f"compute failing: {self.failures} batches in a row raised in a forward "
                f"(models.max_forward_failures {self.max_failures}); last: {self.last_error}"
            )
        return None

    def check(self) -> None:
        """Raises ComputeUnhealthy naming the problem when the compute path counts as broken."""
        problem = self.problem()
        if problem is not None:
            raise ComputeUnhealthy(problem)


def forward_error(results: list) -> Exception | None:
    """The first error among a batch's results (SessionModel.run_batch) that a forward raised,
    not a call's own invalid input (ValueError, which says nothing about the replica); None
    when there is none."""
    return next(
        (r for r in results if isinstance(r, Exception) and not isinstance(r, ValueError)), None
    )
