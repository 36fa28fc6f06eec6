"""Imported by Python at start-up in a process whose PYTHONPATH holds this folder (the
TargetModel replicas of tests/integration/test_half_precision_service.py): loads the target
that $SPECDEC_TEST_WIDTH_SETS names with the several-width layers of tests/width_sets.py."""

import os

if os.environ.get("SPECDEC_TEST_WIDTH_SETS"):
    from width_sets import install_from_environment

    install_from_environment()
