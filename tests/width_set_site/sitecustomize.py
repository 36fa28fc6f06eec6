"""Imported by Python at start-up in a process whose PYTHONPATH holds this folder: the
TargetModel replicas of tests/integration/test_half_precision_service.py, which
tests/width_sets.py's service_env puts it on, with $SPECDEC_TEST_WIDTH_SETS naming the target
to load with the several-width layers."""

from width_sets import install_from_environment

install_from_environment()
