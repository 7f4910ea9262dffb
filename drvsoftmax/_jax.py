"""JAX front door: ``jax.Array`` in, ``jax.Array`` out, outside ``jax.jit``.

On a GPU array, one call:

1. finds the stream JAX takes external work on for x's device
   (``Device.get_stream_for_external_ready_events``), or the given ``stream``;
2. exports x (and the mask, key_lengths) through DLPack with that stream: the stream waits
   for whatever still computes them (an event, no host sync), and the exported reference
   keeps their memory alive until the result is released;
3. allocates the output with ``cuMemAllocAsync`` on that stream and launches the kernel there;
4. hands the output to JAX as a DLPack view with that stream, so JAX orders every use of it
   after the kernel; when JAX releases it, ``cuMemFreeAsync`` on the same stream frees it.

x is read in place (no copy).  JAX arrays are immutable: ``out=`` is refused.  Inside
``jax.jit`` (or any transformation) x is a tracer and the call is refused with an error
that says what is supported.  CPU arrays take the float64 reference path and come back as
JAX arrays on the same device.  The dtype is JAX's own (bfloat16 included).
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _args, _core, _driver, _intake, _reference
from ._errors import DrvSoftmaxError, arg_type_error, arg_value_error, check

_SUPPORTED = (
    "a concrete jax.Array on one device, called outside jax.jit, vmap, grad and other JAX transformations "
    "(drvsoftmax launches its own CUDA kernel and returns a new array; it cannot be traced into a JAX "
    "program: call it between jitted functions, or use jax.nn.softmax inside them)"
)
_KDLCUDA = 2
_DL_DTYPE = {"float16": (2, 16), "bfloat16": (4, 16), "float32": (2, 32)}  # (DLDataTypeCode, bits)


def is_jax(a: object) -> bool:
    return type(a).__module__.startswith("jax")


_tracer: type | None = None  # jax.core.Tracer, once looked up


def _tracer_type() -> type:
    global _tracer
    if _tracer is None:
        try:
            from jax.core import Tracer
        except ImportError:  # (where jax.core no longer re-exports it)
            from jax._src.core import Tracer
        _tracer = Tracer
    return _tracer


def _refuse_traced(name: str, a: object) -> None:
    """A tracer (inside jax.jit and other transformations) is refused, naming what works."""
    if isinstance(a, _tracer or _tracer_type()):
        raise arg_type_error(name, _SUPPORTED, f"a JAX tracer ({type(a).__name__}: inside jax.jit or a transformation)")


_names: dict[Any, str] = {}  # dtype -> its NumPy name (dtype.name is slow to compute)


def _dtname(a: Any) -> str:
    """NumPy's name of a's dtype, also for ml_dtypes' bfloat16: never guessed from the item size."""
    dt = a.dtype
    n = _names.get(dt)
    if n is None:
        n = _names[dt] = str(dt.name)
    return n


def _device_of(name: str, a: Any) -> Any:
    devs = a.devices()
    if len(devs) != 1:
        raise arg_value_error(name, "an array on one device (not sharded)", f"an array on {len(devs)} devices")
    (d,) = devs
    return d


# ----------------------------------------------------------------------------------
# Results handed to JAX: memory from cuMemAllocAsync in a DLPack capsule of our own.

# struct DLManagedTensor { DLTensor{data, device{type, id}, ndim, dtype{code, bits, lanes},
#                          shape, strides, byte_offset}, manager_ctx, deleter }
# followed, in the same buffer, by int64 shape[ndim] and int64 strides[ndim] (row-major, elements)
_DLM = struct.Struct("=Q ii i BBH Q Q Q Q Q")
_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = (ctypes.py_object, ctypes.c_char_p)

_live: dict[int, tuple[Any, Callable[[], None], tuple[Any, ...]]] = {}  # address -> (buffer, release, keep)
_live_lock = threading.Lock()


def _free(addr: int) -> None:
    """The deleter: JAX no longer needs the result (and every use of it finished)."""
    lock, live = _live_lock, _live
    if lock is None or live is None:  # (at interpreter exit, after this module's teardown: the process frees it)
        return
    with lock:
        rec = live.pop(addr, None)
    if rec is None:
        return
    _, release, keep = rec
    with contextlib.suppress(Exception):  # (at interpreter exit the driver may be gone: the process frees it)
        release()
    del keep  # the inputs' exported references: released after the result


def _cuda_release(ptr: int, stream: int, ctx: Any) -> Callable[[], None]:
    """Frees `ptr` with cuMemFreeAsync on `stream`, in the context `ctx` (any thread)."""

    def release() -> None:
        drv = _drv or _load_driver()
        cur = drv.cuCtxGetCurrent()[1]
        if cur == ctx:  # (the common case: JAX releases on the calling thread, our context current)
            check(drv.cuMemFreeAsync(ptr, _core._stream_obj(stream)), "cuMemFreeAsync")
            return
        check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            check(drv.cuMemFreeAsync(ptr, _core._stream_obj(stream)), "cuMemFreeAsync")
        finally:
            drv.cuCtxPopCurrent()

    return release


_drv: Any = None  # the cuda.bindings driver module, once imported


def _load_driver() -> Any:
    global _drv
    from cuda.bindings import driver

    _drv = driver
    return driver


_deleter = _DELETER_T(_free)  # (kept alive here for as long as the module lives)
_DELETER = ctypes.cast(_deleter, ctypes.c_void_p).value or 0


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a dense row-major array (the layout of JAX's arrays)."""
    return _intake.contiguous(shape)


def _result(
    jdev: Any,
    ptr: int,
    shape: tuple[int, ...],
    dtype: str,
    stream: int | None,
    release: Callable[[], None],
    keep: tuple[Any, ...],
    dl_type: int = _KDLCUDA,
) -> Any:
    """A jax.Array over memory `ptr` (ours, of DLPack device type `dl_type`), ready after the
    work queued on `stream`; `release` frees the memory once JAX lets go of it."""
    _jax = _jaxlib()

    nd = len(shape)
    buf = ctypes.create_string_buffer(_DLM.size + 16 * nd)
    addr = ctypes.addressof(buf)
    code, bits = _DL_DTYPE[dtype]
    dims = addr + _DLM.size
    _DLM.pack_into(
        buf, 0, ptr, dl_type, jdev.local_hardware_id, nd, code, bits, 1, dims, dims + 8 * nd, 0, addr, _DELETER
    )
    struct.pack_into(f"={2 * nd}q", buf, _DLM.size, *shape, *_row_major(shape))
    with _live_lock:
        _live[addr] = (buf, release, keep)
    cap = None
    try:
        cap = _capsule_new(addr, b"dltensor", None)
        to_buffer = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
        if to_buffer is None:  # (a jaxlib without it: the public import, on JAX's own stream)
            return _public_import(cap, jdev, stream, dl_type)
        try:
            return to_buffer(cap, jdev, stream, False, dl_type)
        except TypeError:  # jaxlib before the dl_device_type argument
            return to_buffer(cap, jdev, stream, False)
    except BaseException:
        if cap is None or _capsule_is_valid(cap, b"dltensor"):
            _free(addr)  # not taken over by JAX (it renames the capsules it takes): ours to free
        raise


class _Exported:
    """A DLPack producer around a capsule of ours, for jax.dlpack.from_dlpack."""

    def __init__(self, cap: Any, dl: tuple[int, int]) -> None:
        self.cap, self.dl = cap, dl

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.cap

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.dl


def _public_import(cap: Any, jdev: Any, stream: int | None, dl_type: int) -> Any:
    """jax.dlpack.from_dlpack of our capsule: JAX takes it ready after its own stream's work,
    so the kernel must have run there."""
    import jax

    if stream is not None and stream != _jax_stream(jdev):
        raise DrvSoftmaxError(
            "stream= needs jaxlib's dlpack_managed_tensor_to_buffer, which this jaxlib lacks; "
            "call without stream= (JAX's stream)"
        )
    return jax.dlpack.from_dlpack(_Exported(cap, (dl_type, jdev.local_hardware_id)), copy=False)


_streams: dict[int, int] = {}  # JAX device id -> the stream JAX takes external work on


def _jax_stream(jdev: Any) -> int:
    s = _streams.get(jdev.id)
    if s is None:
        s = _streams[jdev.id] = int(jdev.get_stream_for_external_ready_events())
    return s


def _export(a: Any, stream: int) -> Any:
    """A DLPack export of `a` with `stream`: the stream waits for `a` to be computed (no host
    sync); the capsule holds a reference to a's memory while it lives."""
    try:
        return _jaxlib().buffer_to_dlpack_managed_tensor(a, stream=stream)
    except (ImportError, AttributeError, TypeError):  # (the public, slower way)
        return a.__dlpack__(stream=stream)


_jaxlib_mod: Any = None


def _jaxlib() -> Any:
    """jaxlib's extension module (DLPack export and import without the Python layers around them)."""
    global _jaxlib_mod
    if _jaxlib_mod is None:
        from jax._src.lib import _jax

        _jaxlib_mod = _jax
    return _jaxlib_mod


def _operand(a: Any, dtype: str) -> _core.Operand:
    shape = tuple(a.shape)
    return _core.Operand(int(a.unsafe_buffer_pointer()), dtype, shape, _row_major(shape))


def _check_array(name: str, a: Any, jdev: Any, like: str = "x") -> None:
    if not is_jax(a):
        raise arg_type_error(name, f"a jax.Array like {like} (or None)", type(a).__name__)
    _refuse_traced(name, a)
    d = _device_of(name, a)
    if d != jdev:
        raise arg_value_error(name, f"on {like}'s device {jdev}", f"device {d}")


class _Context:
    """The device's primary context current around our driver calls.  JAX leaves none current
    on the calling thread: then it is made current and stays (as CuPy and PyTorch leave theirs);
    another context that is current is restored afterwards."""

    __slots__ = ("ctx", "pushed")

    def __init__(self, dev: _driver.Device) -> None:
        self.ctx = dev.ctx
        self.pushed = False

    def __enter__(self) -> None:
        drv = _drv or _load_driver()
        cur = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur == self.ctx:
            return
        if cur is None or int(cur) == 0:
            check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        else:
            check(drv.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
            self.pushed = True

    def __exit__(self, *exc: object) -> None:
        if self.pushed:
            check(_drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _stream_for(jdev: Any, stream: object) -> int:
    if stream is None:
        return _jax_stream(jdev)
    s = _args.stream_handle(stream)
    if s <= 2:
        raise arg_value_error(
            "stream",
            "None (JAX's stream for x's device) or a stream other than the default streams for JAX arrays",
            f"handle {s}",
        )
    return s


_pools: dict[int, Any] = {}  # CUDA ordinal -> our memory pool (None: the device's default pool)


def _pool(ordinal: int) -> Any:
    """A stream-ordered memory pool of our own on the device, that keeps freed memory for
    reuse (the default pool returns it to the driver at every synchronisation)."""
    if ordinal in _pools:
        return _pools[ordinal]
    from cuda.bindings import driver

    pool = None
    try:
        props = driver.CUmemPoolProps()
        props.allocType = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ordinal
        pool = check(driver.cuMemPoolCreate(props), "cuMemPoolCreate")
        check(
            driver.cuMemPoolSetAttribute(
                pool, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, driver.cuuint64_t(2**64 - 1)
            ),
            "cuMemPoolSetAttribute",
        )
    except Exception:  # (a driver without pools of its own: the default pool)
        pool = None
    _pools[ordinal] = pool
    return pool


def _alloc(shape: tuple[int, ...], dtype: str, stream: int, ordinal: int) -> int:
    from cuda.bindings import driver

    n = _args.ITEMSIZE[dtype]
    for d in shape:
        n *= d
    pool = _pool(ordinal)
    if pool is None:
        return int(check(driver.cuMemAllocAsync(n, driver.CUstream(stream)), "cuMemAllocAsync"))
    return int(check(driver.cuMemAllocFromPoolAsync(n, pool, driver.CUstream(stream)), "cuMemAllocFromPoolAsync"))


def _empty_result(shape: tuple[int, ...], a: Any, jdev: Any) -> Any:
    import jax

    return jax.device_put(np.zeros(shape, dtype=a.dtype), jdev)


def _np(a: Any) -> np.ndarray:
    v = np.asarray(a)
    return v.astype(np.float32) if v.dtype.name == "bfloat16" else v


def _lengths(key_lengths: Any, x_shape: tuple[int, ...], jdev: Any) -> Any:
    """key_lengths as a JAX integer array on x's device (lists, tuples and NumPy arrays are put there)."""
    if isinstance(key_lengths, (list, tuple)):
        key_lengths = _args.lengths_array(key_lengths)
    if isinstance(key_lengths, np.ndarray):
        _args.check_key_lengths(key_lengths.shape, key_lengths.dtype.name, x_shape)
        # int32 with the same meaning (values clamp to [0, Sk] and Sk < 2**31): JAX keeps int64
        # only with x64 enabled
        import jax

        hi = np.minimum(key_lengths, 2**31 - 1)
        return jax.device_put(
            np.maximum(hi, -1).astype(np.int32) if hi.dtype.kind == "i" else hi.astype(np.int32), jdev
        )
    if not is_jax(key_lengths):
        raise arg_type_error(
            "key_lengths",
            "a jax.Array, list, tuple or NumPy array of integers of shape [B] (or None)",
            type(key_lengths).__name__,
        )
    _check_array("key_lengths", key_lengths, jdev)
    _args.check_key_lengths(tuple(key_lengths.shape), _dtname(key_lengths), x_shape)
    dt = _dtname(key_lengths)
    if dt not in _args.KLEN_KERNEL_DTYPES:  # other integer dtypes: the same values as int32 (or clamped int64)
        import jax.numpy as jnp

        if dt in ("uint32", "uint64"):
            key_lengths = jnp.minimum(key_lengths, jnp.iinfo(jnp.int32).max)
        key_lengths = key_lengths.astype(jnp.int32)
    return key_lengths


class _Fast:
    """A layout of plain GPU calls whose checks passed: what a repeated call needs."""

    __slots__ = ("jdev", "dev", "stream", "shape", "dtype", "preps")

    def __init__(self, jdev: Any, dev: Any, stream: int, shape: tuple[int, ...], dtype: str) -> None:
        self.jdev, self.dev, self.stream, self.shape, self.dtype = jdev, dev, stream, shape, dtype
        self.preps: dict[bool, Any] = {}


_fast: dict[tuple[Any, ...], _Fast] = {}


def forward(x: Any, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Any:
    # A repeated plain call (x alone, JAX's stream) of a layout whose checks passed: export x,
    # allocate, launch, hand the result over.  The checks depend on nothing else (x's type,
    # shape, dtype and device, scale, causal); our context must already be current.
    _refuse_traced("x", x)
    key = None
    if (
        mask is None
        and key_lengths is None
        and out is None
        and stream is None
        and type(scale) in (float, int)
        and type(causal) is bool
    ):
        devs = x.devices()
        if len(devs) == 1:
            key = (type(x), x.shape, x.dtype, scale, causal, *devs)
            ent = _fast.get(key)
            if ent is not None:
                y = _fast_forward(x, ent)
                if y is not None:
                    return y
    y = _forward(x, mask, scale, causal, key_lengths, out, stream)
    if key is not None and key[-1].platform in ("gpu", "cuda") and 0 not in key[1]:
        _remember_fast(key, x, scale, causal)
    return y


def _fast_forward(x: Any, ent: _Fast) -> Any:
    drv = _drv or _load_driver()
    dev = ent.dev
    if drv.cuCtxGetCurrent()[1] != dev.ctx:
        return None
    s = ent.stream
    keep = _export(x, s)
    xp = int(x.unsafe_buffer_pointer())
    prep = ent.preps.get(not (xp & 15))
    if prep is None:
        return None
    yp = _alloc(ent.shape, ent.dtype, s, dev.ordinal)
    try:
        _core.launch(prep, xp, yp, 0, 0, s, True)
    except BaseException:
        _free_now(yp, s)
        raise
    return _result(ent.jdev, yp, ent.shape, ent.dtype, s, _cuda_release(yp, s, dev.ctx), (keep,))


def _remember_fast(key: tuple[Any, ...], x: Any, scale: Any, causal: Any) -> None:
    """After a plain GPU call succeeded: its layout's fast-path entry."""
    jdev = key[-1]
    shape, dt = tuple(x.shape), _dtname(x)
    ent = _fast.get(key)
    if ent is None:
        if len(_fast) > 1024:
            _fast.clear()
        ent = _fast[key] = _Fast(jdev, _driver.device(jdev.local_hardware_id), _jax_stream(jdev), shape, dt)
    xo = _operand(x, dt)
    ent.preps[not (xo.ptr & 15)] = _core.prepared_forward(
        ent.dev, xo, xo._replace(ptr=0), None, None, _args.check_causal(causal), _args.check_scale(scale)
    )


def _forward(x: Any, mask: Any, scale: Any, causal: Any, key_lengths: Any, out: Any, stream: object) -> Any:
    _refuse_traced("x", x)
    scale = _args.check_scale(scale)
    causal = _args.check_causal(causal)
    jdev = _device_of("x", x)
    shape = tuple(x.shape)
    dt = _dtname(x)
    on_gpu = jdev.platform in ("gpu", "cuda")
    _args.check_x(
        shape, dt, _args.X_DTYPES_GPU if on_gpu else _args.X_DTYPES_CPU, "on the GPU" if on_gpu else "on the CPU path"
    )
    _args.check_causal_shape(causal, shape)
    if out is not None:
        raise arg_type_error(
            "out", "None for JAX arrays (they are immutable; the result is a new array)", type(out).__name__
        )
    if mask is not None:
        _check_array("mask", mask, jdev)
        _args.check_mask_dtype(_dtname(mask))
        _args.check_broadcast(tuple(int(n) for n in mask.shape), shape)
    if key_lengths is not None:
        key_lengths = _lengths(key_lengths, shape, jdev)
    if not on_gpu:
        _args.check_stream(stream)
        kl = None if key_lengths is None else np.asarray(key_lengths)
        y = _reference.softmax_forward(_np(x), None if mask is None else _np(mask), scale, causal, kl)
        return _empty_result(shape, x, jdev) if y.size == 0 else _put(y, x, jdev)
    s = _stream_for(jdev, stream)
    if 0 in shape:
        return _empty_result(shape, x, jdev)
    dev = _driver.device(jdev.local_hardware_id)
    keep = [_export(x, s)]
    xo = _operand(x, dt)
    mo = ko = None
    if mask is not None:
        keep.append(_export(mask, s))
        mo = _operand(mask, _dtname(mask))
    if key_lengths is not None:
        keep.append(_export(key_lengths, s))
        ko = _operand(key_lengths, _dtname(key_lengths))
    with _Context(dev):
        yp = _alloc(shape, dt, s, dev.ordinal)
        try:
            _core.forward(dev, xo, xo._replace(ptr=yp), mo, ko, causal, scale, s)
        except BaseException:
            _free_now(yp, s)
            raise
        return _result(jdev, yp, shape, dt, s, _cuda_release(yp, s, dev.ctx), tuple(keep))


def backward(dy: Any, y: Any, scale: Any, out: Any, stream: object) -> Any:
    _refuse_traced("y", y)
    scale = _args.check_scale(scale)
    jdev = _device_of("y", y)
    shape = tuple(y.shape)
    dt = _dtname(y)
    on_gpu = jdev.platform in ("gpu", "cuda")
    _args.check_x(
        shape,
        dt,
        _args.X_DTYPES_GPU if on_gpu else _args.X_DTYPES_CPU,
        "on the GPU" if on_gpu else "on the CPU path",
        "y",
    )
    if not is_jax(dy):
        raise arg_type_error("dy", "a jax.Array like y", type(dy).__name__)
    _check_array("dy", dy, jdev, "y")
    if tuple(int(n) for n in dy.shape) != shape or _dtname(dy) != dt:
        raise arg_value_error(
            "dy", f"of y's shape {shape} and dtype {dt}", f"shape {tuple(dy.shape)}, dtype {_dtname(dy)}"
        )
    if out is not None:
        raise arg_type_error(
            "out", "None for JAX arrays (they are immutable; the result is a new array)", type(out).__name__
        )
    if not on_gpu:
        _args.check_stream(stream)
        dx = _reference.softmax_backward(_np(dy), _np(y), scale)
        return _empty_result(shape, y, jdev) if dx.size == 0 else _put(dx, y, jdev)
    s = _stream_for(jdev, stream)
    if 0 in shape:
        return _empty_result(shape, y, jdev)
    dev = _driver.device(jdev.local_hardware_id)
    keep = (_export(dy, s), _export(y, s))
    do, yo = _operand(dy, dt), _operand(y, dt)
    with _Context(dev):
        dxp = _alloc(shape, dt, s, dev.ordinal)
        try:
            _core.backward(dev, do, yo, yo._replace(ptr=dxp), scale, s)
        except BaseException:
            _free_now(dxp, s)
            raise
        return _result(jdev, dxp, shape, dt, s, _cuda_release(dxp, s, dev.ctx), keep)


def _free_now(ptr: int, stream: int) -> None:
    from cuda.bindings import driver

    driver.cuMemFreeAsync(ptr, driver.CUstream(stream))


def _put(v: np.ndarray, like: Any, jdev: Any) -> Any:
    import jax

    return jax.device_put(v.astype(like.dtype), jdev)


__all__ = ["is_jax", "forward", "backward"]
