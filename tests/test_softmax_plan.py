"""The pure-Python planner (`_plan`) and geometry (`_core`), without a GPU.

* Which tier, kernel, threads per row and block each boundary row length selects.
* Every kernel a plan can name is compiled (is in all_kernel_names()), and every compiled
  kernel is reachable by some input: no dead variants, no plans without a kernel.
* Leading-dim merging and broadcasting of operands, checked against a brute-force offset map.
* FWD_STRUCT / BWD_STRUCT against the C structs parsed from cuda_src, so the two cannot drift,
  and the packed parameters of a prepared launch read back field by field under C names.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import drvsoftmax
from drvsoftmax import _args, _compiler, _core, _plan

DTYPES = list(_plan.X_DTYPES)  # float16, bfloat16, float32
MASK_KINDS = list(_plan.MASK_KINDS)
ITEMSIZE = {dt: _plan.X_DTYPES[dt][1] for dt in DTYPES}


def _tpr(plan) -> int:
    return 1 << plan.tpr_log2


# ----------------------------------------------------------------------------------
# Tier selection at the boundaries.

# (Sk, tier, chunks per thread, threads per row).  16-bit dtypes: 8 elements per 16-byte
# chunk; the big register tier holds 32 values per thread forward (4 chunks) and 16 of y
# and of dy backward (2 chunks).
#   1, 2, 8     one chunk: one thread per row (short tier: n rows per thread)
#   9           two chunks: 2 threads
#   31,32,33    4 chunks (4 threads) / 5 chunks (8 threads)
#   256/257     32 chunks = a warp of 1-chunk threads, the short tier's end / 33 chunks -> register tier
#   32768/9     forward capacity: 1024 threads x 4 chunks / the looped tier
#   16384/5     backward capacity: 1024 threads x 2 chunks / the looped tier
FWD_16 = [
    (1, "short", 1, 1),
    (2, "short", 1, 1),
    (8, "short", 1, 1),
    (9, "short", 1, 2),
    (31, "short", 1, 4),
    (32, "short", 1, 4),
    (33, "short", 1, 8),
    (256, "short", 1, 32),
    (257, "register", 4, 16),
    (1024, "register", 4, 32),
    (1025, "register", 4, 64),
    (32768, "register", 4, 1024),
    (32769, "loop", 0, 1024),
]
BWD_16 = FWD_16[:7] + [
    (256, "short", 1, 32),
    (257, "register", 2, 32),
    (512, "register", 2, 32),
    (513, "register", 2, 64),
    (16384, "register", 2, 1024),
    (16385, "loop", 0, 1024),
    (32768, "loop", 0, 1024),
]
# fp32: 4 elements per chunk; 8 chunks per thread forward, 4 backward.
FWD_32 = [
    (1, "short", 1, 1),
    (4, "short", 1, 1),
    (5, "short", 1, 2),
    (128, "short", 1, 32),
    (129, "register", 8, 8),
    (1024, "register", 8, 32),
    (1025, "register", 8, 64),
    (32768, "register", 8, 1024),
    (32769, "loop", 0, 1024),
]
BWD_32 = FWD_32[:4] + [
    (129, "register", 4, 16),
    (512, "register", 4, 32),
    (513, "register", 4, 64),
    (16384, "register", 4, 1024),
    (16385, "loop", 0, 1024),
]
BOUNDARY_CASES = (
    [(dt, False, *b) for dt in ("float16", "bfloat16") for b in FWD_16]
    + [(dt, True, *b) for dt in ("float16", "bfloat16") for b in BWD_16]
    + [("float32", False, *b) for b in FWD_32]
    + [("float32", True, *b) for b in BWD_32]
)


@pytest.mark.parametrize("dtype,backward,sk,tier,nch,tpr", BOUNDARY_CASES)
def test_boundary_tiers(dtype, backward, sk, tier, nch, tpr):
    rows = 1000
    plan = (
        _plan.plan_backward(rows, sk, dtype, True) if backward else _plan.plan_forward(rows, sk, dtype, "hide1", True)
    )
    assert (plan.tier, plan.nch, _tpr(plan)) == (tier, nch, tpr), plan
    t = _plan.X_DTYPES[dtype][0]
    n = _plan.reg_nch(ITEMSIZE[dtype], _plan.BWD_VALUES) if backward else 4  # rows per thread, short tier
    if tier == "short":
        want = f"smx_bwd_short<{t}, {n}>" if backward else f"smx_fwd_short<{t}, MaskHide<smx_u8>, {n}>"
        assert plan.block == 128 and plan.rpt == n
        assert plan.grid == -(-rows // ((plan.block // tpr) * n))
    elif tier == "register":
        want = f"smx_bwd_reg<{t}, {nch}>" if backward else f"smx_fwd_reg<{t}, MaskHide<smx_u8>, {nch}>"
        assert plan.block == max(tpr, 128) and plan.rpt == 1
        assert plan.grid == -(-rows // (plan.block // tpr))
    else:
        want = f"smx_bwd_loop<{t}>" if backward else f"smx_fwd_loop<{t}, MaskHide<smx_u8>>"
        assert plan.block == 1024 and plan.grid == rows
    assert plan.kernel == want
    assert plan.vector is True


def _sweep_sks():
    sks = set(range(1, 300)) | {2**k + d for k in range(8, 17) for d in (-1, 0, 1)}
    sks |= {int(v) for v in np.geomspace(300, 70000, 60)} | {16384, 16385, 32768, 32769, 65536, 70000}
    return sorted(sks)


SWEEP = _sweep_sks()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sweep_plans_are_consistent_and_named_kernels_exist(dtype):
    names = set(_plan.all_kernel_names())
    per_chunk = 16 // ITEMSIZE[dtype]
    for sk in SWEEP:
        for rows in (1, 7, 4096):
            plans = [_plan.plan_forward(rows, sk, dtype, mk, vec) for mk in MASK_KINDS for vec in (True, False)]
            plans += [_plan.plan_backward(rows, sk, dtype, vec) for vec in (True, False)]
            for p in plans:
                assert p.kernel in names, (sk, p)
                assert p.block % 32 == 0 and 32 <= p.block <= 1024, p
                assert 1 <= p.grid <= _plan.MAX_GRID
                if p.tier in ("short", "register"):
                    tpr = _tpr(p)
                    big = _plan.reg_nch(ITEMSIZE[dtype], _plan.BWD_VALUES if "bwd" in p.kernel else _plan.REG_VALUES)
                    rpt = _plan.short_rows(ITEMSIZE[dtype], "bwd" in p.kernel)
                    assert (p.nch, p.rpt) == ((1, rpt) if p.tier == "short" else (big, 1)), p
                    assert tpr <= p.block and p.block % tpr == 0, p
                    assert p.tier == "register" or tpr <= 32, p  # short rows stay within a warp
                    # The row fits in tpr x nch chunks, and would not fit in half the threads.
                    assert tpr * p.nch * per_chunk >= sk, (sk, p)
                    assert tpr == 1 or (tpr // 2) * p.nch * per_chunk < sk, (sk, p)
                    assert p.grid * (p.block // tpr) * p.rpt >= rows
                else:
                    assert p.tier == "loop" and p.nch == 0 and p.grid == rows
                    assert sk > (32768 if "fwd" in p.kernel else 16384)
            # One tier per (Sk, dtype, direction): the mask kind never changes the shape.
            fwd = {(p.tier, p.nch, p.tpr_log2, p.block, p.grid) for p in plans if "fwd" in p.kernel}
            assert len(fwd) == 1, sk
            assert len({(p.tier, p.nch, p.tpr_log2, p.block, p.grid) for p in plans if "bwd" in p.kernel}) == 1, sk


def test_every_kernel_name_is_reachable():
    reached = set()
    for dtype in DTYPES:
        for sk in SWEEP:
            for mk in MASK_KINDS:
                reached.add(_plan.plan_forward(64, sk, dtype, mk, True).kernel)
            reached.add(_plan.plan_backward(64, sk, dtype, True).kernel)
    names = _plan.all_kernel_names()
    assert len(names) == len(set(names)), "duplicate kernel names"
    assert set(names) == reached, f"never planned: {sorted(set(names) - reached)}"
    assert names == _plan.all_kernel_names(), "the order must be stable (it keys caches)"


def test_every_mask_kind_is_reachable_from_some_dtype():
    kinds = set(_core.MASK_KIND_OF_DTYPE.values()) | {"none"}
    assert kinds == set(_plan.MASK_KINDS)
    assert set(_core.MASK_KIND_OF_DTYPE) == set(_args.MASK_DTYPES)
    assert set(_plan.X_DTYPES) == set(_args.X_DTYPES_GPU)
    # Hiding masks are dispatched on width only: each kind's width matches its dtypes.
    for dt, kind in _core.MASK_KIND_OF_DTYPE.items():
        if kind.startswith("hide"):
            width = 1 if dt == "bool" else np.dtype(dt).itemsize
            assert kind == f"hide{width}", dt
        else:
            assert kind == f"add_{dt}"


def test_grid_is_capped_for_huge_row_counts():
    for sk in (1, 100, 5000, 100000):
        p = _plan.plan_forward(2**40, sk, "float16", "none", True)
        assert p.grid == _plan.MAX_GRID  # the kernels loop over rows with a grid stride


def test_kernel_name_templates_are_instantiable_names():
    pat = re.compile(
        r"^smx_((fwd_short|fwd_reg)<\w+, \w+(<\w+>)?, [48]>|fwd_loop<\w+, \w+(<\w+>)?>|"
        r"(bwd_short|bwd_reg)<\w+, [24]>|bwd_loop<\w+>)$"
    )
    for n in _plan.all_kernel_names():
        assert pat.match(n), n
    n_fwd = len(DTYPES) * len(MASK_KINDS) * 3  # short, register and loop tiers
    n_bwd = len(DTYPES) * 3
    assert len(_plan.all_kernel_names()) == n_fwd + n_bwd


# ----------------------------------------------------------------------------------
# explain()


@pytest.mark.parametrize(
    "shape,dtype,kw,tier,needle",
    [
        ((2, 12, 128, 128), "float16", {}, "short", "smx_fwd_short<smx_f16, MaskNone, 4>"),
        ((2, 12, 128, 128), "bfloat16", {"mask_dtype": "bool"}, "short", "MaskHide<smx_u8>"),
        ((4, 1024), "float32", {"mask_dtype": "float64"}, "register", "MaskAdd<double>, 8>"),
        ((3, 40000), "float16", {"mask_dtype": "int32"}, "loop", "smx_fwd_loop<smx_f16, MaskHide<smx_u32>>"),
        ((3, 16385), "float32", {"backward": True}, "loop", "smx_bwd_loop<float>"),
        ((7, 9), "float16", {"backward": True}, "short", "smx_bwd_short<smx_f16, 2>"),
    ],
)
def test_explain_names_tier_and_kernel(shape, dtype, kw, tier, needle):
    text = drvsoftmax.explain(shape, dtype, **kw)
    assert isinstance(text, str)
    assert text.startswith(f"{tier} tier"), text
    assert needle in text and "threads per row" in text and "grid" in text


def test_explain_vector_access_and_errors():
    assert "16-byte vector" in drvsoftmax.explain((3, 64), "float16")
    assert "element-wise" in drvsoftmax.explain((3, 65), "float16")  # rows 65 elements apart: unaligned
    assert "16-byte vector" in drvsoftmax.explain((3, 68), "float32")
    with pytest.raises(drvsoftmax.ArgumentTypeError, match=r"^x must be of dtype .*got dtype float64"):
        drvsoftmax.explain((4, 8), "float64")
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^x must be at least 1-D.*got shape \(\)"):
        drvsoftmax.explain((), "float16")


@pytest.mark.parametrize("case", ["np_dtype", "bad_mask_dtype"])
def test_explain_dtype_objects_and_bad_mask_dtype(case):
    if case == "np_dtype":
        assert drvsoftmax.explain((4, 8), np.dtype("float16")) == drvsoftmax.explain((4, 8), "float16")
    else:
        with pytest.raises(drvsoftmax.ArgumentTypeError, match=r"^mask must be .*got dtype complex64"):
            drvsoftmax.explain((4, 8), "float16", mask_dtype="complex64")


# ----------------------------------------------------------------------------------
# merge_rows and broadcast_strides


def _contig(shape):
    return tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))


def test_merge_contiguous_to_one_dim():
    shape = (2, 3, 4, 40)
    st_ = _contig(shape)[:-1]
    rows, sizes, strides = _core.merge_rows(shape[:-1], [st_, st_])
    assert (rows, sizes, strides) == (24, [24], [[40], [40]])


def test_merge_drops_size_one_dims():
    shape = (2, 1, 4, 1, 40)
    st_ = _contig(shape)[:-1]
    rows, sizes, strides = _core.merge_rows(shape[:-1], [st_])
    assert (rows, sizes, strides) == (8, [8], [[40]])
    rows, sizes, strides = _core.merge_rows((1, 1), [(5, 5)])
    assert (rows, sizes, strides) == (1, [], [[]])


def test_transposed_views_do_not_merge():
    x = np.zeros((2, 3, 4, 40), np.float16).transpose(0, 2, 1, 3)  # [2, 4, 3, 40]
    st_ = tuple(s // 2 for s in x.strides[:-1])  # (480, 40, 160)
    rows, sizes, strides = _core.merge_rows(x.shape[:-1], [st_, _contig(x.shape)[:-1]])
    assert rows == 24 and sizes == [2, 4, 3] and strides == [[480, 40, 160], [480, 120, 40]]


def test_broadcast_operands():
    shape = (2, 3, 4, 40)
    x = _contig(shape)[:-1]
    m_b1qk = _core.broadcast_strides("mask", (2, 1, 4, 40), _contig((2, 1, 4, 40)), shape)
    assert m_b1qk == (160, 0, 40, 1)
    rows, sizes, strides = _core.merge_rows(shape[:-1], [x, m_b1qk[:-1]])
    assert sizes == [2, 3, 4] and strides[1] == [160, 0, 40]  # H is broadcast: nothing merges
    m_qk = _core.broadcast_strides("mask", (4, 40), (40, 1), shape)
    assert m_qk == (0, 0, 40, 1)
    rows, sizes, strides = _core.merge_rows(shape[:-1], [x, m_qk[:-1]])
    assert sizes == [6, 4] and strides == [[160, 40], [0, 40]]  # B and H merge: stride 0 in both
    m_11k = _core.broadcast_strides("mask", (1, 1, 1, 40), (40, 40, 40, 1), shape)
    assert m_11k == (0, 0, 0, 1)
    rows, sizes, strides = _core.merge_rows(shape[:-1], [x, m_11k[:-1]])
    assert sizes == [24] and strides == [[40], [0]]
    # Extra leading size-1 dims broadcast away; a size-1 dim of x gets stride 0.
    assert _core.broadcast_strides("mask", (1, 1, 4, 40), (9, 9, 40, 1), (4, 40)) == (40, 1)
    assert _core.broadcast_strides("m", (3, 1, 5), (5, 5, 1), (3, 1, 5)) == (5, 0, 1)


@pytest.mark.parametrize(
    "shape,target",
    [((3, 5), (2, 3, 4, 5)), ((4, 6), (2, 3, 4, 5)), ((2, 2, 3, 4, 5), (2, 3, 4, 5)), ((7, 1, 5), (5,))],
)
def test_broadcast_strides_errors(shape, target):
    with pytest.raises(drvsoftmax.ArgumentValueError) as info:
        _core.broadcast_strides("mask", shape, _contig(shape), target)
    msg = str(info.value)
    assert msg.startswith("mask must be broadcastable to x.shape") and f"got shape {shape}" in msg


def _row_offsets(sizes, strides, row):
    """smx_row_offsets of softmax_common.cuh: innermost dim last."""
    off = [0] * len(strides)
    for d in range(len(sizes) - 1, -1, -1):
        row, i = divmod(row, sizes[d])
        for k in range(len(strides)):
            off[k] += i * strides[k][d]
    return off


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    perm_seed=st.integers(0, 2**16),
    mask_keep=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_merged_geometry_gives_the_same_offsets(shape, perm_seed, mask_keep):
    """Merging is invisible: every row maps to the offsets the unmerged layout gives."""
    rng = np.random.default_rng(perm_seed)
    lead = tuple(shape)
    # x: a permuted (transposed) view of a contiguous buffer; y contiguous; mask broadcast.
    perm = rng.permutation(len(lead))
    base = _contig(tuple(lead[p] for p in perm))
    x_st = tuple(base[list(perm).index(i)] for i in range(len(lead)))
    y_st = _contig(lead)
    mshape = tuple(n if keep else 1 for n, keep in zip(lead, mask_keep, strict=False))
    m_st = _core.broadcast_strides("mask", mshape, _contig(mshape), lead)
    ops = [x_st, y_st, m_st]
    rows, sizes, strides = _core.merge_rows(lead, ops)
    assert rows == int(np.prod(lead))
    assert all(n > 1 for n in sizes) and len(sizes) <= len(lead)
    for row in range(rows):
        idx = np.unravel_index(row, lead)
        want = [sum(int(i) * s for i, s in zip(idx, op, strict=True)) for op in ops]
        assert _row_offsets(sizes, strides, row) == want, (lead, ops, sizes, strides, row)


def test_geometry_beyond_maxd_is_an_argument_error():
    sizes = [2] * (_core.MAXD + 1)
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^x must be a layout whose leading dims merge"):
        _core._geom_fields(2 ** len(sizes), sizes, [[3**i for i in range(len(sizes))]])


# ----------------------------------------------------------------------------------
# The parameter structs, against the C source.

C_CODES = {"smx_i64": "q", "long long": "q", "int": "i", "float": "f", "smx_u32": "I"}


def _c_defines(text):
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"#define\s+(\w+)\s+(-?\d+)\b", text)}


def _c_struct_fields(text, name, defines):
    """[(field name, C type, [array dims])] of `struct name { ... };`, comments stripped."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, flags=re.S)
    assert m, f"struct {name} not found"
    fields = []
    for decl in m.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        dm = re.match(r"^((?:long long|[A-Za-z_]\w*))\s+(.*)$", decl)
        assert dm, decl
        ctype = dm.group(1)
        for item in dm.group(2).split(","):
            item = item.strip()
            nm = re.match(r"^(\w+)((?:\[\w+\])*)$", item)
            assert nm, item
            dims = [int(d) if d.isdigit() else defines[d] for d in re.findall(r"\[(\w+)\]", nm.group(2))]
            fields.append((nm.group(1), ctype, dims))
    return fields


def _flatten(fields, structs, prefix=""):
    """[(qualified name, struct code)] with arrays expanded, nested structs inlined."""
    out = []
    for name, ctype, dims in fields:
        for idx in np.ndindex(*dims) if dims else [()]:
            q = prefix + name + "".join(f"[{i}]" for i in idx)
            if ctype in structs:
                out += _flatten(structs[ctype], structs, q + ".")
            else:
                out.append((q, C_CODES[ctype]))
    return out


def _c_layout(codes):
    """C natural-alignment offsets and size (every member here aligns to its own size)."""
    off, offsets, align = 0, [], 1
    for c in codes:
        n = struct.calcsize(c)
        off = -(-off // n) * n
        offsets.append(off)
        off += n
        align = max(align, n)
    return offsets, -(-off // align) * align


def _py_layout(fmt):
    """Member codes and offsets of a '<'-struct format, pads ('x') skipped."""
    codes, offsets, off = [], [], 0
    for count, c in re.findall(r"(\d*)([a-zA-Z?])", fmt.lstrip("<=!>@")):
        for _ in range(int(count or 1)):
            if c != "x":
                codes.append(c)
                offsets.append(off)
            off += struct.calcsize("<" + c)
    return codes, offsets, off


def _parsed_structs():
    src = _compiler.source_dir()
    common = (src / "softmax_common.cuh").read_text()
    fwd = (src / "softmax_fwd.cu").read_text()
    bwd = (src / "softmax_bwd.cu").read_text()
    defines = {**_c_defines(common), **_c_defines(fwd), **_c_defines(bwd)}
    structs = {"RowGeom": _c_struct_fields(common, "RowGeom", defines)}
    structs["FwdParams"] = _c_struct_fields(fwd, "FwdParams", defines)
    structs["BwdParams"] = _c_struct_fields(bwd, "BwdParams", defines)
    return structs, defines


def test_struct_sizes():
    assert _core.FWD_STRUCT.size == 400
    assert _core.BWD_STRUCT.size == 392


@pytest.mark.parametrize("cname,pystruct", [("FwdParams", _core.FWD_STRUCT), ("BwdParams", _core.BWD_STRUCT)])
def test_python_struct_mirrors_the_c_struct(cname, pystruct):
    structs, defines = _parsed_structs()
    flat = _flatten(structs[cname], structs)
    c_codes = [c for _, c in flat]
    c_offsets, c_size = _c_layout(c_codes)
    py_codes, py_offsets, py_size = _py_layout(pystruct.format)
    assert py_codes == c_codes, f"{cname}: field order/count differs:\nC  {''.join(c_codes)}\npy {''.join(py_codes)}"
    assert py_offsets == c_offsets, f"{cname}: implicit C padding the Python format does not have"
    assert py_size == c_size == pystruct.size


def test_constants_match_the_c_defines():
    _, defines = _parsed_structs()
    assert defines["SMX_MAXD"] == _core.MAXD and defines["SMX_NOP"] == _core.NOP
    assert defines["SMX_F_CAUSAL"] == _core.F_CAUSAL and defines["SMX_F_KLEN"] == _core.F_KLEN
    assert defines["SMX_F_KLEN64"] == _core.F_KLEN64 and defines["SMX_F_VEC"] == _core.F_VEC
    assert defines["SMX_B_VEC"] == _core.F_VEC


class _FakeDevice:
    ordinal = 0

    def kernel(self, name):
        return f"<CUfunction {name}>"


def _unpack(cname, pystruct, prep):
    structs, _ = _parsed_structs()
    names = [n for n, _ in _flatten(structs[cname], structs)]
    raw = bytes(prep.params.raw)
    assert len(raw) == pystruct.size
    return dict(zip(names, pystruct.unpack(raw), strict=True))


def test_prepared_forward_parameters_read_back_under_c_names():
    Op = _core.Operand
    shape = (2, 3, 4, 40)
    x = Op(0x1000, "float16", shape, _contig(shape))
    y = Op(0x2000, "float16", shape, _contig(shape))
    mask = Op(0x3000, "bool", (2, 1, 4, 40), _contig((2, 1, 4, 40)))
    klen = Op(0x4000, "int64", (2,), (1,))
    prep = _core.prepare_forward(_FakeDevice(), x, y, mask, klen, True, 0.125, True)
    f = _unpack("FwdParams", _core.FWD_STRUCT, prep)
    assert prep.kernel == "<CUfunction smx_fwd_short<smx_f16, MaskHide<smx_u8>, 4>>" and prep.nargs == 5
    assert f["g.rows"] == 24 and f["g.ndim"] == 3 and f["g.small"] == 1
    assert [f[f"g.size[{d}]"] for d in range(6)] == [2, 3, 4, 1, 1, 1]
    stride = [[f[f"g.stride[{k}][{d}]"] for d in range(3)] for k in range(5)]
    # operands: 0 x, 1 y, 2 mask, 3 key_lengths (stride 1 along B), 4 query index (stride 1 along Sq)
    assert stride == [[480, 160, 40], [480, 160, 40], [160, 0, 40], [1, 0, 0], [0, 0, 1]]
    assert (f["sk"], f["sx"], f["sy"], f["sm"], f["causal_shift"]) == (40, 1, 1, 1, 36)
    assert f["scale"] == 0.125
    assert f["flags"] == _core.F_CAUSAL | _core.F_KLEN | _core.F_KLEN64 | _core.F_VEC
    assert f["tpr_log2"] == prep.plan.tpr_log2 == 3  # 5 chunks -> 8 threads
    assert (prep.grid, prep.block) == (prep.plan.grid, prep.plan.block) == (1, 128)
    # Division by the inner sizes (3 and 4) through multiply-high and shift; the outermost needs none.
    for d, n in ((1, 3), (2, 4)):
        m, sh = f[f"g.mul[{d}]"], f[f"g.shr[{d}]"]
        assert all(((r * m) >> 32) >> sh == r // n for r in range(0, 5000, 7))


def test_prepared_forward_strided_int32_klen_no_vector():
    Op = _core.Operand
    shape = (3, 5, 33)
    x = Op(0x1008, "float32", shape, (400, 66, 2))  # last-dim stride 2: element-wise
    y = Op(0x2000, "float32", shape, _contig(shape))
    klen = Op(0x4000, "int32", (3,), (1,))
    prep = _core.prepare_forward(_FakeDevice(), x, y, None, klen, False, -2.0, False)
    f = _unpack("FwdParams", _core.FWD_STRUCT, prep)
    assert f["flags"] == _core.F_KLEN and f["causal_shift"] == 0 and f["scale"] == -2.0
    assert (f["sk"], f["sx"], f["sy"], f["sm"]) == (33, 2, 1, 0)
    assert f["g.ndim"] == 2 and [f["g.size[0]"], f["g.size[1]"]] == [3, 5]
    assert prep.plan.vector is False and "MaskNone" in prep.plan.kernel


def test_prepared_backward_parameters_read_back_under_c_names():
    Op = _core.Operand
    shape = (6, 50000)
    c = _contig(shape)
    prep = _core.prepare_backward(
        _FakeDevice(), Op(0, "bfloat16", shape, c), Op(0, "bfloat16", shape, c), Op(0, "bfloat16", shape, c), 0.5, True
    )
    f = _unpack("BwdParams", _core.BWD_STRUCT, prep)
    assert prep.plan.tier == "loop" and prep.kernel == "<CUfunction smx_bwd_loop<smx_bf16>>" and prep.nargs == 4
    assert f["g.rows"] == 6 and f["g.ndim"] == 1 and f["g.size[0]"] == 6
    assert [f[f"g.stride[{k}][0]"] for k in range(5)] == [50000, 50000, 50000, 0, 0]
    assert (f["sk"], f["sdy"], f["sy"], f["sdx"], f["scale"]) == (50000, 1, 1, 1, 0.5)
    assert f["flags"] == _core.F_VEC and f["tpr_log2"] == 10
