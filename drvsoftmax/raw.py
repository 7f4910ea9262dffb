"""Raw device pointers: the softmax for programs that hold CUDA memory but no array library.

    import drvsoftmax.raw as raw
    raw.forward(x_ptr, y_ptr, (B, H, Sq, Sk), "bfloat16", scale=0.125,
                mask=m_ptr, mask_dtype="bool", mask_shape=(B, 1, Sq, Sk),
                causal=True, key_lengths=kl_ptr, key_lengths_dtype="int32",
                stream=stream_handle, device=0)
    raw.backward(dy_ptr, y_ptr, dx_ptr, (B, H, Sq, Sk), "bfloat16", scale=0.125, stream=stream_handle)

Pointers are integers (device addresses); shapes are sequences of integers; strides are
in elements (not bytes), one per dim, None for a contiguous row-major layout; dtypes are
names: "float16", "bfloat16" or "float32" for x / y / dy / dx, any of "bool", "int8" ..
"uint64", "float16", "bfloat16", "float32", "float64" for the mask, "int32" or "int64" for
key_lengths.  ``stream`` is a CUstream handle as an integer (0: the legacy default stream
of the device's primary context) or any object the other doors take as a stream.

The call only enqueues one kernel on ``stream`` and returns: it allocates nothing, copies
nothing, synchronises nothing and imports no array framework.  The memory must stay valid
until the kernel has run, and its producers must have been ordered before ``stream`` by
the caller.  Every argument is checked first; a bad one raises ArgumentTypeError or
ArgumentValueError naming it.  Launches of a layout seen before reuse their prepared
parameters (the core's cache), so a repeated call costs one kernel launch and the checks.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from . import _args, _core, _driver, _dtypes
from ._core import Operand
from ._errors import arg_type_error, arg_value_error
from ._intake import contiguous

_PTR_MAX = 2**64 - 1


def forward(
    x: int,
    y: int,
    shape: Sequence[int],
    dtype: str,
    *,
    x_strides: Sequence[int] | None = None,
    y_strides: Sequence[int] | None = None,
    scale: float = 1.0,
    mask: int | None = None,
    mask_dtype: str | None = None,
    mask_shape: Sequence[int] | None = None,
    mask_strides: Sequence[int] | None = None,
    causal: bool = False,
    key_lengths: int | None = None,
    key_lengths_dtype: str = "int32",
    key_lengths_stride: int = 1,
    stream: object = 0,
    device: int = 0,
) -> None:
    """Enqueue ``y = softmax(x * scale + mask)`` over the last axis of ``shape`` on ``stream``.

    Args:
        x, y: device pointers of x and y (``y == x`` with equal strides runs in place; any
            other overlap of y with x, the mask or key_lengths is refused).
        shape: x's shape [..., Sk] (canonically [B, H, Sq, Sk]); y has the same shape.
        dtype: "float16", "bfloat16" or "float32", of x and y.
        x_strides, y_strides: element strides of x and y, or None for row-major contiguous.
        scale: finite real multiplier of x.
        mask: device pointer of the mask, or None.  Then ``mask_dtype`` names its dtype
            (bool/integers: nonzero hides; floats: added, -inf hides) and either
            ``mask_shape`` (broadcastable to ``shape``; with ``mask_strides`` in elements,
            or None for contiguous) or ``mask_strides`` alone: one stride per dim of
            ``shape``, 0 along the dims the mask is broadcast over.
        causal: hide key j from query i when j > i + (Sk - Sq).
        key_lengths: device pointer of B = shape[0] integers (keys j >= key_lengths[b] are
            hidden; values clamp to [0, Sk]), or None.  ``key_lengths_dtype`` is "int32"
            or "int64" (this layer converts nothing), ``key_lengths_stride`` their
            element stride.
        stream: the CUstream handle as an int (0: legacy default stream).
        device: CUDA device ordinal of every pointer.
    """
    shp = _args.check_shape_arg("shape", shape)
    dt = _dtype_name("dtype", dtype)
    nd = len(shp)
    xo = Operand(_pointer("x", x), dt, shp, _strides("x_strides", x_strides, shp))
    yo = Operand(_pointer("y", y), dt, shp, _strides("y_strides", y_strides, shp))
    mo = None
    if mask is not None:
        mp = _pointer("mask", mask)
        if mask_dtype is None:
            raise arg_type_error("mask_dtype", "a dtype name when mask is given", "None")
        mdt = _dtype_name("mask_dtype", mask_dtype)
        if mask_shape is not None:
            ms = _args.check_shape_arg("mask_shape", mask_shape)
            mo = Operand(mp, mdt, ms, _strides("mask_strides", mask_strides, ms))
        elif mask_strides is not None:
            mst = _strides("mask_strides", mask_strides, shp)
            mo = Operand(mp, mdt, tuple(1 if s == 0 else n for n, s in zip(shp, mst)), mst)
        else:
            raise arg_value_error("mask_shape", "given (or mask_strides) when mask is given", "neither")
    elif mask_dtype is not None or mask_shape is not None or mask_strides is not None:
        raise arg_value_error("mask", "a pointer when mask_dtype, mask_shape or mask_strides is given", "None")
    ko = None
    if key_lengths is not None:
        kdt = _dtype_name("key_lengths_dtype", key_lengths_dtype)
        if kdt not in _dtypes.KLEN_KERNEL_DTYPES:
            raise arg_type_error("key_lengths_dtype", "int32 or int64 (raw pointers are not converted)", kdt)
        kst = _int("key_lengths_stride", key_lengths_stride)
        ko = Operand(_pointer("key_lengths", key_lengths), kdt, (shp[0] if nd else 0,), (kst,))
    s = _args.stream_handle(stream)
    d = _int("device", device)
    sc, cz = _args.check_forward_call(xo, mo, ko, yo, scale, causal)
    if 0 in shp:
        return
    _need_data(xo, yo, mo, ko)
    run_forward(_ordinal(d), xo, yo, mo, ko, cz, sc, s)


def backward(
    dy: int,
    y: int,
    dx: int,
    shape: Sequence[int],
    dtype: str,
    *,
    dy_strides: Sequence[int] | None = None,
    y_strides: Sequence[int] | None = None,
    dx_strides: Sequence[int] | None = None,
    scale: float = 1.0,
    stream: object = 0,
    device: int = 0,
) -> None:
    """Enqueue ``dx = scale * y * (dy - sum(dy * y, -1))`` on ``stream``.

    dy, y and dx are device pointers of ``shape`` and ``dtype`` ("float16", "bfloat16" or
    "float32") with element strides (None: contiguous); dx may be exactly dy or y (in
    place), any other overlap is refused.  ``stream`` and ``device`` as in `forward`.
    """
    shp = _args.check_shape_arg("shape", shape)
    dt = _dtype_name("dtype", dtype)
    do = Operand(_pointer("dy", dy), dt, shp, _strides("dy_strides", dy_strides, shp))
    yo = Operand(_pointer("y", y), dt, shp, _strides("y_strides", y_strides, shp))
    xo = Operand(_pointer("dx", dx), dt, shp, _strides("dx_strides", dx_strides, shp))
    s = _args.stream_handle(stream)
    d = _int("device", device)
    sc = _args.check_backward_call(do, yo, xo, scale)
    if 0 in shp:
        return
    _need_data(do, yo, xo)
    run_backward(_ordinal(d), do, yo, xo, sc, s)


# ----------------------------------------------------------------------------------
# The launches every door ends in (arguments already checked).


def run_forward(
    ordinal: int,
    x: Operand,
    y: Operand,
    mask: Operand | None,
    klen: Operand | None,
    causal: bool,
    scale: float,
    stream: int,
) -> None:
    _core.forward(_driver.device(ordinal), x, y, mask, klen, causal, scale, stream)


def run_backward(ordinal: int, dy: Operand, y: Operand, dx: Operand, scale: float, stream: int) -> None:
    _core.backward(_driver.device(ordinal), dy, y, dx, scale, stream)


# ----------------------------------------------------------------------------------
# Argument checks of this layer.


def _int(name: str, v: object) -> int:
    if type(v) is int:
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise arg_type_error(name, "an integer", f"{type(v).__name__} {v!r:.60}")
    return int(v)


def _pointer(name: str, v: object) -> int:
    if type(v) is int and 0 <= v <= _PTR_MAX:
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise arg_type_error(name, "a device pointer (an int)", f"{type(v).__name__} {v!r:.60}")
    p = int(v)
    if not 0 <= p <= _PTR_MAX:
        raise arg_value_error(name, "a device pointer in [0, 2**64)", str(p))
    return p


def _dtype_name(name: str, v: object) -> str:
    if not isinstance(v, str) or v not in _dtypes.TABLE:
        raise arg_type_error(name, f"a dtype name ({', '.join(_dtypes.TABLE)})", f"{v!r:.60}")
    return v


def _strides(name: str, v: Sequence[int] | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    if v is None:
        return contiguous(shape)
    if type(v) is tuple and len(v) == len(shape) and all(type(s) is int for s in v):
        return v
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise arg_type_error(name, "a sequence of integers (element strides) or None", f"{type(v).__name__}")
    st = tuple(_int(name, s) for s in v)
    if len(st) != len(shape):
        raise arg_value_error(name, f"one stride per dim of shape {shape}", f"{len(st)} strides {st}")
    return st


_known_ordinals: set[int] = set()


def _ordinal(d: int) -> int:
    if d in _known_ordinals:
        return d
    if d < 0:
        raise arg_value_error("device", "a CUDA device ordinal (>= 0)", str(d))
    n = _driver.device_count()
    if d >= n:
        raise arg_value_error("device", f"a CUDA device ordinal below {n} (the devices present)", str(d))
    _known_ordinals.add(d)
    return d


def _need_data(*ops: Operand | None) -> None:
    names = ("x", "y", "mask", "key_lengths") if len(ops) == 4 else ("dy", "y", "dx")
    for name, op in zip(names, ops):
        if op is not None and op.ptr == 0:
            raise arg_value_error(name, "a non-null device pointer (the array has elements)", "0")


__all__ = ["forward", "backward"]
