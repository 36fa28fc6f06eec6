"""The bundled real pair with the shipped local config's settings, for the e2e tests."""

from __future__ import annotations

import pytest
from local_service import LOCAL_CONFIG


@pytest.fixture(scope="session")
def real_pair_args(tmp_path_factory) -> dict:
    """Overrides of the shipped local config's specdec args: the bundled pair's converted
    directories (converted on first use: minutes, once) and a calibration cache for this test
    session only.

    The in-process engine (test_real_pair) measures both models with the shipped settings and
    keeps the results there; the service (test_real_pair_service) then reuses them after its own
    exactness check, as a repeated deploy does, instead of measuring both models again at the
    same time on the same cores (about 5 minutes on a 2-core CPU). Nothing from an earlier run
    or from the user's own deploys is in it.
    """
    from specdec.deployments.deploy import resolve_models

    folder = tmp_path_factory.mktemp("real-pair-calibrations")
    return resolve_models(LOCAL_CONFIG, {"calibration_cache": str(folder)})
