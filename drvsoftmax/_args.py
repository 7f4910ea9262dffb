"""Argument checks shared by every front door (messages name argument, expectation, value)."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._errors import arg_type_error, arg_value_error

FLT_MAX = 3.4028234663852886e38
X_DTYPES_GPU = ("float16", "bfloat16", "float32")
X_DTYPES_CPU = X_DTYPES_GPU + ("float64",)
MASK_DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
)
INT_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


def check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise arg_type_error("scale", "a real number", f"{type(scale).__name__} {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or abs(s) > FLT_MAX:
        raise arg_value_error("scale", "a finite float within float32 range", repr(scale))
    return s


def check_causal(causal) -> bool:
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    raise arg_type_error("causal", "a bool", f"{type(causal).__name__} {causal!r}")


def check_x(shape: tuple, dtype: str, allowed: tuple, where: str, name: str = "x") -> None:
    if dtype not in allowed:
        raise arg_type_error(name, f"of dtype {', '.join(allowed)} {where}", f"dtype {dtype}")
    if len(shape) < 1:
        raise arg_value_error(name, "at least 1-D (softmax runs over the last axis)", f"shape {tuple(shape)}")


def check_mask_dtype(dtype: str) -> None:
    if dtype not in MASK_DTYPES:
        raise arg_type_error(
            "mask", "bool, an integer dtype (nonzero hides) or a float dtype (added)", f"dtype {dtype}"
        )


def check_broadcast(mask_shape: tuple, x_shape: tuple) -> None:
    ms, xs = tuple(mask_shape), tuple(x_shape)
    ok = all(n == 1 for n in ms[: max(0, len(ms) - len(xs))])
    for m, x in zip(reversed(ms), reversed(xs)):
        ok = ok and (m == x or m == 1)
    if not ok:
        raise arg_value_error("mask", f"broadcastable to x.shape {xs}", f"shape {ms}")


def check_causal_shape(causal: bool, x_shape: tuple) -> None:
    if causal and len(x_shape) < 2:
        raise arg_value_error("x", "at least 2-D [..., Sq, Sk] when causal=True", f"shape {tuple(x_shape)}")


def check_key_lengths(shape: tuple, dtype: str, x_shape: tuple, allowed=INT_DTYPES) -> None:
    if dtype not in allowed:
        raise arg_type_error("key_lengths", f"of an integer dtype ({', '.join(allowed)})", f"dtype {dtype}")
    if len(x_shape) < 2:
        raise arg_value_error("x", "at least 2-D [B, ..., Sk] when key_lengths is given", f"shape {tuple(x_shape)}")
    if tuple(shape) != (x_shape[0],):
        raise arg_value_error(
            "key_lengths", f"of shape [B] = ({x_shape[0]},) (B = x.shape[0])", f"shape {tuple(shape)}"
        )


def check_out(shape: tuple, dtype: str, x_shape: tuple, x_dtype: str, like: str = "x") -> None:
    if dtype != x_dtype:
        raise arg_type_error("out", f"of {like}'s dtype {x_dtype}", f"dtype {dtype}")
    if tuple(shape) != tuple(x_shape):
        raise arg_value_error("out", f"of {like}'s shape {tuple(x_shape)}", f"shape {tuple(shape)}")


def check_out_strides(shape: tuple, strides: tuple, name: str = "out") -> None:
    for n, s in zip(shape, strides):
        if n > 1 and s == 0:
            raise arg_value_error(
                name, "writable without overlap (no broadcast/expanded dims)", f"strides {tuple(strides)}"
            )


def stream_handle(stream) -> int:
    """The raw handle of a stream given as an int, a CUstream, a torch/CuPy/Numba stream
    object or anything with ``__cuda_stream__``."""
    if isinstance(stream, bool) or stream is None:
        raise arg_type_error("stream", "a CUstream, an int handle or a stream object", repr(stream))
    if isinstance(stream, int):
        if stream < 0:
            raise arg_value_error("stream", "a non-negative stream handle", stream)
        return stream
    cs = getattr(stream, "__cuda_stream__", None)
    if cs is not None:
        v = cs() if callable(cs) else cs
        return int(v[1]) if isinstance(v, tuple) else int(v)
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    h = getattr(stream, "handle", None)  # numba.cuda stream: a ctypes c_void_p
    if h is not None and hasattr(h, "value"):
        return int(h.value or 0)
    try:
        from cuda.bindings import driver
        from cuda.bindings.utils import get_cuda_native_handle

        if isinstance(stream, driver.CUstream):
            return int(get_cuda_native_handle(stream))
    except ImportError:
        pass
    raise arg_type_error(
        "stream",
        "None, a CUstream, an int handle, a torch/CuPy/Numba stream or an object with __cuda_stream__",
        type(stream).__name__,
    )
