"""drvsoftmax on raw device pointers: CUDA memory from cuMemAlloc, no array framework.

    python examples/raw_pointers.py

Allocates x, y, a [B, 1, Sq, Sk] bool mask and int32 key lengths with the CUDA driver API
(cuda.bindings), runs a masked causal forward on a stream of its own, and checks y
against a float64 NumPy reference.  NumPy only holds host data.
"""

from __future__ import annotations

import sys

import numpy as np
from cuda.bindings import driver as cu

import drvsoftmax.raw as raw


def ok(result):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


def reference(x, mask, kl, scale):
    B, H, Sq, Sk = x.shape
    j = np.arange(Sk)
    hidden = mask | (j > np.arange(Sq)[:, None] + (Sk - Sq)) | (j >= kl[:, None, None, None])
    s = np.where(hidden, -np.inf, x.astype(np.float64) * scale)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    d = e.sum(-1, keepdims=True)
    return np.where(d > 0, e / np.where(d > 0, d, 1), 0)


def main() -> int:
    B, H, Sq, Sk, scale = 2, 4, 64, 96, 0.125
    rng = np.random.default_rng()
    x = rng.standard_normal((B, H, Sq, Sk)).astype(np.float16)
    mask = rng.random((B, 1, Sq, Sk)) < 0.2  # True hides
    kl = np.array([Sk, Sk // 3], dtype=np.int32)

    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxPushCurrent(ctx))
    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    bufs = {}
    for name, host in (("x", x), ("y", x), ("mask", mask), ("kl", kl)):
        bufs[name] = ok(cu.cuMemAlloc(host.nbytes))
    for name, host in (("x", x), ("mask", mask), ("kl", kl)):
        ok(cu.cuMemcpyHtoDAsync(bufs[name], host.ctypes.data, host.nbytes, stream))

    raw.forward(
        int(bufs["x"]),
        int(bufs["y"]),
        x.shape,
        "float16",
        scale=scale,
        mask=int(bufs["mask"]),
        mask_dtype="bool",
        mask_shape=mask.shape,
        causal=True,
        key_lengths=int(bufs["kl"]),
        key_lengths_dtype="int32",
        stream=int(stream),
        device=0,
    )
    y = np.empty_like(x)
    ok(cu.cuMemcpyDtoHAsync(y.ctypes.data, bufs["y"], y.nbytes, stream))
    ok(cu.cuStreamSynchronize(stream))
    for b in bufs.values():
        ok(cu.cuMemFree(b))
    ok(cu.cuStreamDestroy(stream))
    ok(cu.cuCtxPopCurrent())

    err = float(np.max(np.abs(y.astype(np.float64) - reference(x, mask, kl, scale))))
    frameworks = sorted({"torch", "cupy", "numba", "jax"} & set(sys.modules))
    print(f"frameworks imported: {', '.join(frameworks) or 'none'}")
    print(f"raw pointers, fp16 {x.shape}: max |y - ref| = {err:.2e}")
    return 0 if err < 2e-3 and not frameworks else 1


if __name__ == "__main__":
    sys.exit(main())
