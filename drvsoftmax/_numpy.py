"""The NumPy door: the float64 reference path, with the argument checks of every door.

Arrays are described as core Operands (pointer, dtype name, shape, element strides) and
checked by `_args.check_forward_call` / `check_backward_call`, the same checks and
messages as the GPU doors; then `_reference` computes in float64 and the result is cast
to x's dtype (written into ``out`` when given).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _args, _reference
from ._core import Operand
from ._errors import arg_type_error, arg_value_error
from ._intake import np_dtype_name

WHERE = "on the CPU path"


def _operand(name: str, a: np.ndarray) -> Operand:
    item = max(a.itemsize, 1)
    if any(s % item for s in a.strides):
        # Element strides are what every door checks with: a view whose byte strides are
        # no whole number of elements (a field of a packed record) is described by a
        # copy, or refused as out.
        if name == "out":
            raise arg_value_error(name, "an array whose strides are whole elements", f"byte strides {a.strides}")
        a = np.ascontiguousarray(a)
    return Operand(
        int(a.__array_interface__["data"][0]), np_dtype_name(a.dtype), a.shape, tuple(s // item for s in a.strides)
    )


def _lengths(key_lengths: object) -> np.ndarray:
    if isinstance(key_lengths, np.ndarray):
        return key_lengths
    if isinstance(key_lengths, (list, tuple)):
        return _args.lengths_array(key_lengths)
    raise arg_type_error(
        "key_lengths",
        "a NumPy integer array, a list or tuple of integers of shape [B] (or None)",
        type(key_lengths).__name__,
    )


def forward(x: np.ndarray, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: Any) -> np.ndarray:
    _args.check_stream(stream)
    if mask is not None and not isinstance(mask, np.ndarray):
        raise arg_type_error("mask", "a numpy.ndarray like x (or None)", type(mask).__name__)
    kl = None if key_lengths is None else _lengths(key_lengths)
    if out is not None and not isinstance(out, np.ndarray):
        raise arg_type_error("out", "a numpy.ndarray like x (or None)", type(out).__name__)
    scale, causal = _args.check_forward_call(
        _operand("x", x),
        None if mask is None else _operand("mask", mask),
        None if kl is None else _operand("key_lengths", kl),
        None if out is None else _operand("out", out),
        scale,
        causal,
        _args.X_DTYPES_CPU,
        WHERE,
        out_readonly=out is not None and not out.flags.writeable,
    )
    y = _reference.softmax_forward(x, mask, scale, causal, kl).astype(x.dtype)
    if out is None:
        return y
    dst: np.ndarray = out
    dst[...] = y
    return dst


def backward(dy: Any, y: np.ndarray, scale: Any, out: Any, stream: Any) -> np.ndarray:
    _args.check_stream(stream)
    if not isinstance(dy, np.ndarray):
        raise arg_type_error("dy", "a numpy.ndarray like y", type(dy).__name__)
    if out is not None and not isinstance(out, np.ndarray):
        raise arg_type_error("out", "a numpy.ndarray like y (or None)", type(out).__name__)
    scale = _args.check_backward_call(
        _operand("dy", dy),
        _operand("y", y),
        None if out is None else _operand("out", out),
        scale,
        _args.X_DTYPES_CPU,
        WHERE,
        out_readonly=out is not None and not out.flags.writeable,
    )
    dx = _reference.softmax_backward(dy, y, scale).astype(y.dtype)
    if out is None:
        return dx
    dst: np.ndarray = out
    dst[...] = dx
    return dst


__all__ = ["forward", "backward"]
