"""drvsoftmax on Numba device arrays (``__cuda_array_interface__``): the result is one too.

python examples/numba_softmax.py
"""

from __future__ import annotations

import sys

import numpy as np
from numba import cuda

import drvsoftmax
from drvsoftmax import _reference


def main() -> int:
    rng = np.random.default_rng()
    xh = rng.standard_normal((3, 8, 200)).astype(np.float32)
    bias = np.where(rng.random((8, 200)) < 0.1, -np.inf, 0.5 * rng.standard_normal((8, 200))).astype(np.float32)
    kl = np.array([200, 120, 7], dtype=np.int64)
    s = cuda.stream()
    x, m, k = cuda.to_device(xh, stream=s), cuda.to_device(bias, stream=s), cuda.to_device(kl, stream=s)
    y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.5, key_lengths=k, stream=s)  # float mask: added
    out = y.copy_to_host(stream=s)
    s.synchronize()
    err = float(np.max(np.abs(out - _reference.softmax_forward(xh, bias, 0.5, False, kl))))
    print(f"numba {type(y).__name__} {out.dtype} {out.shape}: max |y - ref| = {err:.2e}")
    return 0 if err < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
