"""CuPy, Numba and other ``__cuda_array_interface__`` arrays: a thin adapter to the core.

Reads shape, strides, dtype, pointer and stream from the interface, allocates the output
with the array's own library (CuPy or Numba), and launches on the array's stream: CuPy's
current stream when ``stream`` is None, the stream named in the interface (v3) if any,
else the legacy default stream.  A consumer on another stream than the producer's is
made to wait with an event (no host synchronisation).  No autograd here.
"""

from __future__ import annotations

import numpy as np

from . import _args, _core, _driver
from ._errors import arg_type_error, arg_value_error, check

_TYPESTR = {
    "f2": "float16",
    "f4": "float32",
    "f8": "float64",
    "b1": "bool",
    "i1": "int8",
    "u1": "uint8",
    "i2": "int16",
    "u2": "uint16",
    "i4": "int32",
    "u4": "uint32",
    "i8": "int64",
    "u8": "uint64",
}


def is_cai(a) -> bool:
    return hasattr(a, "__cuda_array_interface__")


def _describe(a, name: str):
    """(Operand, interface dict) of a CUDA array."""
    cai = a.__cuda_array_interface__
    ts = cai["typestr"]
    if ts[0] == ">":
        raise arg_type_error(name, "a little-endian array", f"typestr {ts}")
    dtype = _TYPESTR.get(ts[1:])
    if dtype is None and ts[1:] == "V2" and "bfloat16" in str(getattr(a, "dtype", "")):
        dtype = "bfloat16"
    if dtype is None:
        raise arg_type_error(name, "an array of a supported dtype", f"typestr {ts} ({getattr(a, 'dtype', '?')})")
    shape = tuple(int(n) for n in cai["shape"])
    item = int(ts[2:]) if ts[2:].isdigit() else 2
    if cai.get("strides") is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= max(n, 1)
        strides = tuple(reversed(strides))
    else:
        bs = tuple(int(s) for s in cai["strides"])
        if any(s % item for s in bs):
            raise arg_value_error(name, "strides that are whole elements", f"byte strides {bs}")
        strides = tuple(s // item for s in bs)
    ptr = int(cai["data"][0] or 0)
    return _core.Operand(ptr, dtype, shape, strides), cai


def _device_of(ptr: int, a) -> int:
    dev = getattr(a, "device", None)
    for attr in ("id", "index"):
        v = getattr(dev, attr, None)
        if isinstance(v, int):
            return v
    if ptr == 0:
        return 0
    from cuda.bindings import driver

    _driver.init()
    ordinal = check(
        driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
        "cuPointerGetAttribute",
    )
    return int(ordinal)


def _stream_of(a, cai, stream) -> int:
    if stream is not None:
        return _args.stream_handle(stream)
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    s = cai.get("stream")
    return int(s) if s else 0


def _empty_like(a, op: _core.Operand):
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy.empty(op.shape, dtype=a.dtype)
    if mod == "numba":
        from numba import cuda

        return cuda.device_array(op.shape, dtype=np.dtype(op.dtype))
    raise arg_type_error(
        "out",
        "given for arrays of this library (drvsoftmax allocates only CuPy and Numba arrays)",
        f"out=None for a {type(a).__module__}.{type(a).__name__}",
    )


def _check_same_device(name: str, op, a, dev: int):
    d = _device_of(op.ptr, a)
    if d != dev:
        raise arg_value_error(name, f"on x's device {dev}", f"device {d}")


def forward(x, mask, scale, causal, key_lengths, out, stream):
    scale = _args.check_scale(scale)
    causal = _args.check_causal(causal)
    xo, xc = _describe(x, "x")
    _args.check_x(xo.shape, xo.dtype, _args.X_DTYPES_GPU, "on the GPU")
    _args.check_causal_shape(causal, xo.shape)
    dev = _device_of(xo.ptr, x)
    mo = ko = None
    if mask is not None:
        if not is_cai(mask):
            raise arg_type_error("mask", "a CUDA array like x (or None)", type(mask).__name__)
        mo, _ = _describe(mask, "mask")
        _args.check_mask_dtype(mo.dtype)
        _args.check_broadcast(mo.shape, xo.shape)
        _check_same_device("mask", mo, mask, dev)
    if key_lengths is not None:
        if not is_cai(key_lengths):
            raise arg_type_error(
                "key_lengths", "a CUDA array of int32/int64 of shape [B] (or None)", type(key_lengths).__name__
            )
        ko, _ = _describe(key_lengths, "key_lengths")
        _args.check_key_lengths(ko.shape, ko.dtype, xo.shape, ("int32", "int64"))
        _check_same_device("key_lengths", ko, key_lengths, dev)
    if out is None:
        out = _empty_like(x, xo)
    elif not is_cai(out):
        raise arg_type_error("out", "a CUDA array like x (or None)", type(out).__name__)
    yo, _ = _describe(out, "out")
    _args.check_out(yo.shape, yo.dtype, xo.shape, xo.dtype)
    _args.check_out_strides(yo.shape, yo.strides)
    if any(n == 0 for n in xo.shape):
        return out
    _core.forward(_driver.device(dev), xo, yo, mo, ko, causal, scale, _stream_of(x, xc, stream))
    return out


def backward(dy, y, scale, out, stream):
    scale = _args.check_scale(scale)
    yo, yc = _describe(y, "y")
    if not is_cai(dy):
        raise arg_type_error("dy", "a CUDA array like y", type(dy).__name__)
    do, _ = _describe(dy, "dy")
    _args.check_x(yo.shape, yo.dtype, _args.X_DTYPES_GPU, "on the GPU", "y")
    if do.shape != yo.shape or do.dtype != yo.dtype:
        raise arg_value_error(
            "dy", f"of y's shape {yo.shape} and dtype {yo.dtype}", f"shape {do.shape}, dtype {do.dtype}"
        )
    dev = _device_of(yo.ptr, y)
    if out is None:
        out = _empty_like(y, yo)
    xo, _ = _describe(out, "out")
    _args.check_out(xo.shape, xo.dtype, yo.shape, yo.dtype, "y")
    _args.check_out_strides(xo.shape, xo.strides)
    if any(n == 0 for n in yo.shape):
        return out
    _core.backward(_driver.device(dev), do, yo, xo, scale, _stream_of(y, yc, stream))
    return out


__all__ = ["is_cai", "forward", "backward"]
