"""drvsoftmax on CuPy arrays: the result is a cupy.ndarray, on CuPy's current stream.

python examples/cupy_softmax.py
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np

import drvsoftmax
from drvsoftmax import _reference


def main() -> int:
    B, H, Sq, Sk, scale = 2, 4, 64, 96, 0.125
    x = cp.random.standard_normal((B, H, Sq, Sk), dtype=cp.float32).astype(cp.float16)
    pad = cp.random.random((B, 1, 1, Sk)) < 0.1  # [B, 1, 1, Sk] key padding, True hides
    with cp.cuda.Stream(non_blocking=True) as s:  # launched on CuPy's current stream
        y = drvsoftmax.scaled_masked_softmax(x, pad, scale=scale, causal=True)
        dx = drvsoftmax.scaled_masked_softmax_backward(cp.ones_like(y), y, scale=scale)
    s.synchronize()
    ref = _reference.softmax_forward(cp.asnumpy(x), cp.asnumpy(pad), scale, True)
    err = float(np.max(np.abs(cp.asnumpy(y).astype(np.float64) - ref)))
    print(
        f"cupy {type(y).__name__} {y.dtype} {y.shape}: max |y - ref| = {err:.2e}; |dx| max {float(abs(dx).max()):.1e}"
    )
    return 0 if err < 2e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
