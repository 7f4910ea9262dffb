"""Shared test helpers: tolerances per dtype (written once), GPU detection, reference checks."""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest

# |got - ref| <= atol + rtol * |ref|, against a float64 reference computed from the same
# (already rounded) inputs.  Output rounding alone is 2^-11 (fp16) and 2^-8 (bf16)
# relative; fp32 leaves room for exp2 and the summation order.
TOLS = {
    "float16": dict(rtol=2e-3, atol=2e-5),
    "bfloat16": dict(rtol=1.6e-2, atol=1e-5),
    "float32": dict(rtol=2e-5, atol=1e-7),
    "float64": dict(rtol=1e-12, atol=1e-15),
}


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


_GPU_COUNT = """
try:
    from cuda.bindings import driver
    ok = int(driver.cuInit(0)[0]) == 0
    err, n = driver.cuDeviceGetCount() if ok else (1, 0)
    print(int(n) if int(err) == 0 else 0)
except Exception:
    print(0)
"""


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    """GPUs the CUDA driver reports, asked in a subprocess (this process stays un-initialised,
    so fork tests and framework initialisation order are not disturbed); 0 without a driver."""
    try:
        r = subprocess.run([sys.executable, "-c", _GPU_COUNT], capture_output=True, text=True, timeout=120)
        return int(r.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def cuda_available() -> bool:
    """A CUDA GPU is visible to the driver (whatever frameworks are installed)."""
    return gpu_count() > 0


def torch_cuda_available() -> bool:
    """PyTorch is installed and sees a CUDA GPU."""
    torch = torch_or_none()
    return bool(torch is not None and torch.cuda.is_available())


requires_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (the CUDA driver reports none)")
requires_torch_cuda = pytest.mark.skipif(
    not torch_cuda_available(), reason="needs PyTorch with a CUDA GPU (torch.cuda.is_available() is False)"
)


def assert_matches(got: np.ndarray, ref: np.ndarray, dtype: str, what: str = "") -> None:
    """Element-wise closeness, NaN only where the reference has NaN, exact zeros kept."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan_ref, err_msg=f"{what}: NaN pattern differs")
    tol = TOLS[dtype]
    g, r = got[~nan_ref], ref[~nan_ref]
    err = np.abs(g - r)
    bad = err > tol["atol"] + tol["rtol"] * np.abs(r)
    if bad.any():
        i = int(np.argmax(err))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {g.size} elements outside tolerance {tol}; "
            f"worst |got-ref| = {err[i]:.3g} at ref {r[i]:.6g}"
        )
    zeros = ref == 0
    assert np.all(got[zeros] == 0), f"{what}: positions the reference holds at exactly 0 are not 0"


def run_in_threads(work, n: int) -> list:
    """Run work(0) .. work(n-1) in n threads at once; return the exceptions they raised."""
    import threading

    errors = []

    def guarded(i):
        try:
            work(i)
        except Exception as e:  # collected for the caller's assertion
            errors.append(e)

    ts = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors
