"""Markers shared by every test module.

    @pytest.mark.requires_torch   skipped where PyTorch is not installed
    @pytest.mark.gpu              skipped where the CUDA driver reports no GPU

So the NumPy/CPU tests run without torch, and a GPU machine with CuPy and no torch runs
the GPU tests that need no torch (GPU presence is asked of the driver, in a subprocess,
so the test process itself never initialises CUDA before a test does).
"""

from __future__ import annotations

import os

import pytest

# JAX takes most of the GPU's memory at its first use by default; with several test workers
# on one GPU (pytest -n) that starves the others' CuPy, Numba and torch tests.  Allocate on
# demand instead (before any test module imports JAX).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
from helpers import cuda_available, torch_or_none


def pytest_runtest_setup(item):
    if item.get_closest_marker("requires_torch") and torch_or_none() is None:
        pytest.skip("needs PyTorch (not installed)")
    if item.get_closest_marker("gpu") and not cuda_available():
        pytest.skip("needs a CUDA GPU (the CUDA driver reports none)")
