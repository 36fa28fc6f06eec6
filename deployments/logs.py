"""specdec's own log lines in the Serve replica logs."""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"


def route_specdec_logs(level: int = logging.INFO) -> None:
    """Sends the ``specdec`` loggers' records (a model replica's start-up calibration, the
    router's draft availability) to the handlers Serve gave its own logger: the replica's log
    file and stderr. Serve configures only that logger, and a Ray worker's root logger drops
    INFO, so those lines were lost. Idempotent; call it in a replica's constructor."""
    ours = logging.getLogger("specdec")
    ours.setLevel(level)
    ours.propagate = False  # the root logger's handlers would print WARNINGs twice
    for handler in logging.getLogger(SERVE_LOGGER).handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
