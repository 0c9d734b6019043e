"""Shared by every tier: tests/core (one process, no ranks), tests/ranks (thread-ranks on real
gloo) and tests/processes (real processes). Test modules import shared helpers from
tests/helpers.py (``from helpers import ...``), never from one another."""
import os
import pathlib
import sys

import torch

_TESTS = str(pathlib.Path(__file__).resolve().parent)
if _TESTS not in sys.path:  # ``helpers`` importable from every tier, in any import mode
    sys.path.insert(0, _TESTS)

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Worlds started by the tests price plans with the built-in figures, not a probe of this busy
# machine, so a plan a test asserts is the same on every run (tests/processes/test_cost_probe.py
# runs the probe itself).
os.environ.setdefault("GT_COSTS", "default")


def pytest_make_parametrize_id(config, val, argname):
    """Test ids use the compact form: S(0), B, P, (S(0), B)."""
    from globaltensor.sbp import SBP_TYPES

    if isinstance(val, SBP_TYPES):
        return str(val)
    if isinstance(val, tuple) and val and all(isinstance(v, SBP_TYPES) for v in val):
        return "(" + ",".join(str(v) for v in val) + ")"
    return None
