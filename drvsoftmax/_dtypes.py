"""The one dtype table: every dtype drvsoftmax knows, by name, with what each layer needs.

Every other module (argument checks, the planner, the core, the front doors and the
DLPack / ``__cuda_array_interface__`` intake) derives its view from ``TABLE``, so a dtype
is added or changed here only.  Pure Python, no framework.
"""

from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    name: str
    itemsize: int  # bytes
    dlpack: tuple[int, int]  # (DLDataTypeCode, bits), lanes 1
    typestr: str  # __cuda_array_interface__ typestr without the byte-order character
    ctype: str  # the kernels' storage type ("" where no kernel stores it)
    x: bool  # usable as x / y / dy on the GPU
    mask_kind: str  # the kernels' mask source for a mask of this dtype
    klen: str  # "kernel": read by the kernels as key_lengths; "convert": converted first; "": refused


# DLPack's DLDataTypeCode values.
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT, DL_BOOL = 0, 1, 2, 4, 6

TABLE = {
    d.name: d
    for d in (
        DType("bool", 1, (DL_BOOL, 8), "b1", "", False, "hide1", ""),
        DType("int8", 1, (DL_INT, 8), "i1", "", False, "hide1", "convert"),
        DType("uint8", 1, (DL_UINT, 8), "u1", "", False, "hide1", "convert"),
        DType("int16", 2, (DL_INT, 16), "i2", "", False, "hide2", "convert"),
        DType("uint16", 2, (DL_UINT, 16), "u2", "", False, "hide2", "convert"),
        DType("int32", 4, (DL_INT, 32), "i4", "", False, "hide4", "kernel"),
        DType("uint32", 4, (DL_UINT, 32), "u4", "", False, "hide4", "convert"),
        DType("int64", 8, (DL_INT, 64), "i8", "", False, "hide8", "kernel"),
        DType("uint64", 8, (DL_UINT, 64), "u8", "", False, "hide8", "convert"),
        DType("float16", 2, (DL_FLOAT, 16), "f2", "smx_f16", True, "add_float16", ""),
        DType("bfloat16", 2, (DL_BFLOAT, 16), "", "smx_bf16", True, "add_bfloat16", ""),
        DType("float32", 4, (DL_FLOAT, 32), "f4", "float", True, "add_float32", ""),
        DType("float64", 8, (DL_FLOAT, 64), "f8", "", False, "add_float64", ""),
    )
}

# Views of the table, named for their use.
X_DTYPES_GPU = tuple(n for n, d in TABLE.items() if d.x)  # float16, bfloat16, float32
X_DTYPES_CPU = X_DTYPES_GPU + ("float64",)  # the float64 reference path takes float64 too
MASK_DTYPES = tuple(TABLE)
MASK_KIND_OF_DTYPE = {n: d.mask_kind for n, d in TABLE.items()}
INT_DTYPES = tuple(n for n, d in TABLE.items() if d.klen)
KLEN_KERNEL_DTYPES = tuple(n for n, d in TABLE.items() if d.klen == "kernel")  # int32, int64
ITEMSIZE = {n: d.itemsize for n, d in TABLE.items()}
KERNEL_CTYPES = {n: (d.ctype, d.itemsize) for n, d in TABLE.items() if d.x}  # name -> (C++ type, bytes)
OF_DLPACK = {d.dlpack: n for n, d in TABLE.items()}  # (code, bits) -> name
OF_TYPESTR = {d.typestr: n for n, d in TABLE.items() if d.typestr}  # "f2" -> "float16"
