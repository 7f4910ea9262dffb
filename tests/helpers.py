"""Shared test helpers: tolerances per dtype (written once), GPU detection, reference checks."""

from __future__ import annotations

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


def cuda_available() -> bool:
    torch = torch_or_none()
    return bool(torch is not None and torch.cuda.is_available())


requires_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


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
