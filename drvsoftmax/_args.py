"""Argument checks shared by every front door (messages name argument, expectation, value).

Front doors read what they need from their arrays (shape, dtype name, strides, pointer)
and call these functions, so that a bad argument gets the same exception class and the
same message whichever door it came through.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import _dtypes
from ._errors import arg_type_error, arg_value_error

if TYPE_CHECKING:
    from ._core import Operand

FLT_MAX = 3.4028234663852886e38
# key_lengths: any integer dtype on every path.  The kernels read int32 and int64; the GPU
# front doors convert the other integer dtypes to one of those first (B elements, on the
# launch stream), keeping every value's meaning (values clamp to [0, Sk]).
X_DTYPES_GPU, X_DTYPES_CPU, MASK_DTYPES = _dtypes.X_DTYPES_GPU, _dtypes.X_DTYPES_CPU, _dtypes.MASK_DTYPES
INT_DTYPES, KLEN_KERNEL_DTYPES, ITEMSIZE = _dtypes.INT_DTYPES, _dtypes.KLEN_KERNEL_DTYPES, _dtypes.ITEMSIZE
STREAM_MAX = 2**64 - 1  # a stream handle is a pointer


def check_scale(scale: object) -> float:
    if type(scale) is float and -FLT_MAX <= scale <= FLT_MAX:  # the common case, quickly (NaN fails)
        return scale
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise arg_type_error("scale", "a real number", f"{type(scale).__name__} {scale!r}")
    if isinstance(scale, numbers.Integral) and abs(int(scale)) > FLT_MAX:  # 10**400 would overflow float()
        s = math.inf
    else:
        try:
            s = float(scale)
        except (OverflowError, ValueError, TypeError):  # huge Fractions, exotic Real types
            s = math.inf
    if not math.isfinite(s) or abs(s) > FLT_MAX:
        raise arg_value_error("scale", "a finite float within float32 range", _short_repr(scale))
    return s


def check_causal(causal: object) -> bool:
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    raise arg_type_error("causal", "a bool", f"{type(causal).__name__} {_short_repr(causal)}")


def check_flag(name: str, value: object) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise arg_type_error(name, "a bool", f"{type(value).__name__} {_short_repr(value)}")


def check_x(shape: tuple[int, ...], dtype: str, allowed: tuple[str, ...], where: str, name: str = "x") -> None:
    if dtype not in allowed:
        raise arg_type_error(name, f"of dtype {', '.join(allowed)} {where}", f"dtype {dtype}")
    if len(shape) < 1:
        raise arg_value_error(name, "at least 1-D (softmax runs over the last axis)", f"shape {tuple(shape)}")


def check_shape_arg(name: str, shape: object) -> tuple[int, ...]:
    """A shape given as a value (explain's x_shape): a sequence of non-negative integers."""
    if type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape):
        return shape
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise arg_type_error(name, "a sequence of non-negative integers", f"{type(shape).__name__} {shape!r}")
    dims = list(shape)
    for n in dims:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise arg_type_error(
                name, "a sequence of non-negative integers", f"{_short_repr(dims)} (a {type(n).__name__} dim)"
            )
        if int(n) < 0:
            raise arg_value_error(name, "a sequence of non-negative integers", f"{_short_repr(dims)}")
    return tuple(int(n) for n in dims)


def check_mask_dtype(dtype: str) -> None:
    if dtype not in MASK_DTYPES:
        raise arg_type_error(
            "mask", "bool, an integer dtype (nonzero hides) or a float dtype (added)", f"dtype {dtype}"
        )


def check_broadcast(mask_shape: tuple[int, ...], x_shape: tuple[int, ...]) -> None:
    ms, xs = tuple(mask_shape), tuple(x_shape)
    ok = all(n == 1 for n in ms[: max(0, len(ms) - len(xs))])
    for m, x in zip(reversed(ms), reversed(xs)):
        ok = ok and (m == x or m == 1)
    if not ok:
        raise arg_value_error("mask", f"broadcastable to x.shape {xs}", f"shape {ms}")


def check_causal_shape(causal: bool, x_shape: tuple[int, ...]) -> None:
    if causal and len(x_shape) < 2:
        raise arg_value_error("x", "at least 2-D [..., Sq, Sk] when causal=True", f"shape {tuple(x_shape)}")


def check_key_lengths(
    shape: tuple[int, ...], dtype: str, x_shape: tuple[int, ...], allowed: tuple[str, ...] = INT_DTYPES
) -> None:
    if dtype not in allowed:
        raise arg_type_error("key_lengths", f"of an integer dtype ({', '.join(allowed)})", f"dtype {dtype}")
    if len(x_shape) < 2:
        raise arg_value_error("x", "at least 2-D [B, ..., Sk] when key_lengths is given", f"shape {tuple(x_shape)}")
    if tuple(shape) != (x_shape[0],):
        raise arg_value_error(
            "key_lengths", f"of shape [B] = ({x_shape[0]},) (B = x.shape[0])", f"shape {tuple(shape)}"
        )


def lengths_array(values: object) -> np.ndarray:
    """key_lengths given as a list or tuple: a NumPy integer array (int64, or uint64 when a
    value needs it).  Anything but integers of at most 64 bits is refused by name."""
    if not isinstance(values, (list, tuple)):
        raise arg_type_error("key_lengths", "a list or tuple of integers", type(values).__name__)
    if all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in values):
        ints = [int(v) for v in values]
        if all(-(2**63) <= v < 2**63 for v in ints):
            return np.array(ints, dtype=np.int64).reshape(len(ints))
        if all(0 <= v < 2**64 for v in ints):
            return np.array(ints, dtype=np.uint64).reshape(len(ints))
        raise arg_value_error("key_lengths", "integers that fit in 64 bits (int64 or uint64)", _short_repr(values))
    try:
        a = np.asarray(values)
    except (TypeError, ValueError, OverflowError):  # ragged nesting and the like
        a = np.empty(0, dtype=object)
    if a.dtype.name in INT_DTYPES:  # nested sequences of ints: the shape check names them
        return a
    raise arg_type_error(
        "key_lengths", f"of an integer dtype ({', '.join(INT_DTYPES)})", f"dtype {a.dtype.name} ({_short_repr(values)})"
    )


def check_out(shape: tuple[int, ...], dtype: str, x_shape: tuple[int, ...], x_dtype: str, like: str = "x") -> None:
    if dtype != x_dtype:
        raise arg_type_error("out", f"of {like}'s dtype {x_dtype}", f"dtype {dtype}")
    if tuple(shape) != tuple(x_shape):
        raise arg_value_error("out", f"of {like}'s shape {tuple(x_shape)}", f"shape {tuple(shape)}")


def check_out_strides(shape: tuple[int, ...], strides: tuple[int, ...], name: str = "out") -> None:
    """`out` must not write one address twice: no zero strides along dims of size > 1, and
    no interleaving that could map two elements to one address.  (The test is the usual
    sufficient one: sorted by stride, each stride passes the reach of the smaller ones.)"""
    reach = 1  # elements spanned by the dims seen so far
    for n, s in sorted(((n, abs(s)) for n, s in zip(shape, strides) if n > 1), key=lambda t: t[1]):
        if s < reach:
            raise arg_value_error(
                name,
                "writable without overlap (no broadcast/expanded dims, no two elements at one address)",
                f"strides {tuple(strides)} for shape {tuple(shape)}",
            )
        reach += (n - 1) * s


# ----------------------------------------------------------------------------------
# One call's checks, the same for every door that describes its arrays as Operands
# (NumPy, CUDA arrays, raw pointers): each door reads its arrays (refusing objects of the
# wrong kind by name) and hands their metadata here.  Device checks stay with the doors.


_checked: set[tuple[object, ...]] = set()  # metadata that passed the checks below


def check_forward_call(
    x: Operand,
    mask: Operand | None,
    klen: Operand | None,
    out: Operand | None,
    scale: object,
    causal: object,
    allowed: tuple[str, ...] = X_DTYPES_GPU,
    where: str = "on the GPU",
    out_readonly: bool = False,
) -> tuple[float, bool]:
    """Every argument check of a forward call; returns (scale, causal) as float and bool.

    The checks on metadata alone (dtypes, shapes, strides) run once per combination seen;
    the overlap of out with the inputs, which depends on pointers, on every call."""
    s = check_scale(scale)
    c = causal if causal is True or causal is False else check_causal(causal)
    key = (
        "f",
        x.dtype,
        x.shape,
        None if mask is None else (mask.dtype, mask.shape),
        None if klen is None else (klen.dtype, klen.shape),
        None if out is None else (out.dtype, out.shape, out.strides, out_readonly),
        c,
        allowed,
    )
    if key not in _checked:
        check_x(x.shape, x.dtype, allowed, where)
        if mask is not None:
            check_mask_dtype(mask.dtype)
            check_broadcast(mask.shape, x.shape)
        check_causal_shape(c, x.shape)
        if klen is not None:
            check_key_lengths(klen.shape, klen.dtype, x.shape)
        if out is not None:
            if out_readonly:
                raise arg_value_error("out", "a writable array", "a read-only array")
            check_out(out.shape, out.dtype, x.shape, x.dtype)
            check_out_strides(out.shape, out.strides)
        _remember_checked(key)
    if out is not None and _may_overlap(out, (x, mask, klen)):
        check_no_overlap(
            operand_region("out", out),
            (operand_region("x", x), operand_region("mask", mask), operand_region("key_lengths", klen)),
            in_place=("x",),
        )
    return s, c


def check_backward_call(
    dy: Operand,
    y: Operand,
    out: Operand | None,
    scale: object,
    allowed: tuple[str, ...] = X_DTYPES_GPU,
    where: str = "on the GPU",
    out_readonly: bool = False,
) -> float:
    """Every argument check of a backward call; returns scale as a float."""
    s = check_scale(scale)
    key = (
        "b",
        y.dtype,
        y.shape,
        dy.dtype,
        dy.shape,
        None if out is None else (out.dtype, out.shape, out.strides, out_readonly),
        allowed,
    )
    if key not in _checked:
        check_x(y.shape, y.dtype, allowed, where, "y")
        if dy.shape != y.shape or dy.dtype != y.dtype:
            raise arg_value_error(
                "dy", f"of y's shape {y.shape} and dtype {y.dtype}", f"shape {dy.shape}, dtype {dy.dtype}"
            )
        if out is not None:
            if out_readonly:
                raise arg_value_error("out", "a writable array", "a read-only array")
            check_out(out.shape, out.dtype, y.shape, y.dtype, "y")
            check_out_strides(out.shape, out.strides)
        _remember_checked(key)
    if out is not None and _may_overlap(out, (dy, y)):
        check_no_overlap(
            operand_region("out", out), (operand_region("dy", dy), operand_region("y", y)), in_place=("dy", "y")
        )
    return s


def _remember_checked(key: tuple[object, ...]) -> None:
    if len(_checked) > 4096:
        _checked.clear()
    _checked.add(key)


_forms: dict[tuple[tuple[int, ...], tuple[int, ...], int], tuple[int, int, tuple[int, ...]] | None] = {}


def _may_overlap(out: Operand, reads: tuple[Operand | None, ...]) -> bool:
    """The byte ranges of out and some input meet (then `check_no_overlap` decides)."""
    f = _form(out)
    if f is None:
        return False
    lo, hi = out.ptr + f[0], out.ptr + f[1]
    for r in reads:
        if r is not None:
            g = _form(r)
            if g is not None and r.ptr + g[0] < hi and lo < r.ptr + g[1]:
                return True
    return False


def _form(op: Operand) -> tuple[int, int, tuple[int, ...]] | None:
    """(first byte, last byte + 1, normalised byte strides) of op's layout from its
    pointer; None when it has no elements.  Cached by layout."""
    item = ITEMSIZE.get(op.dtype, 1)
    fkey = (op.shape, op.strides, item)
    form = _forms.get(fkey)
    if form is None and fkey not in _forms:
        r = region("", 0, op.shape, op.strides, item)
        form = None if r is None else (r.lo, r.hi, r.layout[2])
        if len(_forms) > 4096:
            _forms.clear()
        _forms[fkey] = form
    return form


def operand_region(name: str, op: Operand | None) -> Region | None:
    """`region` of an Operand (strides in elements), its layout's extent cached."""
    if op is None:
        return None
    form = _form(op)
    if form is None:
        return None
    p = op.ptr
    return Region(name, p + form[0], p + form[1], (p, op.shape, form[2], ITEMSIZE.get(op.dtype, 1)))


# ----------------------------------------------------------------------------------
# Memory overlap of the written array with the read ones.


class Region(NamedTuple):
    """The memory an array touches: [lo, hi) in bytes, None when it has no elements, with
    its layout (to recognise `out=x` exactly)."""

    name: str
    lo: int
    hi: int
    layout: tuple[int, tuple[int, ...], tuple[int, ...], int]  # ptr, shape, byte strides, itemsize


def extent(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, int] | None:
    """(first, last + 1) byte offsets from the data pointer that an array of this shape and
    byte strides touches; None when it has no elements."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n == 0:
            return None
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + itemsize


def region(name: str, ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> Region | None:
    """Region of an array given by pointer, shape and strides in elements."""
    bstrides = tuple(int(s) * itemsize for s in strides)
    return region_bytes(name, ptr, shape, bstrides, itemsize)


def region_bytes(name: str, ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> Region | None:
    """Region of an array given by pointer, shape and strides in bytes (NumPy's)."""
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    e = extent(shape, strides, itemsize)
    if e is None:
        return None
    # Strides along dims of size 1 never move the pointer: they play no part in identity.
    norm = tuple(0 if n == 1 else s for n, s in zip(shape, strides))
    return Region(name, ptr + e[0], ptr + e[1], (ptr, shape, norm, itemsize))


def check_no_overlap(out: Region | None, reads: Iterable[Region | None], in_place: tuple[str, ...] = ()) -> None:
    """Raise when the memory `out` writes meets memory an input is read from.

    The one exception is `out` being exactly one of the `in_place` inputs (same pointer,
    shape, strides and item size): every element is then read before it is overwritten,
    by the thread that writes it.  Any other overlap lets one row's writes reach another
    row's reads, so it is refused on every path, the CPU ones included.
    """
    if out is None:
        return
    for r in reads:
        if r is None or r.hi <= out.lo or out.hi <= r.lo:
            continue
        if r.name in in_place and r.layout == out.layout:
            continue
        exact = f" (out={r.name} exactly is allowed)" if r.name in in_place else ""
        raise arg_value_error(
            "out",
            f"memory that does not overlap {r.name}'s{exact}",
            f"out at bytes [{out.lo:#x}, {out.hi:#x}) and {r.name} at [{r.lo:#x}, {r.hi:#x})",
        )


# ----------------------------------------------------------------------------------
# Streams.


def stream_handle(stream: object) -> int:
    """The raw handle of a stream given as an int, a CUstream, a torch/CuPy/Numba stream
    object or anything with ``__cuda_stream__``."""
    if type(stream) is int and 0 <= stream <= STREAM_MAX:  # the common case, quickly
        return stream
    if isinstance(stream, (bool, np.bool_)) or stream is None:
        raise arg_type_error("stream", "a CUstream, an int handle or a stream object", repr(stream))
    if isinstance(stream, (int, np.integer)):
        return _handle_value(int(stream), repr(stream))
    cs = getattr(stream, "__cuda_stream__", None)
    if cs is not None:
        try:
            v = cs() if callable(cs) else cs
        except Exception as e:  # a foreign object's protocol method failing
            raise arg_value_error(
                "stream", "an object whose __cuda_stream__ gives (version, handle)", f"{type(e).__name__}: {e}"
            ) from e
        h = v[1] if isinstance(v, tuple) and len(v) == 2 else v
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
            raise arg_type_error(
                "stream", "an object whose __cuda_stream__ gives (version, handle)", f"__cuda_stream__ = {v!r}"
            )
        return _handle_value(int(h), f"__cuda_stream__ handle {int(h)}")
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        v = getattr(stream, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return _handle_value(v, f"{type(stream).__name__}.{attr} = {v}")
    h = getattr(stream, "handle", None)  # numba.cuda stream: a ctypes c_void_p
    if h is not None and hasattr(h, "value"):
        return _handle_value(int(h.value or 0), f"{type(stream).__name__}.handle = {h.value}")
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
        f"{type(stream).__name__} {_short_repr(stream)}",
    )


def _handle_value(h: int, what: str) -> int:
    if not 0 <= h <= STREAM_MAX:
        raise arg_value_error("stream", "a stream handle in [0, 2**64)", what)
    return h


def check_stream(stream: object) -> None:
    """Validate `stream` where it has no use (the CPU paths): the same errors as on the GPU."""
    if stream is not None:
        stream_handle(stream)


def _short_repr(v: Any, limit: int = 80) -> str:
    try:
        r = repr(v)
    except Exception:  # a foreign object's repr failing must not hide the real error
        r = f"<{type(v).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."
