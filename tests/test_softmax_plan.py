"""The pure-Python planner (`_plan`), row maps (`_core`) and parameter structs (`_params`),
without a GPU.

* Which kernel, chunks per thread, rows per thread and threads per row each boundary row
  length selects, and that every planned row fits the launch it gets.
* Every kernel a plan can name is compiled (is in all_kernel_names()), every compiled
  kernel is reachable, and the packaged set covers every common configuration.
* Row maps against a brute-force offset map of arbitrary layouts and broadcasts.
* The C header is what `_params.c_header()` writes, a C compiler accepts its size and
  offset checks (and rejects a wrong one), and prepared launches read back by C name.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from helpers import plan_of
from hypothesis import given, settings
from hypothesis import strategies as st

import drvsoftmax
from drvsoftmax import _args, _compiler, _core, _params, _plan

DTYPES = list(_plan.X_DTYPES)  # float16, bfloat16, float32
H200 = _plan.DeviceCaps(90, 232448)  # sm_90, 227 KB of shared memory per block
MASK_KINDS = list(_plan.MASK_KINDS)
ITEMSIZE = {dt: _plan.X_DTYPES[dt][1] for dt in DTYPES}


def _tpr(plan) -> int:
    return plan.tpr


def _contig(shape):
    return tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))


# ----------------------------------------------------------------------------------
# The register tier's tables at their boundaries.  16-bit: 8 elements per 16-byte chunk;
# fp32: 4.  Rows that may start off a 16-byte boundary (aligned_rows=False) touch one
# chunk more.  Rows that are whole chunks (aligned, Sk a multiple of the chunk) run the
# whole-chunk kernels (AL), the others the general ones.
#   (Sk, aligned rows, whole, forward (nch, rpt) or "loop", backward, threads per row)
CASES_16 = [
    (1, True, False, (2, 1), (2, 2), 1),
    (16, True, True, (2, 1), (2, 2), 1),
    (17, True, False, (2, 1), (2, 2), 2),
    (32, True, True, (2, 1), (2, 2), 2),
    (31, False, False, (2, 1), (2, 2), 4),  # 4 chunks + 1 for misalignment
    (128, True, True, (2, 1), (2, 2), 8),
    (512, True, True, (2, 1), (2, 2), 32),  # 64 chunks: the last rows within a warp
    (513, True, False, (4, 1), (4, 1), 32),
    (520, True, True, (4, 1), (4, 1), 32),
    (4096, True, True, (4, 1), (4, 1), 128),  # rows span 4 warps, 2 rows per block
    (4097, True, False, (4, 1), (4, 1), 160),  # 5 warps: a block per row
    (4090, False, False, (4, 1), (4, 1), 160),  # 512 chunks + 1 for misalignment
    (16384, True, True, (4, 1), (4, 1), 512),  # a row per 512-thread block
    (16376, True, True, (4, 1), (4, 1), 512),
    (16383, True, False, (4, 1), (4, 1), 512),
    (16385, True, False, "loop", "loop", 256),
    (16384, False, False, "loop", "loop", 256),
]
CASES_32 = [
    (8, True, True, (2, 1), (2, 2), 1),
    (16, True, True, (2, 1), (2, 2), 2),
    (17, True, False, (2, 1), (2, 2), 4),
    (256, True, True, (2, 1), (2, 2), 32),
    (257, True, False, (4, 1), (4, 1), 32),
    (260, True, True, (4, 1), (4, 1), 32),
    (2048, True, True, (4, 1), (4, 1), 128),
    (2049, True, False, (4, 1), (4, 1), 160),
    (8192, True, True, (4, 1), (4, 1), 512),
    (8193, True, False, (8, 1), (8, 1), 288),  # 9 warps x 8 chunks
    (8196, True, True, (8, 1), (8, 1), 288),
    (16384, True, True, (8, 1), (8, 1), 512),
    (16383, True, False, (8, 1), (8, 1), 512),
    (16385, True, False, "loop", "loop", 256),
]
BOUNDARY_CASES = [(dt, bwd, *c) for dt in ("float16", "bfloat16") for bwd in (False, True) for c in CASES_16]
BOUNDARY_CASES += [("float32", bwd, *c) for bwd in (False, True) for c in CASES_32]


@pytest.mark.parametrize("dtype,backward,sk,aligned,whole,fcfg,bcfg,tpr", BOUNDARY_CASES)
def test_boundary_configs(dtype, backward, sk, aligned, whole, fcfg, bcfg, tpr):
    rows = 1000
    if backward:
        plan = _plan.plan_backward(rows, sk, dtype, True, aligned)
    else:
        plan = _plan.plan_forward(rows, sk, dtype, "hide1", True, aligned)
    t = _plan.X_DTYPES[dtype][0]
    cfg = bcfg if backward else fcfg
    assert _tpr(plan) == tpr, plan
    if cfg == "loop":
        assert plan.tier == "loop" and plan.grid == rows and plan.block == _plan.BLOCK and not plan.whole
        assert plan.kernel == (f"smx_bwd_loop<{t}, 4>" if backward else f"smx_fwd_loop<{t}, MaskHide<smx_u8>, 4>")
        return
    nch, rpt = cfg
    assert plan.tier == "register" and (plan.nch, plan.rpt) == (nch, rpt)
    al = "true" if whole else "false"
    want = f"smx_bwd<{t}, {nch}, {rpt}, {al}>" if backward else f"smx_fwd<{t}, MaskHide<smx_u8>, {nch}, {rpt}, {al}>"
    assert plan.kernel == want and plan.whole == whole
    pow2 = tpr & (tpr - 1) == 0
    own = not backward  # a masked forward: rows of more than a warp get a block each
    assert plan.block == (128 if tpr <= 32 else (tpr if own else max(256, tpr)) if pow2 else tpr)
    assert plan.grid == -(-rows // ((plan.block // tpr) * rpt))
    assert plan.vector is True


# Rows of 2 or 4 warps: a block each in a masked or causal forward, blocks of BLOCK threads
# (several rows) otherwise.  (dtype, Sk, mask kind, causal, backward, threads per row, block)
OWN_BLOCK_CASES = [
    ("float16", 2048, "hide1", False, False, 64, 64),
    ("float16", 4096, "add_float16", False, False, 128, 128),
    ("bfloat16", 2048, "add_bfloat16", False, False, 64, 64),
    ("float32", 2048, "add_float32", False, False, 64, 64),  # 8 chunks per thread (wide mask)
    ("float32", 1024, "hide1", False, False, 64, 64),
    ("float16", 2048, "none", True, False, 64, 64),  # causal
    ("float16", 4097, "none", True, False, 128, 128),  # causal, edged rows (512 whole chunks)
    ("float16", 16384, "hide1", False, False, 512, 512),  # a block of one row either way
    ("float16", 1024, "hide1", False, False, 32, 128),  # within a warp: rows share blocks
    ("float32", 1024, "none", False, False, 64, 256),  # no mask: rows share blocks
    ("bfloat16", 4097, "none", False, False, 64, 256),
    ("float16", 2048, "none", False, True, 64, 256),  # backward: rows share blocks
]


@pytest.mark.parametrize("dtype,sk,mk,causal,backward,tpr,block", OWN_BLOCK_CASES)
def test_masked_and_causal_forwards_give_wide_rows_a_block_each(dtype, sk, mk, causal, backward, tpr, block):
    rows = 1000
    if backward:
        plan = _plan.plan_backward(rows, sk, dtype, True, True)
    else:
        plan = _plan.plan_forward(rows, sk, dtype, mk, True, True, causal=causal)
    assert plan.tier == "register" and _tpr(plan) == tpr and plan.block == block, plan
    assert plan.grid == -(-rows // ((block // tpr) * plan.rpt))
    assert ("a block per row" in plan.reason) == (32 < tpr < 256 and block == tpr), plan.reason


# 16-bit forwards without a mask on whole-chunk rows of more than LEAN_FROM chunks: the
# lean kernels (8 chunks per thread, values computed afresh in each pass).
#   (Sk, threads per row, block)
LEAN_CASES = [
    (1024, 32, 128, False),  # 128 chunks: still the 4-chunk row
    (1032, 32, 128, True),  # 129 chunks / 8
    (2048, 32, 128, True),
    (4096, 64, 256, True),
    (12000, 192, 192, True),  # 1500 chunks: 188 threads, a block of 6 warps per row
    (16376, 256, 256, True),
    (16384, 256, 256, True),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sk,tpr,block,lean", LEAN_CASES)
def test_lean_kernels_take_long_16bit_rows_without_a_mask(dtype, sk, tpr, block, lean):
    t = _plan.X_DTYPES[dtype][0]
    plan = _plan.plan_forward(1000, sk, dtype, "none", True, True)
    nch = _plan.LEAN_NCH if lean else 4
    assert plan.tier == "register" and plan.whole and (plan.nch, plan.rpt) == (nch, 1), plan
    assert plan.kernel == f"smx_fwd<{t}, MaskNone, {nch}, 1, true>"
    assert (_tpr(plan), plan.block) == (tpr, block), plan
    assert plan.grid == -(-1000 // (block // tpr))
    assert plan.kernel in _plan.packaged_kernel_names()
    # Not lean: a mask, causal, element-wise access, the backward.
    for other in (
        _plan.plan_forward(1000, sk, dtype, "none", True, True, causal=True),
        _plan.plan_forward(1000, sk, dtype, "hide1", True, True),
        _plan.plan_forward(1000, sk, dtype, f"add_{dtype}", True, True),
        _plan.plan_forward(1000, sk, dtype, "none", False, True),
        _plan.plan_backward(1000, sk, dtype, True, True),
    ):
        assert other.nch == 4, other
    # Rows off the chunk grid (4097 etc.) are edged: lean in the general kernel beyond
    # LEAN_FROM whole chunks, not when causal.
    for k, aligned in ((sk, False), (sk + 1, True), (sk + 1, False)):
        if k > 16384:  # (beyond the register tier)
            continue
        edged = _plan.plan_forward(1000, k, dtype, "none", True, aligned)
        assert not edged.whole and "edged rows" in edged.reason, edged
        assert edged.kernel == f"smx_fwd<{t}, MaskNone, {nch}, 1, false>", edged
        assert edged.kernel in _plan.packaged_kernel_names()
        assert _plan.plan_forward(1000, k, dtype, "none", True, aligned, causal=True).nch == 4


@pytest.mark.parametrize("dtype,sk,nch", [("float16", 77, 2), ("bfloat16", 4097, 8), ("float32", 197, 2)])
def test_edged_rows_are_planned_by_their_whole_chunks(dtype, sk, nch):
    """Rows off the 16-byte grid without a mask: threads for the row's whole 16-byte blocks,
    the keys outside them one per lane (two at 2 chunks per thread); a mask, element-wise
    access or an fp32 row of more chunks take the general path's one chunk more."""
    item, n = _plan.X_DTYPES[dtype][1], 16 // _plan.X_DTYPES[dtype][1]
    plan = _plan.plan_forward(10, sk, dtype, "none", True, False)
    assert "edged rows" in plan.reason and plan.nch == nch and not plan.whole, plan
    assert _tpr(plan) == 1 << (-(-(sk // n) // nch) - 1).bit_length(), plan
    assert _plan.edged_kernel(item, plan.nch, plan.rpt, _tpr(plan))
    assert _tpr(plan) * _plan.edge_slots(plan.nch) >= 2 * (n - 1)
    for other in (
        _plan.plan_forward(10, sk, dtype, "hide1", True, False),
        _plan.plan_forward(10, sk, dtype, "none", False, False),
        _plan.plan_forward(10, 4097, "float32", "none", True, False),
    ):
        assert "edged rows" not in other.reason, other
    # Too few lanes for the edges: the general path (fp16 Sk 60: 7 whole chunks, 4 threads).
    assert "edged rows" not in _plan.plan_forward(10, 60, "float16", "none", True, False).reason
    assert not _plan.edged_kernel(2, 2, 1, 4) and _plan.edged_kernel(2, 2, 1, 8) and not _plan.edged_kernel(2, 4, 1, 8)
    assert not _plan.edged_kernel(4, 4, 1, 64) and _plan.edged_kernel(4, 2, 1, 4)


def test_lean_rows_are_16bit_without_a_mask_on_whole_chunks():
    assert _plan.lean_rows(2, "none", True)
    assert not _plan.lean_rows(2, "none", False)
    assert not _plan.lean_rows(2, "none", True, causal=True)
    assert not _plan.lean_rows(4, "none", True)
    assert not any(_plan.lean_rows(2, mk, True) for mk in _plan.MASK_KINDS if mk != "none")


def test_whole_chunk_kernels_need_every_operand_whole():
    """A mask that is not read a chunk at a time, a mask kind without whole-chunk kernels,
    element-wise access or rows off the grid: the general kernel."""
    whole = _plan.plan_forward(100, 128, "float16", "hide1", True, True)
    assert whole.whole and whole.kernel.endswith(", true>")
    for plan in (
        _plan.plan_forward(100, 128, "float16", "hide1", True, True, mask_whole=False),
        _plan.plan_forward(100, 128, "float16", "hide4", True, True),
        _plan.plan_forward(100, 128, "float16", "add_float32", True, True),
        _plan.plan_forward(100, 128, "float16", "none", False, True),
        _plan.plan_forward(100, 128, "float16", "none", True, False),
        _plan.plan_backward(100, 128, "float16", False, True),
    ):
        assert not plan.whole and plan.kernel.endswith(", false>"), plan


def _sweep_sks():
    sks = set(range(1, 300)) | {2**k + d for k in range(8, 17) for d in (-1, 0, 1)}
    sks |= {int(v) for v in np.geomspace(300, 70000, 60)} | {16384, 16385, 32768, 32769, 65536, 70000}
    return sorted(sks)


SWEEP = _sweep_sks()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("aligned", [True, False])
def test_every_planned_row_fits_its_launch(dtype, backward, aligned):
    """Threads per row x chunks per thread cover the row's chunks, with at most half of
    the threads idle; blocks hold whole rows; grids cover every row."""
    names = set(_plan.all_kernel_names())
    for sk in SWEEP:
        for rows in (1, 7, 1000, 123457):
            p = (
                _plan.plan_backward(rows, sk, dtype, True, aligned)
                if backward
                else _plan.plan_forward(rows, sk, dtype, "none", True, aligned)
            )
            assert p.kernel in names
            chunks = _plan.row_chunks(sk, ITEMSIZE[dtype], aligned)
            if p.tier == "register":
                # The kernel's chunks: a row's whole 16-byte blocks where it takes the edged
                # path; the rows it was planned for: those where the plan says so.
                item, n = ITEMSIZE[dtype], 16 // ITEMSIZE[dtype]
                edged = (
                    not backward
                    and not _plan.whole_chunks(sk, item, True, aligned)
                    and _plan.edged_kernel(item, p.nch, p.rpt, _tpr(p))
                )
                assert _tpr(p) * p.nch >= (max(sk // n, 1) if edged else chunks), (sk, p)
                if "edged rows" in p.reason:
                    assert edged, (sk, p)
                    chunks = max(sk // n, 1)
                # No narrower row fits: half as many threads, or a warp less for rows of whole warps.
                narrower = _tpr(p) // 2 if _tpr(p) <= 32 else _tpr(p) - 32
                assert _tpr(p) == 1 or narrower * p.nch < chunks, (sk, p)
                assert p.block % _tpr(p) == 0 and p.block <= _plan.MAX_BLOCK
                rows_per_block = p.block // _tpr(p) * p.rpt
                assert (p.grid - 1) * rows_per_block < rows <= p.grid * rows_per_block
            else:
                assert p.grid == rows and p.block == _tpr(p) == _plan.BLOCK
                assert chunks > 2048 * (2 if ITEMSIZE[dtype] == 4 else 1)
                if not backward and ITEMSIZE[dtype] == 2:  # (edged rows: up to 16384 keys in registers)
                    assert sk > 16384, (sk, p)


def test_every_kernel_name_is_reachable(monkeypatch):
    # (the coop tier's masked and backward kernels: where COOP_WHERE_IT_FITS asks for them)
    monkeypatch.setattr(_plan, "COOP_WHERE_IT_FITS", True)
    # (the pipelined register tier's kernels of shapes it is not planned for by default)
    monkeypatch.setattr(_plan, "FORCE_PIPE", True)
    reached = set()
    a100 = _plan.DeviceCaps(80, 166912, 108)
    for dtype in DTYPES:
        # long rows: the cluster and coop tiers' register variants
        for sk in [*SWEEP, 262144, 524288, 2**20, 2**21, 2**22, 2**23]:
            for caps in (None, H200, a100):
                for mk in MASK_KINDS:
                    reached.add(_plan.plan_forward(64, sk, dtype, mk, True, True, caps).kernel)
                reached.add(_plan.plan_backward(64, sk, dtype, True, True, caps).kernel)
    # (the streamed cluster forward: fp32 rows no cluster holds, enough to fill the device,
    # where the coop tier is not asked for)
    monkeypatch.setattr(_plan, "COOP_WHERE_IT_FITS", False)
    for mk in _plan.STREAM_MASK_KINDS:
        reached.add(
            _plan.plan_forward(4096, 2**20, "float32", mk, True, True, _plan.DeviceCaps(90, 232448, 132)).kernel
        )
    # (the streamed cluster backward, of every dtype: under the hook)
    monkeypatch.setattr(_plan, "FORCE_STREAM", _plan.STREAM_SMEM)
    for dtype in DTYPES:
        reached.add(_plan.plan_backward(64, 2**20, dtype, True, True, H200).kernel)
    monkeypatch.setattr(_plan, "FORCE_STREAM", None)
    # (the split tier: the rows no cluster holds, where the coop tier is not asked for)
    monkeypatch.setattr(_plan, "FORCE_SPLIT", True)
    for dtype in DTYPES:
        for mk in MASK_KINDS:
            reached.add(_plan.plan_forward(64, 2**23, dtype, mk, True, True, H200).kernel)
        reached.add(_plan.plan_backward(64, 2**23, dtype, True, True, H200).kernel)
    names = _plan.all_kernel_names()
    assert len(names) == len(set(names)), "duplicate kernel names"
    assert set(names) == reached, f"never planned: {sorted(set(names) - reached)}"
    assert names == _plan.all_kernel_names(), "the order must be stable (it keys caches)"


def test_packaged_kernels_cover_the_common_configurations():
    """fp16/bf16/fp32 x none/bool/additive (x's dtype) up to 16384 keys, forward and
    backward, aligned or not: no compile at run time."""
    packaged = set(_plan.packaged_kernel_names())
    assert packaged <= set(_plan.all_kernel_names())
    for dtype in DTYPES:
        for sk in [s for s in SWEEP if s <= 16384]:
            for aligned in (True, False):
                if not aligned and sk > 16384 - 16 // ITEMSIZE[dtype] + 1:
                    continue  # one chunk more than the register tier holds: the looped tier
                for mk in ("none", "hide1", f"add_{dtype}"):
                    for causal in (False, True):
                        for caps in (None, H200):  # (on the H200: the pipelined tier's kernels)
                            k = _plan.plan_forward(4, sk, dtype, mk, True, aligned, caps, causal=causal).kernel
                            assert k in packaged, (dtype, sk, mk, causal, caps)
                assert _plan.plan_backward(4, sk, dtype, True, aligned).kernel in packaged


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


def test_grid_beyond_the_launch_limit_is_an_argument_error():
    p = _plan.plan_forward(2**37, 1, "float16", "none", True)
    assert p.grid == 2**37 // 128  # 128 threads x 1 row per block
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^x must be at most \d+ blocks of rows"):
        _plan.plan_forward(2**50, 100, "float16", "none", True)


# ----------------------------------------------------------------------------------
# explain()


@pytest.mark.parametrize(
    "shape,dtype,kw,tier,needle",
    [
        ((2, 12, 128, 128), "float16", {}, "register", "smx_fwd<smx_f16, MaskNone, 2, 1, true>"),
        ((2, 12, 128, 127), "float16", {}, "register", "smx_fwd<smx_f16, MaskNone, 2, 1, false>"),
        ((2, 12, 128, 128), "bfloat16", {"mask_dtype": "bool"}, "register", "MaskHide<smx_u8>"),
        ((4, 1024), "float32", {"mask_dtype": "float64"}, "register", "MaskAdd<double>, 8, 1, false>"),
        ((4, 1024), "float32", {"mask_dtype": "bool"}, "register", "MaskHide<smx_u8>, 4, 1, true>"),
        ((3, 40000), "float16", {"mask_dtype": "int32"}, "loop", "smx_fwd_loop<smx_f16, MaskHide<smx_u32>, 4>"),
        ((3, 16385), "float32", {"backward": True}, "loop", "smx_bwd_loop<float, 4>"),
        ((7, 9), "float16", {"backward": True}, "register", "smx_bwd<smx_f16, 2, 2, false>"),
        ((7, 16), "float16", {"backward": True}, "register", "smx_bwd<smx_f16, 2, 2, true>"),
    ],
)
def test_explain_names_tier_and_kernel(shape, dtype, kw, tier, needle):
    text = drvsoftmax.explain(shape, dtype, **kw)
    assert isinstance(text, str)
    assert text.startswith(f"{tier} tier"), text
    assert needle in text and "threads per row" in text and "grid" in text


def test_explain_vector_access_and_errors():
    assert "16-byte vector" in drvsoftmax.explain((3, 64), "float16")
    assert "16-byte vector" in drvsoftmax.explain((3, 65), "float16")  # odd rows: first/last chunk element-wise
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
# broadcast_strides and row maps


def test_broadcast_operands():
    shape = (2, 3, 4, 40)
    assert _core.broadcast_strides("mask", (2, 1, 4, 40), _contig((2, 1, 4, 40)), shape) == (160, 0, 40, 1)
    assert _core.broadcast_strides("mask", (4, 40), (40, 1), shape) == (0, 0, 40, 1)
    assert _core.broadcast_strides("mask", (1, 1, 1, 40), (40, 40, 40, 1), shape) == (0, 0, 0, 1)
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


def test_row_maps_of_common_layouts():
    lead = (2, 3, 4)  # [B, H, Sq] of x [2, 3, 4, 40]
    assert _core.row_map(lead, (480, 160, 40)) == [(1, 0, 40)]  # contiguous: row * Sk
    assert _core.row_map(lead, (160, 0, 40)) == [(1, 4, 40), (12, 0, 160)]  # mask [B,1,Sq,Sk]
    assert _core.row_map(lead, (0, 0, 40)) == [(1, 4, 40)]  # mask [Sq,Sk]
    assert _core.row_map(lead, (40, 0, 0)) == [(12, 0, 40)]  # mask [B,1,1,Sk]
    assert _core.row_map(lead, (1, 0, 0)) == [(12, 0, 1)]  # key_lengths: the batch index
    assert _core.row_map(lead, (0, 0, 1)) == [(1, 4, 1)]  # the causal query index
    assert _core.row_map(lead, (0, 0, 0)) == []  # fully broadcast
    assert _core.row_map((1, 5, 1), (99, 7, 99)) == [(1, 0, 7)]  # size-1 dims drop out
    assert _core.row_map((3, 4), (1, 3)) == [(1, 4, 3), (4, 0, 1)]  # transposed: no merge


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    perm_seed=st.integers(0, 2**16),
    keep=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_row_maps_give_the_offsets_of_the_unmerged_layout(shape, perm_seed, keep):
    """Merging and dropping are invisible: every row maps to the offset the layout gives,
    through the kernels' 32-bit magic division too."""
    rng = np.random.default_rng(perm_seed)
    lead = tuple(shape)
    perm = rng.permutation(len(lead))
    base = _contig(tuple(lead[p] for p in perm))
    x_st = tuple(base[list(perm).index(i)] for i in range(len(lead)))  # a transposed view
    mshape = tuple(n if k else 1 for n, k in zip(lead, keep, strict=False))
    m_st = _core.broadcast_strides("mask", mshape, _contig(mshape), lead)
    rows = int(np.prod(lead))
    for op in (x_st, m_st, _contig(lead)):
        terms = _core.row_map(lead, op)
        assert len(terms) <= len(lead) and all(s != 0 for _, _, s in terms)
        fields = _core._map_fields("m", terms, True)
        for row in range(rows):
            idx = np.unravel_index(row, lead)
            want = sum(int(i) * s for i, s in zip(idx, op, strict=True))
            assert _core.map_offset(terms, row) == want, (lead, op, terms, row)
            got = 0
            for t in range(fields["m.nterms"]):  # what smx_row_offset computes, small path
                mul, shr = fields["m.dmul"][t], fields["m.dshr"][t]
                q = ((row * mul) >> 32) >> shr if mul else row
                if fields["m.mod"][t]:
                    mm, ms = fields["m.mmul"][t], fields["m.mshr"][t]
                    q -= (((q * mm) >> 32) >> ms) * fields["m.mod"][t]
                got += q * fields["m.stride"][t]
            assert got == want


def test_magic_division_is_exact_below_2_31():
    rng = np.random.default_rng(7)
    for d in [2, 3, 7, 12, 640, 4097, 65535, 2**20 + 1, 2**31 - 1]:
        mul, shr = _core.magic_divisor(d)
        ns = [0, 1, d - 1, d, d + 1, 2**31 - 1] + list(rng.integers(0, 2**31, 200))
        assert all(((int(n) * mul) >> 32) >> shr == int(n) // d for n in ns), d


def test_row_maps_beyond_maxt_are_an_argument_error():
    lead = (2,) * (_core.MAXD + 1)
    strides = tuple(3**i for i in range(len(lead)))  # nothing merges
    with pytest.raises(drvsoftmax.ArgumentValueError, match=r"^x must be a layout whose leading dims merge"):
        _core.row_map(lead, strides)


def test_vector_access_rules():
    Op = _core.Operand
    shape = (3, 5, 4097)
    c = _contig(shape)
    x, y = Op(0, "float16", shape, c), Op(0, "float16", shape, c)
    assert _core._vector_ok(2, [x, y], shape[:-1])  # odd rows, shared strides: the same misalignment
    assert not _core.rows_aligned([x, y], shape[:-1], 8)
    y2 = Op(0, "float16", shape, (5 * 4104, 4104, 1))  # padded rows: misaligned unlike x
    assert not _core._vector_ok(2, [x, y2], shape[:-1])
    x3, y3 = Op(0, "float16", (3, 64), (72, 1)), Op(0, "float16", (3, 64), (64, 1))
    assert _core._vector_ok(2, [x3, y3], (3,)) and _core.rows_aligned([x3, y3], (3,), 8)
    assert not _core._vector_ok(2, [Op(0, "float16", (3, 64), (128, 2)), y3], (3,))  # strided along the row


# ----------------------------------------------------------------------------------
# The parameter structs: one definition, a generated header, checked by a C compiler.


def test_the_header_in_the_tree_is_generated_from_params():
    path = _compiler.source_dir() / "softmax_params.cuh"
    assert path.read_text() == _params.c_header(), "run `python -m drvsoftmax._params`"


def test_struct_sizes_and_layout():
    assert _params.MAP.size == 248 and _params.FWD.size == 72 + 5 * 248 and _params.BWD.size == 64 + 3 * 248
    for lay in (_params.MAP, _params.FWD, _params.BWD):
        offs = list(lay.offsets.values())
        assert offs == sorted(offs) and lay.size == lay.struct.size


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("lang", ["c", "c++"])
def test_a_c_compiler_checks_every_offset(tmp_path, lang):
    hdr = tmp_path / "softmax_params.cuh"
    hdr.write_text(_params.c_header())
    cmd = ["cc", "-fsyntax-only", "-x", lang, "-std=" + ("c11" if lang == "c" else "c++17"), str(hdr)]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    # A wrong offset must fail the compile: the checks have teeth.
    off = _params.FWD.offsets["scale"]
    good = f"SMX_CHECK_OFFSET(SmxFwdParams, scale, {off})"
    assert good in _params.c_header()
    hdr.write_text(_params.c_header().replace(good, f"SMX_CHECK_OFFSET(SmxFwdParams, scale, {off + 4})"))
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode != 0 and "SmxFwdParams.scale" in bad.stderr


def test_pack_unpack_round_trip():
    vals = {"rows": 12, "sk": 40, "flags": 3, "scale": 0.5, "map_x.nterms": 2, "map_x.div": [1, 12]}
    back = _params.FWD.unpack(_params.FWD.pack(vals))
    assert back["rows"] == 12 and back["sk"] == 40 and back["scale"] == 0.5
    assert back["map_x.div"] == [1, 12, 0, 0, 0, 0] and back["map_y.nterms"] == 0


class _FakeDevice:
    ordinal = 0

    def kernel(self, name):
        return f"<CUfunction {name}>"


def test_prepared_forward_parameters_read_back_under_c_names():
    Op = _core.Operand
    shape = (2, 3, 4, 40)
    x = Op(0x1000, "float16", shape, _contig(shape))
    y = Op(0x2000, "float16", shape, _contig(shape))
    mask = Op(0x3000, "bool", (2, 1, 4, 40), _contig((2, 1, 4, 40)))
    klen = Op(0x4000, "int64", (2,), (1,))
    # A mask whose alignment is not known to be 16 bytes: the general kernel; with it, the
    # whole-chunk kernel.
    whole = _core.prepare_forward(_FakeDevice(), x, y, mask, klen, True, 0.125, True, True)
    assert whole.kernel == "<CUfunction smx_fwd<smx_f16, MaskHide<smx_u8>, 2, 1, true>>"
    prep = _core.prepare_forward(_FakeDevice(), x, y, mask, klen, True, 0.125, True)
    f = _params.FWD.unpack(bytes(prep.params.raw))
    assert prep.kernel == "<CUfunction smx_fwd<smx_f16, MaskHide<smx_u8>, 2, 1, false>>" and prep.nargs == 5
    assert f["rows"] == 24 and f["sk"] == 40 and f["scale"] == 0.125
    assert (f["sx"], f["sy"], f["sm"], f["causal_shift"]) == (1, 1, 1, 36)
    assert f["flags"] == (
        _core.F_CAUSAL | _core.F_KLEN | _core.F_KLEN64 | _core.F_VEC | _core.F_MVEC | _core.F_SMALL | _core.F_SAMEMAP
    )
    assert f["span_x"] == 2 * 3 * 4 * 40 and f["span_m"] == 2 * 4 * 40
    assert f["tpr_log2"] == prep.plan.tpr_log2 == 2  # 5 chunks over 2 per thread -> 4 threads
    assert f["map_x.nterms"] == 1 and f["map_x.stride"][0] == 40 and f["map_x.dmul"][0] == 0
    assert f["map_m.nterms"] == 2 and f["map_m.mod"][:2] == [4, 0] and f["map_m.div"][:2] == [1, 12]
    assert f["map_k.nterms"] == 1 and f["map_k.div"][0] == 12
    assert f["map_q.nterms"] == 1 and f["map_q.mod"][0] == 4
    assert (prep.grid, prep.block) == (prep.plan.grid, prep.plan.block) == (1, 128)


def test_prepared_forward_strided_int32_klen_no_vector():
    Op = _core.Operand
    shape = (3, 5, 33)
    x = Op(0x1008, "float32", shape, (400, 66, 2))  # last-dim stride 2: element-wise
    y = Op(0x2000, "float32", shape, _contig(shape))
    klen = Op(0x4000, "int32", (3,), (1,))
    prep = _core.prepare_forward(_FakeDevice(), x, y, None, klen, False, -2.0, False)
    f = _params.FWD.unpack(bytes(prep.params.raw))
    assert f["flags"] == _core.F_KLEN | _core.F_SMALL and f["causal_shift"] == 0 and f["scale"] == -2.0
    assert (f["sk"], f["sx"], f["sy"], f["sm"]) == (33, 2, 1, 0)
    assert f["map_x.nterms"] == 2 and f["map_x.stride"][:2] == [66, 400]
    assert prep.plan.vector is False and "MaskNone" in prep.plan.kernel


def test_prepared_backward_parameters_read_back_under_c_names():
    Op = _core.Operand
    shape = (6, 50000)
    c = _contig(shape)
    prep = _core.prepare_backward(
        _FakeDevice(), Op(0, "bfloat16", shape, c), Op(0, "bfloat16", shape, c), Op(0, "bfloat16", shape, c), 0.5, True
    )
    f = _params.BWD.unpack(bytes(prep.params.raw))
    assert prep.plan.tier == "loop" and prep.kernel == "<CUfunction smx_bwd_loop<smx_bf16, 4>>" and prep.nargs == 4
    assert f["rows"] == 6 and [f[f"map_{k}.stride"][0] for k in ("dy", "y", "dx")] == [50000] * 3
    assert (f["sk"], f["sdy"], f["sy"], f["sdx"], f["scale"]) == (50000, 1, 1, 1, 0.5)
    assert f["flags"] == _core.F_VEC | _core.F_SMALL | _core.F_SAMEMAP and f["tpr_log2"] == 8
    assert f["span_dy"] == f["span_y"] == 6 * 50000


def _fwd_maps(v, name):
    """A row map (div, mod, stride terms) read back from forward_params' fields."""
    n = v[f"{name}.nterms"]
    return list(zip(v[f"{name}.div"][:n], v[f"{name}.mod"][:n], v[f"{name}.stride"][:n]))


@pytest.mark.parametrize(
    "shape, mshape, big",
    [
        ((2, 32, 4096, 4096), (2, 1, 4096, 4096), True),  # a mask per batch, shared by 32 heads: heads innermost
        ((2, 16, 512, 16384), (1, 1, 512, 16384), True),  # 48 MiB between uses
        ((8, 32, 2048, 2048), (8, 1, 2048, 2048), True),  # 24 MiB between uses (fp16 additive)
        ((8, 32, 1024, 2048), (8, 1, 1024, 2048), False),  # 12 MiB between uses: row-major
        ((2, 32, 4096, 4096), (2, 1, 1, 4096), False),  # a key-padding mask: reused at once
        ((3, 5, 7, 9), (3, 1, 7, 9), True),  # small, with the threshold lowered below
        ((3, 5, 7, 9), (1, 1, 7, 9), True),
        ((4, 3, 5, 6, 9), (4, 1, 5, 1, 9), True),
    ],
)
def test_mask_row_order_walks_every_row_once_with_consistent_maps(monkeypatch, shape, mshape, big):
    """Rows sharing a mask row run together where its reuse distance is large; whatever the
    order, launch row r maps every operand (x, y, mask, key_lengths, query index) to the same
    logical row, and the launch rows cover every logical row once."""
    import itertools

    if shape[-1] < 64:
        monkeypatch.setattr(_core, "MASK_REUSE_BYTES", 0)
    lead = shape[:-1]
    xs = _core_contiguous(shape)
    ms = _core_contiguous(mshape)
    x = _core.Operand(0, "float16", shape, xs)
    m = _core.Operand(0, "float16", mshape, ms)
    kl = _core.Operand(0, "int32", (shape[0],), (1,))
    v, _ = _core.forward_params(x, x, m, kl, True, 1.0, True, True)
    order = _core._mask_row_order(lead, shape[-1], 2, _core.broadcast_strides("mask", mshape, ms, shape), m)
    assert (order != tuple(range(len(lead)))) == big
    mst = _core.broadcast_strides("mask", mshape, ms, shape)
    rows = 1
    for n in lead:
        rows *= n
    seen = set()
    sample = range(rows) if rows <= 5000 else itertools.chain(range(3000), range(rows - 3000, rows))
    for r in sample:
        ox = _core.map_offset(_fwd_maps(v, "map_x"), r)
        assert ox % shape[-1] == 0
        idx, rem = [], ox // shape[-1]
        for n in reversed(lead):
            idx.append(rem % n)
            rem //= n
        idx.reverse()
        assert rem == 0 and tuple(idx) not in seen
        seen.add(tuple(idx))
        assert _core.map_offset(_fwd_maps(v, "map_y"), r) == ox
        assert _core.map_offset(_fwd_maps(v, "map_m"), r) == sum(i * s for i, s in zip(idx, mst[:-1]))
        assert _core.map_offset(_fwd_maps(v, "map_k"), r) == idx[0]
        assert _core.map_offset(_fwd_maps(v, "map_q"), r) == idx[-1]
    if rows <= 5000:
        assert len(seen) == rows


@pytest.mark.parametrize(
    "mdtype, xdtype, inner",
    [
        ("bool", "float16", False),
        ("float16", "float16", True),
        ("bfloat16", "bfloat16", True),
        ("bool", "float32", True),
    ],
)
def test_mask_row_order_limit_between_bool_and_additive_16bit_at_2048_keys(mdtype, xdtype, inner):
    """[8,32,2048,2048] with a mask [8,1,2048,2048]: 20 MiB of x, y and a bool mask pass
    between two uses of one mask row (row-major), 24 MiB with a 16-bit additive one and 36 MiB
    with a bool mask on fp32 x (heads innermost): the limit, MASK_REUSE_BYTES, lies between."""
    shape, mshape = (8, 32, 2048, 2048), (8, 1, 2048, 2048)
    ms = _core_contiguous(mshape)
    m = _core.Operand(0, mdtype, mshape, ms)
    mst = _core.broadcast_strides("mask", mshape, ms, shape)
    itemsize = 4 if xdtype == "float32" else 2
    order = _core._mask_row_order(shape[:-1], shape[-1], itemsize, mst, m)
    assert order == ((0, 2, 1) if inner else (0, 1, 2))


def _core_contiguous(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


# ----------------------------------------------------------------------------------
# The pipelined register tier: whole-chunk register-tier shapes on devices of
# PIPE_MIN_CC and newer, where `pipe_rows` takes them; the grid is what the device holds
# (set at launch), the block and the per-thread shape are the register tier's.
PIPE_CASES = [
    # dtype, Sk, mask kind, causal, planned by default on the H200, with FORCE_PIPE
    ("float16", 2048, "none", True, False, False),
    ("bfloat16", 128, "hide1", False, False, False),
    ("float16", 16384, "add_float16", False, False, False),
    ("float32", 16384, "hide1", False, False, False),
    ("float32", 256, "add_float32", False, False, False),  # 2 chunks per thread: no kernel
    ("float32", 1000, "add_float32", False, False, True),  # 8 chunks x 32 threads, rows within a warp
    ("float32", 4096, "add_float32", False, False, True),  # 128 threads: four blocks per SM
    ("float32", 8192, "add_float32", False, False, True),  # 256 threads: two blocks per SM
    ("float32", 8196, "add_float32", False, True, True),  # 264 threads in a block of 288: one per SM
    ("float32", 16384, "add_float32", False, True, True),
    ("float32", 16384, "add_float32", True, True, True),
]


@pytest.mark.parametrize("dtype,sk,mk,causal,default,forced", PIPE_CASES)
def test_pipelined_tier_takes_the_register_shape(monkeypatch, dtype, sk, mk, causal, default, forced):
    reg = _plan.plan_forward(1000, sk, dtype, mk, True, True, None, causal=causal)
    item = _plan.X_DTYPES[dtype][1]
    assert _plan.pipe_rows(item, mk, causal, reg.nch, reg.tpr) == default
    plan = _plan.plan_forward(1000, sk, dtype, mk, True, True, H200, causal=causal)
    if not default:
        assert plan == reg
        monkeypatch.setattr(_plan, "FORCE_PIPE", True)
        assert _plan.pipe_rows(item, mk, causal, reg.nch, reg.tpr) == forced
        plan = _plan.plan_forward(1000, sk, dtype, mk, True, True, H200, causal=causal)
        if not forced:
            assert plan == reg
            return
    assert plan.tier == "pipe" and plan.kernel == _plan.kernel_fwd_pipe(dtype, mk, reg.nch), plan
    same = ("grid", "block", "tpr_log2", "nch", "rpt", "vector", "whole")
    assert all(getattr(plan, f) == getattr(reg, f) for f in same), (plan, reg)
    assert plan.smem == _plan.pipe_smem(reg.nch, reg.block, item, mk) <= H200.smem_per_block
    assert plan.kernel in _plan.all_kernel_names() and plan.kernel in _plan.packaged_kernel_names()
    # older GPUs and planning without a device: the register tier
    a100 = _plan.DeviceCaps(80, 166912, 108)
    assert _plan.plan_forward(1000, sk, dtype, mk, True, True, a100, causal=causal) == reg
    assert "pipe tier" in drvsoftmax.explain((1000, sk), dtype, mask_dtype=_MASK_DTYPE[mk], causal=causal, arch="sm_90")


def test_pipelined_tier_needs_32_bit_row_maps(monkeypatch):
    """2^31 rows or more (64-bit row maps, whose division is a call): the register tier."""
    monkeypatch.setattr(_plan, "FORCE_PIPE", True)
    assert _plan.plan_forward(2**31 - 1, 1000, "float32", "add_float32", True, True, H200).tier == "pipe"
    assert _plan.plan_forward(2**31, 1000, "float32", "add_float32", True, True, H200).tier == "register"
    assert _plan.plan_forward(2**27, 16384, "float32", "add_float32", True, True, H200).tier == "pipe"


_MASK_DTYPE = {"none": None, "hide1": "bool", "add_float16": "float16", "add_float32": "float32"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_pipelined_tier_never_takes_rows_off_the_chunk_grid_or_lean_ones(monkeypatch, dtype):
    monkeypatch.setattr(_plan, "FORCE_PIPE", True)
    item = _plan.X_DTYPES[dtype][1]
    for sk in SWEEP:
        if sk > 16384:
            continue
        for mk in ("none", "hide1", "hide4", f"add_{dtype}", "add_float64"):
            for aligned in (True, False):
                plan = _plan.plan_forward(64, sk, dtype, mk, True, aligned, H200)
                if plan.tier != "pipe":
                    continue
                assert plan.whole and plan.rpt == 1 and mk in _plan.al_mask_kinds(dtype), plan
                assert item == 4 and plan.nch == 8, plan
                assert plan.kernel in _plan.all_kernel_names()


def test_split_tier_takes_the_looped_tiers_rows_only_where_they_leave_the_device_idle():
    """Few rows (at most half the SMs) whose segments fit the device at once: the split
    tier; more rows, too many segments, an unknown SM count, no device or a chip before
    sm_70: the looped tier; rows a cluster holds keep their cluster, and fp32 forwards
    stream on sm_90+ however few their rows."""
    h200 = _plan.DeviceCaps(90, 232448, 132)
    for dtype in DTYPES:
        item = ITEMSIZE[dtype]
        for sk in (2**20, 2**20 + 3):
            for backward in (False, True):
                segs = _plan.split_segments(sk, item, True, backward)
                assert segs <= 132 * _plan.SPLIT_MAX_PER_SM
                few = plan_of(backward, 66, sk, dtype, "hide1", True, h200)
                many = plan_of(backward, 67, sk, dtype, "hide1", True, h200)
                if not backward and item == 4:  # fp32 forwards: streamed by a cluster, however few
                    assert few.kernel == many.kernel == _plan.kernel_fwd_stream(dtype, "hide1"), (few, many)
                    continue
                if few.tier == "cluster":
                    assert many.tier == "cluster"
                    continue
                assert few.tier == "split" and few.split == segs and few.grid == segs * 66, few
                assert many.tier == "loop", many
                for caps in (None, _plan.DeviceCaps(90, 232448), _plan.DeviceCaps(61, 98304, 20)):
                    fewer = plan_of(backward, 8, sk, dtype, "hide1", True, caps)
                    assert fewer.tier in ("loop", "coop") or "stream" in fewer.kernel, fewer
        # a row of more segments than SMs (fp32: streamed by a cluster)
        wide = plan_of(False, 2, 2**23, dtype, "none", True, h200)
        assert wide.kernel == _plan.kernel_fwd_stream(dtype, "none") if item == 4 else wide.tier == "loop", wide


def test_split_segments_cover_the_row_and_the_workspace_is_one_slot_each():
    h200 = _plan.DeviceCaps(90, 232448, 132)
    for dtype in DTYPES:
        item = ITEMSIZE[dtype]
        n = 16 // item
        for mk in ("none", "hide1", "add_float32", "add_float64"):
            for sk in (16385, 65537, 2**20 - 1):
                for aligned in (True, False):
                    p = _plan.plan_forward(5, sk, dtype, mk, True, aligned, h200)
                    if p.tier != "split":
                        continue
                    chunks = _plan.row_chunks(sk, item, aligned)
                    per = p.nch * p.block  # chunks per segment
                    assert (p.split - 1) * per < chunks <= p.split * per, (dtype, mk, sk, p)
                    assert p.workspace(5) == 5 * p.split * 16
                    assert f", {p.nch}>" in p.kernel and p.nch * n <= 32
