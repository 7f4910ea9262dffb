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


# Backward tolerance, relative to the size of the terms of dx = scale * y * (dy - sum(dy * y)).
BWD_RTOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5}


def assert_backward_matches(got, dy, y, ref, scale: float, dtype: str, what: str = "") -> None:
    """dx against its float64 reference `ref`: NaN and infinities where the reference has
    them, every finite element within BWD_RTOL of |y| * (|dy| + |sum(dy * y)|) * |scale|,
    exactly 0 where y == 0."""
    got, dy, y, ref = (np.asarray(a, dtype=np.float64) for a in (got, dy, y, ref))
    with np.errstate(invalid="ignore"):  # (an infinite dy times y == 0)
        mag = np.abs(y) * (np.abs(dy) + np.abs((dy * y).sum(-1, keepdims=True))) * abs(scale)
    mag = np.where(y == 0, 0.0, mag)  # dx is exactly 0 there, whatever the row's sum
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{what}: NaN pattern differs")
    inf = np.isinf(ref)
    np.testing.assert_array_equal(got[inf], ref[inf], err_msg=f"{what}: infinities differ")
    with np.errstate(invalid="ignore"):
        bad = np.isfinite(ref) & ~(np.abs(got - ref) <= BWD_RTOL[dtype] * mag + 1e-7)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.size} elements outside the backward tolerance"
    assert np.all(got[y == 0] == 0), f"{what}: positions where y == 0 must get exactly 0"


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


# ----------------------------------------------------------------------------------
# Long-row tiers (cluster and coop): shared pieces of their tests.

LONG_ROW_MASK_KINDS = [
    "bool_b1qk",
    "int64_11qk",
    "add_own_b1qk",
    "add_f32_b11k",
    "add_f64_qk",
    "bool_offset",
    "add_strided",
]


def long_row_mask(kind: str, b: int, q: int, sk: int, x_dtype, gen):
    """A CUDA mask for x [b, h, q, sk] of LONG_ROW_MASK_KINDS: `<dtype>_<dims>` (dims b1qk,
    11qk, b11k, qk; dtype bool, int64, add_own (x's dtype), add_f32, add_f64), a bool mask one
    element into a wider row (read element-wise) or an additive mask with a stride along the row."""
    import torch

    dims = {"b1qk": (b, 1, q, sk), "11qk": (1, 1, q, sk), "b11k": (b, 1, 1, sk), "qk": (q, sk)}
    if kind in ("bool_offset", "add_strided"):
        wide = (b, 1, q, 2 * sk + 8)
        if kind == "bool_offset":
            return torch.from_numpy(gen.random(wide) < 0.3).cuda()[..., 1 : 1 + sk]
        v = torch.from_numpy(gen.standard_normal(wide)).to(x_dtype)
        return v.masked_fill(torch.from_numpy(gen.random(wide) < 0.2), float("-inf")).cuda()[..., : 2 * sk : 2]
    mshape = dims[kind.rsplit("_", 1)[1]]
    if kind.startswith("add"):
        mdt = {"own": x_dtype, "f32": torch.float32, "f64": torch.float64}[kind.split("_")[1]]
        v = torch.from_numpy(gen.standard_normal(mshape)).to(mdt)
        return v.masked_fill(torch.from_numpy(gen.random(mshape) < 0.2), float("-inf")).cuda()
    mdt = {"bool": torch.bool, "int64": torch.int64}[kind.split("_")[0]]
    return torch.from_numpy(gen.integers(1, 5, mshape) * (gen.random(mshape) < 0.3)).to(mdt).cuda()


def chunk_slot_bytes(mask_kind: str, dtype: str, backward: bool) -> int:
    """Shared memory per 16-byte chunk of x in the long-row tiers, from the C types of the
    mask kinds (not the planner's table)."""
    import re

    from drvsoftmax import _plan

    if backward:
        return 32
    c_bytes = {
        "smx_u8": 1,
        "smx_u16": 2,
        "smx_u32": 4,
        "smx_u64": 8,
        "smx_f16": 2,
        "smx_bf16": 2,
        "float": 4,
        "double": 8,
    }
    m = re.search(r"<(\w+)>", _plan.MASK_KINDS[mask_kind])
    return 16 + (16 // _plan.X_DTYPES[dtype][1]) * (c_bytes[m.group(1)] if m else 0)


def plan_of(backward: bool, rows: int, sk: int, dtype: str, mask_kind: str, aligned: bool, caps):
    """The planner's plan of a forward (mask kind) or backward on a device of `caps`."""
    from drvsoftmax import _plan

    if backward:
        return _plan.plan_backward(rows, sk, dtype, True, aligned, caps)
    return _plan.plan_forward(rows, sk, dtype, mask_kind, True, aligned, caps)


def to_numpy(t) -> np.ndarray:
    """A torch tensor's values as a host NumPy array (bfloat16 as float32, which holds it exactly)."""
    import torch

    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def operand(t):
    """The drvsoftmax core's Operand of a torch tensor: data pointer, dtype name, shape, element strides."""
    from drvsoftmax import _core

    return _core.Operand(t.data_ptr(), str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()))


def cuda_device():
    """drvsoftmax's Device for torch's current CUDA device."""
    import torch

    from drvsoftmax import _driver

    return _driver.device(torch.cuda.current_device())
