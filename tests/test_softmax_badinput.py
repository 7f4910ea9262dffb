"""Bad input through every front door: each case is a clear argument error, inputs untouched.

One table of bad calls runs through each door that can express it: NumPy, CPU torch,
torch.compile (fullgraph, so that the traced path's own checks are what raises), the
``__cuda_array_interface__`` intake (with arrays that only describe device memory, so its
checks run without a GPU), and, where a GPU is visible, CUDA torch, compiled CUDA torch
and CuPy.  Each case asserts the exception class (TypeError for a wrong type or dtype,
ValueError for a wrong shape, value, device or overlap; both drvsoftmax.DrvSoftmaxError),
that the message starts with the argument's name, and that no input (out included) was
modified by the failing call.  The nn.Module, ``explain`` and the command line follow.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import re
import zlib
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from helpers import cuda_available

import drvsoftmax

torch = pytest.importorskip("torch")
from drvsoftmax.torch import ScaledMaskedSoftmax  # noqa: E402

XSHAPE = (2, 3, 4, 5)
TypeE, ValueE = TypeError, ValueError
GPU = cuda_available()

_TORCH_DT = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
}
_TYPESTR = {
    "bool": "|b1",
    "uint8": "|u1",
    "int8": "|i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "uint64": "<u8",
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "complex64": "<c8",
}


def _rng(*key):
    return np.random.default_rng([20261130, zlib.crc32(repr(key).encode())])


def _host(shape, dtype, fill=None):
    rng = _rng(shape, dtype, fill)
    a = rng.standard_normal(shape) * 2 if fill is None else np.full(shape, fill)
    if dtype == "bool":
        return np.asarray(a > 0)
    return np.asarray(a).astype(dtype)


# ----------------------------------------------------------------------------------
# The doors.


class NumpyDoor:
    name = "numpy"
    compiles = False

    def arr(self, shape, dtype="float32", fill=None):
        return _host(shape, dtype, fill)

    def klen(self, values, dtype="int64"):
        return np.array(values, dtype=dtype).reshape(len(values))

    def base(self, n, dtype="float32"):
        return self.arr((n,), dtype)

    def view(self, base, offset, shape, strides=None):
        if strides is None:
            strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        item = base.itemsize
        return np.lib.stride_tricks.as_strided(base[offset:], shape, tuple(s * item for s in strides))

    def reinterpret(self, base, dtype, n):
        return base.view(dtype)[:n]

    def other(self, shape):
        return torch.zeros(shape)

    def fwd(self, x, mask=None, **kw):
        return drvsoftmax.scaled_masked_softmax(x, mask, **kw)

    def bwd(self, dy, y, **kw):
        return drvsoftmax.scaled_masked_softmax_backward(dy, y, **kw)


class TorchDoor:
    name = "torch"
    compiles = False
    device = "cpu"

    def arr(self, shape, dtype="float32", fill=None):
        return torch.from_numpy(_host(shape, dtype, fill).copy()).to(self.device, _TORCH_DT[dtype])

    def klen(self, values, dtype="int64"):
        return torch.tensor(values, dtype=_TORCH_DT[dtype], device=self.device).reshape(len(values))

    def base(self, n, dtype="float32"):
        return self.arr((n,), dtype)

    def view(self, base, offset, shape, strides=None):
        if strides is None:
            strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        return base.as_strided(shape, strides, base.storage_offset() + offset)

    def reinterpret(self, base, dtype, n):
        return base.view(_TORCH_DT[dtype])[:n]

    def other(self, shape):
        return np.zeros(shape, np.float32)

    def fwd(self, x, mask=None, **kw):
        return drvsoftmax.scaled_masked_softmax(x, mask, **kw)

    def bwd(self, dy, y, **kw):
        return drvsoftmax.scaled_masked_softmax_backward(dy, y, **kw)


def snapshot(a):
    """A copy of an input's contents (None where there is nothing readable to compare)."""
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided or a.is_nested or a.device.type == "meta":
            return None
        return a.detach().cpu().clone()
    if isinstance(a, np.ndarray):
        return np.array(a, copy=True)
    if type(a).__module__.startswith("cupy"):
        return a.get()
    if hasattr(a, "__cuda_array_interface__"):
        return copy.deepcopy(a.__cuda_array_interface__)
    return copy.deepcopy(a)


def unchanged(a, snap):
    if isinstance(a, torch.Tensor):
        if snap is None:
            return True
        b = a.detach().cpu()
        return b.shape == snap.shape and b.dtype == snap.dtype and torch.equal(_bits(b), _bits(snap))
    if isinstance(a, np.ndarray):
        return a.shape == snap.shape and a.tobytes() == snap.tobytes()
    if type(a).__module__.startswith("cupy"):
        return a.get().tobytes() == snap.tobytes()
    if hasattr(a, "__cuda_array_interface__"):
        return a.__cuda_array_interface__ == snap
    return a == snap


def _bits(t):
    """A tensor's bytes (NaN-safe equality)."""
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


class CudaTorchDoor(TorchDoor):
    name = "torch-cuda"
    device = "cuda"


class CompileDoor(TorchDoor):
    """torch.compile as users call it: a check the traced path skipped would let the call
    compile and run without an error.  (Where dynamo cannot trace a check, it runs the
    function eagerly, and the caller gets the eager error.)"""

    name = "compile"
    compiles = True
    backend = "aot_eager"
    fullgraph = False

    def fwd(self, x, mask=None, key_lengths=None, out=None, **kw):
        def f(x, mask, key_lengths, out):
            return drvsoftmax.scaled_masked_softmax(x, mask, key_lengths=key_lengths, out=out, **kw)

        torch._dynamo.reset()
        return torch.compile(f, fullgraph=self.fullgraph, backend=self.backend)(x, mask, key_lengths, out)

    def bwd(self, dy, y, out=None, **kw):
        def f(dy, y, out):
            return drvsoftmax.scaled_masked_softmax_backward(dy, y, out=out, **kw)

        torch._dynamo.reset()
        return torch.compile(f, fullgraph=self.fullgraph, backend=self.backend)(dy, y, out)


class FullgraphDoor(CompileDoor):
    """torch.compile(fullgraph=True): nothing falls back to eager, so what raises is the
    traced path's own check.  Errors found while tracing reach the caller as dynamo's
    Unsupported carrying our exception; errors found by the op on real tensors come out as
    they are."""

    name = "compile-fullgraph"
    fullgraph = True


class CudaCompileDoor(FullgraphDoor):
    name = "compile-cuda"
    device = "cuda"


class FakeCudaArray:
    """Describes device memory through ``__cuda_array_interface__`` (v3); no memory behind it.

    Enough for the CUDA-array intake to run every check; a call that passed them all would
    go on to the driver and fail there (no GPU), not with an argument error."""

    __module__ = "fakearrays"
    _next = 1 << 40

    def __init__(self, shape, dtype, ptr=None, strides=None, typestr=None, device=0):
        if ptr is None:
            ptr = FakeCudaArray._next
            FakeCudaArray._next += 1 << 24  # far apart: no accidental overlap
        self.shape, self.dtype, self.ptr = tuple(shape), dtype, ptr
        self.itemsize = np.dtype(dtype).itemsize if dtype in _TYPESTR else 1
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr or _TYPESTR[dtype],
            "data": (ptr, False),
            "strides": None if strides is None else tuple(s * self.itemsize for s in strides),
            "version": 3,
            "stream": 1,
        }

        class _Dev:
            id = device

        self.device = _Dev()


class CaiDoor(NumpyDoor):
    name = "cai"

    def arr(self, shape, dtype="float32", fill=None):
        return FakeCudaArray(shape, dtype)

    def klen(self, values, dtype="int64"):
        return FakeCudaArray((len(values),), dtype)

    def view(self, base, offset, shape, strides=None):
        return FakeCudaArray(shape, base.dtype, base.ptr + offset * base.itemsize, strides)

    def reinterpret(self, base, dtype, n):
        return FakeCudaArray((n,), dtype, base.ptr)

    def other(self, shape):
        return np.zeros(shape, np.float32)

    def fwd(self, x, mask=None, **kw):
        if "out" not in kw and isinstance(x, FakeCudaArray):
            kw["out"] = FakeCudaArray(x.shape, x.dtype)  # nothing to allocate with: give one
        return drvsoftmax.scaled_masked_softmax(x, mask, **kw)

    def bwd(self, dy, y, **kw):
        if "out" not in kw and isinstance(y, FakeCudaArray):
            kw["out"] = FakeCudaArray(y.shape, y.dtype)
        return drvsoftmax.scaled_masked_softmax_backward(dy, y, **kw)


class CupyDoor(NumpyDoor):
    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy

    def arr(self, shape, dtype="float32", fill=None):
        return self.cp.asarray(_host(shape, dtype, fill))

    def klen(self, values, dtype="int64"):
        return self.cp.asarray(np.array(values, dtype=dtype).reshape(len(values)))

    def view(self, base, offset, shape, strides=None):
        if strides is None:
            strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        item = base.itemsize
        return self.cp.lib.stride_tricks.as_strided(base[offset:], shape, tuple(s * item for s in strides))

    def reinterpret(self, base, dtype, n):
        return base.view(dtype)[:n]


def _door(name):
    if name == "numpy":
        return NumpyDoor()
    if name == "torch":
        return TorchDoor()
    if name == "compile":
        return CompileDoor()
    if name == "compile-fullgraph":
        return FullgraphDoor()
    if name == "cai":
        return CaiDoor()
    if not GPU:
        pytest.skip("needs a CUDA GPU")
    if name == "torch-cuda":
        return CudaTorchDoor()
    if name == "compile-cuda":
        return CudaCompileDoor()
    if name == "cupy":
        pytest.importorskip("cupy")
        return CupyDoor()
    raise AssertionError(name)


CPU_DOORS = ("numpy", "torch", "compile", "compile-fullgraph", "cai")
GPU_DOORS = ("torch-cuda", "compile-cuda", "cupy")
ALL = CPU_DOORS + GPU_DOORS
TORCH = ("torch", "compile", "compile-fullgraph", "torch-cuda", "compile-cuda")
EAGER = ("numpy", "torch", "cai", "torch-cuda", "cupy")  # no tracing
EAGER_NOT_CUPY = ("numpy", "torch", "cai", "torch-cuda")
NOT_FULLGRAPH = tuple(d for d in ALL if d not in ("compile-fullgraph", "compile-cuda"))
GPU_ONLY = ("torch-cuda", "compile-cuda", "cupy")

# Cases dynamo cannot trace to our check (the default torch.compile then runs the call
# eagerly and raises our error; with fullgraph=True dynamo raises its own first).
FULLGRAPH_SKIP = {
    "scale_decimal": "dynamo cannot trace Decimal.__repr__",
    "scale_np_nan": "dynamo cannot trace numpy scalar constants here",
    "stream_object": "dynamo cannot trace hasattr on an arbitrary object",
    "x_nested": "torch.compile does not take strided nested tensors",
}
if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
    # Seen with torch 2.11: dynamo cannot trace float() of a Fraction, and may fail
    # internally on a first traced backward call; 2.13 traces both to our checks.
    FULLGRAPH_SKIP["scale_fraction_huge"] = "dynamo before torch 2.13 cannot trace float(Fraction)"
    FULLGRAPH_SKIP["bwd_dy_list"] = "dynamo before torch 2.13 fails inside its own tracer here"
# The default torch.compile (falling back to eager where dynamo cannot trace) costs about a
# second a case: it runs where fullgraph cannot, and on this sample of the rest.
COMPILE_SAMPLE = {
    "x_int32",
    "mask_not_broadcastable",
    "causal_str",
    "klen_wrong_len",
    "scale_nan",
    "stream_str",
    "out_float64_broadcastable",
    "out_overlaps_x",
    "out_is_mask",
    "bwd_dy_shape",
    "bwd_out_overlaps_y",
    "x_meta",
    "out_requires_grad",
}
# Cases torch.compile itself refuses before any check of ours can run.
COMPILE_SKIP = {
    "out_contains_key_lengths": "aot_autograd refuses mutated inputs viewed with two dtypes",
}


# ----------------------------------------------------------------------------------
# Checking one bad call.


def _pattern_without_anchor(p):
    return p[1:] if p.startswith("^") else p


def expect_error(door, call, inputs, exc, pattern):
    """`call` raises an argument error of class `exc` matching `pattern`; `inputs` unchanged."""
    snaps = [snapshot(a) for a in inputs]
    try:
        call()
    except drvsoftmax.DrvSoftmaxError as e:
        msg = str(e)
        assert re.match(pattern, msg), f"message {msg!r} does not match {pattern!r}"
        want = drvsoftmax.ArgumentTypeError if exc is TypeError else drvsoftmax.ArgumentValueError
        assert isinstance(e, want), f"{type(e).__name__} is not {want.__name__}: {msg}"
        assert isinstance(e, exc) and not isinstance(e, (ValueError if exc is TypeError else TypeError))
    except Exception as e:
        if not door.compiles or not isinstance(e, torch._dynamo.exc.TorchDynamoException):
            raise AssertionError(f"{type(e).__name__} is not a DrvSoftmaxError: {e}") from e
        # Raised while tracing: dynamo reports our exception (class and message) in its text.
        text = str(e)
        cls = "ArgumentTypeError" if exc is TypeError else "ArgumentValueError"
        assert f"raised exception {cls}(" in text, f"no {cls} in the traced error:\n{text[:2000]}"
        assert re.search(_pattern_without_anchor(pattern), text), f"{pattern!r} not in:\n{text[:2000]}"
    else:
        raise AssertionError("no exception raised")
    for a, s in zip(inputs, snaps, strict=True):
        assert unchanged(a, s), "an input was modified by the failing call"


def _is_array(a):
    return isinstance(a, (np.ndarray, torch.Tensor, FakeCudaArray)) or hasattr(a, "__cuda_array_interface__")


def fwd(D, x=None, mask=None, **kw):
    x = D.arr(XSHAPE) if x is None else x
    inputs = [a for a in (x, mask, *kw.values()) if _is_array(a)]
    return (lambda: D.fwd(x, mask, **kw)), inputs


def bwd(D, dy=None, y=None, **kw):
    y = D.arr(XSHAPE) if y is None else y
    dy = D.arr(XSHAPE) if dy is None else dy
    inputs = [a for a in (dy, y, *kw.values()) if _is_array(a)]
    return (lambda: D.bwd(dy, y, **kw)), inputs


class _BadStream:
    def __cuda_stream__(self):
        raise RuntimeError("no stream here")


class _JunkStream:
    def __cuda_stream__(self):
        return ("junk",)


# (id, build(door) -> (call, inputs), exception class, regex, doors)
CASES = [
    # ---- x
    ("x_int32", lambda D: fwd(D, D.arr(XSHAPE, "int32")), TypeE, r"^x must be of dtype .*got dtype int32", ALL),
    ("x_bool", lambda D: fwd(D, D.arr(XSHAPE, "bool")), TypeE, r"^x must be of dtype .*got dtype bool", ALL),
    ("x_uint8", lambda D: fwd(D, D.arr(XSHAPE, "uint8")), TypeE, r"^x must be of dtype .*got dtype uint8", ALL),
    ("x_complex", lambda D: fwd(D, D.arr(XSHAPE, "complex64")), TypeE, r"^x must be .*complex64", ALL),
    ("x_0d", lambda D: fwd(D, D.arr(())), ValueE, r"^x must be at least 1-D.*got shape \(\)", ALL),
    ("x_float64_gpu", lambda D: fwd(D, D.arr(XSHAPE, "float64")), TypeE, r"^x must be of dtype .*float64", GPU_ONLY),
    ("x_float64_cai", lambda D: fwd(D, D.arr(XSHAPE, "float64")), TypeE, r"^x must be of dtype .*float64", ("cai",)),
    # ---- mask
    (
        "mask_not_broadcastable",
        lambda D: fwd(D, mask=D.arr((3, 5), "bool")),
        ValueE,
        r"^mask must be broadcastable to x\.shape \(2, 3, 4, 5\), got shape \(3, 5\)",
        ALL,
    ),
    (
        "mask_wrong_last_dim",
        lambda D: fwd(D, mask=D.arr((4, 6))),
        ValueE,
        r"^mask must be broadcastable .*got shape \(4, 6\)",
        ALL,
    ),
    (
        "mask_extra_leading_dim",
        lambda D: fwd(D, mask=D.arr((2, 2, 3, 4, 5), "uint8")),
        ValueE,
        r"^mask must be broadcastable .*got shape \(2, 2, 3, 4, 5\)",
        ALL,
    ),
    ("mask_complex", lambda D: fwd(D, mask=D.arr((4, 5), "complex64")), TypeE, r"^mask must be .*complex64", ALL),
    ("mask_list", lambda D: fwd(D, mask=[0, 0, 0, 0, 1]), TypeE, r"^mask must be a .*got list", ALL),
    ("mask_str", lambda D: fwd(D, mask="causal"), TypeE, r"^mask must be a .*got str", ALL),
    ("mask_other_framework", lambda D: fwd(D, mask=D.other((4, 5))), TypeE, r"^mask must be a .*got", EAGER_NOT_CUPY),
    # CuPy's door reads any DLPack producer: a host tensor is refused for where it lives.
    (
        "mask_other_framework_on_host",
        lambda D: fwd(D, mask=D.other((4, 5))),
        ValueE,
        r"^mask must be an array in CUDA device memory, got a DLPack array on CPU",
        ("cupy",),
    ),
    # ---- causal
    ("causal_str", lambda D: fwd(D, causal="yes"), TypeE, r"^causal must be a bool, got str 'yes'", ALL),
    ("causal_float", lambda D: fwd(D, causal=1.5), TypeE, r"^causal must be a bool, got float 1\.5", ALL),
    ("causal_none", lambda D: fwd(D, causal=None), TypeE, r"^causal must be a bool, got NoneType None", ALL),
    ("causal_int", lambda D: fwd(D, causal=1), TypeE, r"^causal must be a bool, got int 1", ALL),
    ("causal_1d_x", lambda D: fwd(D, D.arr((5,)), causal=True), ValueE, r"^x must be at least 2-D .*causal", ALL),
    # ---- key_lengths
    (
        "klen_wrong_len",
        lambda D: fwd(D, key_lengths=D.klen([1, 2, 3])),
        ValueE,
        r"^key_lengths must be of shape \[B\] = \(2,\).*got shape \(3,\)",
        ALL,
    ),
    (
        "klen_2d",
        lambda D: fwd(D, key_lengths=D.arr((2, 1), "int64")),
        ValueE,
        r"^key_lengths must be of shape \[B\].*got shape \(2, 1\)",
        ALL,
    ),
    (
        "klen_0d",
        lambda D: fwd(D, key_lengths=D.arr((), "int64")),
        ValueE,
        r"^key_lengths must be of shape \[B\].*got shape \(\)",
        ALL,
    ),
    (
        "klen_float",
        lambda D: fwd(D, key_lengths=D.arr((2,), "float32")),
        TypeE,
        r"^key_lengths must be of an integer dtype .*got dtype float32",
        ALL,
    ),
    (
        "klen_bool",
        lambda D: fwd(D, key_lengths=D.arr((2,), "bool")),
        TypeE,
        r"^key_lengths must be of an integer dtype .*got dtype bool",
        ALL,
    ),
    (
        "klen_1d_x",
        lambda D: fwd(D, D.arr((5,)), key_lengths=D.klen([3])),
        ValueE,
        r"^x must be at least 2-D .*key_lengths",
        ALL,
    ),
    ("klen_dict", lambda D: fwd(D, key_lengths={0: 1}), TypeE, r"^key_lengths must be .*got dict", ALL),
    ("klen_str_list", lambda D: fwd(D, key_lengths=["a", "b"]), TypeE, r"^key_lengths must be .*got", NOT_FULLGRAPH),
    ("klen_none_in_list", lambda D: fwd(D, key_lengths=[None, 1]), TypeE, r"^key_lengths must be .*got", NOT_FULLGRAPH),
    ("klen_float_list", lambda D: fwd(D, key_lengths=[1.5, 2.5]), TypeE, r"^key_lengths must be .*got", NOT_FULLGRAPH),
    (
        "klen_2_64_list",
        lambda D: fwd(D, key_lengths=[2**64, 1]),
        ValueE,
        r"^key_lengths must be integers that fit in 64 bits.*got \[18446744073709551616, 1\]",
        ("numpy", "torch", "torch-cuda"),
    ),
    (
        "klen_minus_2_64_list",
        lambda D: fwd(D, key_lengths=[-(2**64), 1]),
        ValueE,
        r"^key_lengths must be integers that fit in 64 bits",
        ("numpy", "torch", "torch-cuda"),
    ),
    ("klen_list_on_array_door", lambda D: fwd(D, key_lengths=[2**64, 1]), TypeE, r"^key_lengths must be a", ("cai",)),
    # ---- scale
    ("scale_str", lambda D: fwd(D, scale="0.5"), TypeE, r"^scale must be a real number, got str '0\.5'", ALL),
    ("scale_none", lambda D: fwd(D, scale=None), TypeE, r"^scale must be a real number, got NoneType None", ALL),
    ("scale_bool", lambda D: fwd(D, scale=True), TypeE, r"^scale must be a real number, got bool True", ALL),
    ("scale_complex", lambda D: fwd(D, scale=1j), TypeE, r"^scale must be a real number, got complex 1j", ALL),
    ("scale_decimal", lambda D: fwd(D, scale=Decimal("0.5")), TypeE, r"^scale must be a real number, got Decimal", ALL),
    ("scale_nan", lambda D: fwd(D, scale=math.nan), ValueE, r"^scale must be a finite float.*got nan", ALL),
    ("scale_inf", lambda D: fwd(D, scale=math.inf), ValueE, r"^scale must be a finite float.*got inf", ALL),
    ("scale_minus_inf", lambda D: fwd(D, scale=-math.inf), ValueE, r"^scale must be a finite float.*got -inf", ALL),
    ("scale_1e39", lambda D: fwd(D, scale=1e39), ValueE, r"^scale must be a finite float within float32.*1e\+39", ALL),
    ("scale_10_400", lambda D: fwd(D, scale=10**400), ValueE, r"^scale must be a finite float.*got 1000000", ALL),
    ("scale_minus_10_400", lambda D: fwd(D, scale=-(10**400)), ValueE, r"^scale must be a finite float.*got -100", ALL),
    (
        "scale_fraction_huge",
        lambda D: fwd(D, scale=Fraction(10**400, 3)),
        ValueE,
        r"^scale must be a finite float.*Fraction",
        ALL,
    ),
    ("scale_np_nan", lambda D: fwd(D, scale=np.float64("nan")), ValueE, r"^scale must be a finite float.*nan", ALL),
    # ---- stream (validated on the CPU paths too)
    ("stream_str", lambda D: fwd(D, stream="garbage"), TypeE, r"^stream must be .*got str 'garbage'", ALL),
    ("stream_negative", lambda D: fwd(D, stream=-1), ValueE, r"^stream must be a stream handle in \[0, 2\*\*64\)", ALL),
    ("stream_float", lambda D: fwd(D, stream=3.5), TypeE, r"^stream must be .*got float 3\.5", ALL),
    ("stream_2_64", lambda D: fwd(D, stream=2**64), ValueE, r"^stream must be a stream handle in", ALL),
    ("stream_bool", lambda D: fwd(D, stream=True), TypeE, r"^stream must be .*got True", ALL),
    ("stream_object", lambda D: fwd(D, stream=object()), TypeE, r"^stream must be .*got object", ALL),
    ("stream_protocol_fails", lambda D: fwd(D, stream=_BadStream()), ValueE, r"^stream must be .*RuntimeError", EAGER),
    ("stream_protocol_junk", lambda D: fwd(D, stream=_JunkStream()), TypeE, r"^stream must be .*junk", EAGER),
    # ---- out
    (
        "out_shape",
        lambda D: fwd(D, out=D.arr((2, 3, 4, 6))),
        ValueE,
        r"^out must be of x's shape \(2, 3, 4, 5\), got shape \(2, 3, 4, 6\)",
        ALL,
    ),
    (
        "out_broadcast_shape",
        lambda D: fwd(D, out=D.arr((5, 2, 3, 4, 5))),
        ValueE,
        r"^out must be of x's shape \(2, 3, 4, 5\), got shape \(5, 2, 3, 4, 5\)",
        ALL,
    ),
    (
        "out_float64_broadcastable",  # copy_ would cast and broadcast: it must not get that far
        lambda D: fwd(D, D.arr((2, 3, 4)), out=D.arr((5, 2, 3, 4), "float64")),
        TypeE,
        r"^out must be of x's dtype float32, got dtype float64",
        ALL,
    ),
    ("out_dtype", lambda D: fwd(D, out=D.arr(XSHAPE, "float16")), TypeE, r"^out must be of x's dtype float32", ALL),
    ("out_list", lambda D: fwd(D, out=[0.0] * 5), TypeE, r"^out must be a .*got list", ALL),
    (
        "out_zero_stride",
        lambda D: fwd(D, out=D.view(D.base(8), 0, XSHAPE, (0, 0, 0, 1))),
        ValueE,
        r"^out must be writable without overlap.*got strides \(0, 0, 0, 1\)",
        ALL,
    ),
    (
        "out_rows_overlap_each_other",  # rows 4 elements apart, 5 long
        lambda D: fwd(D, out=D.view(D.base(200), 0, XSHAPE, (48, 16, 4, 1))),
        ValueE,
        r"^out must be writable without overlap.*got strides \(48, 16, 4, 1\)",
        ALL,
    ),
    (
        "out_overlaps_x",
        lambda D: (lambda b: fwd(D, D.view(b, 0, XSHAPE), out=D.view(b, 60, XSHAPE)))(D.base(240)),
        ValueE,
        r"^out must be memory that does not overlap x's \(out=x exactly is allowed\), got out at bytes",
        ALL,
    ),
    (
        "out_overlaps_x_by_one_element",
        lambda D: (lambda b: fwd(D, D.view(b, 0, XSHAPE), out=D.view(b, 119, XSHAPE)))(D.base(240)),
        ValueE,
        r"^out must be memory that does not overlap x's",
        ALL,
    ),
    (
        "out_is_x_transposed",  # the same memory, another layout: not in place
        lambda D: (lambda b: fwd(D, D.view(b, 0, (2, 3, 5, 5)), out=D.view(b, 0, (2, 3, 5, 5), (75, 25, 1, 5))))(
            D.base(150)
        ),
        ValueE,
        r"^out must be memory that does not overlap x's",
        ALL,
    ),
    (
        "out_is_mask",
        lambda D: (lambda m: fwd(D, mask=m, out=m))(D.arr(XSHAPE)),
        ValueE,
        r"^out must be memory that does not overlap mask's, got",
        ALL,
    ),
    (
        "out_contains_mask",
        lambda D: (lambda b: fwd(D, mask=D.view(b, 30, (4, 5)), out=D.view(b, 0, XSHAPE)))(D.base(120)),
        ValueE,
        r"^out must be memory that does not overlap mask's",
        ALL,
    ),
    (
        "out_x_in_place_but_mask_inside",
        lambda D: (lambda b: fwd(D, D.view(b, 0, XSHAPE), mask=D.view(b, 100, (4, 5)), out=D.view(b, 0, XSHAPE)))(
            D.base(120)
        ),
        ValueE,
        r"^out must be memory that does not overlap mask's",
        ALL,
    ),
    (
        "out_contains_key_lengths",
        lambda D: (lambda b: fwd(D, key_lengths=D.reinterpret(b, "int64", 2), out=D.view(b, 0, XSHAPE)))(D.base(120)),
        ValueE,
        r"^out must be memory that does not overlap key_lengths's",
        ALL,
    ),
    # ---- backward
    (
        "bwd_dy_list",
        lambda D: bwd(D, dy=[1.0]),
        TypeE,
        r"^dy must be a .*like y, got list",
        ALL,
    ),
    (
        "bwd_dy_other_framework",
        lambda D: bwd(D, dy=D.other(XSHAPE)),
        TypeE,
        r"^dy must be a .*like y, got",
        EAGER_NOT_CUPY,
    ),
    (
        "bwd_dy_other_framework_on_host",
        lambda D: bwd(D, dy=D.other(XSHAPE)),
        ValueE,
        r"^dy must be an array in CUDA device memory, got a DLPack array on CPU",
        ("cupy",),
    ),
    (
        "bwd_dy_shape",
        lambda D: bwd(D, dy=D.arr((2, 3, 4, 6))),
        ValueE,
        r"^dy must be of y's shape \(2, 3, 4, 5\).*got shape \(2, 3, 4, 6\)",
        ALL,
    ),
    (
        "bwd_dy_broadcastable",
        lambda D: bwd(D, dy=D.arr((1, 3, 4, 5))),
        ValueE,
        r"^dy must be of y's shape .*got shape \(1, 3, 4, 5\)",
        ALL,
    ),
    ("bwd_dy_dtype", lambda D: bwd(D, dy=D.arr(XSHAPE, "float16")), ValueE, r"^dy must be of y's shape .*dtype", ALL),
    (
        "bwd_y_int",
        lambda D: bwd(D, dy=D.arr(XSHAPE, "int64"), y=D.arr(XSHAPE, "int64")),
        TypeE,
        r"^y must be of dtype .*int64",
        ALL,
    ),
    ("bwd_y_0d", lambda D: bwd(D, dy=D.arr(()), y=D.arr(())), ValueE, r"^y must be at least 1-D", ALL),
    ("bwd_scale_str", lambda D: bwd(D, scale="x"), TypeE, r"^scale must be a real number, got str 'x'", ALL),
    ("bwd_scale_nan", lambda D: bwd(D, scale=math.nan), ValueE, r"^scale must be a finite float", ALL),
    ("bwd_scale_10_400", lambda D: bwd(D, scale=10**400), ValueE, r"^scale must be a finite float", ALL),
    ("bwd_stream_str", lambda D: bwd(D, stream="garbage"), TypeE, r"^stream must be .*got str 'garbage'", ALL),
    ("bwd_stream_negative", lambda D: bwd(D, stream=-5), ValueE, r"^stream must be a stream handle", ALL),
    (
        "bwd_out_shape",
        lambda D: bwd(D, out=D.arr((2, 3, 5))),
        ValueE,
        r"^out must be of y's shape \(2, 3, 4, 5\), got shape \(2, 3, 5\)",
        ALL,
    ),
    ("bwd_out_dtype", lambda D: bwd(D, out=D.arr(XSHAPE, "float16")), TypeE, r"^out must be of y's dtype", ALL),
    ("bwd_out_list", lambda D: bwd(D, out=[]), TypeE, r"^out must be a .*got list", ALL),
    (
        "bwd_out_zero_stride",
        lambda D: bwd(D, out=D.view(D.base(8), 0, XSHAPE, (0, 0, 0, 1))),
        ValueE,
        r"^out must be writable without overlap",
        ALL,
    ),
    (
        "bwd_out_overlaps_dy",
        lambda D: (lambda b: bwd(D, dy=D.view(b, 0, XSHAPE), out=D.view(b, 5, XSHAPE)))(D.base(240)),
        ValueE,
        r"^out must be memory that does not overlap dy's \(out=dy exactly is allowed\)",
        ALL,
    ),
    (
        "bwd_out_overlaps_y",
        lambda D: (lambda b: bwd(D, y=D.view(b, 120, XSHAPE), out=D.view(b, 10, XSHAPE)))(D.base(240)),
        ValueE,
        r"^out must be memory that does not overlap y's",
        ALL,
    ),
]


def _params(cases, doors=ALL):
    out = []
    for case in cases:
        cid, build, exc, pattern, where = case
        for d in doors:
            if d not in where or (d in ("compile-fullgraph", "compile-cuda") and cid in FULLGRAPH_SKIP):
                continue
            if d.startswith("compile") and cid in COMPILE_SKIP:
                continue
            traced_fully = "compile-fullgraph" in where and cid not in FULLGRAPH_SKIP
            if d == "compile" and traced_fully and cid not in COMPILE_SAMPLE:
                continue
            out.append(pytest.param(d, build, exc, pattern, id=f"{d}-{cid}"))
    return out


@pytest.mark.parametrize("door,build,exc,pattern", _params(CASES))
def test_bad_input(door, build, exc, pattern):
    D = _door(door)
    call, inputs = build(D)
    expect_error(D, call, inputs, exc, pattern)


# ----------------------------------------------------------------------------------
# Torch only: tensors the kernels cannot read, and out= tensors that may not be written.


def _sparse(D, shape=XSHAPE):
    return D.arr(shape).to_sparse()


def _nested(D):
    return torch.nested.nested_tensor([D.arr((3, 5)), D.arr((4, 5))])


def _jagged(D):
    return torch.nested.nested_tensor([D.arr((3, 5)), D.arr((4, 5))], layout=torch.jagged)


def _meta(shape=XSHAPE, dtype=torch.float32):
    return torch.empty(shape, device="meta", dtype=dtype)


def _inference(D, shape=XSHAPE):
    with torch.inference_mode():
        return D.arr(shape)


EAGER_TORCH = ("torch", "torch-cuda")
TORCH_CASES = [
    (
        "x_sparse",
        lambda D: fwd(D, _sparse(D)),
        TypeE,
        r"^x must be a dense \(strided\) tensor, got layout",
        EAGER_TORCH,
    ),
    ("x_nested", lambda D: fwd(D, _nested(D)), TypeE, r"^x must be a dense \(strided\) tensor, got a nested", TORCH),
    ("x_jagged", lambda D: fwd(D, _jagged(D)), TypeE, r"^x must be a dense \(strided\) tensor, got a nested", TORCH),
    (
        "x_meta",
        lambda D: fwd(D, _meta()),
        ValueE,
        r"^x must be a tensor on a CPU or CUDA device, got device meta",
        TORCH,
    ),
    ("mask_sparse", lambda D: fwd(D, mask=_sparse(D, (4, 5))), TypeE, r"^mask must be a dense", EAGER_TORCH),
    ("mask_meta", lambda D: fwd(D, mask=_meta((4, 5))), ValueE, r"^mask must be .*device meta", TORCH),
    ("mask_nested", lambda D: fwd(D, mask=_nested(D)), TypeE, r"^mask must be a dense", EAGER_TORCH),
    (
        "klen_meta",
        lambda D: fwd(D, key_lengths=_meta((2,), torch.int64)),
        ValueE,
        r"^key_lengths must be .*device meta",
        TORCH,
    ),
    (
        "klen_sparse",
        lambda D: fwd(D, key_lengths=D.klen([1, 2]).to_sparse()),
        TypeE,
        r"^key_lengths must be a dense",
        EAGER_TORCH,
    ),
    ("out_sparse", lambda D: fwd(D, out=_sparse(D)), TypeE, r"^out must be a dense", EAGER_TORCH),
    ("out_meta", lambda D: fwd(D, out=_meta()), ValueE, r"^out must be .*device meta", TORCH),
    (
        "out_requires_grad",
        lambda D: fwd(D, out=D.arr(XSHAPE).requires_grad_(True)),
        ValueE,
        r"^out must be a tensor that does not require grad",
        TORCH,
    ),
    (
        "out_requires_grad_no_grad_x",
        lambda D: fwd(D, D.arr(XSHAPE), out=D.arr(XSHAPE).requires_grad_(True)),
        ValueE,
        r"^out must be a tensor that does not require grad",
        TORCH,
    ),
    (
        "out_inference_tensor",
        lambda D: fwd(D, out=_inference(D)),
        ValueE,
        r"^out must be a normal tensor outside torch\.inference_mode",
        EAGER_TORCH,
    ),
    (
        "out_with_x_requiring_grad",
        lambda D: fwd(D, D.arr(XSHAPE).requires_grad_(True), out=D.arr(XSHAPE)),
        ValueE,
        r"^out must be None when x or mask requires grad",
        TORCH,
    ),
    (
        "out_with_mask_requiring_grad",
        lambda D: fwd(D, mask=D.arr((4, 5)).requires_grad_(True), out=D.arr(XSHAPE)),
        ValueE,
        r"^out must be None when x or mask requires grad",
        TORCH,
    ),
    (
        "bwd_out_with_y_requiring_grad",
        lambda D: bwd(D, y=D.arr(XSHAPE).requires_grad_(True), out=D.arr(XSHAPE)),
        ValueE,
        r"^out must be None when dy or y requires grad",
        TORCH,
    ),
    ("bwd_y_meta", lambda D: bwd(D, dy=_meta(), y=_meta()), ValueE, r"^y must be .*device meta", TORCH),
    ("bwd_dy_meta", lambda D: bwd(D, dy=_meta()), ValueE, r"^dy must be .*device meta", TORCH),
    ("bwd_y_sparse", lambda D: bwd(D, y=_sparse(D)), TypeE, r"^y must be a dense", EAGER_TORCH),
    ("bwd_out_inference", lambda D: bwd(D, out=_inference(D)), ValueE, r"^out must be a normal tensor", EAGER_TORCH),
    (
        "bwd_out_requires_grad",
        lambda D: bwd(D, out=D.arr(XSHAPE).requires_grad_(True)),
        ValueE,
        r"^out must be a tensor that does not require grad",
        TORCH,
    ),
    (
        "stream_under_compile_on_cuda",
        lambda D: fwd(D, stream=0),
        ValueE,
        r"^stream must be None under torch\.compile",
        ("compile-cuda",),
    ),
    # CUDA: every operand on x's device.
    (
        "mask_on_cpu",
        lambda D: fwd(D, mask=D.arr((4, 5)).cpu()),
        ValueE,
        r"^mask must be on x's device",
        ("torch-cuda", "compile-cuda"),
    ),
    (
        "klen_on_cpu",
        lambda D: fwd(D, key_lengths=D.klen([1, 2]).cpu()),
        ValueE,
        r"^key_lengths must be on x's device",
        ("torch-cuda", "compile-cuda"),
    ),
    (
        "out_on_cpu",
        lambda D: fwd(D, out=D.arr(XSHAPE).cpu()),
        ValueE,
        r"^out must be on x's device",
        ("torch-cuda", "compile-cuda"),
    ),
    (
        "bwd_dy_on_cpu",
        lambda D: bwd(D, dy=D.arr(XSHAPE).cpu()),
        ValueE,
        r"^dy must be on y's device",
        ("torch-cuda", "compile-cuda"),
    ),
    (
        "bwd_out_on_cpu",
        lambda D: bwd(D, out=D.arr(XSHAPE).cpu()),
        ValueE,
        r"^out must be on y's device",
        ("torch-cuda", "compile-cuda"),
    ),
]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("door,build,exc,pattern", _params(TORCH_CASES))
def test_bad_torch_input(door, build, exc, pattern):
    D = _door(door)
    call, inputs = build(D)
    expect_error(D, call, inputs, exc, pattern)


# ----------------------------------------------------------------------------------
# The CUDA-array intake: malformed interfaces are argument errors too.


def _cai(**over):
    a = FakeCudaArray(XSHAPE, "float32")
    a.__cuda_array_interface__.update(over)
    return a


class _NoDict:
    __cuda_array_interface__ = ["shape", (2, 3)]


CAI_CASES = [
    ("cai_big_endian", lambda D: fwd(D, _cai(typestr=">f4")), TypeE, r"^x must be a little-endian array"),
    ("cai_unknown_typestr", lambda D: fwd(D, _cai(typestr="<V3")), TypeE, r"^x must be an array of a supported dtype"),
    ("cai_typestr_junk", lambda D: fwd(D, _cai(typestr=5)), TypeE, r"^x must be an array of a supported dtype"),
    ("cai_no_shape", lambda D: fwd(D, _cai(shape=None)), ValueE, r"^x must be an array with a valid __cuda_array"),
    ("cai_negative_dim", lambda D: fwd(D, _cai(shape=(2, -3))), ValueE, r"^x must be an array of non-negative dims"),
    (
        "cai_strides_half",
        lambda D: fwd(D, _cai(strides=(240, 80, 20, 2))),
        ValueE,
        r"^x must be strides that are whole",
    ),
    ("cai_strides_count", lambda D: fwd(D, _cai(strides=(4,))), ValueE, r"^x must be strides for each of its 4 dims"),
    ("cai_no_data", lambda D: fwd(D, _cai(data=None)), ValueE, r"^x must be an array with a valid __cuda_array"),
    ("cai_not_a_dict", lambda D: fwd(D, _NoDict()), ValueE, r"^x must be an array whose __cuda_array_interface__ is"),
    ("cai_mask_bad", lambda D: fwd(D, mask=_cai(typestr="<c16")), TypeE, r"^mask must be an array of a supported"),
    ("cai_out_bad", lambda D: fwd(D, out=_cai(shape="abc")), ValueE, r"^out must be an array with a valid"),
    ("cai_klen_bad", lambda D: fwd(D, key_lengths=_cai(data=("p", 0))), ValueE, r"^key_lengths must be an array"),
    ("cai_stream_junk", lambda D: fwd(D, _cai(stream="junk")), TypeE, r"^stream must be .*got str 'junk'"),
    ("cai_out_none_foreign", lambda D: fwd(D, out=None), TypeE, r"^out must be given for arrays of this library"),
    (
        "cai_mask_other_device",
        lambda D: fwd(D, mask=FakeCudaArray((4, 5), "bool", device=1)),
        ValueE,
        r"^mask must be on x's device 0, got device 1",
    ),
    (
        "cai_out_other_device",
        lambda D: fwd(D, out=FakeCudaArray(XSHAPE, "float32", device=1)),
        ValueE,
        r"^out must be on x's device",
    ),
    (
        "cai_bwd_dy_other_device",
        lambda D: bwd(D, dy=FakeCudaArray(XSHAPE, "float32", device=1)),
        ValueE,
        r"^dy must be on y's device",
    ),
    (
        "cai_bwd_out_not_cai",
        lambda D: bwd(D, out=np.zeros(XSHAPE, np.float32)),
        TypeE,
        r"^out must be a CUDA array like y",
    ),
    (
        "cai_klen_foreign_uint16",  # a dtype the kernels do not read, of a library we cannot convert with
        lambda D: fwd(D, key_lengths=FakeCudaArray((2,), "int16")),
        TypeE,
        r"^key_lengths must be int32 or int64 for arrays of this library",
    ),
]


@pytest.mark.parametrize("build,exc,pattern", [pytest.param(*c[1:], id=c[0]) for c in CAI_CASES])
def test_bad_cuda_array_interface(build, exc, pattern):
    D = CaiDoor()
    call, inputs = build(D)
    expect_error(D, call, inputs, exc, pattern)


# ----------------------------------------------------------------------------------
# nn.Module: its errors name `scores` where the function names `x`.


MODULE_CASES = [
    ("scale_inf", lambda: ScaledMaskedSoftmax(scale=math.inf), ValueE, r"^scale must be a finite float.*got inf"),
    ("scale_10_400", lambda: ScaledMaskedSoftmax(scale=10**400), ValueE, r"^scale must be a finite float"),
    ("scale_str", lambda: ScaledMaskedSoftmax(scale="0.1"), TypeE, r"^scale must be a real number, got str"),
    ("causal_str", lambda: ScaledMaskedSoftmax(causal="no"), TypeE, r"^causal must be a bool, got str 'no'"),
    ("causal_none", lambda: ScaledMaskedSoftmax(causal=None), TypeE, r"^causal must be a bool, got NoneType"),
    ("scores_list", lambda: ScaledMaskedSoftmax()([[1.0]]), TypeE, r"^scores must be a torch\.Tensor, got list"),
    ("scores_numpy", lambda: ScaledMaskedSoftmax()(np.zeros(XSHAPE)), TypeE, r"^scores must be a torch\.Tensor"),
    (
        "scores_int",
        lambda: ScaledMaskedSoftmax()(torch.ones(XSHAPE, dtype=torch.int32)),
        TypeE,
        r"^scores must be of dtype",
    ),
    (
        "scores_1d_causal",
        lambda: ScaledMaskedSoftmax(causal=True)(torch.randn(5)),
        ValueE,
        r"^scores must be at least 2-D",
    ),
    ("scores_meta", lambda: ScaledMaskedSoftmax()(_meta()), ValueE, r"^scores must be a tensor on a CPU or CUDA"),
    (
        "mask_shape",
        lambda: ScaledMaskedSoftmax()(torch.randn(XSHAPE), torch.zeros(3, 5)),
        ValueE,
        r"^mask must be broadcastable",
    ),
    ("mask_list", lambda: ScaledMaskedSoftmax()(torch.randn(XSHAPE), [1]), TypeE, r"^mask must be a torch\.Tensor"),
    (
        "key_lengths_len",
        lambda: ScaledMaskedSoftmax()(torch.randn(XSHAPE), None, torch.tensor([1, 2, 3])),
        ValueE,
        r"^key_lengths must be of shape \[B\]",
    ),
    (
        "key_lengths_strs",
        lambda: ScaledMaskedSoftmax()(torch.randn(XSHAPE), None, ["a", "b"]),
        TypeE,
        r"^key_lengths must be",
    ),
]


@pytest.mark.parametrize("call,exc,pattern", [pytest.param(*c[1:], id=c[0]) for c in MODULE_CASES])
def test_bad_module_input(call, exc, pattern):
    expect_error(TorchDoor(), call, [], exc, pattern)


def test_bad_module_input_leaves_tensors_alone():
    x, m = torch.randn(XSHAPE), torch.randn(3, 5)
    D = TorchDoor()
    expect_error(D, lambda: ScaledMaskedSoftmax()(x, m), [x, m], ValueError, r"^mask must be broadcastable")


def test_module_errors_under_compile_name_scores():
    torch._dynamo.reset()
    mod = torch.compile(ScaledMaskedSoftmax(causal=True), backend="aot_eager")
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^scores must be at least 2-D"):
        mod(torch.randn(5))


# ----------------------------------------------------------------------------------
# explain()


EXPLAIN_CASES = [
    ("shape_str", lambda: drvsoftmax.explain("ab"), TypeE, r"^x_shape must be a sequence of non-negative integers"),
    ("shape_str_dim", lambda: drvsoftmax.explain((2, "a")), TypeE, r"^x_shape must be .*got \[2, 'a'\] \(a str dim\)"),
    ("shape_negative", lambda: drvsoftmax.explain((2, -1)), ValueE, r"^x_shape must be .*non-negative.*got \[2, -1\]"),
    ("shape_int", lambda: drvsoftmax.explain(5), TypeE, r"^x_shape must be a sequence .*got int 5"),
    ("shape_none", lambda: drvsoftmax.explain(None), TypeE, r"^x_shape must be a sequence .*got NoneType"),
    ("shape_bool_dim", lambda: drvsoftmax.explain((True, 3)), TypeE, r"^x_shape must be .*\(a bool dim\)"),
    ("shape_float_dim", lambda: drvsoftmax.explain((2.0, 3)), TypeE, r"^x_shape must be .*\(a float dim\)"),
    ("shape_empty", lambda: drvsoftmax.explain(()), ValueE, r"^x must be at least 1-D"),
    ("sk_too_long", lambda: drvsoftmax.explain((2, 2**31)), ValueE, r"^x must be rows of at most 2147483647"),
    ("dtype_float64", lambda: drvsoftmax.explain((4, 8), "float64"), TypeE, r"^x must be of dtype .*got dtype float64"),
    ("dtype_int8", lambda: drvsoftmax.explain((4, 8), np.int8), TypeE, r"^x must be of dtype .*got dtype int8"),
    ("dtype_object", lambda: drvsoftmax.explain((4, 8), object()), TypeE, r"^x must be of dtype .*got dtype"),
    (
        "dtype_torch_int",
        lambda: drvsoftmax.explain((4, 8), torch.int32),
        TypeE,
        r"^x must be of dtype .*got dtype int32",
    ),
    ("mask_complex", lambda: drvsoftmax.explain((4, 8), mask_dtype="complex64"), TypeE, r"^mask must be .*complex64"),
    ("mask_junk", lambda: drvsoftmax.explain((4, 8), mask_dtype="junk"), TypeE, r"^mask must be .*got dtype junk"),
    ("causal_str", lambda: drvsoftmax.explain((4, 8), causal="yes"), TypeE, r"^causal must be a bool, got str 'yes'"),
    ("causal_1d", lambda: drvsoftmax.explain((8,), causal=True), ValueE, r"^x must be at least 2-D .*causal"),
    ("backward_str", lambda: drvsoftmax.explain((4, 8), backward="no"), TypeE, r"^backward must be a bool, got str"),
]


@pytest.mark.parametrize("call,exc,pattern", [pytest.param(*c[1:], id=c[0]) for c in EXPLAIN_CASES])
def test_bad_explain_input(call, exc, pattern):
    expect_error(NumpyDoor(), call, [], exc, pattern)


def test_explain_accepts_what_the_functions_accept():
    by_objects = drvsoftmax.explain((2, 3, 8), torch.bfloat16, mask_dtype=torch.bool, causal=True)
    assert by_objects == drvsoftmax.explain((2, 3, 8), "bfloat16", mask_dtype="bool", causal=True)
    assert " tier: " in by_objects
    by_numpy = drvsoftmax.explain([np.int64(4), 100], np.float32, mask_dtype=np.uint64)
    assert by_numpy == drvsoftmax.explain((4, 100), "float32", mask_dtype="uint64")
    assert drvsoftmax.explain((0, 8)).startswith("no kernel")
    assert drvsoftmax.explain((4, 0), backward=True).startswith("no kernel")


# ----------------------------------------------------------------------------------
# The command line: argparse's usage errors (exit status 2) name the argument.


CLI_CASES = [
    ([], r"the following arguments are required: cmd"),
    (["bogus"], r"argument cmd: invalid choice: 'bogus'"),
    (["info", "--bogus"], r"unrecognized arguments: --bogus"),
    (["demo", "extra"], r"unrecognized arguments: extra"),
    (["info", "--arch"], r"argument --arch: expected one argument"),
    (["info", "--kernels=yes"], r"argument --kernels: ignored explicit argument 'yes'"),
]


@pytest.mark.parametrize(
    "argv,pattern", CLI_CASES, ids=["none", "bogus", "info_bogus", "demo_extra", "arch_missing", "kernels_value"]
)
def test_bad_command_line(argv, pattern):
    from drvsoftmax.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert re.search(pattern, err.getvalue()), err.getvalue()


# ----------------------------------------------------------------------------------
# Size of the matrix, and legal neighbours of the bad cases (no false alarms).


def test_the_matrix_is_large():
    cpu = [p for p in _params(CASES) + _params(TORCH_CASES) if p.values[0] in CPU_DOORS]
    total = len(_params(CASES)) + len(_params(TORCH_CASES)) + len(CAI_CASES) + len(MODULE_CASES)
    total += len(EXPLAIN_CASES) + len(CLI_CASES)
    assert len(cpu) + len(CAI_CASES) + len(MODULE_CASES) + len(EXPLAIN_CASES) + len(CLI_CASES) >= 150
    assert total >= 250


def _values(a):
    return a.detach().cpu().numpy().copy() if isinstance(a, torch.Tensor) else np.array(a, copy=True)


@pytest.mark.parametrize("door", ["numpy", "torch", "torch-cuda"])
def test_overlap_neighbours_that_are_legal(door):
    # out=x exactly, out=dy / out=y exactly, and disjoint views of one buffer: accepted,
    # with the values separate arrays give.
    from drvsoftmax import _reference

    D = _door(door)
    b = D.base(480)
    x, out = D.view(b, 0, XSHAPE), D.view(b, 120, XSHAPE)
    mask = D.view(b, 240, (4, 5))
    want = _reference.softmax_forward(_values(x), _values(mask), 0.5)
    assert D.fwd(x, mask, scale=0.5, out=out) is out
    np.testing.assert_allclose(_values(out), want, rtol=2e-5, atol=1e-7)
    assert D.fwd(x, mask, scale=0.5, out=x) is x  # in place
    np.testing.assert_allclose(_values(x), want, rtol=2e-5, atol=1e-7)
    dy, y = D.view(b, 360, XSHAPE), x
    want_dx = _reference.softmax_backward(_values(dy), _values(y), 0.5)
    assert D.bwd(dy, y, scale=0.5, out=dy) is dy
    np.testing.assert_allclose(_values(dy), want_dx, rtol=1e-4, atol=1e-6)
    y2 = _values(y)
    want_dx2 = _reference.softmax_backward(_values(D.view(b, 120, XSHAPE)), y2, 0.5)
    assert D.bwd(D.view(b, 120, XSHAPE), y, scale=0.5, out=y) is y  # out=y exactly
    np.testing.assert_allclose(_values(y), want_dx2, rtol=1e-4, atol=1e-6)


def test_compiled_out_must_match_like_eager():
    # The traced path ends in out.copy_(y), which would cast and broadcast: it must refuse
    # first, with the eager path's error (the default compile falls back to raise it).
    x = torch.randn(2, 3, 4)
    out = torch.zeros(5, 2, 3, 4, dtype=torch.float64)
    before = out.clone()
    torch._dynamo.reset()
    f = torch.compile(lambda x, out: drvsoftmax.scaled_masked_softmax(x, out=out), backend="aot_eager")
    with pytest.raises(drvsoftmax.ArgumentTypeError, match=r"^out must be of x's dtype float32, got dtype float64"):
        f(x, out)
    assert torch.equal(out, before)


class _Sub(torch.Tensor):
    """A plain tensor subclass: takes the traced path (torch.ops) outside torch.compile."""


@pytest.mark.parametrize(
    "kw,exc,pattern",
    [
        ({"out": torch.zeros(5, 2, 3, 4, dtype=torch.float64)}, TypeE, r"^out must be of x's dtype"),
        ({"out": torch.zeros(2, 3, 5)}, ValueE, r"^out must be of x's shape"),
        ({"mask": torch.zeros(3, 5)}, ValueE, r"^mask must be broadcastable"),
        ({"mask": np.zeros((4,), bool)}, TypeE, r"^mask must be a torch\.Tensor"),
        ({"stream": "garbage"}, TypeE, r"^stream must be"),
        ({"key_lengths": torch.zeros(2)}, TypeE, r"^key_lengths must be of an integer dtype"),
        ({"out": "self+1"}, ValueE, r"^out must be memory that does not overlap x's"),
    ],
    ids=["out_dtype", "out_shape", "mask_shape", "mask_numpy", "stream", "klen_float", "out_overlap"],
)
def test_tensor_subclass_gets_the_eager_checks(kw, exc, pattern):
    base = torch.randn(60)
    x = base[:24].view(2, 3, 4).as_subclass(_Sub)
    if kw.get("out") == "self+1":
        kw = {"out": base[1:25].view(2, 3, 4)}
    expect_error(TorchDoor(), lambda: drvsoftmax.scaled_masked_softmax(x, **kw), [x, *kw.values()], exc, pattern)
