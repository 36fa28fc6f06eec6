"""specdec's INFO lines (the calibration's measurements) reach the handlers of Serve's logger."""

from __future__ import annotations

import logging

import pytest

from specdec.deployments.logs import SERVE_LOGGER, route_specdec_logs


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def serve_handler():
    """A handler on Serve's logger, as Serve's replica set-up adds; the loggers are restored."""
    serve, ours = logging.getLogger(SERVE_LOGGER), logging.getLogger("specdec")
    saved = (list(serve.handlers), list(ours.handlers), ours.level, ours.propagate)
    handler = _Collect()
    serve.addHandler(handler)
    yield handler
    serve.handlers[:], ours.handlers[:] = saved[0], saved[1]
    ours.setLevel(saved[2])
    ours.propagate = saved[3]


def test_calibration_info_lines_reach_the_replica_log_once(serve_handler):
    calibration = logging.getLogger("specdec.device.calibration")
    calibration.info("before")  # a Ray worker's root logger drops INFO: the bug
    route_specdec_logs()
    route_specdec_logs()  # idempotent: no second copy of each line
    calibration.info("target runs in %s", "float32")
    assert serve_handler.messages == ["target runs in float32"]


def test_specdec_lines_follow_the_level_serve_set_from_the_deployments_logging_config(
    serve_handler,
):
    serve = logging.getLogger(SERVE_LOGGER)
    saved = serve.level
    try:
        serve.setLevel(logging.DEBUG)  # logging_config: {log_level: DEBUG}
        route_specdec_logs()
        logging.getLogger("specdec.decoding.k_policy").debug("k=4 of 12")
        serve.setLevel(logging.WARNING)
        route_specdec_logs()
        logging.getLogger("specdec.device.calibration").info("dropped at WARNING")
    finally:
        serve.setLevel(saved)
    assert serve_handler.messages == ["k=4 of 12"]
