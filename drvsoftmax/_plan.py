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

CHUNK_BYTES = 16  # one vector access
REG_VALUES = 32  # fp32 values of row data one thread holds (forward)
BWD_VALUES = 16  # backward holds y and dy: 16 values of each
MAX_TPR = 1024  # threads per row of the register tier (one block)
SHORT_CHUNKS = 32  # rows of at most this many chunks take the short tier
SHORT_BLOCK = 128  # block of the short tier
SHORT_ROWS = 4  # rows per thread in flight in the short tier (forward)
LOOP_THREADS = 1024  # block size of the looped tier
MIN_BLOCK = 128  # register-tier blocks hold at least this many threads
# Blocks per launch at most; beyond it the kernels loop over rows with a grid stride
# (65535 blocks of >= 128 threads are far more than the largest GPU holds at once).
MAX_GRID = 65535


def reg_nch(itemsize: int, values: int = REG_VALUES) -> int:
    """Chunks (16 bytes each) in `values` fp32 values: 4 of 16-bit or 8 of fp32 data
    forward, 2 or 4 backward."""
    return values // (CHUNK_BYTES // itemsize)


# The tiers, by the number of 16-byte chunks in a row (n = reg_nch: 4 for 16-bit, 8 for
# fp32 forward; 2 and 4 backward).  Threads per row (TPR) is a power of two.
#   tier       chunks per row          layout
TIERS = (
    ("short", "<= 32", "one chunk per thread, TPR = 1..32 (within a warp), several rows per thread in flight"),
    ("register", "<= 1024 * n", "n chunks per thread, TPR = 1..1024 (block reduction above 32)"),
    ("loop", "> 1024 * n", "a block of 1024 per row, two passes over the row"),
)
# So the register tier ends at 32768 elements forward and 16384 backward, every dtype.


def kernel_fwd_short(dtype: str, mask_kind: str, rows_per_thread: int) -> str:
    return f"smx_fwd_short<{X_DTYPES[dtype][0]}, {MASK_KINDS[mask_kind]}, {rows_per_thread}>"


def kernel_fwd_reg(dtype: str, mask_kind: str, nch: int) -> str:
    return f"smx_fwd_reg<{X_DTYPES[dtype][0]}, {MASK_KINDS[mask_kind]}, {nch}>"


def kernel_fwd_loop(dtype: str, mask_kind: str) -> str:
    return f"smx_fwd_loop<{X_DTYPES[dtype][0]}, {MASK_KINDS[mask_kind]}>"


def kernel_bwd_short(dtype: str, rows_per_thread: int) -> str:
    return f"smx_bwd_short<{X_DTYPES[dtype][0]}, {rows_per_thread}>"


def kernel_bwd_reg(dtype: str, nch: int) -> str:
    return f"smx_bwd_reg<{X_DTYPES[dtype][0]}, {nch}>"


def kernel_bwd_loop(dtype: str) -> str:
    return f"smx_bwd_loop<{X_DTYPES[dtype][0]}>"


def all_kernel_names() -> list[str]:
    """Every kernel the package can launch, in a stable order."""
    names = []
    for dt, (_, item) in X_DTYPES.items():
        n = reg_nch(item)
        for mk in MASK_KINDS:
            names += [kernel_fwd_short(dt, mk, SHORT_ROWS), kernel_fwd_reg(dt, mk, n), kernel_fwd_loop(dt, mk)]
        nb = reg_nch(item, BWD_VALUES)
        names += [kernel_bwd_short(dt, nb), kernel_bwd_reg(dt, nb), kernel_bwd_loop(dt)]
    return names


def packaged_kernel_names() -> list[str]:
    """The kernels that ship precompiled in the wheel (the configurations Transformers
    commonly call); every other kernel of `all_kernel_names` compiles on first use."""
    return all_kernel_names()


@dataclass(frozen=True)
class LaunchPlan:
    kernel: str  # name expression of the kernel
    tier: str  # "short", "register" or "loop"
    grid: int
    block: int
    tpr_log2: int  # log2(threads per row); for the loop tier log2(block)
    nch: int  # chunks per thread and row (1 short, n register, 0 loop)
    rpt: int  # rows per thread at once (n short, 1 otherwise)
    vector: bool  # 16-byte accesses
    reason: str  # which tier row chose it

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


def short_rows(itemsize: int, backward: bool) -> int:
    """Rows per thread of the short tier: 4 forward; backward (y and dy) 16 values' worth."""
    return reg_nch(itemsize, BWD_VALUES) if backward else SHORT_ROWS


def choose_shape(rows: int, sk: int, itemsize: int, values: int = REG_VALUES):
    """(tier, nch, rpt, tpr_log2, block, grid, reason) for `rows` rows of `sk` elements."""
    chunks = _ceil_div(sk, CHUNK_BYTES // itemsize)
    n = reg_nch(itemsize, values)
    if chunks <= SHORT_CHUNKS:
        t = _log2_ceil(chunks)
        r = short_rows(itemsize, values == BWD_VALUES)
        grid = _ceil_div(rows, (SHORT_BLOCK >> t) * r)
        return "short", 1, r, t, SHORT_BLOCK, grid, f"{chunks} chunks {TIERS[0][1]}: {TIERS[0][2]}"
    if chunks <= MAX_TPR * n:
        t = _log2_ceil(_ceil_div(chunks, n))
        block = max(1 << t, MIN_BLOCK)
        grid = _ceil_div(rows, block >> t)
        return "register", n, 1, t, block, grid, f"{chunks} chunks {TIERS[1][1]}: {TIERS[1][2]}"
    t = _log2_ceil(LOOP_THREADS)
    return "loop", 0, 1, t, LOOP_THREADS, rows, f"{chunks} chunks {TIERS[2][1]}: {TIERS[2][2]}"


def plan_forward(rows: int, sk: int, dtype: str, mask_kind: str, vector: bool) -> LaunchPlan:
    tier, nch, rpt, t, block, grid, reason = choose_shape(rows, sk, X_DTYPES[dtype][1])
    n = reg_nch(X_DTYPES[dtype][1])
    name = {
        "short": lambda: kernel_fwd_short(dtype, mask_kind, rpt),
        "register": lambda: kernel_fwd_reg(dtype, mask_kind, n),
        "loop": lambda: kernel_fwd_loop(dtype, mask_kind),
    }[tier]()
    return LaunchPlan(name, tier, min(grid, MAX_GRID), block, t, nch, rpt, vector, reason)


def plan_backward(rows: int, sk: int, dtype: str, vector: bool) -> LaunchPlan:
    tier, nch, rpt, t, block, grid, reason = choose_shape(rows, sk, X_DTYPES[dtype][1], BWD_VALUES)
    n = reg_nch(X_DTYPES[dtype][1], BWD_VALUES)
    name = {
        "short": lambda: kernel_bwd_short(dtype, rpt),
        "register": lambda: kernel_bwd_reg(dtype, n),
        "loop": lambda: kernel_bwd_loop(dtype),
    }[tier]()
    return LaunchPlan(name, tier, min(grid, MAX_GRID), block, t, nch, rpt, vector, reason)
