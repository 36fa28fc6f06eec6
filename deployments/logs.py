"""specdec's own log lines in the Serve replica logs."""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"


def route_specdec_logs() -> None:
    """Sends the ``specdec`` loggers' records (a model replica's start-up calibration, the
    router's draft availability, at DEBUG the controller's every choice of k) to the handlers
    Serve gave its own logger: the replica's log file and stderr. Serve configures only that
    logger, and a Ray worker's root logger drops INFO, so those lines were lost. The level is
    the deployment's, which Serve set on its logger from ``logging_config.log_level`` in the
    Serve config (INFO unless set). Idempotent; call it in a replica's constructor."""
    serve = logging.getLogger(SERVE_LOGGER)
    ours = logging.getLogger("specdec")
    ours.setLevel(serve.level or logging.INFO)
    ours.propagate = False  # the root logger's handlers would print WARNINGs twice
    for handler in serve.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
