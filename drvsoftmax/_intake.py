"""One intake for every non-torch GPU array: DLPack first, then ``__cuda_array_interface__``.

``read(a, name, stream)`` turns an array into an `Item`: a core `Operand` (pointer, dtype
name, shape, element strides), its device ordinal, its read-only flag, the stream its
producer last wrote it on (to be waited on), and, for DLPack, the deleter to call once
the launch is enqueued.  In order:

* CuPy ndarrays: read from their attributes (the same values their DLPack capsule and
  interface hold, without building either); the producer stream is CuPy's current stream.
* Objects with ``__dlpack__`` and ``__dlpack_device__``: the capsule is requested with our
  stream (``stream=1`` for the legacy default stream, as DLPack spells it), so the producer
  orders our stream after its pending work itself; it is parsed through ctypes, renamed
  ``used_dltensor`` and its deleter is called when the call is done.  Versioned capsules
  (DLPack 1.x, ``max_version``) are asked for first and carry the read-only flag.  The dtype
  comes from the DLPack type code and bits (bfloat16 included), never from the item size.
* Objects with ``__cuda_array_interface__`` (v2, v3): the v3 ``stream`` entry is waited on
  without a host sync (an event recorded on the producer's stream, ``cuStreamWaitEvent`` on
  ours; one cached event per device and thread), and ``data[1]`` is the read-only flag.

Every malformed description is an argument error that names the argument.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
from typing import Any, NamedTuple

from . import _args, _dtypes
from ._core import Operand
from ._errors import DrvSoftmaxError, arg_type_error, arg_value_error, check


class Item(NamedTuple):
    op: Operand
    device: int  # CUDA device ordinal
    readonly: bool
    producer: int | None  # stream the producer wrote on, to wait on; None: nothing to wait on
    release: Any  # a callable, called once the call is done (DLPack deleters), or None
    lib: str  # "cupy", "numba", or the producer's top-level module


DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_DEVICE_NAMES = {
    1: "CPU",
    2: "CUDA",
    3: "CUDA host",
    4: "OpenCL",
    7: "Vulkan",
    8: "Metal",
    10: "ROCm",
    13: "CUDA managed",
}
DLPACK_MAX_VERSION = (1, 1)
FLAG_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY

# Capsule names: the pointers of these bytes objects are kept by the capsules renamed with
# them, so they live as long as the module.
_NAME = b"dltensor"
_NAME_V = b"dltensor_versioned"
_USED = b"used_dltensor"
_USED_V = b"used_dltensor_versioned"

_api = ctypes.pythonapi
_cap_ptr = _api.PyCapsule_GetPointer
_cap_ptr.argtypes, _cap_ptr.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
_cap_rename = _api.PyCapsule_SetName
_cap_rename.argtypes, _cap_rename.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int

# DLTensor: data, device (type, id), ndim, dtype (code, bits, lanes), shape*, strides*, byte_offset.
DLTENSOR = struct.Struct("<QiiiBBHQQQ")
# DLManagedTensor: DLTensor, manager_ctx, deleter.  DLManagedTensorVersioned: version
# (major, minor), manager_ctx, deleter, flags, DLTensor.
MANAGED_TAIL = struct.Struct("<QQ")
VERSIONED_HEAD = struct.Struct("<IIQQQ")
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_deleters: dict[int, Any] = {}


def _deleter(addr: int) -> Any:
    f = _deleters.get(addr)
    if f is None:
        f = _deleters[addr] = _DELETER(addr)
    return f


class _Release:
    """Calls a DLPack deleter once (the capsule was renamed 'used': it is ours to free)."""

    __slots__ = ("fn", "managed")

    def __init__(self, fn: int, managed: int) -> None:
        self.fn, self.managed = fn, managed

    def __call__(self) -> None:
        fn, self.fn = self.fn, 0
        if fn:
            _deleter(fn)(self.managed)


def release_all(items: list[Item]) -> None:
    for it in items:
        if it.release is not None:
            it.release()


# ----------------------------------------------------------------------------------
# Kinds of arrays.

_cupy_nd: Any = None  # cupy.ndarray, once CuPy is imported


def _is_cupy(a: object) -> bool:
    global _cupy_nd
    if _cupy_nd is None:
        cp = sys.modules.get("cupy")
        if cp is None:
            return False
        _cupy_nd = cp.ndarray
    return type(a) is _cupy_nd


_kind_of_type: dict[type, str] = {}


def kind(a: object) -> str:
    """'cupy', 'dlpack', 'cai', or '' for objects the intake cannot read."""
    t = type(a)
    k = _kind_of_type.get(t)
    if k is None:
        if t.__module__ == "numpy":
            k = ""  # host arrays: the NumPy door's (their DLPack device is the CPU)
        elif _is_cupy(a):
            k = "cupy"
        elif hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__"):
            k = "dlpack"
        elif hasattr(t, "__cuda_array_interface__"):
            k = "cai"  # a property of the type (Numba)
        elif hasattr(a, "__cuda_array_interface__"):
            return "cai"  # an instance attribute: not cached by type
        else:
            return ""
        _kind_of_type[t] = k
    return k


_lib_of_type: dict[type, str] = {}


def library(a: object) -> str:
    """The top-level module of a's type: "cupy", "numba", ..."""
    t = type(a)
    lib = _lib_of_type.get(t)
    if lib is None:
        lib = _lib_of_type[t] = t.__module__.split(".")[0]
    return lib


def read(a: Any, name: str, stream: int, cupy_stream: int | None = None) -> Item:
    """Read array `a` (argument `name`); `stream` is the stream the call launches on
    (DLPack producers are given it), `cupy_stream` CuPy's current stream if known."""
    k = kind(a)
    if k == "cupy":
        return _read_cupy(a, name, cupy_stream)
    if k == "dlpack":
        return _read_dlpack(a, name, stream)
    if k == "cai":
        return _read_cai(a, name)
    raise arg_type_error(
        name, "a CUDA array (__dlpack__ or __cuda_array_interface__)", f"{type(a).__module__}.{type(a).__name__}"
    )


# ----------------------------------------------------------------------------------
# Readers.


def _elem_strides(name: str, shape: tuple[int, ...], bstrides: tuple[int, ...] | None, item: int) -> tuple[int, ...]:
    if bstrides is None:
        return contiguous(shape)
    if len(bstrides) != len(shape):
        raise arg_value_error(name, f"strides for each of its {len(shape)} dims", f"byte strides {bstrides}")
    es = _estrides.get((bstrides, item))
    if es is None:
        if any(s % item for s in bstrides):
            raise arg_value_error(name, "strides that are whole elements", f"byte strides {bstrides}")
        es = tuple(s // item for s in bstrides)
        if len(_estrides) > 1024:
            _estrides.clear()
        _estrides[(bstrides, item)] = es
    return es


_estrides: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
_contig: dict[tuple[int, ...], tuple[int, ...]] = {}


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of `shape`."""
    st = _contig.get(shape)
    if st is None:
        acc, rev = 1, []
        for n in reversed(shape):
            rev.append(acc)
            acc *= max(n, 1)
        st = tuple(reversed(rev))
        if len(_contig) > 1024:
            _contig.clear()
        _contig[shape] = st
    return st


_np_names: dict[Any, str] = {}


def np_dtype_name(dt: Any) -> str:
    """The table's name of a NumPy dtype (bfloat16 of ml_dtypes included)."""
    n = _np_names.get(dt)
    if n is None:
        n = _np_names[dt] = str(getattr(dt, "name", dt))
    return n


def cupy_current_stream() -> int:
    return int(sys.modules["cupy"].cuda.get_current_stream().ptr)


def _read_cupy(a: Any, name: str, current: int | None) -> Item:
    dt = np_dtype_name(a.dtype)
    shape = a.shape
    st = _elem_strides(name, shape, a.strides, a.itemsize)
    p = cupy_current_stream() if current is None else current
    return Item(Operand(a.data.ptr, dt, shape, st), a.device.id, False, p, None, "cupy")


def _dlpack_stream_arg(stream: int) -> int:
    return 1 if stream == 0 else stream  # DLPack: 1 is the legacy default stream, 0 is not allowed


_takes_max_version: dict[type, bool] = {}


def _read_dlpack(a: Any, name: str, stream: int) -> Item:
    try:
        dev = a.__dlpack_device__()
        dtype_code, dev_id = int(dev[0]), int(dev[1])
    except Exception as e:
        raise arg_value_error(name, "an array whose __dlpack_device__() gives (device_type, id)", f"{e!r}") from e
    if dtype_code not in (DL_CUDA, DL_CUDA_MANAGED):
        where = _DL_DEVICE_NAMES.get(dtype_code, f"device type {dtype_code}")
        raise arg_value_error(name, "an array in CUDA device memory", f"a DLPack array on {where} (id {dev_id})")
    t = type(a)
    s = _dlpack_stream_arg(stream)
    try:
        if _takes_max_version.get(t, True):
            try:
                cap = a.__dlpack__(stream=s, max_version=DLPACK_MAX_VERSION)
                _takes_max_version[t] = True
            except TypeError:  # a producer of DLPack < 1.0 takes no max_version
                _takes_max_version[t] = False
                cap = a.__dlpack__(stream=s)
        else:
            cap = a.__dlpack__(stream=s)
    except DrvSoftmaxError:
        raise
    except Exception as e:
        raise arg_value_error(name, "an array whose __dlpack__(stream=...) gives a capsule", f"{e!r}") from e
    return parse_capsule(cap, name, library(a))


def parse_capsule(cap: object, name: str, lib: str = "dlpack") -> Item:
    """Take ownership of a DLPack capsule and read it (the deleter is called by `release`)."""
    versioned = True
    try:
        managed = _cap_ptr(cap, _NAME_V)  # a capsule of another name raises ValueError
    except (ValueError, TypeError):
        versioned = False
        try:
            managed = _cap_ptr(cap, _NAME)
        except (ValueError, TypeError):
            managed = None
    if not managed:
        raise arg_value_error(
            name, "a DLPack capsule named 'dltensor' or 'dltensor_versioned'", f"{type(cap).__name__} {cap!r:.60}"
        )
    if _cap_rename(cap, _USED_V if versioned else _USED):
        raise arg_value_error(name, "a usable DLPack capsule", "a capsule that could not be renamed")
    if versioned:
        raw = ctypes.string_at(managed, VERSIONED_HEAD.size + DLTENSOR.size)
        major, minor, _ctx, deleter, flags = VERSIONED_HEAD.unpack_from(raw)
        rel = _Release(deleter, managed)
        if major != 1:
            rel()
            raise arg_value_error(name, "a DLPack 1.x capsule", f"version {major}.{minor}")
        fields = DLTENSOR.unpack_from(raw, VERSIONED_HEAD.size)
        readonly = bool(flags & FLAG_READ_ONLY)
    else:
        raw = ctypes.string_at(managed, DLTENSOR.size + MANAGED_TAIL.size)
        _ctx, deleter = MANAGED_TAIL.unpack_from(raw, DLTENSOR.size)
        rel = _Release(deleter, managed)
        fields = DLTENSOR.unpack_from(raw)
        readonly = False
    try:
        op, dev = _read_dltensor(fields, name)
    except BaseException:
        rel()
        raise
    return Item(op, dev, readonly, None, rel, lib)


def _read_dltensor(fields: tuple[Any, ...], name: str) -> tuple[Operand, int]:
    data, dev_type, dev_id, ndim, code, bits, lanes, shape_p, strides_p, offset = fields
    if dev_type not in (DL_CUDA, DL_CUDA_MANAGED):
        where = _DL_DEVICE_NAMES.get(dev_type, f"device type {dev_type}")
        raise arg_value_error(name, "an array in CUDA device memory", f"a DLPack tensor on {where}")
    dt = _dtypes.OF_DLPACK.get((code, bits))
    if dt is None or lanes != 1:
        raise arg_type_error(
            name, "an array of a supported dtype", f"DLPack dtype code {code}, {bits} bits, {lanes} lanes"
        )
    if not 0 <= ndim <= 64:
        raise arg_value_error(name, "a DLPack tensor of 0 to 64 dims", f"ndim {ndim}")
    fmt = _QFMT[ndim]
    shape = fmt.unpack(ctypes.string_at(shape_p, 8 * ndim)) if ndim else ()
    if any(n < 0 for n in shape):
        raise arg_value_error(name, "an array of non-negative dims", f"shape {shape}")
    strides = fmt.unpack(ctypes.string_at(strides_p, 8 * ndim)) if strides_p and ndim else contiguous(shape)
    return Operand(data + offset, dt, shape, strides), dev_id


_QFMT = [struct.Struct(f"<{n}q") for n in range(65)]


_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}


def _shape(name: str, v: Any) -> tuple[int, ...]:
    """A shape tuple from an interface: ints >= 0 (a tuple seen before: one lookup)."""
    try:
        sh = _shapes.get(v)
    except TypeError:  # a list, say: unhashable
        sh = None
    if sh is None:
        sh = tuple(int(n) for n in v)
        if any(n < 0 for n in sh):
            raise arg_value_error(name, "an array of non-negative dims", f"shape {sh}")
        if type(v) is tuple:
            if len(_shapes) > 1024:
                _shapes.clear()
            _shapes[v] = sh
    return sh


def _read_cai(a: Any, name: str) -> Item:
    try:
        cai = a.__cuda_array_interface__
        if not isinstance(cai, dict):
            raise arg_value_error(name, "an array whose __cuda_array_interface__ is a dict", type(cai).__name__)
        ts = cai["typestr"]
        if not isinstance(ts, str) or len(ts) < 3:
            raise arg_type_error(name, "an array of a supported dtype", f"typestr {ts!r}")
        if ts[0] == ">":
            raise arg_type_error(name, "a little-endian array", f"typestr {ts}")
        dtype = _dtypes.OF_TYPESTR.get(ts[1:])
        if dtype is None and ts[1:] == "V2" and "bfloat16" in str(getattr(a, "dtype", "")):
            dtype = "bfloat16"  # the interface has no bfloat16 typestr: the library's dtype names it
        if dtype is None:
            raise arg_type_error(name, "an array of a supported dtype", f"typestr {ts} ({getattr(a, 'dtype', '?')})")
        shape = _shape(name, cai["shape"])
        bs = cai.get("strides")
        strides = _elem_strides(name, shape, None if bs is None else tuple(int(s) for s in bs), _dtypes.ITEMSIZE[dtype])
        data = cai["data"]
        ptr = int(data[0] or 0)
        if ptr < 0:
            raise arg_value_error(name, "an array with a valid device pointer", f"pointer {ptr}")
        readonly = bool(data[1])
        if cai.get("mask") is not None:
            raise arg_value_error(name, "an array without a mask (__cuda_array_interface__ 'mask')", "a masked array")
        ps = cai.get("stream") if cai.get("version", 0) >= 3 else None
    except DrvSoftmaxError:
        raise
    except Exception as e:  # a foreign object's interface missing keys or holding junk
        raise arg_value_error(
            name, "an array with a valid __cuda_array_interface__ (v3)", f"{type(e).__name__}: {e}"
        ) from e
    producer = None if ps is None else _args.stream_handle(ps)
    return Item(Operand(ptr, dtype, shape, strides), _device_of(ptr, a), readonly, producer, None, library(a))


def _device_of(ptr: int, a: Any) -> int:
    dev = getattr(a, "device", None)
    for attr in ("id", "index"):
        v = getattr(dev, attr, None)
        if isinstance(v, int):
            return v
    if ptr == 0:
        return 0
    from cuda.bindings import driver

    from . import _driver

    _driver.init()
    ordinal = check(
        driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
        "cuPointerGetAttribute",
    )
    return int(ordinal)


# ----------------------------------------------------------------------------------
# Stream order without host syncs.


class _Events(threading.local):
    def __init__(self) -> None:
        self.by_device: dict[int, Any] = {}


_events = _Events()


def _legacy(h: int) -> bool:
    return h <= 1  # 0 and CU_STREAM_LEGACY (1) name the same stream


def wait(producer: int, consumer: int, ordinal: int) -> None:
    """Order `consumer` after the work enqueued so far on `producer` (device `ordinal`),
    without blocking the host: an event recorded on one, waited on by the other."""
    if producer == consumer or (_legacy(producer) and _legacy(consumer)):
        return
    from cuda.bindings import driver

    from . import _core, _driver

    dev = _driver.device(ordinal)
    needs_ctx = producer <= 2 or consumer <= 2  # default streams are those of the current context
    pushed = False
    if needs_ctx:
        cur = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur != dev.ctx:
            check(driver.cuCtxPushCurrent(dev.ctx), "cuCtxPushCurrent")
            pushed = True
    try:
        ev = _events.by_device.get(ordinal)
        if ev is None:
            if not pushed and not needs_ctx:
                check(driver.cuCtxPushCurrent(dev.ctx), "cuCtxPushCurrent")
                try:
                    ev = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                finally:
                    check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
            else:
                ev = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            _events.by_device[ordinal] = ev
        check(driver.cuEventRecord(ev, _core._stream_obj(producer)), "cuEventRecord")
        check(driver.cuStreamWaitEvent(_core._stream_obj(consumer), ev, 0), "cuStreamWaitEvent")
    finally:
        if pushed:
            check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def wait_all(items: list[Item], stream: int) -> None:
    """Order `stream` after each array's producer stream (each distinct stream once)."""
    seen: tuple[int, ...] = ()
    for it in items:
        p = it.producer
        if p is not None and p not in seen:
            seen += (p,)
            if p != stream and not (_legacy(p) and _legacy(stream)):
                wait(p, stream, it.device)


__all__ = ["Item", "read", "kind", "wait", "wait_all", "parse_capsule", "release_all", "np_dtype_name"]
