"""Every argument error of the public functions, on NumPy arrays and on CPU torch tensors.

Each case checks the exception class (TypeError for a wrong type or dtype, ValueError for a
wrong shape or value, both subclasses of drvsoftmax.DrvSoftmaxError) and that the message
names the argument and shows what was given.  Nothing a user can pass may surface as an
AssertionError or as a bare NumPy/torch error.
Checks that need a GPU (float64 x on the device, device mismatches) live with the GPU tests.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from helpers import torch_or_none
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import drvsoftmax

torch = torch_or_none()  # the NumPy cases run without it; torch tests are marked requires_torch

FRONTS = ["numpy", "torch"] if torch is not None else ["numpy"]
XSHAPE = (2, 3, 4, 5)
_NP_TO_TORCH = (
    {}
    if torch is None
    else {
        np.bool_: torch.bool,
        np.uint8: torch.uint8,
        np.int8: torch.int8,
        np.int16: torch.int16,
        np.int32: torch.int32,
        np.int64: torch.int64,
        np.float16: torch.float16,
        np.float32: torch.float32,
        np.float64: torch.float64,
        np.complex64: torch.complex64,
        np.complex128: torch.complex128,
    }
)


def arr(front, shape, dtype=np.float32, fill=None):
    """A fresh random array (or CPU tensor) of this shape and dtype."""
    rng = np.random.default_rng([20261130, zlib.crc32(repr((shape, np.dtype(dtype).name)).encode())])
    a = (rng.standard_normal(shape) if fill is None else np.full(shape, fill)).astype(dtype)
    if front == "numpy":
        return a
    return torch.from_numpy(a.copy()).to(_NP_TO_TORCH[dtype])  # (ascontiguousarray makes 0-D 1-D)


def _fwd(front, x=None, mask=None, **kw):
    x = arr(front, XSHAPE) if x is None else x
    return lambda: drvsoftmax.scaled_masked_softmax(x, mask, **kw)


def _bwd(front, dy=None, y=None, **kw):
    y = arr(front, XSHAPE) if y is None else y
    dy = arr(front, XSHAPE) if dy is None else dy
    return lambda: drvsoftmax.scaled_masked_softmax_backward(dy, y, **kw)


def _klen(front, values, dtype=np.int64):
    if front == "numpy":
        return np.array(values, dtype)
    return torch.tensor(values, dtype=_NP_TO_TORCH[dtype]).reshape(len(values))


TypeE, ValueE = TypeError, ValueError

# (id, builder(front) -> callable, exception class, regex naming the argument and the given value)
CASES = [
    # x
    ("x_list", lambda f: lambda: drvsoftmax.scaled_masked_softmax([[1.0, 2.0]]), TypeE, r"^x must be .*got list"),
    ("x_none", lambda f: lambda: drvsoftmax.scaled_masked_softmax(None), TypeE, r"^x must be .*got NoneType"),
    ("x_0d", lambda f: _fwd(f, arr(f, ())), ValueE, r"^x must be at least 1-D.*got shape \(\)"),
    ("x_int32", lambda f: _fwd(f, arr(f, XSHAPE, np.int32)), TypeE, r"^x must be of dtype .*float16.*got dtype int32"),
    ("x_bool", lambda f: _fwd(f, arr(f, XSHAPE, np.bool_)), TypeE, r"^x must be of dtype .*got dtype bool"),
    ("x_complex", lambda f: _fwd(f, arr(f, XSHAPE, np.complex64)), TypeE, r"^x must be of dtype .*got dtype complex64"),
    # mask
    (
        "mask_complex",
        lambda f: _fwd(f, mask=arr(f, XSHAPE[-2:], np.complex128)),
        TypeE,
        r"^mask must be bool, an integer dtype .*got dtype complex128",
    ),
    (
        "mask_list",
        lambda f: _fwd(f, mask=[0, 0, 0, 0, 1]),
        TypeE,
        r"^mask must be a (numpy\.ndarray|torch\.Tensor).*got list",
    ),
    (
        "mask_other_framework",
        lambda f: _fwd(f, mask=arr("torch" if f == "numpy" else "numpy", (5,))),
        TypeE,
        r"^mask must be a (numpy\.ndarray|torch\.Tensor).*got (Tensor|ndarray)",
    ),
    (
        "mask_not_broadcastable",
        lambda f: _fwd(f, mask=arr(f, (3, 5), np.bool_)),
        ValueE,
        r"^mask must be broadcastable to x\.shape \(2, 3, 4, 5\), got shape \(3, 5\)",
    ),
    (
        "mask_wrong_last_dim",
        lambda f: _fwd(f, mask=arr(f, (4, 6))),
        ValueE,
        r"^mask must be broadcastable to x\.shape \(2, 3, 4, 5\), got shape \(4, 6\)",
    ),
    (
        "mask_extra_leading_dim",
        lambda f: _fwd(f, mask=arr(f, (2, 2, 3, 4, 5), np.uint8)),
        ValueE,
        r"^mask must be broadcastable to x\.shape \(2, 3, 4, 5\), got shape \(2, 2, 3, 4, 5\)",
    ),
    # causal
    ("causal_str", lambda f: _fwd(f, causal="yes"), TypeE, r"^causal must be a bool, got str 'yes'"),
    ("causal_float", lambda f: _fwd(f, causal=1.5), TypeE, r"^causal must be a bool, got float 1\.5"),
    ("causal_none", lambda f: _fwd(f, causal=None), TypeE, r"^causal must be a bool, got NoneType None"),
    ("causal_int", lambda f: _fwd(f, causal=1), TypeE, r"^causal must be a bool, got int 1"),
    (
        "causal_1d_x",
        lambda f: _fwd(f, arr(f, (5,)), causal=True),
        ValueE,
        r"^x must be at least 2-D .*causal=True.*got shape \(5,\)",
    ),
    # key_lengths
    (
        "klen_wrong_len",
        lambda f: _fwd(f, key_lengths=_klen(f, [1, 2, 3])),
        ValueE,
        r"^key_lengths must be of shape \[B\] = \(2,\).*got shape \(3,\)",
    ),
    (
        "klen_2d",
        lambda f: _fwd(f, key_lengths=_klen(f, [1, 2]).reshape(2, 1)),
        ValueE,
        r"^key_lengths must be of shape \[B\].*got shape \(2, 1\)",
    ),
    (
        "klen_0d",
        lambda f: _fwd(f, key_lengths=_klen(f, [3]).reshape(())),
        ValueE,
        r"^key_lengths must be of shape \[B\].*got shape \(\)",
    ),
    (
        "klen_float",
        lambda f: _fwd(f, key_lengths=arr(f, (2,), np.float32, 3.0)),
        TypeE,
        r"^key_lengths must be of an integer dtype .*got dtype float32",
    ),
    (
        "klen_bool",
        lambda f: _fwd(f, key_lengths=arr(f, (2,), np.bool_, True)),
        TypeE,
        r"^key_lengths must be of an integer dtype .*got dtype bool",
    ),
    (
        "klen_1d_x",
        lambda f: _fwd(f, arr(f, (5,)), key_lengths=_klen(f, [3])),
        ValueE,
        r"^x must be at least 2-D .*key_lengths.*got shape \(5,\)",
    ),
    # scale
    ("scale_str", lambda f: _fwd(f, scale="0.5"), TypeE, r"^scale must be a real number, got str '0\.5'"),
    ("scale_none", lambda f: _fwd(f, scale=None), TypeE, r"^scale must be a real number, got NoneType None"),
    ("scale_bool", lambda f: _fwd(f, scale=True), TypeE, r"^scale must be a real number, got bool True"),
    ("scale_complex", lambda f: _fwd(f, scale=1j), TypeE, r"^scale must be a real number, got complex 1j"),
    ("scale_nan", lambda f: _fwd(f, scale=math.nan), ValueE, r"^scale must be a finite float.*got nan"),
    ("scale_inf", lambda f: _fwd(f, scale=math.inf), ValueE, r"^scale must be a finite float.*got inf"),
    ("scale_minus_inf", lambda f: _fwd(f, scale=-math.inf), ValueE, r"^scale must be a finite float.*got -inf"),
    ("scale_1e39", lambda f: _fwd(f, scale=1e39), ValueE, r"^scale must be a finite float within float32.*got 1e\+39"),
    ("scale_np_nan", lambda f: _fwd(f, scale=np.float64("nan")), ValueE, r"^scale must be a finite float.*got .*nan"),
    # out
    (
        "out_shape",
        lambda f: _fwd(f, out=arr(f, (2, 3, 4, 6))),
        ValueE,
        r"^out must be of x's shape \(2, 3, 4, 5\), got shape \(2, 3, 4, 6\)",
    ),
    (
        "out_dtype",
        lambda f: _fwd(f, out=arr(f, XSHAPE, np.float64)),
        TypeE,
        r"^out must be of x's dtype float32, got dtype float64",
    ),
    ("out_list", lambda f: _fwd(f, out=[0.0] * 5), TypeE, r"^out must be a (numpy\.ndarray|torch\.Tensor).*got list"),
    # backward
    (
        "bwd_y_list",
        lambda f: lambda: drvsoftmax.scaled_masked_softmax_backward(arr(f, XSHAPE), [1.0]),
        TypeE,
        r"^y must be .*got list",
    ),
    (
        "bwd_dy_list",
        lambda f: _bwd(f, dy=[1.0]),
        TypeE,
        r"^dy must be a (numpy\.ndarray|torch\.Tensor) like y, got list",
    ),
    (
        "bwd_dy_other_framework",
        lambda f: _bwd(f, dy=arr("torch" if f == "numpy" else "numpy", XSHAPE)),
        TypeE,
        r"^dy must be a (numpy\.ndarray|torch\.Tensor) like y, got (Tensor|ndarray)",
    ),
    (
        "bwd_dy_shape",
        lambda f: _bwd(f, dy=arr(f, (2, 3, 4, 6))),
        ValueE,
        r"^dy must be of y's shape \(2, 3, 4, 5\).*got shape \(2, 3, 4, 6\)",
    ),
    (
        "bwd_dy_broadcastable_shape",
        lambda f: _bwd(f, dy=arr(f, (1, 3, 4, 5))),
        ValueE,
        r"^dy must be of y's shape \(2, 3, 4, 5\).*got shape \(1, 3, 4, 5\)",
    ),
    (
        "bwd_dy_dtype",
        lambda f: _bwd(f, dy=arr(f, XSHAPE, np.float16)),
        ValueE,
        r"^dy must be of y's shape .* and dtype .*float32.*got .*dtype .*float16",
    ),
    ("bwd_scale_str", lambda f: _bwd(f, scale="x"), TypeE, r"^scale must be a real number, got str 'x'"),
    ("bwd_scale_nan", lambda f: _bwd(f, scale=math.nan), ValueE, r"^scale must be a finite float.*got nan"),
    ("bwd_scale_bool", lambda f: _bwd(f, scale=False), TypeE, r"^scale must be a real number, got bool False"),
    (
        "bwd_out_shape",
        lambda f: _bwd(f, out=arr(f, (2, 3, 5))),
        ValueE,
        r"^out must be of .*shape \(2, 3, 4, 5\), got shape \(2, 3, 5\)",
    ),
    (
        "bwd_out_dtype",
        lambda f: _bwd(f, out=arr(f, XSHAPE, np.float16)),
        TypeE,
        r"^out must be of .*dtype float32, got dtype float16",
    ),
    ("bwd_out_list", lambda f: _bwd(f, out=[]), TypeE, r"^out must be a (numpy\.ndarray|torch\.Tensor).*got list"),
]


# The backward names its argument `y`; these messages must say so, not `x`.
BWD_Y_CASES = [
    ("bwd_y_0d", lambda f: _bwd(f, dy=arr(f, ()), y=arr(f, ())), ValueE, r"^y must be at least 1-D.*got shape \(\)"),
    (
        "bwd_y_int",
        lambda f: _bwd(f, dy=arr(f, XSHAPE, np.int64), y=arr(f, XSHAPE, np.int64)),
        TypeE,
        r"^y must be of dtype .*got dtype int64",
    ),
    ("bwd_out_shape_names_y", lambda f: _bwd(f, out=arr(f, (2, 3, 5))), ValueE, r"^out must be of y's shape"),
    ("bwd_out_dtype_names_y", lambda f: _bwd(f, out=arr(f, XSHAPE, np.float16)), TypeE, r"^out must be of y's dtype"),
]


def _check_raises(call, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        call()
    e = info.value
    assert isinstance(e, drvsoftmax.DrvSoftmaxError), f"{type(e).__name__} is not a DrvSoftmaxError: {e}"
    assert not isinstance(e, AssertionError)
    if exc is TypeError:
        assert isinstance(e, drvsoftmax.ArgumentTypeError) and not isinstance(e, ValueError)
    else:
        assert isinstance(e, drvsoftmax.ArgumentValueError) and not isinstance(e, TypeError)
    return e


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("case,build,exc,pattern", CASES, ids=[c[0] for c in CASES])
def test_argument_errors(front, case, build, exc, pattern):
    if torch is None and case.endswith("_other_framework"):
        pytest.skip("needs torch for the other framework's array")
    _check_raises(build(front), exc, pattern)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("case,build,exc,pattern", BWD_Y_CASES, ids=[c[0] for c in BWD_Y_CASES])
def test_backward_messages_name_y(front, case, build, exc, pattern):
    _check_raises(build(front), exc, pattern)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("case,build,exc", [c[:3] for c in BWD_Y_CASES], ids=[c[0] for c in BWD_Y_CASES])
def test_backward_y_errors_have_the_right_class(front, case, build, exc):
    _check_raises(build(front), exc, r"must be .*, got ")


@pytest.mark.parametrize("front", FRONTS)
def test_validation_precedes_any_work(front):
    # A bad argument after a valid x must not leave a half-written `out`.
    x = arr(front, XSHAPE)
    out = arr(front, XSHAPE, np.float32, 7.0)
    _check_raises(lambda: drvsoftmax.scaled_masked_softmax(x, scale="bad", out=out), TypeError, r"^scale")
    _check_raises(lambda: drvsoftmax.scaled_masked_softmax(x, arr(front, (3, 5)), out=out), ValueError, r"^mask")
    assert (np.asarray(out) == 7.0).all()


# -- torch-only argument errors (CPU tensors) ------------------------------------------


@pytest.mark.requires_torch
def test_torch_key_lengths_as_a_sequence():
    # A list, tuple or NumPy array is taken as key_lengths (moved to x's device); the
    # result equals a tensor's.  Anything else is refused.
    x = arr("torch", XSHAPE)
    b = XSHAPE[0]
    lens = [(i * 3) % (XSHAPE[-1] + 1) for i in range(b)]
    want = drvsoftmax.scaled_masked_softmax(x, key_lengths=torch.tensor(lens))
    for lengths in (lens, tuple(lens), np.array(lens, dtype=np.int32)):
        assert torch.equal(drvsoftmax.scaled_masked_softmax(x, key_lengths=lengths), want)
    _check_raises(
        lambda: drvsoftmax.scaled_masked_softmax(x, key_lengths={0: 1}),
        TypeError,
        r"^key_lengths must be a tensor, list or array of integers.*got dict",
    )
    _check_raises(
        lambda: drvsoftmax.scaled_masked_softmax(x, key_lengths=[1.5] * b),
        TypeError,
        r"^key_lengths must be of an integer dtype.*got dtype float64",
    )


@pytest.mark.requires_torch
def test_torch_out_with_broadcast_strides():
    x = arr("torch", XSHAPE)
    out = torch.zeros(5).expand(XSHAPE)
    _check_raises(
        lambda: drvsoftmax.scaled_masked_softmax(x, out=out),
        ValueError,
        r"^out must be writable without overlap.*got strides \(0, 0, 0, 1\)",
    )
    y = arr("torch", XSHAPE)
    _check_raises(
        lambda: drvsoftmax.scaled_masked_softmax_backward(y, y, out=out),
        ValueError,
        r"^out must be writable without overlap.*got strides \(0, 0, 0, 1\)",
    )


@pytest.mark.requires_torch
def test_torch_out_with_autograd():
    x = arr("torch", XSHAPE).requires_grad_(True)
    _check_raises(
        lambda: drvsoftmax.scaled_masked_softmax(x, out=torch.empty(XSHAPE)),
        ValueError,
        r"^out must be None when x or mask requires grad",
    )
    m = arr("torch", XSHAPE[-2:]).requires_grad_(True)
    _check_raises(
        lambda: drvsoftmax.scaled_masked_softmax(arr("torch", XSHAPE), m, out=torch.empty(XSHAPE)),
        ValueError,
        r"^out must be None when x or mask requires grad",
    )


@pytest.mark.requires_torch
@pytest.mark.parametrize("bad", [("scale", "s"), ("causal", "yes"), ("key_lengths", 2.5)])
def test_torch_errors_under_autograd(bad):
    # The checks run inside autograd.Function too, with the same classes and messages.
    name, value = bad
    x = arr("torch", XSHAPE).requires_grad_(True)
    with pytest.raises(drvsoftmax.DrvSoftmaxError, match=rf"^{name} must be"):
        drvsoftmax.scaled_masked_softmax(x, **{name: value})


@pytest.mark.requires_torch
def test_torch_module_checks_its_arguments():
    from drvsoftmax.torch import ScaledMaskedSoftmax

    _check_raises(lambda: ScaledMaskedSoftmax(scale=math.inf), ValueError, r"^scale must be a finite float.*got inf")
    _check_raises(lambda: ScaledMaskedSoftmax(causal="no"), TypeError, r"^causal must be a bool, got str 'no'")


# -- legal edge values must be accepted --------------------------------------------------


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize(
    "scale", [0, -3, 0.0, -0.0, 3.4028234663852886e38, -1e-45, np.float32(0.5), np.int64(2), np.float16(-1.5)]
)
def test_legal_scales(front, scale):
    y = drvsoftmax.scaled_masked_softmax(arr(front, XSHAPE), scale=scale)
    assert tuple(y.shape) == XSHAPE


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize(
    "mdtype", [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64]
)
@pytest.mark.parametrize("mshape", [(2, 1, 4, 5), (1, 1, 4, 5), (4, 5), (2, 1, 1, 5), (2, 3, 4, 5), (5,), (1,), ()])
def test_legal_mask_dtypes_and_shapes(front, mdtype, mshape):
    y = drvsoftmax.scaled_masked_softmax(arr(front, XSHAPE), arr(front, mshape, mdtype))
    assert tuple(y.shape) == XSHAPE


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("kdtype", [np.int8, np.uint8, np.int16, np.int32, np.int64])
def test_legal_key_lengths_dtypes(front, kdtype):
    y = drvsoftmax.scaled_masked_softmax(arr(front, XSHAPE), key_lengths=_klen(front, [0, 9], kdtype))
    assert np.all(np.asarray(y)[0] == 0)


@pytest.mark.parametrize("front", FRONTS)
def test_numpy_bool_causal_is_accepted(front):
    y = drvsoftmax.scaled_masked_softmax(arr(front, XSHAPE), causal=np.True_)
    assert np.all(np.asarray(y)[..., 0, 2:] == 0)  # query 0 sees keys j <= 0 + 5 - 4


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_numpy_read_only_out(direction):
    x = arr("numpy", XSHAPE)
    out = np.broadcast_to(np.zeros(5, np.float32), XSHAPE)  # read-only, overlapping
    if direction == "forward":
        call = lambda: drvsoftmax.scaled_masked_softmax(x, out=out)  # noqa: E731
    else:
        call = lambda: drvsoftmax.scaled_masked_softmax_backward(x, x, out=out)  # noqa: E731
    _check_raises(call, ValueError, r"^out must be .*got")


# -- fuzzing: whatever the shapes, either a result or a DrvSoftmaxError -------------------

_dims = st.integers(min_value=1, max_value=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    xshape=st.lists(_dims, min_size=1, max_size=4).map(tuple),
    mshape=st.none() | st.lists(_dims, min_size=0, max_size=4).map(tuple),
    mdtype=st.sampled_from([np.bool_, np.int32, np.float16, np.float64, np.complex64]),
    klen=st.none() | st.lists(st.integers(-2, 5), min_size=0, max_size=3),
    causal=st.sampled_from([False, True, 0, "no"]),
    scale=st.sampled_from([1.0, 0.0, -2, math.nan, True, "1", 1e40]),
    front=st.sampled_from(FRONTS),
)
def test_fuzz_arguments_never_escape_as_foreign_errors(xshape, mshape, mdtype, klen, causal, scale, front):
    # Masks with more dims than x are left to test_softmax_reference.test_mask_with_leading_unit_dims.
    if mshape is not None and len(mshape) > len(xshape):
        mshape = mshape[len(mshape) - len(xshape) :]
    x = arr(front, xshape)
    mask = None if mshape is None else arr(front, mshape, mdtype)
    kl = None if klen is None else _klen(front, klen)
    try:
        y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=causal, key_lengths=kl)
    except drvsoftmax.DrvSoftmaxError as e:
        assert isinstance(e, TypeError | ValueError) and not isinstance(e, AssertionError)
        assert str(e).split(" ", 1)[0] in ("x", "mask", "scale", "causal", "key_lengths"), str(e)
        assert ", got " in str(e)
        return
    assert tuple(y.shape) == xshape
    yn = np.asarray(y.float() if front == "torch" else y, dtype=np.float64)
    assert np.all(np.isnan(yn) | ((yn >= 0) & (yn <= 1)))


class _CudaLike:
    """Just enough of a CUDA tensor for the front door to reach its argument checks."""

    is_cuda = True
    dtype = getattr(torch, "float16", None)
    shape = XSHAPE if torch is None else torch.Size(XSHAPE)
    device = "cuda:0" if torch is None else torch.device("cuda:0")
    layout = getattr(torch, "strided", None)
    is_nested = False

    def get_device(self):
        return 0

    def data_ptr(self):
        return 0x10000

    def stride(self):
        return (60, 20, 5, 1)

    def numel(self):
        return 120


@pytest.mark.requires_torch
@pytest.mark.parametrize(
    "kw,exc,pattern",
    [
        ({"mask": np.zeros(XSHAPE, dtype=bool)}, TypeError, r"^mask must be a torch\.Tensor like x.*got ndarray"),
        ({"out": [0.0] * 120}, TypeError, r"^out must be a torch\.Tensor like x.*got list"),
        ({"key_lengths": {0: 1}}, TypeError, r"^key_lengths must be a torch\.Tensor.*got dict"),
    ],
)
def test_cuda_call_with_foreign_arguments_fails_in_the_checks(kw, exc, pattern):
    from drvsoftmax import torch as dtorch

    args = {"mask": None, "scale": 1.0, "causal": False, "key_lengths": None, "out": None, "stream": None, **kw}
    _check_raises(
        lambda: dtorch._forward_impl(
            _CudaLike(), args["mask"], args["scale"], args["causal"], args["key_lengths"], args["out"], args["stream"]
        ),
        exc,
        pattern,
    )
