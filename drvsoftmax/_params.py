"""The kernels' parameter structs, defined once.

Everything the kernels read besides the data pointers lives in one struct per direction
(`SmxFwdParams`, `SmxBwdParams`), passed by value as the kernel's last argument.  This
module is the single definition: it packs the structs for launches (`FWD`, `BWD`) and
writes the C header the kernels include (`cuda_src/softmax_params.cuh`, also shipped to
C programs inside `drvsoftmax.h`).  The header carries `static_assert`s on the size and
every offset, so a compile fails if C and Python ever disagree, and a CPU test checks
that the file in the tree is what `c_header()` writes.

Row maps.  A tensor of shape [..., Sk] is a set of rows numbered in x's row-major order
of the leading dims.  Each operand (x, y, mask, key_lengths, the causal query index; dy,
y, dx backward) finds the element offset of row `r` as

    offset(r) = sum over its terms t of  ((r / div[t]) % mod[t]) * stride[t]

(`mod` 0: no modulo), with the leading dims merged per operand and the broadcast ones
dropped, so a contiguous operand has one term (`r * stride`) and a mask broadcast over
heads two.  `dmul/dshr` and `mmul/mshr` are magic numbers for the two divisions, used
while every quantity is below 2**31 (flag SMX_SMALL); otherwise the kernel divides.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

MAXT = 6  # terms per row map: x's leading dims merge into at most this many


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str  # i64, u32, i32, f32
    count: int = 1
    doc: str = ""


_FMT = {"i64": "q", "u32": "I", "i32": "i", "f32": "f"}
_CTYPE = {"i64": "smx_i64", "u32": "smx_u32", "i32": "int", "f32": "float"}

ROW_MAP = (
    Field("div", "i64", MAXT, "row / div ..."),
    Field("mod", "i64", MAXT, "... % mod (0: none) ..."),
    Field("stride", "i64", MAXT, "... * stride, in elements"),
    Field("dmul", "u32", MAXT, "magic multiplier of div (0: div == 1)"),
    Field("dshr", "u32", MAXT, "magic shift of div"),
    Field("mmul", "u32", MAXT, "magic multiplier of mod"),
    Field("mshr", "u32", MAXT, "magic shift of mod"),
    Field("nterms", "i32", 1, "used terms"),
    Field("pad", "i32", 1, ""),
)

# Flags (SMX_F_*), shared by both directions where they apply.
FLAGS = {
    "CAUSAL": (1, "hide key j from query i when j > i + causal_shift"),
    "KLEN": (2, "key_lengths: hide keys j >= key_lengths[b]"),
    "KLEN64": (4, "key_lengths are int64 (else int32)"),
    "VEC": (8, "x/y (dy/y/dx) rows are unit-stride and share their alignment: 16-byte chunks"),
    "MVEC": (16, "mask rows are unit-stride: chunk-wide mask accesses where a row's alignment allows"),
    "SMALL": (32, "rows and every row-map quantity are below 2**31: 32-bit magic division"),
    "SAMEMAP": (64, "y (dy, dx) rows sit where x's (y's) do: one row map serves them all"),
    "ZERO": (1 << 30, "never set: the kernels read it as a zero the compiler cannot know"),
}

FWD_FIELDS = (
    Field("rows", "i64", 1, "number of rows"),
    Field("sk", "i32", 1, "row length (< 2**31)"),
    Field("flags", "i32", 1, "SMX_F_*"),
    Field("sx", "i64", 1, "element stride of x along a row"),
    Field("sy", "i64", 1, "element stride of y along a row"),
    Field("sm", "i64", 1, "element stride of the mask along a row (0: broadcast)"),
    Field("causal_shift", "i64", 1, "Sk - Sq"),
    Field("span_x", "i64", 1, "elements from x to one past its last: whole 16-byte blocks inside are readable"),
    Field("span_m", "i64", 1, "the same for the mask"),
    Field("scale", "f32", 1, "multiplies x before the mask"),
    Field("tpr_log2", "i32", 1, "log2(threads per row); a block narrower than that is one row"),
    Field("map_x", "map", 1, ""),
    Field("map_y", "map", 1, ""),
    Field("map_m", "map", 1, "mask"),
    Field("map_k", "map", 1, "key_lengths"),
    Field("map_q", "map", 1, "the causal query index"),
)
BWD_FIELDS = (
    Field("rows", "i64", 1, "number of rows"),
    Field("sk", "i32", 1, "row length (< 2**31)"),
    Field("flags", "i32", 1, "SMX_F_*"),
    Field("sdy", "i64", 1, "element stride of dy along a row"),
    Field("sy", "i64", 1, "element stride of y along a row"),
    Field("sdx", "i64", 1, "element stride of dx along a row"),
    Field("span_dy", "i64", 1, "elements from dy to one past its last"),
    Field("span_y", "i64", 1, "elements from y to one past its last"),
    Field("scale", "f32", 1, "dx = scale * y * (dy - sum(dy * y))"),
    Field("tpr_log2", "i32", 1, "log2(threads per row); a block narrower than that is one row"),
    Field("map_dy", "map", 1, ""),
    Field("map_y", "map", 1, ""),
    Field("map_dx", "map", 1, ""),
)


def _flat(fields: tuple[Field, ...]) -> list[tuple[str, Field]]:
    """(C path, field) of every scalar array, row maps expanded."""
    out: list[tuple[str, Field]] = []
    for f in fields:
        if f.ctype == "map":
            out += [(f"{f.name}.{g.name}", g) for g in ROW_MAP]
        else:
            out.append((f.name, f))
    return out


class Layout:
    """A C struct of naturally aligned fields, its Python packing and its offsets."""

    def __init__(self, cname: str, fields: tuple[Field, ...]):
        self.cname = cname
        self.fields = fields
        self.flat = _flat(fields)
        fmt = "<" + "".join(f"{g.count}{_FMT[g.ctype]}" for _, g in self.flat)
        self.struct = struct.Struct(fmt)
        self.offsets: dict[str, int] = {}
        off = 0
        for path, g in self.flat:
            size = struct.calcsize("<" + _FMT[g.ctype])
            if off % size:
                raise RuntimeError(f"{cname}.{path} would be padded: reorder the fields")
            self.offsets[path] = off
            off += size * g.count
        if off != self.struct.size or off % 8:
            raise RuntimeError(f"{cname}: size {off} is not a multiple of 8")
        self.size = off

    def pack(self, values: dict[str, Any]) -> bytes:
        """Pack {C path: value or list}; row-map arrays shorter than MAXT are padded."""
        args: list[float] = []
        for path, g in self.flat:
            if g.count == 1:
                args.append(values.get(path, 0))
            else:
                v = list(values.get(path, ()))
                args += v + [0] * (g.count - len(v))
        return self.struct.pack(*args)

    def unpack(self, data: bytes) -> dict[str, Any]:
        vals = self.struct.unpack(data)
        out, i = {}, 0
        for path, g in self.flat:
            out[path] = vals[i] if g.count == 1 else list(vals[i : i + g.count])
            i += g.count
        return out


FWD = Layout("SmxFwdParams", FWD_FIELDS)
BWD = Layout("SmxBwdParams", BWD_FIELDS)
MAP = Layout("SmxRowMap", ROW_MAP)


def _c_struct(name: str, fields: tuple[Field, ...]) -> list[str]:
    lines = [f"typedef struct {name} {{"]
    for f in fields:
        decl = "SmxRowMap" if f.ctype == "map" else _CTYPE[f.ctype]
        arr = f"[{f.count}]" if f.count > 1 else ""
        doc = f"  // {f.doc}" if f.doc else ""
        lines.append(f"  {decl} {f.name}{arr};{doc}")
    lines.append(f"}} {name};")
    return lines


def c_layout() -> list[str]:
    """The C text of the layout: types, flags, the three structs and their static checks.
    Shared by the kernels' header and the C programs' `drvsoftmax.h` (drvsoftmax/_capi.py)."""
    out = [
        "typedef long long smx_i64;",
        "typedef unsigned int smx_u32;",
        "",
        f"#define SMX_MAXT {MAXT}",
    ]
    for k, (v, doc) in FLAGS.items():
        out.append(f"#define SMX_F_{k} {v}  // {doc}")
    out.append("")
    out += _c_struct("SmxRowMap", ROW_MAP)
    out.append("")
    out += _c_struct("SmxFwdParams", FWD_FIELDS)
    out.append("")
    out += _c_struct("SmxBwdParams", BWD_FIELDS)
    out.append("")
    out += [
        "// Layout checks: sizes everywhere; offsets wherever offsetof is a constant (any C or",
        "// C++ compiler; NVRTC has none, and compiles the same text the C check compiled).",
        "#if defined(__cplusplus)",
        "#define SMX_STATIC_ASSERT(c, m) static_assert(c, m)",
        "#else",
        "#define SMX_STATIC_ASSERT(c, m) _Static_assert(c, m)",
        "#endif",
        "#if defined(__CUDACC_RTC__)",
        "#define SMX_CHECK_OFFSET(T, f, n)",
        "#else",
        "#include <stddef.h>",
        '#define SMX_CHECK_OFFSET(T, f, n) SMX_STATIC_ASSERT(offsetof(T, f) == n, #T "." #f)',
        "#endif",
    ]
    for lay in (MAP, FWD, BWD):
        out.append(f'SMX_STATIC_ASSERT(sizeof({lay.cname}) == {lay.size}, "{lay.cname} size");')
        for path, off in lay.offsets.items():
            out.append(f"SMX_CHECK_OFFSET({lay.cname}, {path}, {off});")
    return out


def c_header() -> str:
    """The text of cuda_src/softmax_params.cuh."""
    out = [
        "// drvsoftmax kernel parameters.  GENERATED by drvsoftmax/_params.py: edit that file and",
        "// run `python -m drvsoftmax._params` (a CPU test checks this file is current).",
        "#pragma once",
        "",
    ]
    return "\n".join(out + c_layout()) + "\n"


# The kernels' arguments, in order: device pointers (8 bytes each; a missing mask or
# key_lengths is a null pointer), then the parameter struct by value.
FWD_ARGS = ("x", "y", "mask", "key_lengths")
BWD_ARGS = ("dy", "y", "dx")


def kernel_signature(name: str) -> list[str]:
    """The parameter list of the kernel `name` (a name expression of `_plan`), as the
    manifest records it: ``["ptr x", ..., "SmxFwdParams (1312 bytes)"]``."""
    ptrs: tuple[str, ...]
    if name.startswith("smx_fwd"):
        ptrs, lay = FWD_ARGS, FWD
    elif name.startswith("smx_bwd"):
        ptrs, lay = BWD_ARGS, BWD
    else:
        raise ValueError(f"not a drvsoftmax kernel name: {name!r}")
    return [f"ptr {p}" for p in ptrs] + [f"{lay.cname} ({lay.size} bytes)"]


if __name__ == "__main__":
    from pathlib import Path

    p = Path(__file__).resolve().parent.parent / "cuda_src" / "softmax_params.cuh"
    p.write_text(c_header())
    print(f"wrote {p}")
