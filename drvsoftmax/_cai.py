"""CuPy, Numba and other ``__cuda_array_interface__`` arrays: a thin adapter to the core.

Reads shape, strides, dtype, pointer and stream from the interface, allocates the output
with the array's own library (CuPy or Numba), and launches on the array's stream: the
given ``stream``; else CuPy's current stream for CuPy arrays, the stream named in the
interface (v3) if any, else the legacy default stream.  No host synchronisation (but for
key_lengths of a dtype other than int32/int64 on Numba arrays, converted on the host).
A malformed interface, like any other bad argument, is an argument error.  No autograd.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _args, _core, _driver
from ._errors import DrvSoftmaxError, arg_type_error, arg_value_error, check

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


def is_cai(a: object) -> bool:
    return hasattr(a, "__cuda_array_interface__")


def _library(a: object) -> str:
    return type(a).__module__.split(".")[0]


def _describe(a: Any, name: str) -> tuple[_core.Operand, dict[str, Any]]:
    """(Operand, interface dict) of a CUDA array; a malformed interface is an argument error."""
    try:
        return _read_interface(a, name)
    except DrvSoftmaxError:
        raise
    except Exception as e:  # a foreign object's interface missing keys or holding junk
        raise arg_value_error(
            name, "an array with a valid __cuda_array_interface__ (v3)", f"{type(e).__name__}: {e}"
        ) from e


def _read_interface(a: Any, name: str) -> tuple[_core.Operand, dict[str, Any]]:
    cai = a.__cuda_array_interface__
    if not isinstance(cai, dict):
        raise arg_value_error(name, "an array whose __cuda_array_interface__ is a dict", type(cai).__name__)
    ts = cai["typestr"]
    if not isinstance(ts, str) or len(ts) < 3:
        raise arg_type_error(name, "an array of a supported dtype", f"typestr {ts!r}")
    if ts[0] == ">":
        raise arg_type_error(name, "a little-endian array", f"typestr {ts}")
    dtype = _TYPESTR.get(ts[1:])
    if dtype is None and ts[1:] == "V2" and "bfloat16" in str(getattr(a, "dtype", "")):
        dtype = "bfloat16"
    if dtype is None:
        raise arg_type_error(name, "an array of a supported dtype", f"typestr {ts} ({getattr(a, 'dtype', '?')})")
    shape = tuple(int(n) for n in cai["shape"])
    if any(n < 0 for n in shape):
        raise arg_value_error(name, "an array of non-negative dims", f"shape {shape}")
    item = _args.ITEMSIZE[dtype]
    strides: tuple[int, ...]
    if cai.get("strides") is None:
        acc, rev = 1, []
        for n in reversed(shape):
            rev.append(acc)
            acc *= max(n, 1)
        strides = tuple(reversed(rev))
    else:
        bs = tuple(int(s) for s in cai["strides"])
        if len(bs) != len(shape):
            raise arg_value_error(name, f"strides for each of its {len(shape)} dims", f"byte strides {bs}")
        if any(s % item for s in bs):
            raise arg_value_error(name, "strides that are whole elements", f"byte strides {bs}")
        strides = tuple(s // item for s in bs)
    ptr = int(cai["data"][0] or 0)
    if ptr < 0:
        raise arg_value_error(name, "an array with a valid device pointer", f"pointer {ptr}")
    return _core.Operand(ptr, dtype, shape, strides), cai


def _region(name: str, op: _core.Operand | None) -> _args.Region | None:
    if op is None:
        return None
    return _args.region(name, op.ptr, op.shape, op.strides, _args.ITEMSIZE[op.dtype])


def _device_of(ptr: int, a: Any) -> int:
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


def _stream_of(a: Any, cai: dict[str, Any], stream: object) -> int:
    if stream is not None:
        return _args.stream_handle(stream)
    if _library(a) == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    s = cai.get("stream")
    if s is None:
        return 0
    return _args.stream_handle(s)


def _empty_like(a: Any, op: _core.Operand, dev: int) -> Any:
    mod = _library(a)
    if mod == "cupy":
        import cupy

        with cupy.cuda.Device(dev):  # a's device, whichever is current
            return cupy.empty(op.shape, dtype=a.dtype)
    if mod == "numba":
        from numba import cuda

        return cuda.device_array(op.shape, dtype=np.dtype(op.dtype))
    raise arg_type_error(
        "out",
        "given for arrays of this library (drvsoftmax allocates only CuPy and Numba arrays)",
        f"out=None for a {type(a).__module__}.{type(a).__name__}",
    )


def _lengths_for_kernel(a: Any, ko: _core.Operand, stream: int, dev: int) -> tuple[Any, _core.Operand]:
    """key_lengths the kernels can read (int32 or int64), with the same meaning: other
    integer dtypes become int64 on `stream` (CuPy), or through the host (Numba)."""
    if ko.dtype in _args.KLEN_KERNEL_DTYPES:
        return a, ko
    mod = _library(a)
    if mod == "cupy":
        import cupy

        with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(stream):
            v = cupy.asarray(a)
            if ko.dtype == "uint64":  # beyond int64 means beyond any Sk
                v = cupy.minimum(v, 2**63 - 1)
            conv = cupy.ascontiguousarray(v.astype(cupy.int64))
        return conv, _core.Operand(int(conv.data.ptr), "int64", ko.shape, (1,))
    if mod == "numba":
        from numba import cuda

        s = cuda.external_stream(stream) if stream else cuda.default_stream()
        host = a.copy_to_host(stream=s)
        s.synchronize()
        if host.dtype == np.uint64:  # beyond int64 means beyond any Sk
            host = np.minimum(host, np.uint64(2**63 - 1))
        conv = cuda.to_device(host.astype(np.int64), stream=s)
        return conv, _core.Operand(int(conv.__cuda_array_interface__["data"][0]), "int64", ko.shape, (1,))
    raise arg_type_error(
        "key_lengths",
        "int32 or int64 for arrays of this library (other integer dtypes are converted for CuPy and Numba only)",
        f"dtype {ko.dtype} ({type(a).__module__}.{type(a).__name__})",
    )


def _check_same_device(name: str, op: _core.Operand, a: Any, dev: int, like: str = "x") -> None:
    d = _device_of(op.ptr, a)
    if d != dev:
        raise arg_value_error(name, f"on {like}'s device {dev}", f"device {d}")


def forward(x: Any, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Any:
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
                "key_lengths", "a CUDA array of integers of shape [B] (or None)", type(key_lengths).__name__
            )
        ko, _ = _describe(key_lengths, "key_lengths")
        _args.check_key_lengths(ko.shape, ko.dtype, xo.shape)
        _check_same_device("key_lengths", ko, key_lengths, dev)
    s = _stream_of(x, xc, stream)
    if out is None:
        out = _empty_like(x, xo, dev)
        yo, _ = _describe(out, "out")
    else:
        if not is_cai(out):
            raise arg_type_error("out", "a CUDA array like x (or None)", type(out).__name__)
        yo, _ = _describe(out, "out")
        _args.check_out(yo.shape, yo.dtype, xo.shape, xo.dtype)
        _args.check_out_strides(yo.shape, yo.strides)
        _check_same_device("out", yo, out, dev)
        _args.check_no_overlap(
            _region("out", yo),
            (_region("x", xo), _region("mask", mo), _region("key_lengths", ko)),
            in_place=("x",),
        )
    if any(n == 0 for n in xo.shape):
        return out
    keep = None
    if ko is not None:
        keep, ko = _lengths_for_kernel(key_lengths, ko, s, dev)
    _core.forward(_driver.device(dev), xo, yo, mo, ko, causal, scale, s)
    del keep  # (converted key_lengths: freed after the launch, in stream order)
    return out


def backward(dy: Any, y: Any, scale: Any, out: Any, stream: object) -> Any:
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
    _check_same_device("dy", do, dy, dev, "y")
    s = _stream_of(y, yc, stream)
    if out is None:
        out = _empty_like(y, yo, dev)
        xo, _ = _describe(out, "out")
    else:
        if not is_cai(out):
            raise arg_type_error("out", "a CUDA array like y (or None)", type(out).__name__)
        xo, _ = _describe(out, "out")
        _args.check_out(xo.shape, xo.dtype, yo.shape, yo.dtype, "y")
        _args.check_out_strides(xo.shape, xo.strides)
        _check_same_device("out", xo, out, dev, "y")
        _args.check_no_overlap(_region("out", xo), (_region("dy", do), _region("y", yo)), in_place=("dy", "y"))
    if any(n == 0 for n in yo.shape):
        return out
    _core.backward(_driver.device(dev), do, yo, xo, scale, s)
    return out


__all__ = ["is_cai", "forward", "backward"]
