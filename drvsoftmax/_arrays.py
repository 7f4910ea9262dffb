"""The door of CuPy, Numba and any DLPack or CUDA-array-interface producer.

Reads every array through `_intake` (DLPack first, then ``__cuda_array_interface__``),
runs the shared argument checks, allocates the result with x's own library (CuPy: a
cupy.ndarray; Numba: a device array; any other producer: ``out=`` is required), orders
the launch stream after the producers' streams without a host sync, and launches through
`raw`.  The launch stream is ``stream`` when given; else CuPy's current stream for CuPy
arrays, the stream of x's ``__cuda_array_interface__`` (v3) if it names one, else the
legacy default stream.  No host synchronisation (but for key_lengths of a dtype other
than int32/int64 on Numba arrays, converted on the host).  No autograd.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _args, _core, _driver, _intake, raw
from ._core import Operand
from ._errors import arg_type_error, arg_value_error
from ._intake import Item


def _read(a: Any, name: str, stream: int, cur: int | None, like: str, what: str) -> Item:
    if not _intake.kind(a):
        raise arg_type_error(name, f"a CUDA array like {like}{what}", type(a).__name__)
    return _intake.read(a, name, stream, cur)


def _read_first(a: Any, name: str, stream: object) -> tuple[Item, int, int | None]:
    """Read x (y backward) and choose the launch stream: `stream` when given, else CuPy's
    current stream (CuPy), the interface's v3 stream (CUDA array interface), else the
    legacy default stream.  Returns (item, launch stream, CuPy's current stream or None)."""
    k = _intake.kind(a)
    cur = _intake.cupy_current_stream() if k == "cupy" else None
    if stream is not None:
        s = _args.stream_handle(stream)
    elif cur is not None:
        s = cur
    else:
        s = 0
    it = _intake.read(a, name, s, cur)
    if stream is None and k == "cai" and it.producer is not None:
        s = it.producer
    return it, s, cur


def _same_device(name: str, it: Item, dev: int, like: str = "x") -> None:
    if it.device != dev:
        raise arg_value_error(name, f"on {like}'s device {dev}", f"device {it.device}")


class _Fast:
    """A CuPy layout whose checks passed: the call's library, normalised scale and causal,
    device, and prepared launches by x's 16-byte alignment (y is a new allocation)."""

    __slots__ = ("cp", "dev", "preps")

    def __init__(self, cp: Any, dev: Any) -> None:
        self.cp, self.dev = cp, dev
        self.preps: dict[bool, Any] = {}


_fast: dict[tuple[Any, ...], _Fast] = {}


def _fast_key(x: Any, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Any:
    """The fast path's key of a plain CuPy call (x alone, y allocated, CuPy's current stream),
    or None for any other call."""
    if (
        type(x) is not _intake._cupy_nd  # (cupy.ndarray once CuPy is imported and an array was seen)
        or mask is not None
        or key_lengths is not None
        or out is not None
        or stream is not None
        or type(scale) not in (float, int)
        or type(causal) is not bool
    ):
        return None
    return (x.shape, x.strides, x.dtype, scale, causal, x.data.device_id)


def forward(x: Any, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Any:
    # A repeated plain CuPy call of a layout already checked: allocate y and launch.  The
    # checks depend on nothing else (shape, strides, dtype, scale, causal, device), and a
    # new y overlaps nothing; CuPy keeps its device's primary context current.
    key = _fast_key(x, mask, scale, causal, key_lengths, out, stream)
    if key is not None:
        ent = _fast.get(key)
        if ent is not None:
            cp = ent.cp
            xp = x.data.ptr
            prep = ent.preps.get(not (xp & 15))
            if prep is not None and cp.cuda.runtime.getDevice() == key[5]:
                y = cp.ndarray(key[0], key[2])
                _core.launch(prep, xp, y.data.ptr, 0, 0, cp.cuda.get_current_stream().ptr, True)
                return y
    r = _forward(x, mask, scale, causal, key_lengths, out, stream)
    if key is not None and 0 not in key[0]:
        _remember_fast(key, x, r, scale, causal)
    return r


def _remember_fast(key: tuple[Any, ...], x: Any, y: Any, scale: Any, causal: Any) -> None:
    """After a plain CuPy call succeeded: its layout's fast-path entry."""
    cp = sys.modules["cupy"]
    if len(_fast) > 1024:
        _fast.clear()
    ent = _fast.get(key)
    dev_id = key[5]
    if ent is None:
        ent = _fast[key] = _Fast(cp, _driver.device(dev_id))
    sc, cz = _args.check_forward_call(_read_cupy_op(x), None, None, None, scale, causal)
    yo = _read_cupy_op(y)
    ent.preps[not (x.data.ptr & 15)] = _core.prepared_forward(ent.dev, _read_cupy_op(x), yo, None, None, cz, sc)


def _read_cupy_op(a: Any) -> Operand:
    return _intake.read(a, "x", 0, 0).op


def _forward(x: Any, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Any:
    items: list[Item] = []
    try:
        xi, s, cur = _read_first(x, "x", stream)
        items.append(xi)
        mi = ki = oi = None
        if mask is not None:
            mi = _read(mask, "mask", s, cur, "x", " (or None)")
            items.append(mi)
        if key_lengths is not None:
            if not _intake.kind(key_lengths):
                raise arg_type_error(
                    "key_lengths", "a CUDA array of integers of shape [B] (or None)", type(key_lengths).__name__
                )
            ki = _intake.read(key_lengths, "key_lengths", s, cur)
            items.append(ki)
        if out is not None:
            oi = _read(out, "out", s, cur, "x", " (or None)")
            items.append(oi)
        sc, cz = _args.check_forward_call(
            xi.op,
            None if mi is None else mi.op,
            None if ki is None else ki.op,
            None if oi is None else oi.op,
            scale,
            causal,
            out_readonly=oi is not None and oi.readonly,
        )
        dev = xi.device
        for name, it in (("mask", mi), ("key_lengths", ki), ("out", oi)):
            if it is not None:
                _same_device(name, it, dev)
        if oi is None:
            out, yo = _empty_like(x, xi)
        else:
            yo = oi.op
        if 0 in xi.op.shape:
            return out
        _intake.wait_all(items, s)
        keep, ko = None, None
        if ki is not None:
            keep, ko = _lengths_for_kernel(key_lengths, ki, s, dev)
        raw.run_forward(dev, xi.op, yo, None if mi is None else mi.op, ko, cz, sc, s)
        del keep  # (converted key_lengths: freed after the launch, in stream order)
        return out
    finally:
        if items:
            _intake.release_all(items)


def backward(dy: Any, y: Any, scale: Any, out: Any, stream: object) -> Any:
    items: list[Item] = []
    try:
        yi, s, cur = _read_first(y, "y", stream)
        items.append(yi)
        if not _intake.kind(dy):
            raise arg_type_error("dy", "a CUDA array like y", type(dy).__name__)
        di = _intake.read(dy, "dy", s, cur)
        items.append(di)
        oi = None
        if out is not None:
            oi = _read(out, "out", s, cur, "y", " (or None)")
            items.append(oi)
        sc = _args.check_backward_call(
            di.op, yi.op, None if oi is None else oi.op, scale, out_readonly=oi is not None and oi.readonly
        )
        dev = yi.device
        _same_device("dy", di, dev, "y")
        if oi is None:
            out, xo = _empty_like(y, yi)
        else:
            _same_device("out", oi, dev, "y")
            xo = oi.op
        if 0 in yi.op.shape:
            return out
        _intake.wait_all(items, s)
        raw.run_backward(dev, di.op, yi.op, xo, sc, s)
        return out
    finally:
        _intake.release_all(items)


# ----------------------------------------------------------------------------------
# Results and conversions with the array's own library.


def _empty_like(a: Any, it: Item) -> tuple[Any, Operand]:
    """A new contiguous array of a's library, shape and dtype on a's device, and its Operand."""
    op = it.op
    if it.lib == "cupy" and _intake.kind(a) == "cupy":
        cp = sys.modules["cupy"]
        if cp.cuda.runtime.getDevice() == it.device:
            r = cp.empty(op.shape, dtype=a.dtype)
        else:
            with cp.cuda.Device(it.device):  # a's device, whichever is current
                r = cp.empty(op.shape, dtype=a.dtype)
        return r, Operand(r.data.ptr, op.dtype, op.shape, _intake.contiguous(op.shape))
    if it.lib == "numba" and hasattr(a, "__cuda_array_interface__"):
        import numpy as np
        from numba import cuda

        with cuda.gpus[it.device]:
            r = cuda.device_array(op.shape, dtype=np.dtype(op.dtype))
        ptr = int(r.__cuda_array_interface__["data"][0] or 0)
        return r, Operand(ptr, op.dtype, op.shape, _intake.contiguous(op.shape))
    raise arg_type_error(
        "out",
        "given for arrays of this library (drvsoftmax allocates only CuPy and Numba arrays)",
        f"out=None for a {type(a).__module__}.{type(a).__name__}",
    )


def _lengths_for_kernel(a: Any, it: Item, stream: int, dev: int) -> tuple[Any, Operand]:
    """key_lengths the kernels can read (int32 or int64), with the same meaning: other
    integer dtypes become int64 on `stream` (CuPy), or through the host (Numba)."""
    ko = it.op
    if ko.dtype in _args.KLEN_KERNEL_DTYPES:
        return None, ko
    if it.lib == "cupy" and _intake.kind(a) == "cupy":
        import cupy

        with cupy.cuda.Device(dev), cupy.cuda.ExternalStream(stream):
            v = a
            if ko.dtype == "uint64":  # beyond int64 means beyond any Sk
                v = cupy.minimum(v, 2**63 - 1)
            conv = cupy.ascontiguousarray(v.astype(cupy.int64))
        return conv, Operand(int(conv.data.ptr), "int64", ko.shape, (1,))
    if it.lib == "numba" and hasattr(a, "copy_to_host"):
        import numpy as np
        from numba import cuda

        s = cuda.external_stream(stream) if stream else cuda.default_stream()
        host = a.copy_to_host(stream=s)
        s.synchronize()
        if host.dtype == np.uint64:  # beyond int64 means beyond any Sk
            host = np.minimum(host, np.uint64(2**63 - 1))
        conv = cuda.to_device(host.astype(np.int64), stream=s)
        return conv, Operand(int(conv.__cuda_array_interface__["data"][0]), "int64", ko.shape, (1,))
    raise arg_type_error(
        "key_lengths",
        "int32 or int64 for arrays of this library (other integer dtypes are converted for CuPy and Numba only)",
        f"dtype {ko.dtype} ({type(a).__module__}.{type(a).__name__})",
    )


__all__ = ["forward", "backward"]
