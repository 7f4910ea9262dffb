"""The planner: which kernel variant runs, and with which launch shape.

Pure Python and free of any GPU or framework, so that it is tested on every machine and
``drvsoftmax.explain`` can show users what will run.  The kernel names written here are
the C++ name expressions that ``cuda_src`` instantiates; the compiler and the packaged
artifacts are keyed by them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Storage dtypes of x / y / dy: name -> (C++ type, bytes).
X_DTYPES = {
    "float16": ("smx_f16", 2),
    "bfloat16": ("smx_bf16", 2),
    "float32": ("float", 4),
}

# Mask sources: kind -> C++ LOAD modifier.  Integer and boolean masks only need their
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

CHUNK_BYTES = 16          # one vector access
REG_VALUES = 32           # fp32 values of a row one thread holds in the big register tier
MAX_TPR = 1024            # threads per row of the register tier (one block)
LOOP_THREADS = 1024       # block size of the looped tier
MIN_BLOCK = 128           # register-tier blocks hold at least this many threads
MAX_GRID = 2**31 - 1



def reg_nch(itemsize: int, values: int = REG_VALUES) -> int:
    """Chunks per thread of the big register tier: `values` fp32 values (forward: 32, that
    is 4 chunks of 16-bit or 8 of fp32; backward, which holds y and dy: 16 of each)."""
    return values // (CHUNK_BYTES // itemsize)


BWD_VALUES = REG_VALUES // 2


# Register tier, by the number of 16-byte chunks in a row.  Rows are spread over a
# power-of-two number of threads per row (TPR); each thread holds NCH chunks in registers.
#   (max chunks as a function of NCH_big, NCH, comment)
REG_TABLE = (
    (lambda big: 32, lambda big: 1, "short rows: one chunk per thread, 1..32 threads (a warp at most) per row"),
    (lambda big: MAX_TPR * big, lambda big: big,
     "32 values per thread (fewer threads, fewer per-thread overheads), 1..1024 threads per row"),
)
# Beyond the table (rows longer than 32768 elements forward, 16384 backward) the looped
# tier takes a block per row and reads the row twice.


def kernel_fwd_reg(dtype: str, mask_kind: str, nch: int) -> str:
    return f"smx_fwd_reg<{X_DTYPES[dtype][0]}, {MASK_KINDS[mask_kind]}, {nch}>"


def kernel_fwd_loop(dtype: str, mask_kind: str) -> str:
    return f"smx_fwd_loop<{X_DTYPES[dtype][0]}, {MASK_KINDS[mask_kind]}>"


def kernel_bwd_reg(dtype: str, nch: int) -> str:
    return f"smx_bwd_reg<{X_DTYPES[dtype][0]}, {nch}>"


def kernel_bwd_loop(dtype: str) -> str:
    return f"smx_bwd_loop<{X_DTYPES[dtype][0]}>"


def all_kernel_names() -> list[str]:
    """Every kernel the package can launch, in a stable order."""
    names = []
    for dt in X_DTYPES:
        nchs = (1, reg_nch(X_DTYPES[dt][1]))
        for mk in MASK_KINDS:
            names += [kernel_fwd_reg(dt, mk, n) for n in nchs]
            names.append(kernel_fwd_loop(dt, mk))
        names += [kernel_bwd_reg(dt, n) for n in (1, reg_nch(X_DTYPES[dt][1], BWD_VALUES))]
        names.append(kernel_bwd_loop(dt))
    return names


@dataclass(frozen=True)
class LaunchPlan:
    kernel: str      # name expression of the kernel
    tier: str        # "register" or "loop"
    grid: int
    block: int
    tpr_log2: int    # log2(threads per row); for the loop tier log2(block)
    nch: int         # chunks per thread (register tier), 0 for the loop tier
    vector: bool     # 16-byte accesses
    reason: str      # which table row chose it

    def describe(self) -> str:
        return (
            f"{self.tier} tier: {self.kernel}, grid {self.grid} x block {self.block}, "
            f"{1 << self.tpr_log2} threads per row, "
            f"{'16-byte vector' if self.vector else 'element-wise'} access; {self.reason}"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length() if n > 1 else 0


def choose_shape(rows: int, sk: int, itemsize: int, values: int = REG_VALUES) -> tuple[str, int, int, int, str]:
    """(tier, nch, tpr_log2, block, reason) for `rows` rows of `sk` elements."""
    per_chunk = CHUNK_BYTES // itemsize
    chunks = _ceil_div(sk, per_chunk)
    big = reg_nch(itemsize, values)
    for max_chunks, nch, comment in REG_TABLE:
        if chunks <= max_chunks(big):
            n = nch(big)
            tpr_log2 = _log2_ceil(_ceil_div(chunks, n))
            block = max(1 << tpr_log2, MIN_BLOCK)
            return "register", n, tpr_log2, block, f"{chunks} chunks <= {max_chunks(big)}: {comment}"
    return (
        "loop",
        0,
        _log2_ceil(LOOP_THREADS),
        LOOP_THREADS,
        f"{chunks} chunks > {REG_TABLE[-1][0](big)}: a block of {LOOP_THREADS} per row, two passes",
    )


def plan_forward(rows: int, sk: int, dtype: str, mask_kind: str, vector: bool) -> LaunchPlan:
    tier, nch, tpr_log2, block, reason = choose_shape(rows, sk, X_DTYPES[dtype][1])
    if tier == "register":
        name = kernel_fwd_reg(dtype, mask_kind, nch)
        grid = _ceil_div(rows, block >> tpr_log2)
    else:
        name = kernel_fwd_loop(dtype, mask_kind)
        grid = rows
    return LaunchPlan(name, tier, min(grid, MAX_GRID), block, tpr_log2, nch, vector, reason)


def plan_backward(rows: int, sk: int, dtype: str, vector: bool) -> LaunchPlan:
    tier, nch, tpr_log2, block, reason = choose_shape(rows, sk, X_DTYPES[dtype][1], BWD_VALUES)
    if tier == "register":
        name = kernel_bwd_reg(dtype, nch)
        grid = _ceil_div(rows, block >> tpr_log2)
    else:
        name = kernel_bwd_loop(dtype)
        grid = rows
    return LaunchPlan(name, tier, min(grid, MAX_GRID), block, tpr_log2, nch, vector, reason)
