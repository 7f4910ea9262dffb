"""CuPy and Numba arrays through the same front door (``__cuda_array_interface__``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches, requires_cuda

import drvsoftmax
from drvsoftmax import _reference

pytestmark = requires_cuda
_gen = np.random.default_rng(7)


def test_cupy_forward_backward_masks_and_streams():
    cp = pytest.importorskip("cupy")
    for dtype, name in ((np.float16, "float16"), (np.float32, "float32")):
        for sk in (7, 1000, 40000):
            xh = (_gen.standard_normal((2, 3, 4, sk)) * 3).astype(dtype)
            mh = _gen.random((2, 1, 4, sk)) < 0.3
            kl = np.array([sk, sk // 2], dtype=np.int32)
            x, m, k = cp.asarray(xh), cp.asarray(mh), cp.asarray(kl)
            out = cp.full(x.shape, cp.nan, dtype=dtype)
            s = cp.cuda.Stream(non_blocking=True)
            with s:
                y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.4, causal=True, key_lengths=k, out=out)
            s.synchronize()
            assert y is out and isinstance(y, cp.ndarray)
            ref = _reference.softmax_forward(xh, mh, 0.4, True, kl)
            assert_matches(cp.asnumpy(y), ref, name, f"cupy {name} Sk={sk}")
            y2 = drvsoftmax.scaled_masked_softmax(x[:, :, ::2], scale=0.4)  # strided view, allocated output
            cp.cuda.get_current_stream().synchronize()
            assert_matches(cp.asnumpy(y2), _reference.softmax_forward(xh[:, :, ::2], None, 0.4), name, "cupy view")
            dy = cp.asarray(_gen.standard_normal(x.shape).astype(dtype))
            dx = drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.4)
            cp.cuda.get_current_stream().synchronize()
            rdx = _reference.softmax_backward(cp.asnumpy(dy), cp.asnumpy(y), 0.4)
            np.testing.assert_allclose(cp.asnumpy(dx).astype(np.float64), rdx, atol=2e-3, rtol=2e-2)


def test_numba_device_arrays():
    cuda = pytest.importorskip("numba.cuda")
    xh = (_gen.standard_normal((3, 5, 300)) * 2).astype(np.float32)
    mh = (_gen.random((1, 5, 300)) < 0.2).astype(np.uint8)
    x, m = cuda.to_device(xh), cuda.to_device(mh)
    y = drvsoftmax.scaled_masked_softmax(x, m, scale=-0.5)
    cuda.synchronize()
    assert type(y).__module__.startswith("numba")
    assert_matches(y.copy_to_host(), _reference.softmax_forward(xh, mh, -0.5), "float32", "numba")


def test_cai_argument_errors():
    cp = pytest.importorskip("cupy")
    x = cp.zeros((2, 3), dtype=cp.float64)
    with pytest.raises(TypeError, match="x must be of dtype float16, bfloat16, float32"):
        drvsoftmax.scaled_masked_softmax(x)
    x = cp.zeros((2, 3), dtype=cp.float32)
    with pytest.raises(ValueError, match=r"mask must be broadcastable to x.shape \(2, 3\)"):
        drvsoftmax.scaled_masked_softmax(x, cp.zeros((4,), dtype=cp.bool_))
    with pytest.raises(TypeError, match="key_lengths"):
        drvsoftmax.scaled_masked_softmax(x, key_lengths=cp.zeros((2,), dtype=cp.float32))


_KDTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def _klen_values(dt, sk):
    info = np.iinfo(dt)
    vals = [info.max, 0, sk - 1, sk + 1, 40000, 33000, info.min, 1]
    return np.array([v for v in vals if info.min <= v <= info.max][:4], dtype=dt)


@pytest.mark.parametrize("kdtype", _KDTYPES, ids=lambda d: np.dtype(d).name)
def test_cupy_key_lengths_of_every_integer_dtype(kdtype):
    # One rule on every path: any integer dtype; int32/int64 are read directly, the others
    # are converted on the launch stream with every value's meaning kept.
    cp = pytest.importorskip("cupy")
    sk = 35000
    kl = _klen_values(kdtype, sk)
    xh = _gen.standard_normal((len(kl), 2, 3, sk)).astype(np.float16)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y = drvsoftmax.scaled_masked_softmax(cp.asarray(xh), key_lengths=cp.asarray(kl), scale=0.5)
    s.synchronize()
    ref = _reference.softmax_forward(xh, None, 0.5, False, kl)
    assert_matches(cp.asnumpy(y), ref, "float16", f"cupy key_lengths {np.dtype(kdtype).name}")


@pytest.mark.parametrize("kdtype", [np.uint8, np.uint16, np.uint64], ids=lambda d: np.dtype(d).name)
def test_numba_key_lengths_converted(kdtype):
    cuda = pytest.importorskip("numba.cuda")
    sk = 300
    kl = _klen_values(kdtype, sk)
    xh = _gen.standard_normal((len(kl), 2, sk)).astype(np.float32)
    y = drvsoftmax.scaled_masked_softmax(cuda.to_device(xh), key_lengths=cuda.to_device(kl), scale=-0.5)
    cuda.synchronize()
    assert_matches(y.copy_to_host(), _reference.softmax_forward(xh, None, -0.5, False, kl), "float32", "numba klen")


def test_cupy_overlap_refused_in_place_and_disjoint_views_accepted():
    cp = pytest.importorskip("cupy")
    base = cp.asarray(_gen.standard_normal(4 * 120).astype(np.float32))
    x, out = base[:120].reshape(2, 3, 4, 5), base[60:180].reshape(2, 3, 4, 5)
    before = cp.asnumpy(base)
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^out must be memory that does not overlap x's"):
        drvsoftmax.scaled_masked_softmax(x, out=out)
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^out must be memory that does not overlap mask's"):
        drvsoftmax.scaled_masked_softmax(x, base[150:170].reshape(4, 5), out=base[130:250].reshape(2, 3, 4, 5))
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^out must be memory that does not overlap dy's"):
        drvsoftmax.scaled_masked_softmax_backward(
            x, base[240:360].reshape(2, 3, 4, 5), out=base[1:121].reshape(2, 3, 4, 5)
        )
    cp.cuda.get_current_stream().synchronize()
    assert np.array_equal(cp.asnumpy(base), before), "a refused call wrote memory"
    xh = cp.asnumpy(x)
    y = drvsoftmax.scaled_masked_softmax(x, out=base[120:240].reshape(2, 3, 4, 5), scale=0.3)
    cp.cuda.get_current_stream().synchronize()
    assert_matches(cp.asnumpy(y), _reference.softmax_forward(xh, None, 0.3), "float32", "disjoint views")
    assert drvsoftmax.scaled_masked_softmax(x, out=x, scale=0.3) is x
    cp.cuda.get_current_stream().synchronize()
    assert_matches(cp.asnumpy(x), _reference.softmax_forward(xh, None, 0.3), "float32", "in place")


def test_cupy_bad_streams_are_argument_errors():
    cp = pytest.importorskip("cupy")
    x = cp.zeros((2, 3), dtype=cp.float32)
    for bad, exc in (("garbage", TypeError), (-1, ValueError), (3.5, TypeError), (2**64, ValueError)):
        with pytest.raises(exc, match=r"^stream must be"):
            drvsoftmax.scaled_masked_softmax(x, stream=bad)
