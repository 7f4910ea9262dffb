"""drvsoftmax on any DLPack producer: here an object with only ``__dlpack__`` and
``__dlpack_device__`` (wrapping CuPy arrays).  drvsoftmax allocates only CuPy and Numba
arrays, so other producers pass ``out=``.

    python examples/dlpack_softmax.py
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np

import drvsoftmax
from drvsoftmax import _reference


class Producer:
    """Speaks DLPack only: drvsoftmax asks for the capsule with the stream it launches on."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, stream=None, max_version=None):
        kw = {} if max_version is None else {"max_version": max_version}
        try:
            return self._a.__dlpack__(stream=stream, **kw)
        except TypeError:  # a CuPy of DLPack < 1.0
            return self._a.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def main() -> int:
    x = cp.random.standard_normal((2, 4, 33, 257), dtype=cp.float32)
    y = cp.empty_like(x)
    lens = cp.asarray(np.array([257, 100], dtype=np.int32))
    drvsoftmax.scaled_masked_softmax(Producer(x), scale=0.3, key_lengths=Producer(lens), out=Producer(y))
    cp.cuda.get_current_stream().synchronize()
    ref = _reference.softmax_forward(cp.asnumpy(x), None, 0.3, False, cp.asnumpy(lens))
    err = float(np.max(np.abs(cp.asnumpy(y) - ref)))
    print(f"dlpack producer, fp32 {x.shape}: max |y - ref| = {err:.2e}")
    return 0 if err < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
