"""The planner: which kernel variant runs, and with which launch shape.

Pure Python and free of any GPU or framework, so that it is tested on every machine and
``drvsoftmax.explain`` can show users what will run.  The kernel names written here are
the C++ name expressions that ``cuda_src`` instantiates; the compiler and the packaged
artifacts are keyed by them.

A row is cut into 16-byte chunks (8 elements of 16-bit data, 4 of fp32).  A kernel
variant is (chunks per thread NCH, rows per thread RPT); the threads per row (tpr, a
power of two up to the block) are chosen at launch.  Each thread issues NCH * RPT
16-byte loads of x (of dy and y backward) before it uses any of them, so the table below
keeps 2 to 8 loads in flight per thread while filling the chip.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from . import _dtypes

# Storage dtypes of x / y / dy: name -> (C++ type, bytes).
X_DTYPES = _dtypes.KERNEL_CTYPES

# Mask sources: kind -> C++ VALUES step.  Integer and boolean masks only need their
# width (nonzero hides); floating masks are added.
MASK_KINDS = {
    "none": "MaskNone",
    "hide1": "MaskHide<smx_u8>",
    "hide2": "MaskHide<smx_u16>",
    "hide4": "MaskHide<smx_u32>",
    "hide8": "MaskHide<smx_u64>",
    "add_float16": "MaskAdd<smx_f16>",
    "add_bfloat16": "MaskAdd<smx_bf16>",
    "add_float32": "MaskAdd<float>",
    "add_float64": "MaskAdd<double>",
}

# Bytes of one mask element, by kind (a chunk of N x elements holds N of them).
MASK_ITEMSIZE = {
    "none": 0,
    "hide1": 1,
    "hide2": 2,
    "hide4": 4,
    "hide8": 8,
    "add_float16": 2,
    "add_bfloat16": 2,
    "add_float32": 4,
    "add_float64": 8,
}

CHUNK_BYTES = 16  # one vector access
BLOCK = 256  # the block of rows wider than a warp (a row of up to 512 threads gets its own)
MAX_BLOCK = 512  # SMX_BLOCK: rows of 512 threads (kernels of at most 8 chunks per thread)
SMALL_BLOCK = 128  # block of rows of at most 32 threads
LOOP_NCH = 4  # chunks per thread and segment of the looped tier
MAX_GRID = 2**31 - 1

# The register tier, by chunks per row C (rows of C chunks fit when C <= limit).  Every
# row has a whole-chunk kernel (AL: every row of every operand is whole 16-byte chunks, the
# common case) and a general one (rows off the 16-byte grid, strided rows, rare masks).
#   limit   NCH  RPT  threads per row      why
FWD_TABLE = (
    (64, 2, 1, "C/2"),  # Sk <= 512 (16-bit), <= 256 (fp32): rows within a warp
    (2048, 4, 1, "C/4"),  # <= 16384 (16-bit): 17..512 threads x 4 chunks (32 values per thread)
    (4096, 8, 1, "C/8"),  # fp32 <= 16384: 257..512 threads x 8 chunks
)
BWD_TABLE = (
    (64, 2, 2, "C/2"),  # dy and y: 2 rows x 2 chunks, twice the loads in flight
    (2048, 4, 1, "C/4"),
    (4096, 8, 1, "C/8"),
)
# Tried and not kept: 8 chunks per thread for fp32 rows from 129 chunks (Sk > 512; warps of
# 8 chunks at Sk 1000 and 1024, 256 threads at 8192): on the H200, % of copy, 4 -> 8 chunks,
# three rounds each, Sk 1000 95.4 / 96.3 / 96.8 -> 96.2 / 95.7 / 93.4, 8192 96.3 / 97.7 /
# 99.1 -> 95.7 / 95.1 / 92.1, 4097 91.7 / 93.2 / 89.4 -> 90.3 / 93.1 / 89.8.  Nor does the
# cluster tier win below it (fp16 with a bool mask [B,1,Sq,Sk], clusters of 2: Sk 16384
# 77.8 against 44.1% of copy, 4096 92.0 against 11.0; fp32 with an additive mask at 16384
# 72.1 against 64.6).
# Nor does the looped tier (a block per row, the second pass reading the row again, from
# L2 where it still is) on rows the register tier holds (benchmarks/loop_rows.py, % of copy
# planned -> looped, three rounds): without a mask fp32 16384 97 -> 70, 8192 99 -> 91, fp16
# 16384 96 -> 74; bool masks fp16 16384 85 -> 50, fp32 16384 92 -> 72, fp16 4096 93 -> 20;
# additive fp32 16384 (pipelined tier) 88 -> 70; causal fp16 [8,32,2048,2048] 0.894 -> 7.03 ms.
# The register tier holds rows of up to 16384 elements: 4096 fp32 chunks, 2048 16-bit ones
# (longer 16-bit rows would hold 64 values per thread in 512 threads; they take the looped
# tier).
MAX_CHUNKS = {2: 2048, 4: 4096}


# fp32 x with a mask of 4 or more bytes per element (a 16-byte mask access per chunk of x,
# or more) skips the table's 4-chunk row: 8 chunks per thread.  Measured on the H200 with
# an additive fp32 mask [B,1,Sq,Sk]: 74% -> 98% of copy at Sk 1000, 77 -> 88% at 4096, 70 ->
# 87% at 8192; without a mask and with a bool mask the two rows are within 2-3%, and 16-bit x
# loses with 8 chunks (64 values per thread).  16-bit x with a mask keeps the 4-chunk row:
# on the H200, fp16 with a bool mask [B,1,Sq,Sk], % of copy for (chunks, rows) per thread
# (4, 1) / (2, 1) / (2, 2) / (4, 2) / (8, 1): Sk 2048 88 / 70 / 68 / 70 / 50, Sk 4096
# 83 / 64 / 61 / 64 / 51, Sk 16384 69 / - / - / 47 / 49 (bf16 and additive masks alike).
WIDE_MASK_SKIPS_NCH = 4


def wide_mask(itemsize: int, mask_kind: str) -> bool:
    """The forward of x of `itemsize` bytes with this mask kind skips the 4-chunk row."""
    return itemsize == 4 and MASK_ITEMSIZE[mask_kind] >= 4


# Also measured on the H200 for the 16-bit 4-chunk row with a mask, and not kept:
# - the cluster tier's fold in this tier (hidden keys as -inf in x's bits, the max over pairs
#   of 16-bit values, one FMA a term; 60 registers against 56), % of copy, three rounds, fp16
#   with a bool mask [B,1,Sq,Sk]: Sk 2048 94.9 / 96.2 / 97.0 -> 87.1 / 87.9 / 88.3, 4096 89.7 /
#   91.2 / 91.8 -> 85.5 / 84.2 / 84.6, 16384 75.4 / 75.7 / 77.6 -> 70.9 / 69.2 / 69.8 (bf16
#   78.1 / 78.9 / 79.9 -> 73.0 / 71.4 / 72.3);
# - three blocks per SM (40 registers): every such kernel spills (sm_90, 64-160 bytes of
#   stack), and held raw as in the lean kernels it still takes 60 registers uncapped.
# At 16384 keys the mask is not what costs: DRAM reads of fp16 [2,16,512,16384] with a bool
# mask [2,1,512,16384] were 553.7 MB, x and the mask once.  Nor is the arithmetic: a plain
# kernel that reads x and that mask and writes y with none, a row per block, reached
# 73.6 / 76.2% (512 threads x 4 chunks), 74.0 / 75.9 (256 x 8) and 81.3 / 83.1 (1024 x 2)
# against this kernel's 82.2 / 82.3 in the same run (copy 4207 GB/s).
# Also measured and not kept, for a block per row (% of copy, two rounds):
# - warming L2 with the row the block a wave later takes (that row's x and mask, 2 x SM
#   count rows ahead), issued after LOAD: prefetch.global.L2 per chunk / one
#   cp.async.bulk.prefetch.L2 per row: fp16 bool 16384 77.4 / 77.1 -> 76.6 / 77.2 and
#   79.9 / 81.0, bf16 bool 16384 80.7 / 82.5 -> 76.1 / 76.0 and 82.0 / 84.0, but fp16
#   additive 16384 82.1 / 81.6 -> 69.4 / 69.4 and 55.5 / 58.3, fp32 bool 16384 89.5 / 91.6
#   -> 68.4 / 68.3 and 66.2 / 70.6, fp32 without a mask 16384 94.7 / 93.9 -> 70.4 / 70.6 and
#   70.8 / 72.7; issued before LOAD, worse still (fp16 bool 16384 71.0 / 74.3);
# - 8 chunks per thread held raw (the lean kernels) with a hiding mask applied to x's bits
#   right after LOAD (then the lean passes of a row without a mask; 64 registers, 56-80
#   bytes of stack on sm_90): fp16 bool 2048 97.7 / 96.7 / 96.7 -> 69.8 / 69.2 / 69.1, 4096
#   93.1 / 91.8 / 92.1 -> 65.1 / 65.0 / 65.0, 16384 78.5 / 77.3 / 78.0 -> 64.9 / 65.8 / 64.4
#   (bf16 81.9 / 77.4 / 77.3 -> 65.0 / 61.3 / 60.9).
# Nor did storing the zeros past a causal or key_lengths prefix right after LOAD (while the
# loads are in flight) win: fp16 [8,32,2048,2048] causal 0.942 / 0.936 / 0.911 ms -> 0.914 /
# 0.917 / 0.923.  That case's DRAM traffic is its minimum (1.09 GB read, 2.12 GB written).
# (torch's zero_ writes at 3312-3363 GB/s, but that is its kernel: plain 16-byte stores
# wrote the case's 2.15 GB of y in 0.483-0.487 ms, 4.4 TB/s; see ROW_OWN_BLOCK for what
# bounds the case.)
# Where the forwards still short of their targets stand (ncu on the H200 at its base clock,
# 1.44 GHz, kernels of b25d0e1, NVRTC 13.0; the benchmark runs at the boost clock):
#   case                               regs  CTAs/SM  warps/SM  DRAM %  SM %  issue/sched
#   fp16 [2,8,512,65536], cluster of 2   80       3        23    74.5  67.6         0.67
#   fp32 [2,8,256,65536], cluster of 4   64       4        31    78.9  60.4         0.64
#   fp32 [65520,4097], 288 threads       40       5        42    69.5  78.8         0.79
#   fp32 [65536,4096], 256 threads       40       6        46    85.1  72.3         0.73
#   fp16 [2,16,512,16384] + bool mask    56       2        30    62.8  67.0         0.67
# The 4097-key fp32 row issues about 1.3x the instructions of the 4096-key one (its first and
# last chunks element by element, the per-chunk visibility tests) in 1.24x the cycles (the
# edged path at 4 chunks, and 8 chunks per thread, measured slower, above and below).  The
# cluster rows keep about 1.7-1.8 eligible warps per scheduler (four CTAs per SM instead of
# three measured no faster: see smx_fwd_cluster in softmax_cluster.cu).


# 16-bit x without a mask, whole-chunk rows of more than LEAN_FROM chunks (Sk > 1024): 8
# chunks per thread, held raw ("lean" kernels: each pass computes a chunk's values afresh,
# see SMX_HELD_VALUES in softmax_fwd.cu), twice the loads in flight of the 4-chunk row at
# the same 64 registers.  Measured on the H200, % of copy, fp16 / bf16, 4-chunk row -> lean:
# Sk 2048 95.3 -> 97.5 / 94.7 -> 94.6; 4096 94.8 -> 97.9 / 93.9 -> 96.1; 8192 92.6 -> 97.7 /
# 91.7 -> 95.6; 12000 72.9 -> 89.8 / 71.7 -> 87.5; 16384 82.4 -> 96.7 / 81.8 -> 94.5; at
# Sk 1000 the 4-chunk row wins (98.8 / 99.0 against 96.9 / 92.0).  With a mask the lean
# kernels measured slower (25-70% against 74-88%: the mask's raw chunks spill at 64 registers,
# or leave two blocks per SM at 128), as did rows off the chunk grid (Sk 4097: 37 against 62%).
# Where the lean kernels stand (ncu on the H200 at its locked base clock, 1.48 GHz, x
# [32768,16384], NVRTC 13.0): fp16 / bf16 647 / 661 us, DRAM 68 / 67% of peak, SM throughput
# 83% both, 9.3 warp cycles per issued instruction with 8 warps a scheduler (about 0.86 issue
# a cycle), 64 registers and no local memory either.  Their three passes over the raw chunks
# come close to the issue limit there; bf16 takes 2.5% more cycles (its SASS unpacks with
# IMAD.U32 / LOP3 / PRMT, 3752 instructions against fp16's 3720 with HADD2.F32).
# Since then the lean passes fold (SmxFold in softmax_fwd.cu: the max over pairs of 16-bit
# values, one FMA in each term's and output's exponent, on sm_80 to sm_100, where the row
# has no partial chunk and its max is below SMX_FOLD_MAX), and so do the edged lean rows' max
# and sum.  (The 4-chunk rows' max and terms folded too measured the same at Sk 1000, 98.1 /
# 97.8, and causal fp16 [8,32,2048,2048] took 0.979 ms against 0.886-0.895 in earlier runs;
# unfolded again it took 0.929 while its held values were x * scale by __fmul_rn, 63
# registers against 54 in its blocks of 64 threads; by an FMA with -0 again 0.892, the
# build before the fold 0.893 in the same run.)  On the H200, % of copy in one run, two rounds each,
# unfolded -> folded, fp16 / bf16: Sk 12000 88.6 -> 96.6 / 88.0 -> 96.4, 16384 95.6 -> 96.3 /
# 94.8 -> 96.1, 8192 97.0 -> 96.4 / 96.6 -> 96.2, 2048 97.2 -> 96.6 / 97.3 -> 96.6, 1000
# 98.0 -> 98.1 / 97.9 -> 97.8; edged 4097 96.5 -> 95.8 / 95.4 -> 96.5, 16383 96.2 -> 95.2 /
# 94.5 -> 95.7.  (The unfolded passes there took x * scale - max in one FMA, whose unrounded
# product made rows of huge equal scores NaN or 0; rounded first, without the fold, the
# edged ones measured 94.7 / 94.3 at 4097 and 93.5 / 92.1 at 16383.)
LEAN_FROM = 128
LEAN_NCH = 8


def lean_rows(itemsize: int, mask_kind: str, whole: bool, causal: bool = False) -> bool:
    """A forward of x of `itemsize` bytes with this mask kind on whole-chunk rows takes the
    lean kernels beyond LEAN_FROM chunks per row (not a causal one: on the H200, fp16
    [8,32,2048,2048] causal took 1.151 ms lean against 1.056 with 4 chunks per thread, and
    with the kernels of 6c10491 1.170-1.199 against 0.910-0.946 in four rounds)."""
    return itemsize == 2 and mask_kind == "none" and whole and not causal


# Edged rows (smx_fwd_edged in softmax_fwd.cu): a forward without a mask, 16-byte access,
# rows that are not whole chunks (off the 16-byte grid, or Sk not a whole number of
# chunks).  The kernel's chunks are the whole 16-byte blocks inside a row; the at most
# 2 (N - 1) keys outside them (before the row's first 16-byte boundary, after its last) are
# taken one per lane, two at 2 chunks per thread.  Such rows are planned by their whole
# chunks where the kernel then takes that path: 16-bit x (beyond LEAN_FROM whole chunks in
# the lean kernels' shape, smx_fwd_edged_lean) or 2 chunks per thread, one row per thread,
# and a lane for every edge.  Measured on the H200 against the general path (first and last
# chunk element by element), % of copy, fp16 / bf16: Sk 77 39 -> 66 / 38 -> 62, 197 50 ->
# 81 / 50 -> 79, 577 54 -> 77 / 53 -> 74, 1001 88 -> 98 / 87 -> 99, 2047 61 -> 97 / 60 ->
# 95, 4097 72 -> 97 / 71 -> 96, 16383 35 -> 97 / 36 -> 95 (the 4-chunk edged row there: 77 /
# 77); fp32 (2 chunks per thread only: at 4 chunks the general path measured 95 against 92%
# at Sk 4097) 77 52 -> 80, 197 74 -> 90.


def edge_slots(nch: int) -> int:
    """Edges per lane of the edged path at `nch` chunks per thread."""
    return 2 if nch <= 2 else 1


def edged_kernel(itemsize: int, nch: int, rpt: int, tpr: int) -> bool:
    """A launch of the general forward kernel without a mask, 16-byte access, takes the
    edged path (SmxEdged in softmax_fwd.cu; 16-bit x at 8 chunks per thread: lean)."""
    n = CHUNK_BYTES // itemsize
    return rpt == 1 and (itemsize == 2 or nch == 2) and tpr * edge_slots(nch) >= 2 * (n - 1)


def _configs(
    table: tuple[tuple[int, int, int, str], ...], itemsize: int, wide: bool = False
) -> list[tuple[int, int, int, str]]:
    """The rows of a table a dtype uses, the last one capped at the register tier's limit
    (`wide`: without the 4-chunk row, see WIDE_MASK_SKIPS_NCH)."""
    cap = MAX_CHUNKS[itemsize]
    out = []
    for limit, nch, rpt, rule in table:
        if not (wide and nch == WIDE_MASK_SKIPS_NCH):
            out.append((min(limit, cap), nch, rpt, rule))
        if limit >= cap:
            break
    return out


def _t(dtype: str) -> str:
    return X_DTYPES[dtype][0]


def _b(al: bool) -> str:
    return "true" if al else "false"


def kernel_fwd(dtype: str, mask_kind: str, nch: int, rpt: int, al: bool = False) -> str:
    return f"smx_fwd<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {nch}, {rpt}, {_b(al)}>"


def kernel_fwd_loop(dtype: str, mask_kind: str) -> str:
    return f"smx_fwd_loop<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {LOOP_NCH}>"


def kernel_bwd(dtype: str, nch: int, rpt: int, al: bool = False) -> str:
    return f"smx_bwd<{_t(dtype)}, {nch}, {rpt}, {_b(al)}>"


def kernel_bwd_loop(dtype: str) -> str:
    return f"smx_bwd_loop<{_t(dtype)}, {LOOP_NCH}>"


def al_mask_kinds(dtype: str) -> tuple[str, ...]:
    """Mask kinds with whole-chunk (AL) kernels: none, bool / 8-bit integer masks, an
    additive mask of x's own dtype.  Other kinds always run the general kernels."""
    return ("none", "hide1", f"add_{dtype}")


def _fwd_names(dt: str, mk: str, item: int) -> list[str]:
    configs = _configs(FWD_TABLE, item, wide_mask(item, mk))
    names = [kernel_fwd(dt, mk, nch, rpt) for _, nch, rpt, _ in configs]
    if mk in al_mask_kinds(dt):
        names += [kernel_fwd(dt, mk, nch, rpt, True) for _, nch, rpt, _ in configs]
    if lean_rows(item, mk, True):
        names.append(kernel_fwd(dt, mk, LEAN_NCH, 1, True))
        names.append(kernel_fwd(dt, mk, LEAN_NCH, 1, False))  # edged rows
    return names


def _bwd_names(dt: str, item: int) -> list[str]:
    names = [kernel_bwd(dt, nch, rpt) for _, nch, rpt, _ in _configs(BWD_TABLE, item)]
    return names + [kernel_bwd(dt, nch, rpt, True) for _, nch, rpt, _ in _configs(BWD_TABLE, item)]


def kernel_fwd_cluster(dtype: str, mask_kind: str, reg: int = 0) -> str:
    return f"smx_fwd_cluster<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {reg}>"


def kernel_fwd_cluster_xs(dtype: str, mask_kind: str) -> str:
    return f"smx_fwd_cluster_xs<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {CLUSTER_REG}>"


def kernel_fwd_stream(dtype: str, mask_kind: str) -> str:
    return f"smx_fwd_cluster_stream<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {CLUSTER_REG}>"


def kernel_bwd_cluster(dtype: str, reg: int = 0) -> str:
    return f"smx_bwd_cluster<{_t(dtype)}, {reg}>"


def kernel_bwd_stream(dtype: str) -> str:
    return f"smx_bwd_cluster_stream<{_t(dtype)}, {CLUSTER_REG}>"


def kernel_fwd_coop(dtype: str, mask_kind: str, reg: int = 0) -> str:
    return f"smx_fwd_coop<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {reg}>"


def kernel_bwd_coop(dtype: str, reg: int = 0) -> str:
    return f"smx_bwd_coop<{_t(dtype)}, {reg}>"


def kernel_fwd_split(dtype: str, mask_kind: str) -> str:
    nch = split_nch(X_DTYPES[dtype][1], False, MASK_ITEMSIZE[mask_kind])
    return f"smx_fwd_split<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {nch}>"


def kernel_bwd_split(dtype: str) -> str:
    return f"smx_bwd_split<{_t(dtype)}, {split_nch(X_DTYPES[dtype][1], True)}>"


def kernel_fwd_pipe(dtype: str, mask_kind: str, nch: int) -> str:
    return f"smx_fwd_pipe<{_t(dtype)}, {MASK_KINDS[mask_kind]}, {nch}>"


def _pipe_names(dt: str, mk: str, item: int) -> list[str]:
    """The pipelined register tier's kernels of x of `dt` with mask kind `mk` (whole-chunk
    rows: the mask kinds of `al_mask_kinds`)."""
    if mk not in al_mask_kinds(dt):
        return []
    return [
        kernel_fwd_pipe(dt, mk, nch)
        for _, nch, rpt, _ in _configs(FWD_TABLE, item, wide_mask(item, mk))
        if rpt == 1 and _pipe_kernel(item, mk, nch)
    ]


def all_kernel_names() -> list[str]:
    """Every kernel the package can launch, in a stable order."""
    names = []
    for dt, (_, item) in X_DTYPES.items():
        for mk in MASK_KINDS:
            names += _fwd_names(dt, mk, item)
            names.append(kernel_fwd_loop(dt, mk))
        names += _bwd_names(dt, item)
        names.append(kernel_bwd_loop(dt))
    for dt in X_DTYPES:  # the cluster tier (sm_90+) last: the earlier names keep their order
        names += [kernel_fwd_cluster(dt, mk, cluster_reg(X_DTYPES[dt][1], mk)) for mk in MASK_KINDS]
        names.append(kernel_bwd_cluster(dt, CLUSTER_REG))
        names += [kernel_fwd_stream(dt, mk) for mk in stream_mask_kinds(dt)]
        names.append(kernel_bwd_stream(dt))
        names += [kernel_fwd_cluster_xs(dt, mk) for mk in xs_mask_kinds(dt)]
    for dt in X_DTYPES:  # the coop tier after them
        names += [kernel_fwd_coop(dt, mk) for mk in MASK_KINDS]
        names.append(kernel_fwd_coop(dt, "none", CLUSTER_REG))
        names += [kernel_bwd_coop(dt), kernel_bwd_coop(dt, CLUSTER_REG)]
    for dt, (_, item) in X_DTYPES.items():  # the pipelined register tier
        for mk in MASK_KINDS:
            names += _pipe_names(dt, mk, item)
    for dt in X_DTYPES:  # the split tier last
        names += [kernel_fwd_split(dt, mk) for mk in MASK_KINDS]
        names.append(kernel_bwd_split(dt))
    return names


# Mask kinds the wheel precompiles: none, bool / 8-bit integer masks, an additive mask of
# x's own dtype.  Wider integer masks and other float masks compile on first use, as do
# rows beyond the register tier (> 16384 keys: the cluster and looped tiers).
def packaged_mask_kinds(dtype: str) -> tuple[str, ...]:
    return ("none", "hide1", f"add_{dtype}")


def packaged_kernel_names() -> list[str]:
    """The kernels that ship precompiled in the wheel (the configurations Transformers
    commonly call, rows up to 16384 keys); every other kernel of `all_kernel_names`
    compiles on first use (cached)."""
    names = []
    for dt, (_, item) in X_DTYPES.items():
        for mk in packaged_mask_kinds(dt):
            names += _fwd_names(dt, mk, item)
        names += _bwd_names(dt, item)
    for dt, (_, item) in X_DTYPES.items():  # (after them: the earlier names keep their order)
        for mk in packaged_mask_kinds(dt):
            names += _pipe_names(dt, mk, item)
    return names


# ----------------------------------------------------------------------------------
# The cluster tier (sm_90+): rows beyond the register tier held on chip by a thread-block
# cluster of CS CTAs (softmax_cluster.cu).  Each CTA keeps its slice of the row, Q chunks
# per thread, raw in dynamic shared memory: x (and the mask) forward, dy and y backward.
CLUSTER_MIN_CC = 90  # compute capability of the first chip with clusters
CLUSTER_SIZES = (2, 4, 8, 16)  # CTAs per cluster; more than 8 is a non-portable size
CLUSTER_PORTABLE = 8
CLUSTER_STEP = 4  # SMX_CL_U: Q is a multiple of it
# Shared memory per CTA the planner aims below: the smallest cluster whose blocks stay
# under it (two of them share an SM) and under CLUSTER_CHUNKS_TARGET, else the smallest
# under it alone, else the largest that fits the device's per-block
# limit less CLUSTER_SMEM_RESERVE (the kernels' static shared memory).  Fewer, larger slices
# measured faster on the H200 (% of copy, the smallest cluster under 64 KB -> under 112 KB,
# with the register variant below): fp16 forward 65536 keys 73 -> 79, fp32 65536 82 -> 87,
# fp32 262144 75 -> 83; backward fp16 65536 75 -> 88, 262144 69 -> 77; fp16 forward with a
# bool mask 65536 56 -> 61, 262144 50 -> 55.  Smaller slices lose more the smaller they are
# (fp16 forward 65536 keys, clusters of 2 / 4 / 8 / 16 with 4 chunks per thread in
# registers: 79 / 66 / 48 / 22%).  Tried and not kept: persistent clusters (one cluster per
# resident slot, each taking rows c, c + clusters, ..., loading a row into the slots it has
# just stored): 96 registers instead of 63 leave two CTAs per SM instead of three, and the
# fp16 forward at 65536 keys fell from 74 to 69%.
CLUSTER_SMEM_TARGET = 112 * 1024
# ... and at most this many chunks per thread (registers and shared memory together) where
# a cluster of up to 16 holds the row so: a slice of 64 KB of x (of dy and of y backward).
# Measured on the H200 with the one-way exchange (% of copy, clusters holding 32 -> 16
# chunks per thread): fp16 forward 262144 keys 79 -> 83, fp32 forward 65536 82 -> 91,
# 262144 86 -> 88; 8 chunks per thread lose (fp16 forward 65536 89 -> 69).
CLUSTER_CHUNKS_TARGET = 16
CLUSTER_SMEM_RESERVE = 1024
# A masked forward or a backward in clusters of the largest size whose blocks need more
# shared memory than this (one block per SM) loses to the looped tier (measured on the
# H200, % of copy cluster / loop, fp16 rows of 1M keys: bool mask 39 / 52, backward 52 /
# 57; the forward without a mask keeps its clusters: 62 / 56).
CLUSTER_LOOP_SMEM = 128 * 1024
# Chunks per thread the register variants hold in registers (the forward without a mask,
# the fp32 forward with any mask, the 16-bit forward with a 1-byte hiding mask, the
# backward): the cluster tier always takes them there (measured on the H200, % of copy,
# the same cluster without -> with them: fp16 forward 65536 keys 74 -> 79, fp32 forward
# with a bool mask 65536 73 -> 80, 262144 62 -> 75; fp16 forward with a bool mask, once its
# fold works on x's bits (SmxFold in softmax_cluster.cu), 65536 79.5 -> 84.0 and 262144
# 71.2 -> 76.7: 74 KB slices, three CTAs per SM instead of two of 98 KB); the coop tier
# takes them where shared memory alone fits one block per SM and with them two fit.  The
# 16-bit forward with wider masks has no variant: 4 chunks of mask beside 4 of x in
# registers exceed the three CTAs' 80 registers per thread.
CLUSTER_REG = 4


# The streamed cluster forward (sm_90+; smx_fwd_cluster_stream in softmax_cluster.cu): rows
# the cluster tier does not take (no cluster holds them on chip, or only one of 16 CTAs of
# more than CLUSTER_LOOP_SMEM with a mask), however few, run in clusters of STREAM_CLUSTER
# CTAs of up to STREAM_SMEM bytes of shared memory
# each (two per SM), the rest of each slice read from global memory twice: once for the
# row's (max, sum), again, from L2 by then, for y.  With 16 CTAs per row few rows are in
# flight, so the second read finds them in L2; the looped tier, a block per row, reads them
# from DRAM twice.  Measured on an H100 80GB HBM3 (% of copy, looped -> streamed at 16 CTAs
# of 100 KB; fp32 [2,8,16,1M]): without a mask 63.1 -> 73.6 / 62.7 -> 73.8, with a bool mask
# 61.1 -> 68.2 / 60.5 -> 68.4.  By the cap on shared memory per CTA (whole steps below it),
# fp32 without a mask, 16 CTAs: 0 / 64 / 80 / 100 / 120 / 150 / 180 / 200 KB: 64.5 / 71.0 /
# 72.4 / 73.8 / 74.6 / 62.8 / 66.2 / 67.9 (two CTAs per SM up to 120, one beyond); with the
# bool mask 66.5 / 67.8 / 68.4 at 64 / 80 / 100 KB and 56.0-57.6 from 120 (one CTA per SM);
# 8 CTAs of 0 / 100 KB: 63.5 / 67.9; 4 CTAs of 0: 60.7.  Few rows, against the split tier
# (planned before it; H100, % of copy, split -> streamed at 100 KB,
# without / with a bool mask): fp32 rows of 1M keys, 4 rows 10.5 / 11.2 -> 28.7 / 26.6, 16
# rows 27.2 / 21.1 -> 48.9 / 38.3, 32 rows 30.5 / 35.5 -> 58.7 / 52.3, 64 rows 42.9 / 43.2 ->
# 64.3 / 62.2.  Rows of 512K keys with a bool mask, which a cluster of 16 holds only with
# 140 KB per CTA (CLUSTER_LOOP_SMEM: the loop), 128 / 256 / 512 / 1024 rows: loop 48.3 / 60.1
# / 57.7 / 63.8 -> streamed 67.3 / 73.4 / 78.2 / 81.5 (112 KB: 71.3 / 73.4 / 77.9 / 81.5).
# The same rows without a mask keep the cluster that holds them (76.2 / 83.1 / 87.8 / 91.5;
# streamed 79.7 / 85.3 / 89.2 / 90.3).  Not yet measured on an H200.
# Not planned for 16-bit x: fp16 with a bool mask [2,8,32,1M] 59.3
# looped against 43.5-57.6 streamed (4-16 CTAs of 0-200 KB), and the forward without a mask
# keeps the cluster that holds its row (88.9, streamed 35.6-88.8).  Nor for the other
# masks of fp32 x (not measured).
#
# The streamed cluster backward (smx_bwd_cluster_stream), every dtype: rows no cluster
# holds, however few, in clusters of STREAM_CLUSTER CTAs of up to STREAM_SMEM bytes each,
# dy and y past shared memory read once for the dot product and again, from L2, for dx
# (planned after the cluster and coop tiers, before the split and looped ones).  H100 80GB
# HBM3, % of copy, looped / split -> streamed at 100 KB: fp32 rows of 1M keys, 4 rows 4.5 /
# 18.8 -> 45.6, 16 rows 15.0 / 38.8 -> 57.1, 64 rows 46.0 / 53.4 -> 65.8, 256 rows 59.6 /
# 59.1 -> 69.4; fp32 256 rows of 512K 59.0 / 64.4 -> 80.7; fp16 rows of 1M keys, 16 rows
# 11.7 / 30.1 -> 51.7, 512 rows 59.3 / 64.3 -> 79.6.  By the cap per CTA, 0 / 64 / 128 /
# 192 KB: fp32 256x1M 64.6 / 67.7 / 66.1 / 69.2, fp32 256x512K - / 77.8 / 73.8 / 73.4,
# fp16 512x1M 69.1 / 76.2 / 65.9 / 69.7.  Two streamed steps per iteration (one CTA per SM
# for its registers) gave fp32 256x1M 71.9 but fp16 512x1M 47.6 at 96 KB (68.6 at 192 KB):
# not kept.  In the benchmark (H100, df0fe9b), fp32 / fp16 rows of 1M keys 69.0 / 79.0,
# the looped tier 59.9-61.0 before.  Not yet measured on an H200.
# Tried and not kept: STORE taking the steps in shared memory first and refilling each
# stored step by cp.async with the next streamed one (the last read first), so that the
# second reads are in flight while the stores go on, and the forward's PAIR reading the
# streamed steps before the copies into shared memory land (H100, 100 KB per CTA, the two
# kernels one after the other on the same machine, ms): fp32 forward 256x1M 0.9672 ->
# 0.9762, with a bool mask 1.0469 -> 1.0311, backward fp32 256x1M 1.5547 -> 1.6356, fp16
# 512x1M 1.3546 -> 1.3956.  The second reads come after the stores of the held steps, and
# less of the row is still in L2 then.
# Also tried and not kept: L2 eviction hints, so that more of the streamed steps stay in L2
# for their second read (H100 80GB HBM3, e990501's kernels, % of copy; in each of two runs
# every variant built and timed in that run, best of three rounds of 15-launch medians;
# rounds of one kernel vary by up to 1.7).  First run, base / evict_first on the held
# copies (cp.async) of every cluster kernel with `.cs` stores everywhere (SMX_ST_HINT):
# fp32 forward 256x1M 73.7 / 75.2, with a bool mask 68.0 / 69.5, fp32 backward 256x1M 68.4
# / 68.8, fp16 backward 512x1M 78.7 / 81.5, fp16 forward 8192x64K 96.4 / 94.1; with both
# hints, STREAM_SMEM of 64 / 160 KB: 71.8 / 67.7, 67.1 / 58.0, 67.1 / 67.9, 77.0 / 68.1;
# 16-bit x with a bool mask streamed in place of the looped tier, fp16 512x1M: 59.9 against
# 60.6.  Second run, base / evict_first alone / `.cs` alone / evict_first on the held
# copies of the streamed kernels alone: fp32 forward 256x1M 73.3 / 74.4 / 73.7 / 74.7, with
# a bool mask 67.9 / 68.6 / 68.5 / 69.3, fp32 backward 256x1M 69.1 / 69.6 / 68.4 / 68.5,
# fp16 backward 512x1M 79.0 / 80.6 / 78.2 / 79.9, and rows held on chip: fp16 forward
# 8192x64K 96.3 / 93.6 / 95.5 / 95.4, fp32 forward 1024x256K 94.8 / 93.0 / 94.7 / 94.0,
# fp16 backward 4096x64K 92.2 / 89.4 / 93.6 / 91.0.  At most 2-3% on the streamed rows, far
# from their 90% target, for as much lost on rows at or near theirs.
STREAM_CLUSTER = 16
STREAM_SMEM = 100 * 1024
STREAM_MASK_KINDS = ("none", "hide1")
# Testing knob: shared memory bytes per CTA of a streamed plan forced wherever a streamed
# kernel exists for the rows the cluster or looped tier would take (None: as measured).
FORCE_STREAM: int | None = None


# The x-held cluster forward (smx_fwd_cluster_xs): 16-bit x with a 1-byte hiding mask, x
# alone in shared memory, the mask read from global memory (once where STORE folds: PAIR
# leaves x there with its hidden elements -inf).  Slices of x beside the mask take half as
# much shared memory again: fp16 rows of 1M keys with a bool mask need 16 CTAs of 168 KB
# (one per SM: CLUSTER_LOOP_SMEM sends them to the looped tier), x alone 16 of 112 KB.
# Planned only where no cluster holds x and the mask: where one does, the mask travels
# with x by cp.async, and PAIR's reads of the mask wait on memory here.  Measured on an
# H100 80GB HBM3 with its first version (each step's mask read as PAIR reaches the step,
# no read-ahead; % of copy, the mask at its own size, best of three rounds; fp16 / bf16 x
# of 2^29 elements; x-held / mask beside x / looped tier): 8192 rows of 65536 keys with a
# padding mask [1, Sk] 73.7 / 96.4 / 63.2 and 76.2 / 97.2 / 62.0, with a mask of x's shape
# 91.4 / 100.4 / 64.8 and 93.8 / 100.8 / 64.7; 2048 rows of 262144 keys 67.3 / 93.3 / 63.0
# and 72.6 / 95.8 / 62.4, 86.1 / 99.9 / 63.3 and 88.1 / 100.8 / 63.2; 512 rows of 1M keys
# (no cluster holds x and the mask) 66.1 / - / 62.8 and 68.1 / - / 61.7, 80.9 / - / 62.4 and
# 82.2 / - / 62.6.  A padding mask took as long as one of x's shape: the mask's reads
# waited on latency, not bandwidth.  PAIR reads the mask SMX_XS_AHEAD steps ahead since
# (same H100, 512 rows of 1M keys, fp16 / bf16, padding mask and mask of x's shape; best of
# three): 1 step 65.5 / 67.4, 82.9 / 82.8; 2 steps 71.4 / 74.0, 84.2 / 84.5; 4 steps 75.3 /
# 74.8, 85.6 / 85.4 (117 / 120 registers); 6 steps 74.8 / 75.7, 85.7 / 85.6 (128 / 126); 8
# steps 72.0 / 75.0, 85.1 / 86.7 (128 / 128; that run's copy measured 2854 GB/s against
# 2981-2987 in the others: in ms, 8 steps took 1.046 / 1.004 with the padding mask, 4 steps
# 0.956 / 0.962).  Kept at 4, against the looped tier's 61.3 / 60.6 and 60.9 / 60.4 in the
# same runs.  At 4 (benchmarks/xs_rows.py, same H100, x-held /
# mask beside x): 65536 keys 84.9 / 93.6 and 95.0 / 98.7 (fp16), 85.0 / 93.5 and 95.8 /
# 98.8 (bf16); 262144 keys 80.2 / 92.4 and 87.6 / 98.7, 80.5 / 93.5 and 88.5 / 99.3: x-held
# stays where nothing else holds the row.  Nsight Compute on fp16 512 x 1M, padding mask:
# 14 clusters of 16 CTAs active at once (224 of the 264 CTA slots two per SM would give:
# a cluster stays within a GPC), 25% theoretical occupancy, DRAM 64% busy, L2 hit rate 79%,
# a third of the warps' stall cycles waiting on global loads (the mask).
# Tried and not kept (same kind of H100, 512 rows of 1M keys, % of copy in three rounds;
# each variant and the kernel above timed one after the other on one machine, each against
# the copy ceiling of its own run):
# - Slots visited rotated by the row (slot step st holding the slice's step (st + row) %
#   steps), so that clusters on rows sharing a mask read different parts of it at once:
#   fp16 padding mask 74.1 74.3 74.0 against 75.4 75.2 75.4; bf16 74.1-74.5 against
#   76.4-76.8.  The mask's sharing is not what costs: 32 masks each shared by 16 rows
#   (x [32, 16, Sk], mask [32, 1, Sk]) took as long as one shared by all 512 (fp16 0.985
#   against 0.975 ms), and a mask per row 1.081 ms while it moves 25% more bytes.
# - PAIR's loop unrolled SMX_XS_AHEAD times, each step's mask in a fixed register slot
#   (the ring of read-ahead slots above is rotated by register moves, which wait for reads
#   still in flight): fp16 70.8-72.2 (padding mask) and 82.9-83.3 (mask of x's shape)
#   against 73.9-74.6 and 83.9-84.8; bf16 75.2-75.4 and 87.5-87.6 against 75.4-76.1 and
#   84.1-84.6 (120 / 117 registers).  Where the planner does not take it, at 262144 keys,
#   that variant gave 81.3-81.5 / 88.4-88.8 fp16 and 89.4-90.4 / 97.2-98.1 bf16 (the mask
#   beside x 92.6-93.9 / 99.5-100.4 and 96.0-96.5 / 100.4-101.7): bf16 gains where fp16
#   does not, unexplained so far.
XS_MASK_KINDS = ("hide1",)
# Testing knob: True plans it wherever a cluster holds x, False never; None (the default)
# where no cluster holds x and the mask beside it.
CLUSTER_XS: bool | None = None


def xs_mask_kinds(dtype: str) -> tuple[str, ...]:
    """Mask kinds of x of `dtype` with an x-held cluster forward."""
    return XS_MASK_KINDS if X_DTYPES[dtype][1] == 2 else ()


def stream_mask_kinds(dtype: str) -> tuple[str, ...]:
    """Mask kinds of x of `dtype` with a streamed cluster forward."""
    return STREAM_MASK_KINDS if X_DTYPES[dtype][1] == 4 else ()


def cluster_reg(itemsize: int, mask_kind: str) -> int:
    """Chunks per thread in registers of the cluster tier's forward of x of `itemsize`
    bytes with this mask kind: CLUSTER_REG (the register variant) or 0."""
    return CLUSTER_REG if mask_kind in ("none", "hide1") or itemsize == 4 else 0


# The coop tier (every architecture the package builds for): rows beyond the register tier
# held on chip by G ordinary blocks that are all resident at once (a cooperative launch),
# exchanging their pairs through global memory; the same slices as the cluster tier.  It is
# not planned by default: on the H200 it measured slower than the looped tier wherever the
# row count fills the GPU (% of copy coop / loop, the coop tier forced where clusters run:
# fp16 forward 65536 keys 49 / 62, with a bool mask 37 / 51, backward 51 / 57; fp32 forward
# of 1M keys, 256 rows, 50 / 58), and faster only for few rows (fp32 1M keys, 128 rows:
# 47 / 43).  DRVSOFTMAX_FORCE_COOP or COOP_WHERE_IT_FITS plan it wherever it holds a row.
COOP_MIN_CC = 70
COOP_MAX_BLOCKS = 1024  # blocks per row (the grid's x dimension)
COOP_MAX_GROUPS = 65535  # rows in flight (the grid's y dimension)
# Testing knob: DRVSOFTMAX_FORCE_COOP=1 plans the coop tier where the cluster tier would
# run (so that both are tested on one sm_90 GPU).  Read at import; tests set FORCE_COOP.
FORCE_COOP_ENV = "DRVSOFTMAX_FORCE_COOP"
FORCE_COOP = os.environ.get(FORCE_COOP_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
# True: the coop tier for every long row it holds that no cluster does (default False: the
# looped tier, measured faster; see above).
COOP_WHERE_IT_FITS = False
# Shared memory per block the coop tier aims below (as CLUSTER_SMEM_TARGET).
COOP_SMEM_TARGET = 64 * 1024


@dataclass(frozen=True)
class DeviceCaps:
    """What the planner needs to know of a device: its compute capability (90 for sm_90),
    the dynamic shared memory one block may opt in to (bytes) and its SM count (0: unknown,
    when planning without a device)."""

    cc: int
    smem_per_block: int
    sm_count: int = 0

    @property
    def clusters(self) -> bool:
        return self.cc >= CLUSTER_MIN_CC and self.smem_per_block > CLUSTER_SMEM_RESERVE

    @property
    def coop(self) -> bool:
        return self.cc >= COOP_MIN_CC and self.smem_per_block > CLUSTER_SMEM_RESERVE


# Dynamic shared memory one block may opt in to, by compute capability (the CUDA
# programming guide's table), for planning without a device (`explain(arch=...)`); an
# unknown architecture of sm_90 or newer is assumed to have the smallest of them.
SMEM_PER_BLOCK_OPTIN = {
    75: 65536,
    80: 166912,
    86: 101376,
    87: 166912,
    89: 101376,
    90: 232448,
    100: 232448,
    103: 232448,
    110: 232448,
    120: 101376,
    121: 101376,
}


def caps_of_arch(cc: int) -> DeviceCaps:
    """The DeviceCaps of a compute capability (90 for sm_90), from SMEM_PER_BLOCK_OPTIN."""
    smem = SMEM_PER_BLOCK_OPTIN.get(cc, min(SMEM_PER_BLOCK_OPTIN.values()) if cc >= CLUSTER_MIN_CC else 0)
    return DeviceCaps(cc, smem)


def cluster_shape(chunks: int, slot_bytes: int, caps: DeviceCaps | None, reg: int = 0) -> tuple[int, int, int] | None:
    """(CTAs per cluster, chunks per thread Q in shared memory, dynamic shared memory per
    CTA) holding a row of `chunks` 16-byte chunks at `slot_bytes` of shared memory per
    chunk, `reg` chunks per thread in registers; None when the device has no clusters or
    the row does not fit."""
    if caps is None or not caps.clusters:
        return None
    limit = caps.smem_per_block - CLUSTER_SMEM_RESERVE
    fits = []
    for cs in CLUSTER_SIZES:
        q = CLUSTER_STEP * _ceil_div(max(0, chunks - cs * BLOCK * reg), cs * BLOCK * CLUSTER_STEP)
        smem = q * BLOCK * slot_bytes
        if smem <= limit:
            fits.append((cs, q, smem))
    for target in (CLUSTER_CHUNKS_TARGET, None):
        for cs, q, smem in fits:
            if smem <= CLUSTER_SMEM_TARGET and (target is None or reg + q <= target):
                return cs, q, smem
    return fits[-1] if fits else None


def _two_per_sm(smem: int, caps: DeviceCaps) -> bool:
    """Two CTAs of `smem` bytes of dynamic shared memory fit one SM (an SM holds the
    per-block limit plus the 1 KB the system keeps per CTA; reserve for static memory)."""
    return 2 * (smem + CLUSTER_SMEM_RESERVE) <= caps.smem_per_block + 1024


def blocks_per_sm(smem: int, caps: DeviceCaps) -> int:
    """Blocks of the coop tier's kernels (BLOCK threads, launch bounds of two blocks per SM)
    with `smem` bytes of dynamic shared memory that surely fit one SM: what shared memory
    allows, at most two (more where registers allow is found at launch)."""
    return min(2, (caps.smem_per_block + 1024) // (smem + CLUSTER_SMEM_RESERVE))


def coop_shape(
    sk: int, item: int, aligned_rows: bool, slot_bytes: int, caps: DeviceCaps | None, reg: int = 0
) -> tuple[int, int, int] | None:
    """(blocks per row G, chunks per thread Q in shared memory, dynamic shared memory per
    block) holding a row of `sk` elements in the coop tier, `reg` chunks per thread in
    registers; None when the device has no coop tier or the row does not fit.

    The fewest blocks whose slices stay under COOP_SMEM_TARGET with two blocks per SM,
    else the fewest that fit at all.  Every block holds at least one chunk of the row (its
    pair is written there), and, where the SM count is known, G blocks surely fit the
    device at once."""
    if caps is None or not caps.coop:
        return None
    n = CHUNK_BYTES // item
    chunks = row_chunks(sk, item, aligned_rows)
    limit = caps.smem_per_block - CLUSTER_SMEM_RESERVE
    fit = None
    last_q = -1
    for g in range(1, COOP_MAX_BLOCKS + 1):
        q = CLUSTER_STEP * _ceil_div(max(0, chunks - g * BLOCK * reg), g * BLOCK * CLUSTER_STEP)
        if q == last_q:  # more blocks of the same slice: never better
            continue
        last_q = q
        smem = q * BLOCK * slot_bytes
        if smem > limit or sk - (g - 1) * (q + reg) * BLOCK * n < n:
            continue
        if caps.sm_count and g > caps.sm_count * blocks_per_sm(smem, caps):
            continue
        if smem <= COOP_SMEM_TARGET and _two_per_sm(smem, caps):
            return g, q, smem
        if fit is None:
            fit = (g, q, smem)
    return fit


def coop_groups(rows: int, g: int, capacity: int) -> int:
    """Rows in flight (groups of G blocks) for a device that holds `capacity` such blocks
    at once: 0 when not even one group fits."""
    return min(rows, capacity // g, COOP_MAX_GROUPS)


# ----------------------------------------------------------------------------------
# The pipelined register tier (softmax_pipe.cu): a whole-chunk register-tier shape of one
# row per thread group on a persistent grid (the blocks the device holds at once, set at
# launch from its occupancy), each block's next rows in flight, by asynchronous copies into
# its shared memory, while it works on its current ones: the phases of a row (its
# reductions, the barrier of a row of several warps) no longer leave the block without
# loads in flight, which is what bounds the causal and the masked forwards of a block per
# row (see ROW_OWN_BLOCK).  Measured on the H200 beside the register tier's launch of the
# same forward (benchmarks/pipe_rows.py, % of copy, three rounds, same bits), it wins only
# where the register tier leaves one block per SM: fp32 x with an fp32 additive mask at
# 16384 keys (8 chunks x 512 threads, 104 registers) 72.8 / 72.8 / 72.9 -> 88.5 / 88.6 /
# 89.0.  Everywhere else it loses or ties, its loop costing registers (the next group's row,
# the slots' addresses) and blocks per SM: causal fp16 [8,32,2048,2048] 85.7 -> 76.4 (0.90
# -> 1.01 ms; 54 -> 63 registers, 18 -> 16 blocks per SM); bool masks fp16 2048 97.9 -> 81.0,
# 4096 92.9 -> 81.2, 16384 84.2 -> 82.3 (bf16 83.3 -> 83.3), fp32 16384 91.6 -> 91.8 (two
# blocks per SM -> one); additive fp16 1000 92.5 -> 73.6, 2048 93.3 -> 76.8, 16384 85.2 ->
# 81.2, bf16 4096 92.3 -> 78.8, fp32 4096 93.1 -> 83.0 (four blocks per SM); bool fp16 128
# keys 75.5 -> 70.5; without a mask fp32 1024 97.9 -> 88.5, 8192 99.2 -> 87.8, 16384 97.1 ->
# 90.2, fp16 1024 98.2 -> 90.0.  (A variant with two sets of slots, the next group's LOAD
# issued before waiting for this one's, and one without the copies' L2 prefetch hint were
# built for that run and not timed.)  So the planner takes the tier for the rows of
# `_pipe_default` only, and has kernels for those rows' kind alone (fp32 x with an fp32
# additive mask, 8 chunks per thread: with NVRTC 13.0 and 13.5 the kernels of the other
# shapes spill under ptxas's occupancy caps); DRVSOFTMAX_FORCE_PIPE=1 (or FORCE_PIPE) plans
# it for every row its kernels take, on sm_90+ (rows of up to 256 threads too).
PIPE_MIN_CC = 90
# Testing knob, read at import (tests set FORCE_PIPE).
FORCE_PIPE_ENV = "DRVSOFTMAX_FORCE_PIPE"
FORCE_PIPE = os.environ.get(FORCE_PIPE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _pipe_kernel(itemsize: int, mask_kind: str, nch: int) -> bool:
    """The tier has a kernel for these rows: fp32 x with a wide mask (`wide_mask`; of the
    whole-chunk kinds, an fp32 additive one) at 8 chunks per thread."""
    return wide_mask(itemsize, mask_kind) and nch == 8


def _pipe_default(itemsize: int, mask_kind: str, causal: bool, nch: int, threads: int) -> bool:
    """Where the tier is planned by default: its rows in a block of more than 256 threads,
    which the register tier's kernel (104 registers) runs one block per SM (see above)."""
    return _pipe_kernel(itemsize, mask_kind, nch) and threads > 256


def pipe_rows(itemsize: int, mask_kind: str, causal: bool, nch: int, threads: int) -> bool:
    """A whole-chunk forward of x of `itemsize` bytes with this mask kind (causal or not) at
    `nch` chunks per thread, rows of `threads` threads, takes the pipelined register tier
    where the device has it (FORCE_PIPE: wherever the tier has a kernel for the rows)."""
    if FORCE_PIPE:
        return _pipe_kernel(itemsize, mask_kind, nch)
    return _pipe_default(itemsize, mask_kind, causal, nch, threads)


def pipe_smem(nch: int, block: int, itemsize: int, mask_kind: str) -> int:
    """Dynamic shared memory of a pipelined block: a slot per chunk of x and of the mask."""
    return nch * block * (CHUNK_BYTES + (CHUNK_BYTES // itemsize) * MASK_ITEMSIZE[mask_kind])


# ----------------------------------------------------------------------------------
# The split tier (softmax_split.cu, every architecture): rows beyond the register tier in
# segments of SPLIT_NCH chunks per thread, one ordinary block each (grid (S, G): S segments
# of each of G rows at a time), every byte read once.  The blocks of a row exchange their
# pairs through a workspace of 16-byte slots (S per row) that the launch allocates on the
# stream, zeroes, and frees after the kernel.  No block waits on a block that may not be
# resident: one that waits too long (2 ms) computes the missing pairs itself.
# Planned for the rows the looped tier would take where that tier cannot fill the device
# (a block per row: fewer rows than SPLIT_ROWS_PER_SM per SM), and only where a row's
# segments fit the device at once (`split_pays`; at launch, the kernel's occupancy).
# Measured on the H200 (% of copy, looped -> split; benchmarks/split_rows.py, results in
# benchmarks/results): fp32 rows of 1M keys, 4 / 16 / 64 rows: forward 2.2 -> 8.3, 6.6 ->
# 21, 24 -> 36; with a bool mask 2.0 -> 9.6, 6.6 -> 24, 25 -> 38; backward 3.2 -> 12, 11 ->
# 28, 37 -> 41; fp16 rows of 1M keys, 8 / 32 rows: bool mask 3.4 -> 9.9, 12 -> 20,
# backward 4.7 -> 13, 16 -> 30.  It loses where rows fill the device (fp32 1M keys, 256
# rows: forward 59 -> 43, backward 60 -> 49; fp16 128 rows: bool mask 41 -> 28, backward
# 50 -> 48) and everywhere to the cluster tier (fp16 forward of 1M keys, 8 / 32 / 128 rows:
# 29 / 53 / 72 -> 9 / 20 / 31; rows of 65536 and 262144 keys: 80-94 -> 33-67): each
# block waits for its row's other blocks (a round trip through L2) holding its segment,
# with nothing else in flight; and where a row has more segments than the device holds
# blocks (fp32, 1 row of 4M keys, 512 segments: 0.6 -> 0.3, the first blocks reach the
# 2 ms limit).  DRVSOFTMAX_FORCE_SPLIT=1
# (or FORCE_SPLIT) plans it wherever the cluster or looped tier would run.
# Tried and not kept: a lagged split kernel for rows that fill the device (a persistent
# grid (S, G) of 2 blocks per SM, each block taking its segment of rows g, g + G, ... in
# two passes a row apart: pass 1 of row r loads its segment and publishes the pair, then
# pass 2 of the row before gathers that row's pairs, loads its segment again from L2 and
# stores; nothing held across a wait; 97-128 registers).  It lost everywhere, being bound
# by each block's chain of latencies (DRAM load, block reduction, publish, gather, L2
# reload, store) rather than by bandwidth: one block per SM ran at about half the speed of
# two.  Measured on the H200 (% of copy, planned tier / split / lagged at 1 and 2 blocks
# per SM): fp32 16 x 8 x 1M forward 60 / 44 / 22 / 39, bool 58 / 41 / 21 / 37, backward 60 /
# 51 / 31 / 31; fp16 16 x 32 x 1M bool 55 / 27 / 13 / 23, backward 61 / 57 / 23 / 41; fp32
# 16 x 256 x 65536 forward (cluster) 92 / 52 / 28 / 48.  Beating the looped tier this way
# needs several segments in flight per block (asynchronous copies into shared memory).
SPLIT_MIN_CC = 70  # acquire / release memory operations and __nanosleep
SPLIT_BLOCK = 256  # SMX_SPLIT_BLOCK
SPLIT_MAX_GROUPS = 65535  # rows in flight (the grid's y dimension)
SPLIT_SLOT = 16  # bytes of a workspace slot (SmxSlot)
FORCE_SPLIT_ENV = "DRVSOFTMAX_FORCE_SPLIT"
FORCE_SPLIT = os.environ.get(FORCE_SPLIT_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
# True: the split tier takes the looped tier's rows where `split_pays` (else only FORCE_SPLIT).
SPLIT = True
SPLIT_ROWS_PER_SM = 0.5
# Blocks per SM the split kernels may reach (64 registers: the backward's); the launch checks
# the device's occupancy of the kernel and takes the looped tier where a row's segments
# exceed what the device holds at once.
SPLIT_MAX_PER_SM = 4


def split_nch(itemsize: int, backward: bool, mask_item: int = 0) -> int:
    """Chunks per thread of a split-tier segment: 32 fp32 values forward (8 chunks of fp32,
    4 of 16-bit x), but half as many with a mask of 4- or 8-byte elements (more spilled at
    ptxas's 128 registers); 4 chunks of dy and of y backward."""
    if backward or (itemsize == 4 and mask_item >= 4):
        return 4
    if mask_item >= 4:  # (16-bit x: 4 chunks spilled on sm_100 and sm_120 with NVRTC 13.5)
        return 2
    return 2 * itemsize


def split_pays(rows: int, segs: int, caps: DeviceCaps) -> bool:
    """The split tier instead of the looped one by default: too few rows for the looped
    tier to fill the device, and a row's segments no more than the device may hold at
    once (checked again at launch against the kernel's occupancy)."""
    return (
        caps.cc >= SPLIT_MIN_CC
        and caps.sm_count > 0
        and rows <= caps.sm_count * SPLIT_ROWS_PER_SM
        and segs <= caps.sm_count * SPLIT_MAX_PER_SM
    )


def split_segments(sk: int, itemsize: int, aligned_rows: bool, backward: bool, mask_item: int = 0) -> int:
    """Segments (blocks) per row of the split tier."""
    nch = split_nch(itemsize, backward, mask_item)
    return _ceil_div(row_chunks(sk, itemsize, aligned_rows), nch * SPLIT_BLOCK)


def _split_plan(
    name: str, rows: int, sk: int, item: int, aligned_rows: bool, vector: bool, backward: bool, mask_item: int = 0
) -> LaunchPlan:
    segs = split_segments(sk, item, aligned_rows, backward, mask_item)
    groups = max(1, min(rows, SPLIT_MAX_GROUPS))
    nch = split_nch(item, backward, mask_item)
    why = (
        f"{row_chunks(sk, item, aligned_rows)} chunks per row beyond the register tier: {segs} segment(s) of "
        f"{nch} chunks per thread, a block each, their pairs exchanged through a workspace of {rows * segs * SPLIT_SLOT} bytes"
    )
    return LaunchPlan(name, "split", _check_grid(segs * groups), SPLIT_BLOCK, 8, nch, 1, vector, why, split=segs)


@dataclass(frozen=True)
class LaunchPlan:
    kernel: str  # name expression of the kernel
    tier: str  # "register", "pipe", "cluster", "coop", "split" or "loop"
    grid: int
    block: int
    tpr_log2: int  # log2(threads per row)
    nch: int  # chunks per thread and row (per segment in the looped tier, in all in the cluster tier)
    rpt: int  # rows per thread
    vector: bool  # 16-byte accesses
    reason: str  # which table row chose it
    whole: bool = False  # every row of every operand is whole 16-byte chunks (AL kernel)
    cluster: int = 0  # CTAs per cluster (cluster tier), else 0
    smem: int = 0  # dynamic shared memory per block (bytes)
    coop: int = 0  # blocks per row G (coop tier: grid (G, grid // G)), else 0
    split: int = 0  # segments per row S (split tier: grid (S, grid // S)), else 0

    def workspace(self, rows: int) -> int:
        """Bytes of workspace a launch of this plan over `rows` rows needs (split tier)."""
        return rows * self.split * SPLIT_SLOT if self.split else 0

    @property
    def tpr(self) -> int:
        """Threads per row: 2^tpr_log2, or the whole block where that is larger."""
        return min(1 << self.tpr_log2, self.block)

    def describe(self) -> str:
        shape = f"grid {self.grid} x block {self.block}"
        if self.cluster:
            shape += f" in clusters of {self.cluster}, {self.smem} bytes of shared memory per block"
        if self.tier == "pipe":
            shape = (
                f"a persistent grid of at most {self.grid} blocks (as many as the device holds at once) x block "
                f"{self.block}, {self.smem} bytes of shared memory per block"
            )
        if self.split:
            shape = f"grid ({self.split} segments, {self.grid // self.split} rows at a time) x block {self.block}"
        if self.coop:
            shape += (
                f" as {self.grid // self.coop} group(s) of {self.coop} co-resident blocks, "
                f"{self.smem} bytes of shared memory per block"
            )
        return (
            f"{self.tier} tier: {self.kernel}, {shape}, "
            f"{self.tpr} threads per row, {self.nch} chunk(s) x {self.rpt} row(s) per thread, "
            f"{'16-byte vector' if self.vector else 'element-wise'} access"
            f"{', whole-chunk rows' if self.whole else ''}; {self.reason}"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length() if n > 1 else 0


def row_chunks(sk: int, itemsize: int, aligned_rows: bool = True) -> int:
    """16-byte chunks a row touches: rows that may start off a 16-byte boundary touch up
    to one more."""
    n = CHUNK_BYTES // itemsize
    return _ceil_div(sk + (0 if aligned_rows else n - 1), n)


# A masked or causal forward whose rows span 2 or 4 warps (16-bit rows of 1025 to 4096 keys
# at 4 chunks per thread) runs a block per row rather than BLOCK threads of several rows.
# The rows of a block meet at its barrier (the exchange of the warps' partial results), so
# a block of several rows holds its SM slot until the slowest of them is done; such rows
# wait longest where rows differ in work (causal: visible prefixes of every length) or carry
# a mask's loads.  Measured on the H200, % of copy, BLOCK -> a block per row (two runs each):
# fp16 [8,32,2048,2048] causal 76 / 74 -> 85 / 84 (1.02 -> 0.91 ms); bool mask [B,1,Sq,Sk] fp16
# Sk 2048 91 / 91 -> 95 / 97, 4096 89 / 88 -> 93 / 93; additive fp16 2048 91 / 90 -> 93 / 93,
# 4096 91 / 89 -> 92 / 93, bf16 2048 90 / 89 -> 92 / 93; additive fp32 2048 89 / 88 -> 94 / 94,
# 4096 89 / 87 -> 92 / 92.  Not kept for the forward without a mask (fp32 Sk 1000 93 -> 88,
# bf16 Sk 4097 94 -> 89) nor for the backward (within noise); a row barrier per row in
# blocks of BLOCK threads (bar.sync with a thread count) instead gained nothing and cost the
# 16-bit masked kernels 8 registers.  Nor did skipping the terms of chunks wholly past the
# visible prefix (causal 0.90 -> 0.94 ms, masks 2-4% slower: 7-9 registers more; again with
# the values of such chunks skipped too: 0.899 / 0.899 / 0.899 -> 0.890 / 0.908 / 0.889 ms,
# fp16 without a mask Sk 2048 97.4 -> 93.9%, bool 2048 96.6 -> 91.2%).  Other shapes for
# that causal case, ms, two rounds: 4 chunks per thread (as planned) 0.920 / 0.902; 2 chunks
# (128 threads) 1.100 / 1.085; 8 chunks (a warp) 1.208 / 1.166; 4 chunks x 2 rows 1.164 /
# 1.186; 1 chunk 1.593 / 1.598.  A plain kernel that moves the case's bytes (the chunks
# holding a visible key read, the whole row written) with no arithmetic took 0.792-0.799 ms
# in its 8 best timings (52 shapes, two rounds each; 0.902-0.924 for this kernel in the same
# run), 0.809 / 0.822 ms in blocks of 256 / 64 threads in another (0.888 for this kernel).
# What bounds the case is the kernel's instructions: ncu at the base clock saw 676M warp
# instructions against the plain kernel's 90M, and a scheduler without an eligible warp on
# only 20% of cycles (the plain kernel: 86%).  Cutting the work of the chunks wholly past a
# row's prefix (smx_hide_past and SmxPast in softmax_fwd.cu: 647M, then 619M) took it from
# 0.892 to 0.847 ms (bf16 0.924 -> 0.864), and 16-bit terms by one FMA each where the max is
# below SMX_FOLD_MAX (smx_fwd_body) from 0.842 to 0.821 (bf16 0.858 -> 0.834; rows without
# a prefix and the masked ones within 1%, three rounds).  Also measured then and not kept
# (fp16, ms, two rounds): blocks taking rows in the order 0, R-1, 1, R-2, ... (short and
# long prefixes side by side) 0.909 / 0.908 against 0.888 / 0.887, rows from the last 0.899 /
# 0.899 (the plain kernel the same either way), 48 registers (__maxnreg__: 21 blocks per SM
# against 18, 24 bytes of stack) 0.902 / 0.902, and the 16-bit masked kernels so capped lost
# 10-15%.
ROW_OWN_BLOCK = True


def own_block(mask_kind: str, causal: bool) -> bool:
    """A forward with this mask kind (or causal) runs rows of more than a warp a block each."""
    return ROW_OWN_BLOCK and (mask_kind != "none" or causal)


def choose_shape(
    rows: int,
    sk: int,
    itemsize: int,
    backward: bool = False,
    aligned_rows: bool = True,
    whole: bool = False,
    wide: bool = False,
    lean: bool = False,
    edged: bool = False,
    own: bool = False,
) -> tuple[str, int, int, int, int, int, str]:
    """(tier, nch, rpt, tpr_log2, block, grid, reason) for `rows` rows of `sk` elements;
    `whole`: every row is whole 16-byte chunks (the AL kernels' table); `wide`: a forward
    with a wide mask (`wide_mask`); `lean`: a forward that may take the lean kernels
    (`lean_rows`: on whole-chunk rows, and edged ones); `edged`: a forward that may take the
    edged path (see `edged_kernel`); `own`: rows of more than a warp get a block each
    (`own_block`)."""
    table = _configs(BWD_TABLE if backward else FWD_TABLE, itemsize, wide and not backward)
    lean_table = [(MAX_CHUNKS[itemsize], LEAN_NCH, 1, "C/8, lean (values computed afresh in each pass)")]
    if edged and not backward and sk <= MAX_CHUNKS[itemsize] * (CHUNK_BYTES // itemsize):
        whole_chunks = max(sk // (CHUNK_BYTES // itemsize), 1)
        use = lean_table if lean and whole_chunks > LEAN_FROM else table
        got = _register_shape(rows, whole_chunks, use, own)
        if got is not None:
            _, nch, rpt, t, block, _, why = got
            if edged_kernel(itemsize, nch, rpt, min(1 << t, block)):
                return got[:6] + (why + ", edged rows (the keys outside whole chunks one per lane)",)
    chunks = max(row_chunks(sk, itemsize, aligned_rows), 1)
    if lean and whole and not backward and LEAN_FROM < chunks <= MAX_CHUNKS[itemsize]:
        table = lean_table
    got = _register_shape(rows, chunks, table, own)
    if got is not None:
        return got
    t = _log2_ceil(BLOCK)
    why = f"{chunks} chunks per row > {table[-1][0]}: a block per row, {LOOP_NCH} chunks per thread per segment"
    return "loop", LOOP_NCH, 1, t, BLOCK, rows, why


def _register_shape(
    rows: int, chunks: int, table: list[tuple[int, int, int, str]], own: bool = False
) -> tuple[str, int, int, int, int, int, str] | None:
    """The register tier's shape for rows of `chunks` chunks, or None where none fits
    (`own`: rows of more than a warp get a block each, see `own_block`)."""
    for limit, nch, rpt, rule in table:
        if chunks <= limit:
            need = _ceil_div(chunks, nch)
            t = _log2_ceil(need)
            own_why = ""
            if (1 << t) <= 32:
                block = SMALL_BLOCK
            elif (1 << t) == _ceil_div(need, 32) * 32:
                block = max(BLOCK, 1 << t)
                if own and block > (1 << t):
                    block = 1 << t
                    own_why = ", a block per row (a masked or causal forward)"
            else:  # a block of whole warps is one row (the kernel takes the whole block)
                block = _ceil_div(need, 32) * 32
            rows_per_block = max(block >> t, 1) * rpt
            grid = _ceil_div(rows, rows_per_block)
            why = f"{chunks} chunks per row <= {limit}: {nch} chunk(s) x {rpt} row(s) per thread, tpr = {rule}"
            why += own_why
            return "register", nch, rpt, t, block, grid, why
    return None


def _check_grid(grid: int) -> int:
    if grid > MAX_GRID:
        from ._errors import arg_value_error

        raise arg_value_error("x", f"at most {MAX_GRID} blocks of rows", f"{grid}")
    return grid


def whole_chunks(sk: int, itemsize: int, vector: bool, aligned_rows: bool) -> bool:
    """Every row is whole 16-byte chunks: vector access, rows on the chunk grid, and Sk a
    whole number of chunks (so no access reaches past a row)."""
    return vector and aligned_rows and sk % (CHUNK_BYTES // itemsize) == 0


def _with_registers(
    names: tuple[str, str | None], caps: DeviceCaps, shape_of: Callable[[int], tuple[int, int, int] | None]
) -> tuple[tuple[int, int, int], str, int] | None:
    """(shape, kernel, chunks per thread in registers) of the coop tier: every chunk in
    shared memory (`names[0]`), unless that leaves one block per SM (or does not fit) and
    the register variant `names[1]`, if any, gives two (or fits at all).  `shape_of(reg)`
    is the tier's shape with `reg` chunks per thread in registers, or None."""
    shape = shape_of(0)
    if names[1] is not None and (shape is None or not _two_per_sm(shape[2], caps)):
        alt = shape_of(CLUSTER_REG)
        if alt is not None and (shape is None or _two_per_sm(alt[2], caps)):
            return alt, names[1], CLUSTER_REG
    return None if shape is None else (shape, names[0], 0)


def _cluster_plan(
    name: str,
    reg: int,
    rows: int,
    sk: int,
    item: int,
    aligned_rows: bool,
    slot_bytes: int,
    vector: bool,
    caps: DeviceCaps,
    big_loses: bool = False,
) -> LaunchPlan | None:
    """The cluster tier's plan of kernel `name`, which holds `reg` chunks per thread in
    registers (0 or CLUSTER_REG); `big_loses`: a masked forward or a backward (see
    CLUSTER_LOOP_SMEM)."""
    chunks = row_chunks(sk, item, aligned_rows)
    shape = cluster_shape(chunks, slot_bytes, caps, reg)
    if shape is None:
        return None
    cs, q, smem = shape
    if rows * cs > MAX_GRID:
        return None
    if big_loses and cs == max(CLUSTER_SIZES) and smem > CLUSTER_LOOP_SMEM:
        return None  # the looped tier is faster there
    where = f"{q} in shared memory" + (f", {reg} in registers" if reg else "")
    why = (
        f"{chunks} chunks per row beyond the register tier, held on chip by a cluster of {cs} blocks "
        f"({reg + q} chunk(s) per thread: {where}; sm_{caps.cc})"
    )
    return LaunchPlan(
        name, "cluster", rows * cs, BLOCK, _log2_ceil(BLOCK), reg + q, 1, vector, why, cluster=cs, smem=smem
    )


def _stream_plan(
    name: str | None,
    rows: int,
    sk: int,
    item: int,
    aligned_rows: bool,
    vector: bool,
    caps: DeviceCaps,
    slot: int,
    smem_cap: int,
) -> LaunchPlan | None:
    """The plan of streamed cluster kernel `name` (forward or backward; STREAM_CLUSTER CTAs
    a row, `slot` bytes of shared memory a chunk, at most `smem_cap` bytes each, no more
    than the row needs), or None where the device has no clusters or there is no such
    kernel (`name` None)."""
    if name is None or not caps.clusters:
        return None
    cs = STREAM_CLUSTER
    if rows * cs > MAX_GRID:
        return None
    chunks = row_chunks(sk, item, aligned_rows)
    # chunks per thread past the registers (the kernel's smx_slice_steps)
    need = CLUSTER_STEP * _ceil_div(max(0, _ceil_div(chunks, cs * BLOCK) - CLUSTER_REG), CLUSTER_STEP)
    limit = min(smem_cap, caps.smem_per_block - CLUSTER_SMEM_RESERVE)
    q = min(need, max(0, limit) // (slot * BLOCK * CLUSTER_STEP) * CLUSTER_STEP)
    why = (
        f"{chunks} chunks per row, more than a cluster holds on chip: a cluster of {cs} blocks, "
        f"{CLUSTER_REG} chunk(s) per thread in registers, {q} in shared memory, {need - q} streamed "
        f"(read twice, the second time from L2; sm_{caps.cc})"
    )
    return LaunchPlan(
        name,
        "cluster",
        rows * cs,
        BLOCK,
        _log2_ceil(BLOCK),
        CLUSTER_REG + need,
        1,
        vector,
        why,
        cluster=cs,
        smem=q * BLOCK * slot,
    )


def _coop_plan(
    names: tuple[str, str | None],
    rows: int,
    sk: int,
    item: int,
    aligned_rows: bool,
    slot_bytes: int,
    vector: bool,
    caps: DeviceCaps,
) -> LaunchPlan | None:
    """The coop tier's plan, registers taken as in `_cluster_plan`.  Its groups are what
    the SM count surely holds (one without a device); a launch sets them from the device's
    measured occupancy."""
    picked = _with_registers(names, caps, lambda reg: coop_shape(sk, item, aligned_rows, slot_bytes, caps, reg))
    if picked is None:
        return None
    (g, q, smem), name, reg = picked
    cap = caps.sm_count * blocks_per_sm(smem, caps) if caps.sm_count else g
    groups = coop_groups(rows, g, cap)
    chunks = row_chunks(sk, item, aligned_rows)
    where = f"{q} in shared memory" + (f", {reg} in registers" if reg else "")
    why = (
        f"{chunks} chunks per row beyond the register tier, held on chip by {g} co-resident block(s) "
        f"({reg + q} chunk(s) per thread: {where}; sm_{caps.cc}; groups set at launch from occupancy)"
    )
    return LaunchPlan(name, "coop", g * groups, BLOCK, _log2_ceil(BLOCK), reg + q, 1, vector, why, smem=smem, coop=g)


def plan_forward(
    rows: int,
    sk: int,
    dtype: str,
    mask_kind: str,
    vector: bool,
    aligned_rows: bool = True,
    caps: DeviceCaps | None = None,
    mask_whole: bool = True,
    causal: bool = False,
) -> LaunchPlan:
    """`caps`: the device's (compute capability, shared memory, SMs); None plans for any
    device (no cluster or coop tier).  `mask_whole`: the mask (if any) is read a chunk at a time, each of
    its rows on the grid of its chunk width (the host checks its pointer, strides and unit
    key stride).  `causal`: a causal forward (see `lean_rows`)."""
    item = X_DTYPES[dtype][1]
    aligned_rows = aligned_rows or not vector
    whole = whole_chunks(sk, item, vector, aligned_rows) and mask_whole and mask_kind in al_mask_kinds(dtype)
    edged = mask_kind == "none" and vector and not whole
    tier, nch, rpt, t, block, grid, reason = choose_shape(
        rows,
        sk,
        item,
        False,
        aligned_rows,
        whole,
        wide_mask(item, mask_kind),
        lean_rows(item, mask_kind, whole or edged, causal),
        edged,
        own_block(mask_kind, causal),
    )
    if tier == "loop" and caps is not None:
        slot = CHUNK_BYTES + (CHUNK_BYTES // item) * MASK_ITEMSIZE[mask_kind]
        reg = cluster_reg(item, mask_kind)
        name = kernel_fwd_cluster(dtype, mask_kind, reg)
        stream = kernel_fwd_stream(dtype, mask_kind) if mask_kind in stream_mask_kinds(dtype) else None
        if FORCE_STREAM is not None and not (FORCE_COOP or FORCE_SPLIT):
            plan = _stream_plan(stream, rows, sk, item, aligned_rows, vector, caps, slot, FORCE_STREAM)
            if plan is not None:
                return plan
        plan = (
            None
            if FORCE_COOP or FORCE_SPLIT
            else _cluster_plan(name, reg, rows, sk, item, aligned_rows, slot, vector, caps, mask_kind != "none")
        )
        xs = mask_kind in xs_mask_kinds(dtype) and not (FORCE_COOP or FORCE_SPLIT) and CLUSTER_XS is not False
        if xs and (plan is None or CLUSTER_XS):  # x alone in shared memory, the mask read from global memory
            name = kernel_fwd_cluster_xs(dtype, mask_kind)
            held = _cluster_plan(name, CLUSTER_REG, rows, sk, item, aligned_rows, CHUNK_BYTES, vector, caps, True)
            if held is not None:
                plan = replace(
                    held, reason=f"{held.reason}; x alone in shared memory, the mask read from global memory"
                )
        if plan is None and (FORCE_COOP or COOP_WHERE_IT_FITS):
            names = (
                kernel_fwd_coop(dtype, mask_kind),
                kernel_fwd_coop(dtype, mask_kind, CLUSTER_REG) if mask_kind == "none" else None,
            )
            plan = _coop_plan(names, rows, sk, item, aligned_rows, slot, vector, caps)
        if plan is None and not (FORCE_COOP or FORCE_SPLIT):
            plan = _stream_plan(stream, rows, sk, item, aligned_rows, vector, caps, slot, STREAM_SMEM)
        mi = MASK_ITEMSIZE[mask_kind]
        segs = split_segments(sk, item, aligned_rows, False, mi)
        if plan is None and caps.cc >= SPLIT_MIN_CC and (FORCE_SPLIT or (SPLIT and split_pays(rows, segs, caps))):
            name = kernel_fwd_split(dtype, mask_kind)
            plan = _split_plan(name, rows, sk, item, aligned_rows, vector, False, mi)
        if plan is not None:
            return plan
    whole = whole and tier == "register"
    pipe = whole and rpt == 1 and rows < 2**31 and pipe_rows(item, mask_kind, causal, nch, min(1 << t, block))
    if pipe and caps is not None and caps.cc >= PIPE_MIN_CC:
        smem = pipe_smem(nch, block, item, mask_kind)
        if smem <= caps.smem_per_block - CLUSTER_SMEM_RESERVE:
            why = f"{reason}; pipelined (the next rows in flight while a block works, sm_{caps.cc})"
            name = kernel_fwd_pipe(dtype, mask_kind, nch)
            return LaunchPlan(name, "pipe", _check_grid(grid), block, t, nch, rpt, vector, why, whole, smem=smem)
    name = kernel_fwd(dtype, mask_kind, nch, rpt, whole) if tier == "register" else kernel_fwd_loop(dtype, mask_kind)
    return LaunchPlan(name, tier, _check_grid(grid), block, t, nch, rpt, vector, reason, whole)


def plan_backward(
    rows: int, sk: int, dtype: str, vector: bool, aligned_rows: bool = True, caps: DeviceCaps | None = None
) -> LaunchPlan:
    item = X_DTYPES[dtype][1]
    aligned_rows = aligned_rows or not vector
    whole = whole_chunks(sk, item, vector, aligned_rows)
    tier, nch, rpt, t, block, grid, reason = choose_shape(rows, sk, item, True, aligned_rows, whole)
    if tier == "loop" and caps is not None:
        name = kernel_bwd_cluster(dtype, CLUSTER_REG)
        slot = 2 * CHUNK_BYTES
        stream = kernel_bwd_stream(dtype)
        if FORCE_STREAM is not None and not (FORCE_COOP or FORCE_SPLIT):
            plan = _stream_plan(stream, rows, sk, item, aligned_rows, vector, caps, slot, FORCE_STREAM)
            if plan is not None:
                return plan
        plan = (
            None
            if FORCE_COOP or FORCE_SPLIT
            else _cluster_plan(name, CLUSTER_REG, rows, sk, item, aligned_rows, slot, vector, caps, True)
        )
        if plan is None and (FORCE_COOP or COOP_WHERE_IT_FITS):
            names = (kernel_bwd_coop(dtype), kernel_bwd_coop(dtype, CLUSTER_REG))
            plan = _coop_plan(names, rows, sk, item, aligned_rows, slot, vector, caps)
        if plan is None and not (FORCE_COOP or FORCE_SPLIT):
            plan = _stream_plan(stream, rows, sk, item, aligned_rows, vector, caps, slot, STREAM_SMEM)
        segs = split_segments(sk, item, aligned_rows, True)
        if plan is None and caps.cc >= SPLIT_MIN_CC and (FORCE_SPLIT or (SPLIT and split_pays(rows, segs, caps))):
            plan = _split_plan(kernel_bwd_split(dtype), rows, sk, item, aligned_rows, vector, True)
        if plan is not None:
            return plan
    whole = whole and tier == "register"
    name = kernel_bwd(dtype, nch, rpt, whole) if tier == "register" else kernel_bwd_loop(dtype)
    return LaunchPlan(name, tier, _check_grid(grid), block, t, nch, rpt, vector, reason, whole)
