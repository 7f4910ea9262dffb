"""DLPack capsules built by hand (ctypes), and objects that hand them out.

`make_capsule` lays out a DLManagedTensor (or DLManagedTensorVersioned) in memory the
caller chooses, with a deleter that counts its calls, and wraps it in a PyCapsule named
as the protocol says; the capsule has no destructor, so the deleter runs only if the
consumer calls it.  `FakeDLPack` is a producer that has only ``__dlpack__`` and
``__dlpack_device__`` and records the streams it was asked for.  On a GPU machine the
pointer may be real device memory (the GPU tests pass a CuPy allocation), which is how
a bfloat16 array reaches the DLPack door without a framework that has bfloat16.
"""

from __future__ import annotations

import ctypes
import struct

_new = ctypes.pythonapi.PyCapsule_New
_new.restype = ctypes.py_object
_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_valid = ctypes.pythonapi.PyCapsule_IsValid
_valid.restype = ctypes.c_int
_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]

NAMES = {
    "plain": b"dltensor",
    "versioned": b"dltensor_versioned",
    "used": b"used_dltensor",
    "used_versioned": b"used_dltensor_versioned",
}
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
CODES = {  # name -> (DLPack type code, bits)
    "bool": (6, 8),
    "int8": (0, 8),
    "uint8": (1, 8),
    "int16": (0, 16),
    "uint16": (1, 16),
    "int32": (0, 32),
    "uint32": (1, 32),
    "int64": (0, 64),
    "uint64": (1, 64),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "float32": (2, 32),
    "float64": (2, 64),
    "complex64": (5, 64),
}
ITEM = {n: b // 8 for n, (_, b) in CODES.items()}


class Capsule:
    """A DLPack capsule and the memory behind it; `deleted` counts deleter calls."""

    def __init__(
        self,
        ptr,
        shape,
        dtype="float32",
        strides=None,
        byte_offset=0,
        device=(2, 0),
        versioned=False,
        readonly=False,
        lanes=1,
        code_bits=None,
        version=(1, 1),
    ):
        self.deleted = 0
        nd = len(shape)
        self.shape_buf = (ctypes.c_int64 * max(nd, 1))(*shape)
        self.strides_buf = None if strides is None else (ctypes.c_int64 * max(nd, 1))(*strides)
        code, bits = code_bits or CODES[dtype]
        tensor = struct.pack(
            "<QiiiBBHQQQ",
            ptr,
            device[0],
            device[1],
            nd,
            code,
            bits,
            lanes,
            ctypes.addressof(self.shape_buf),
            0 if self.strides_buf is None else ctypes.addressof(self.strides_buf),
            byte_offset,
        )
        self.fn = DELETER(self._delete)
        fn_addr = ctypes.cast(self.fn, ctypes.c_void_p).value
        if versioned:
            head = struct.pack("<IIQQQ", version[0], version[1], 0, fn_addr, 1 if readonly else 0)
            self.mem = ctypes.create_string_buffer(head + tensor)
        else:
            self.mem = ctypes.create_string_buffer(tensor + struct.pack("<QQ", 0, fn_addr))
        self.addr = ctypes.addressof(self.mem)
        self.versioned = versioned
        self.capsule = _new(self.addr, NAMES["versioned" if versioned else "plain"], None)

    def _delete(self, managed):
        assert managed == self.addr, "the deleter got another pointer than the managed tensor's"
        self.deleted += 1

    def renamed(self) -> bool:
        """The consumer took the capsule (renamed it 'used_...')."""
        return bool(_valid(self.capsule, NAMES["used_versioned" if self.versioned else "used"]))


class FakeDLPack:
    """A producer with only __dlpack__ / __dlpack_device__ (versioned if `versioned`)."""

    __module__ = "fakedlpack"

    def __init__(self, shape, dtype="float32", ptr=1 << 40, strides=None, device=(2, 0), versioned=False, **kw):
        self.shape, self.dtype, self.ptr, self.strides, self.device = tuple(shape), dtype, ptr, strides, device
        self.versioned, self.kw = versioned, kw
        self.streams: list[object] = []
        self.capsules: list[Capsule] = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        versioned = self.versioned and max_version is not None and max_version[0] >= 1
        c = Capsule(self.ptr, self.shape, self.dtype, self.strides, device=self.device, versioned=versioned, **self.kw)
        self.capsules.append(c)
        return c.capsule


class OldDLPack(FakeDLPack):
    """A producer of DLPack before 1.0: no max_version argument."""

    def __dlpack__(self, stream=None):
        return super().__dlpack__(stream=stream)
