"""The framework-free core: pointers, shapes, strides, scale and a stream in; one launch out.

Front doors (torch, CuPy, Numba, raw pointers) describe their arrays as `Operand`s and
call `forward` / `backward`.  Everything about an input but its pointers is turned into a
`Prepared` launch once (kernel handle, grid, packed parameters) and cached, so repeated
calls with the same layout only write pointers and launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import struct
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _dtypes, _params, _plan
from ._errors import ArgumentValueError, arg_type_error, arg_value_error, check

if TYPE_CHECKING:
    from ._driver import Device

MAXD = _params.MAXT  # leading dims of one operand merge into at most this many terms
F_CAUSAL, F_KLEN, F_KLEN64, F_VEC, F_MVEC, F_SMALL, F_SAMEMAP = (
    _params.FLAGS[k][0] for k in ("CAUSAL", "KLEN", "KLEN64", "VEC", "MVEC", "SMALL", "SAMEMAP")
)
MAX_SK = 2**31 - 1  # row-internal indices are 32-bit in the kernels

MASK_KIND_OF_DTYPE = _dtypes.MASK_KIND_OF_DTYPE
KLEN_DTYPES = _dtypes.KLEN_KERNEL_DTYPES


class Operand(NamedTuple):
    """An array as the core sees it: data pointer, dtype name, shape, strides in elements."""

    ptr: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]


# ----------------------------------------------------------------------------------
# Shapes and strides (pure; tested on the CPU).


def broadcast_strides(
    name: str, shape: tuple[int, ...], strides: tuple[int, ...], target: tuple[int, ...]
) -> tuple[int, ...]:
    """Strides of an array of `shape` broadcast to `target` (0 along broadcast dims)."""
    if len(shape) > len(target) and any(n != 1 for n in shape[: len(shape) - len(target)]):
        raise arg_value_error(name, f"broadcastable to x.shape {tuple(target)}", f"shape {tuple(shape)}")
    out = []
    for i, n in enumerate(target):
        j = i - len(target) + len(shape)
        if j < 0:
            out.append(0)
        elif shape[j] == n:
            out.append(strides[j] if n != 1 else 0)
        elif shape[j] == 1:
            out.append(0)
        else:
            raise arg_value_error(name, f"broadcastable to x.shape {tuple(target)}", f"shape {tuple(shape)}")
    return tuple(out)


def row_map(lead: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The row map of one operand: terms (div, mod, stride) with
    offset(row) = sum(((row // div) % mod if mod else row // div) * stride).

    `lead` are x's leading sizes (all but the last dim, row-major), `strides` the
    operand's element strides along them (0 where it is broadcast).  Neighbouring dims
    merge where the operand's strides allow it; dims of size 1 and broadcast dims add
    nothing and are dropped, so a contiguous operand has one term.
    """
    groups: list[list[int]] = []  # [div, size, stride], innermost first
    div = 1
    for n, s in zip(reversed(lead), reversed(strides)):
        if n == 1:
            continue
        if groups and s == groups[-1][2] * groups[-1][1]:
            groups[-1][1] *= n
        else:
            groups.append([div, n, s])
        div *= n
    terms = []
    for i, (d, n, s) in enumerate(groups):
        if s == 0:
            continue
        outermost = i == len(groups) - 1
        terms.append((d, 0 if outermost else n, s))
    if len(terms) > MAXD:
        raise arg_value_error(
            "x", f"a layout whose leading dims merge into at most {MAXD} per operand", f"{len(terms)} unmergeable dims"
        )
    return terms


def map_offset(terms: list[tuple[int, int, int]], row: int) -> int:
    """offset(row) of a row map, as the kernels compute it (for tests and checks)."""
    off = 0
    for d, m, s in terms:
        q = row // d
        off += (q % m if m else q) * s
    return off


def magic_divisor(d: int) -> tuple[int, int]:
    """(mul, shr) with n // d == (n * mul >> 32) >> shr for every 0 <= n < 2**31 and d >= 2."""
    if d < 2:
        raise ValueError(f"magic_divisor needs d >= 2, got {d}")
    p = 31 + (d - 1).bit_length()
    return -(-(1 << p) // d), p - 32


def _map_fields(prefix: str, terms: list[tuple[int, int, int]], small: bool) -> dict[str, Any]:
    f: dict[str, Any] = {f"{prefix}.nterms": len(terms)}
    f[f"{prefix}.div"] = [d for d, _, _ in terms]
    f[f"{prefix}.mod"] = [m for _, m, _ in terms]
    f[f"{prefix}.stride"] = [s for _, _, s in terms]
    if small:
        dm = [magic_divisor(d) if d > 1 else (0, 0) for d, _, _ in terms]
        mm = [magic_divisor(m) if m > 1 else (0, 0) for _, m, _ in terms]
        f[f"{prefix}.dmul"] = [a for a, _ in dm]
        f[f"{prefix}.dshr"] = [b for _, b in dm]
        f[f"{prefix}.mmul"] = [a for a, _ in mm]
        f[f"{prefix}.mshr"] = [b for _, b in mm]
    return f


def _vector_ok(itemsize: int, ops: list[Operand], lead: tuple[int, ...], n: int | None = None) -> bool:
    """16-byte chunk accesses are possible for these operands (pointers 16-byte aligned):
    unit stride along the row, and every row either starting on a chunk boundary, or all
    operands sharing their leading strides (so each row is misaligned alike and only its
    first and last chunk are accessed element-wise)."""
    n = n or 16 // itemsize
    for op in ops:
        if len(op.shape) and op.shape[-1] > 1 and op.strides[-1] != 1:
            return False
    return rows_aligned(ops, lead, n) or all(
        size == 1 or len({op.strides[i] for op in ops}) == 1 for i, size in enumerate(lead)
    )


def rows_aligned(ops: list[Operand], lead: tuple[int, ...], n: int) -> bool:
    """Every row of every operand starts a whole number of n-element chunks after the first."""
    return all(size == 1 or st % n == 0 for op in ops for size, st in zip(lead, op.strides[:-1]))


def span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from an array's first element to one past its last (strides >= 0)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(shape, strides))


# ----------------------------------------------------------------------------------
# Prepared launches.


class Prepared:
    """Everything of one launch but the pointers and the stream."""

    __slots__ = (
        "dev",
        "kernel",
        "func",
        "grid",
        "block",
        "params",
        "params_addr",
        "plan",
        "nargs",
        "cluster",
        "coop",
        "fallback",
        "smem",
        "split",
    )

    def __init__(self, dev: Device, plan: _plan.LaunchPlan, packed: bytes, nargs: int) -> None:
        self.dev = dev
        self.plan = plan
        self.kernel = dev.kernel(plan.kernel)
        function = getattr(dev, "function", None)  # (stand-in devices of tests may have kernels only)
        self.func = self.kernel if function is None else function(plan.kernel)
        self.grid, self.block = plan.grid, plan.block
        self.params = ctypes.create_string_buffer(packed, len(packed))
        self.params_addr = ctypes.addressof(self.params)
        self.nargs = nargs
        # Cluster-tier launches: their CUlaunchConfig (cuLaunchKernelEx); None for all others.
        self.cluster: Any = None
        if plan.cluster:
            from ._driver import cluster_config

            self.cluster = cluster_config(plan.grid, plan.cluster, plan.block, plan.smem)
        # Coop-tier launches: (blocks per row, groups), and the plan of the looped tier to
        # take if a cooperative launch is refused; None for all others.
        self.coop: tuple[int, int] | None = (plan.coop, plan.grid // plan.coop) if plan.coop else None
        self.fallback: _plan.LaunchPlan | None = None
        # Dynamic shared memory of a plain launch (the pipelined register tier), else 0.
        self.smem = plan.smem if plan.tier == "pipe" else 0
        # Split-tier launches: (segments per row, rows at a time, workspace bytes), set by
        # `_with_workspace`; None for all others.
        self.split: tuple[int, int, int] | None = None


_Made = tuple[dict[str, Any], _plan.LaunchPlan]


def _cluster_or_loop(dev: Device, made: _Made, replan: Callable[[], _Made]) -> _Made:
    """`made` if its plan is not of the cluster tier or this device can run its clusters
    (checked once per kernel and size), else what `replan` makes without the cluster tier."""
    plan = made[1]
    if plan.cluster and not dev.cluster_ready(plan.kernel, plan.cluster, plan.smem, plan.block):
        return replan()
    return made


def _coop_or_loop(dev: Device, made: _Made, replan: Callable[[], _Made]) -> _Made:
    """`made` if its plan is not of the coop tier; else its grid set from the device's
    measured capacity for its kernel (checked once per kernel and size), or what `replan`
    makes without the device's tiers where not even one row's blocks fit at once."""
    values, plan = made
    if not plan.coop:
        return made
    groups = _plan.coop_groups(values["rows"], plan.coop, dev.coop_capacity(plan.kernel, plan.smem, plan.block))
    if groups < 1:
        return replan()
    return values, dataclasses.replace(plan, grid=plan.coop * groups)


def _pipe_or_register(dev: Device, made: _Made, replan: Callable[[], _Made]) -> _Made:
    """`made` if its plan is not of the pipelined register tier; else its grid set from the
    blocks this device holds at once (asked once per kernel and size), or the register
    tier's plan (`replan`) where it holds none."""
    values, plan = made
    if plan.tier != "pipe":
        return made
    cap = dev.resident_blocks(plan.kernel, plan.smem, plan.block)
    if cap < 1:
        return replan()
    return values, dataclasses.replace(plan, grid=min(plan.grid, cap))


def _split_or_loop(dev: Device, made: _Made, replan: Callable[[], _Made]) -> _Made:
    """`made` if its plan is not of the split tier or this device holds a row's segments
    at once (asked once per kernel); else the looped tier's plan (`replan`)."""
    plan = made[1]
    if not plan.split or _plan.FORCE_SPLIT:
        return made
    resident = getattr(dev, "resident_blocks", None)  # (stand-in devices of tests may lack it)
    if resident is not None and resident(plan.kernel, 0, plan.block) < plan.split:
        return replan()
    return made


def _with_fallback(prep: Prepared, replan: Callable[[], _Made]) -> Prepared:
    """A coop- or split-tier launch keeps the looped tier's plan (same parameters) for a
    refused launch (a cooperative launch too large; no stream-ordered workspace)."""
    if prep.coop is not None or prep.split is not None:
        prep.fallback = replan()[1]
    return prep


def _with_workspace(prep: Prepared, rows: int) -> Prepared:
    """A split-tier launch's grid and the bytes of workspace its launches allocate."""
    plan = prep.plan
    if plan.split:
        prep.split = (plan.split, plan.grid // plan.split, plan.workspace(rows))
    return prep


_cache: dict[tuple[object, ...], Prepared] = {}
_cache_lock = threading.Lock()
_CACHE_MAX = 4096


def _remember(key: tuple[object, ...], prep: Prepared) -> Prepared:
    with _cache_lock:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = prep
    return prep


def check_forward(x: Operand, y: Operand, mask: Operand | None, klen: Operand | None, causal: bool) -> None:
    """Argument checks of the kernel path that the front doors cannot do themselves."""
    if x.dtype not in _plan.X_DTYPES:
        raise arg_type_error("x", "float16, bfloat16 or float32 on the GPU", f"dtype {x.dtype}")
    if y.dtype != x.dtype:
        raise arg_type_error("out", f"of x's dtype {x.dtype}", f"dtype {y.dtype}")
    if tuple(y.shape) != tuple(x.shape):
        raise arg_value_error("out", f"of x's shape {tuple(x.shape)}", f"shape {tuple(y.shape)}")
    if x.shape and x.shape[-1] > MAX_SK:
        raise arg_value_error("x", f"rows of at most {MAX_SK} elements", f"Sk = {x.shape[-1]}")
    if mask is not None and mask.dtype not in MASK_KIND_OF_DTYPE:
        raise arg_type_error("mask", "bool, an integer or a float dtype", f"dtype {mask.dtype}")
    if klen is not None and klen.dtype not in KLEN_DTYPES:
        raise arg_type_error("key_lengths", "int32 or int64 on the GPU", f"dtype {klen.dtype}")


def prepare_forward(
    dev: Device,
    x: Operand,
    y: Operand,
    mask: Operand | None,
    klen: Operand | None,
    causal: bool,
    scale: float,
    aligned: bool,
    mask_aligned: bool = False,
) -> Prepared:
    """`aligned`: x and y are 16-byte aligned; `mask_aligned`: so is the mask (it lets the
    whole-chunk kernels run; without it the general kernels check each mask row)."""

    def replan() -> _Made:
        return forward_params(x, y, mask, klen, causal, scale, aligned, mask_aligned)

    made = forward_params(x, y, mask, klen, causal, scale, aligned, mask_aligned, getattr(dev, "caps", None))
    made = _coop_or_loop(dev, _cluster_or_loop(dev, made, replan), replan)
    values, plan = _pipe_or_register(dev, _split_or_loop(dev, made, replan), replan)
    prep = _with_workspace(Prepared(dev, plan, _params.FWD.pack(values), 5), values["rows"])
    return _with_fallback(prep, replan)


def forward_params(
    x: Operand,
    y: Operand,
    mask: Operand | None,
    klen: Operand | None,
    causal: bool,
    scale: float,
    aligned: bool,
    mask_aligned: bool = False,
    caps: _plan.DeviceCaps | None = None,
) -> tuple[dict[str, Any], _plan.LaunchPlan]:
    """The SmxFwdParams fields (by C name) and the launch plan of a forward on a device
    of `caps` (None: the tiers every device has)."""
    shape = tuple(x.shape)
    lead = shape[:-1]
    sk = shape[-1]
    rows = 1
    for n in lead:
        rows *= n
    small = rows < 2**31
    flags = F_SMALL if small else 0
    v: dict[str, Any] = {"rows": rows, "sk": sk, "sx": x.strides[-1], "sy": y.strides[-1], "scale": scale}
    v["span_x"] = span(shape, x.strides)
    mst = None if mask is None else broadcast_strides("mask", tuple(mask.shape), tuple(mask.strides), shape)
    itemsize = _plan.X_DTYPES[x.dtype][1]
    natural = tuple(range(len(lead)))
    perm = _mask_row_order(lead, sk, itemsize, mst, mask)
    try:
        maps = _row_maps(lead, perm, x, y, mst, klen, causal)
    except ArgumentValueError:
        if perm == natural:
            raise
        maps = _row_maps(lead, natural, x, y, mst, klen, causal)  # that order needs too many terms
    mx, my = maps["map_x"], maps["map_y"]
    for name, terms in maps.items():
        v.update(_map_fields(name, terms, small))
    if mx == my:
        flags |= F_SAMEMAP
    mask_kind = "none"
    mask_whole = True
    if mask is not None and mst is not None:
        v["sm"] = mst[-1]
        v["span_m"] = span(tuple(mask.shape), tuple(mask.strides))
        mask_kind = MASK_KIND_OF_DTYPE[mask.dtype]
        if mst[-1] == 1:
            flags |= F_MVEC
        # Whole-chunk kernels read a mask chunk (the keys of one 16-byte chunk of x) with
        # one access: unit key stride, every row on that access's alignment.
        mbytes = _plan.MASK_ITEMSIZE[mask_kind]
        width = min(16, CHUNK_ELEMS[itemsize] * mbytes)
        mask_whole = (
            mask_aligned
            and (mst[-1] == 1 or sk == 1)
            and all(n == 1 or (st * mbytes) % width == 0 for n, st in zip(lead, mst[:-1]))
        )
    if klen is not None:
        flags |= F_KLEN | (F_KLEN64 if klen.dtype == "int64" else 0)
    if causal:
        v["causal_shift"] = sk - shape[-2]
        flags |= F_CAUSAL
    vec = aligned and _vector_ok(itemsize, [x, y], lead)
    if vec:
        flags |= F_VEC
    ra = rows_aligned([x, y], lead, CHUNK_ELEMS[itemsize])
    plan = _plan.plan_forward(rows, sk, x.dtype, mask_kind, vec, ra, caps, mask_whole, causal)
    v["flags"] = flags
    v["tpr_log2"] = plan.tpr_log2
    return v, plan


CHUNK_ELEMS = {2: 8, 4: 4}

# Rows that share a mask row (a mask broadcast over heads) run one after the other when the
# x, y and mask bytes between two uses of one mask row in row-major order exceed this: then
# the mask is read from DRAM about once rather than once per head (L2 holds 50 MB on an
# H200).  Measured there, mask [B,1,Sq,Sk] on x [B,H,Sq,Sk], % of copy row-major -> heads
# innermost: additive fp32 at Sk 2048 (48 MiB apart) 71 -> 89, at 4096 (192 MiB) 70 -> 88;
# additive fp16 at 4096 (96 MiB) 70 -> 86, at 16384 (48 MiB) 71 -> 76; bool fp32 at 4096
# (144 MiB) 89 -> 92.  Between 20 and 24 MiB apart the GPUs differ (two rounds each): at 24
# MiB (additive 16-bit [8,32,2048,2048]) heads innermost took fp16 92.4 / 92.0 -> 93.5 /
# 92.7 on the H200 and 85.8 -> 94.5 (bf16 85.9 -> 94.6-95.3) on an H100 80GB HBM3; at 20
# MiB (bool fp16, the same shape) 96.1 / 97.0 -> 93.6 / 93.4 on the H200, 93.9 -> 95.2 on
# the H100.  So the limit lies between the two.  Also measured then and not kept: heads
# innermost within tiles of T query rows (rows b, q // T, h, q % T), T = 16 / 64 / 256 on the
# H200: below heads innermost at every case but additive fp32 at 2048 keys (fp16 additive
# 16384: 84.8 / 85.4 against 81.6 / 82.4, 81.7 / 82.1, 79.1 / 80.1).
MASK_REUSE_BYTES = 22 << 20


def _row_maps(
    lead: tuple[int, ...],
    perm: tuple[int, ...],
    x: Operand,
    y: Operand,
    mst: tuple[int, ...] | None,
    klen: Operand | None,
    causal: bool,
) -> dict[str, list[tuple[int, int, int]]]:
    """Every row map of a forward by its field name, the leading dims walked in the order `perm`."""
    lead_p = tuple(lead[i] for i in perm)
    nl = len(lead)

    def rmap(strides: tuple[int, ...]) -> list[tuple[int, int, int]]:
        return row_map(lead_p, tuple(strides[i] for i in perm))

    maps = {"map_x": rmap(x.strides[:-1]), "map_y": rmap(y.strides[:-1])}
    if mst is not None:
        maps["map_m"] = rmap(mst[:-1])
    if klen is not None:  # key_lengths index the first dim
        maps["map_k"] = rmap((klen.strides[0],) + (0,) * (nl - 1))
    if causal:  # the query index is the last leading dim
        maps["map_q"] = rmap((0,) * (nl - 1) + (1,))
    return maps


def _mask_row_order(
    lead: tuple[int, ...], sk: int, itemsize: int, mst: tuple[int, ...] | None, mask: Operand | None
) -> tuple[int, ...]:
    """The order in which the kernel walks the leading dims (a permutation, outermost first):
    row-major, but for a mask broadcast along a leading dim whose reuse distance exceeds
    MASK_REUSE_BYTES, where the broadcast dims move innermost."""
    natural = tuple(range(len(lead)))
    if mask is None or mst is None:
        return natural
    bcast = [i for i, n in enumerate(lead) if n > 1 and mst[i] == 0]
    if not bcast:
        return natural
    inner = 1
    for n in lead[bcast[-1] + 1 :]:
        inner *= n
    mbytes = _plan.MASK_ITEMSIZE[MASK_KIND_OF_DTYPE.get(mask.dtype, "none")]
    if inner * sk * (2 * itemsize + mbytes) <= MASK_REUSE_BYTES:
        return natural
    return tuple(i for i in natural if i not in bcast) + tuple(bcast)


def prepare_backward(dev: Device, dy: Operand, y: Operand, dx: Operand, scale: float, aligned: bool) -> Prepared:
    def replan() -> _Made:
        return backward_params(dy, y, dx, scale, aligned)

    made = backward_params(dy, y, dx, scale, aligned, getattr(dev, "caps", None))
    values, plan = _split_or_loop(dev, _coop_or_loop(dev, _cluster_or_loop(dev, made, replan), replan), replan)
    prep = _with_workspace(Prepared(dev, plan, _params.BWD.pack(values), 4), values["rows"])
    return _with_fallback(prep, replan)


def backward_params(
    dy: Operand, y: Operand, dx: Operand, scale: float, aligned: bool, caps: _plan.DeviceCaps | None = None
) -> tuple[dict[str, Any], _plan.LaunchPlan]:
    """The SmxBwdParams fields (by C name) and the launch plan of a backward."""
    shape = tuple(y.shape)
    lead = shape[:-1]
    rows = 1
    for n in lead:
        rows *= n
    small = rows < 2**31
    flags = F_SMALL if small else 0
    v: dict[str, Any] = {
        "rows": rows,
        "sk": shape[-1],
        "sdy": dy.strides[-1],
        "sy": y.strides[-1],
        "sdx": dx.strides[-1],
    }
    v["scale"] = scale
    v["span_dy"], v["span_y"] = span(shape, dy.strides), span(shape, y.strides)
    maps = [row_map(lead, op.strides[:-1]) for op in (dy, y, dx)]
    for name, terms in zip(("map_dy", "map_y", "map_dx"), maps):
        v.update(_map_fields(name, terms, small))
    if maps[0] == maps[1] == maps[2]:
        flags |= F_SAMEMAP
    itemsize = _plan.X_DTYPES[y.dtype][1]
    ops = [dy, y, dx]
    vec = aligned and _vector_ok(itemsize, ops, lead)
    if vec:
        flags |= F_VEC
    plan = _plan.plan_backward(rows, shape[-1], y.dtype, vec, rows_aligned(ops, lead, CHUNK_ELEMS[itemsize]), caps)
    v["flags"] = flags
    v["tpr_log2"] = plan.tpr_log2
    return v, plan


# ----------------------------------------------------------------------------------
# Launching.


class _ThreadArgs(threading.local):
    """Per-thread kernel arguments; the driver copies them at launch, so they are reused.

    Each buffer holds the kernelParams array (void*) and, after it, the pointer slots it
    points at: a launch writes the parameter block's address and the pointers with one
    struct.pack_into.  Forward (5 arguments): argv[0..4] at bytes 0..40, slots at 40..72.
    Backward (4 arguments): argv[0..3] at bytes 0..32, slots at 32..56.
    """

    def __init__(self) -> None:
        self.buf5 = ctypes.create_string_buffer(72)
        self.addr5 = ctypes.addressof(self.buf5)
        struct.pack_into("4Q", self.buf5, 0, *(self.addr5 + 40 + 8 * i for i in range(4)))
        self.buf4 = ctypes.create_string_buffer(56)
        self.addr4 = ctypes.addressof(self.buf4)
        struct.pack_into("3Q", self.buf4, 0, *(self.addr4 + 32 + 8 * i for i in range(3)))
        self.a5 = (self.buf5, self.addr5)  # (one thread-local lookup per launch)
        self.a4 = (self.buf4, self.addr4)


_targs = _ThreadArgs()
_pack5 = struct.Struct("5Q").pack_into  # params address, then 4 pointers, from byte 32 of buf5
_pack4 = struct.Struct("4Q").pack_into  # params address, then 3 pointers, from byte 24 of buf4
_streams: dict[int, Any] = {}  # handle -> driver.CUstream


def _stream_obj(handle: int) -> Any:
    s = _streams.get(handle)
    if s is None:
        from cuda.bindings import driver

        if len(_streams) > 256:
            _streams.clear()
        s = _streams[handle] = driver.CUstream(handle)
    return s


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
_INVALID_HANDLE = 400  # CUDA_ERROR_INVALID_HANDLE


def fast_entry(prep: Prepared) -> tuple[Any, ...]:
    """What a front door's eager fast path keeps of a forward's prepared launch: (CUfunction,
    launch configs by stream handle, parameter block address, prep), the first None unless
    the launch is one plain kernel launch (not of the cluster, coop or split tier), which the
    door then makes itself with cuLaunchKernelEx and the stream's config (`plain_config`) in
    a context that is current; else it calls `launch` with prep."""
    plain = prep.cluster is None and prep.coop is None and prep.split is None and prep.nargs == 5
    return (prep.func if plain else None, {}, prep.params_addr, prep)


def plain_config(prep: Prepared, stream: int) -> Any:
    """The CUlaunchConfig of a plain launch of `prep` on the stream of handle `stream` (no
    attributes), for cuLaunchKernelEx: cheaper through cuda.bindings than cuLaunchKernel's
    eleven arguments (benchmarks/host_launch.py).  Built once per stream and never changed
    after, so threads may share it."""
    drv = _drv or _load_driver()
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = prep.grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = prep.block, 1, 1
    cfg.sharedMemBytes = prep.smem
    cfg.hStream = _stream_obj(stream)
    cfg.numAttrs = 0
    return cfg


def launch(prep: Prepared, p0: int, p1: int, p2: int, p3: int, stream: int, ctx_ok: bool | None = None) -> None:
    """One cuLaunchKernel of a prepared launch with these pointers on `stream`.

    The launch takes the kernel's CUfunction in its device's primary context.  A legacy or
    per-thread default stream (handles 0, 1, 2) means 'of the current context'; then the
    launch must happen with that context current.  `ctx_ok` is the front door's belief
    that it is (None: unknown, ask the driver); a launch that finds no context, or a stream
    of another context, is retried through the CUkernel (with the context pushed if needed).
    """
    if prep.nargs == 5:
        buf, argv_addr = _targs.a5
        _pack5(buf, 32, prep.params_addr, p0, p1, p2, p3)
    else:
        buf, argv_addr = _targs.a4
        _pack4(buf, 24, prep.params_addr, p0, p1, p2)
    if prep.cluster is not None:
        _launch_cluster(prep, argv_addr, stream)
        return
    if prep.coop is not None:
        _launch_coop(prep, argv_addr, stream)
        return
    if prep.split is not None:
        _launch_split(prep, (p0, p1, p2, p3) if prep.nargs == 5 else (p0, p1, p2), stream)
        return
    if stream > 2 or ctx_ok:
        s = _streams.get(stream)
        if s is None:
            s = _stream_obj(stream)
        err = (_drv or _load_driver()).cuLaunchKernel(
            prep.func, prep.grid, 1, 1, prep.block, 1, 1, prep.smem, s, argv_addr, 0
        )[0]
        if not err:
            return
        _relaunch(prep, argv_addr, stream, err)
        return
    _launch_in_context(prep, argv_addr, stream)


def _relaunch(prep: Prepared, argv_addr: int, stream: int, err: Any, what: str = "cuLaunchKernel") -> None:
    """After the CUfunction's launch (by `what`) failed with `err`: the CUkernel, which the
    driver resolves in the stream's (or the current) context, and the context pushed if
    none is."""
    if int(err) not in (_INVALID_CONTEXT, _INVALID_HANDLE):
        check((err,), what)
    drv = _drv or _load_driver()
    err2 = drv.cuLaunchKernel(
        prep.kernel, prep.grid, 1, 1, prep.block, 1, 1, prep.smem, _stream_obj(stream), argv_addr, 0
    )[0]
    if not err2:
        return
    if stream > 2 or int(err2) != _INVALID_CONTEXT:
        check((err2,), "cuLaunchKernel")
    _launch_in_context(prep, argv_addr, stream)


_drv: Any = None  # the cuda.bindings driver module, once imported


def _load_driver() -> Any:
    global _drv
    from cuda.bindings import driver

    _drv = driver
    return driver


def _launch_in_context(prep: Prepared, argv_addr: int, stream: int) -> None:
    """Launch with the prepared kernel's device's primary context current."""
    drv = _drv or _load_driver()
    with _in_context(drv, prep.dev.ctx):
        check(
            drv.cuLaunchKernel(
                prep.kernel, prep.grid, 1, 1, prep.block, 1, 1, prep.smem, _stream_obj(stream), argv_addr, 0
            ),
            "cuLaunchKernel",
        )


@contextlib.contextmanager
def _in_context(drv: Any, ctx: Any) -> Iterator[None]:
    """`ctx` current inside (pushed, and popped after, where another context or none is)."""
    pushed = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent") != ctx
    if pushed:
        check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        if pushed:
            check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _launch_cluster(prep: Prepared, argv_addr: int, stream: int) -> None:
    """One cuLaunchKernelEx of a cluster-tier launch (clusters and dynamic shared memory
    cannot be given to cuLaunchKernel), with the kernel's device's primary context current."""
    drv = _drv or _load_driver()
    cfg = prep.cluster
    with _in_context(drv, prep.dev.ctx), _cluster_lock:  # (the config's stream is set per launch)
        cfg.hStream = _stream_obj(stream)
        check(drv.cuLaunchKernelEx(cfg, prep.func, argv_addr, 0), "cuLaunchKernelEx")


_cluster_lock = threading.Lock()
_COOPERATIVE_LAUNCH_TOO_LARGE = 720


def _take_fallback(prep: Prepared, fb: _plan.LaunchPlan) -> None:
    """This launch and all later ones of `prep` take the looped tier's plan `fb` (the same
    parameters, a plain launch)."""
    prep.func, prep.kernel = prep.dev.function(fb.kernel), prep.dev.kernel(fb.kernel)
    prep.grid, prep.block, prep.plan = fb.grid, fb.block, fb
    prep.coop = prep.split = None


def _launch_coop(prep: Prepared, argv_addr: int, stream: int) -> None:
    """One cuLaunchCooperativeKernel of a coop-tier launch (grid (G, groups), all blocks
    resident at once), with the kernel's device's primary context current.  Where the
    driver refuses it as too large (the device is shared, say), this launch and all later
    ones of `prep` take the looped tier: its kernel reads the same parameters."""
    drv = _drv or _load_driver()
    with _in_context(drv, prep.dev.ctx):
        coop = prep.coop
        if coop is not None:
            err = drv.cuLaunchCooperativeKernel(
                prep.func, coop[0], coop[1], 1, prep.block, 1, 1, prep.plan.smem, _stream_obj(stream), argv_addr
            )[0]
            if int(err) != _COOPERATIVE_LAUNCH_TOO_LARGE or prep.fallback is None:
                check((err,), "cuLaunchCooperativeKernel")
                return
            from ._log import log

            log.info("cooperative launch of %s refused as too large: the looped tier instead", prep.plan.kernel)
            _take_fallback(prep, prep.fallback)
        check(
            drv.cuLaunchKernel(prep.func, prep.grid, 1, 1, prep.block, 1, 1, 0, _stream_obj(stream), argv_addr, 0),
            "cuLaunchKernel",
        )


def _launch_split(prep: Prepared, ptrs: tuple[int, ...], stream: int) -> None:
    """One split-tier launch: its workspace allocated on `stream` (cuMemAllocAsync), its
    flags zeroed, the kernel (grid (S, G)) with the workspace as its last argument, the
    workspace freed after it on the same stream; with the kernel's device's primary context
    current.  Where the device or the stream cannot give stream-ordered memory, this launch
    and all later ones of `prep` take the looped tier: its kernel reads the same parameters;
    where the pool is out of memory, only this launch does."""
    drv = _drv or _load_driver()
    with _in_context(drv, prep.dev.ctx):
        split = prep.split
        s = _stream_obj(stream)
        func, grid, block = prep.func, prep.grid, prep.block
        if split is not None:
            segs, groups, nbytes = split
            err, ws = drv.cuMemAllocAsync(nbytes, s)
            if not err:
                try:
                    check(drv.cuMemsetD32Async(ws, 0, nbytes // 4, s), "cuMemsetD32Async")
                    n = len(ptrs) + 2  # the pointers, the parameter block, the workspace
                    args = (ctypes.c_uint64 * (2 * n))()
                    base = ctypes.addressof(args)
                    slots = [*ptrs, int(ws)]
                    for i, v in enumerate(slots[:-1]):
                        args[i] = base + 8 * (n + i)
                        args[n + i] = v
                    args[len(ptrs)] = prep.params_addr
                    args[n - 1] = base + 8 * (2 * n - 1)
                    args[2 * n - 1] = int(ws)
                    check(drv.cuLaunchKernel(func, segs, groups, 1, block, 1, 1, 0, s, base, 0), "cuLaunchKernel")
                finally:
                    check(drv.cuMemFreeAsync(ws, s), "cuMemFreeAsync")
                return
            fb = prep.fallback
            if fb is None:
                check((err,), "cuMemAllocAsync")
                return
            from ._log import log

            if int(err) == _OUT_OF_MEMORY:  # (this launch only: the pool may have room again later)
                log.info("no room for the workspace of %s: the looped tier for this launch", prep.plan.kernel)
                func, grid, block = prep.dev.function(fb.kernel), fb.grid, fb.block
            else:
                log.info("no stream-ordered workspace for %s (%s): the looped tier instead", prep.plan.kernel, err)
                _take_fallback(prep, fb)
                func, grid, block = prep.func, prep.grid, prep.block
        buf, argv_addr = _targs.a5 if prep.nargs == 5 else _targs.a4
        if prep.nargs == 5:
            _pack5(buf, 32, prep.params_addr, *ptrs)
        else:
            _pack4(buf, 24, prep.params_addr, *ptrs)
        check(drv.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, 0, s, argv_addr, 0), "cuLaunchKernel")


_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


def forward(
    dev: Device,
    x: Operand,
    y: Operand,
    mask: Operand | None,
    klen: Operand | None,
    causal: bool,
    scale: float,
    stream: int,
    ctx_ok: bool | None = None,
) -> None:
    """Launch y = softmax(x * scale + mask) on `stream` of device `dev` (a _driver.Device)."""
    prep = prepared_forward(dev, x, y, mask, klen, causal, scale)
    launch(prep, x.ptr, y.ptr, mask.ptr if mask is not None else 0, klen.ptr if klen is not None else 0, stream, ctx_ok)


def prepared_forward(
    dev: Device, x: Operand, y: Operand, mask: Operand | None, klen: Operand | None, causal: bool, scale: float
) -> Prepared:
    """The (cached) prepared launch of a forward of this layout and these pointers' alignment."""
    aligned = not ((x.ptr | y.ptr) & 15)
    mask_aligned = mask is None or not (mask.ptr & 15)
    key = (
        dev.ordinal,
        x.dtype,
        x.shape,
        x.strides,
        y.strides,
        mask[1:] if mask is not None else None,
        klen[1:] if klen is not None else None,
        causal,
        scale,
        aligned,
        mask_aligned,
    )
    prep = _cache.get(key)
    if prep is None:
        check_forward(x, y, mask, klen, causal)
        prep = _remember(key, prepare_forward(dev, x, y, mask, klen, causal, scale, aligned, mask_aligned))
    return prep


def backward(
    dev: Device, dy: Operand, y: Operand, dx: Operand, scale: float, stream: int, ctx_ok: bool | None = None
) -> None:
    aligned = not ((dy.ptr | y.ptr | dx.ptr) & 15)
    key = ("bwd", dev.ordinal, y.dtype, y.shape, dy.strides, y.strides, dx.strides, scale, aligned)
    prep = _cache.get(key)
    if prep is None:
        if y.dtype not in _plan.X_DTYPES:
            raise arg_type_error("y", "float16, bfloat16 or float32 on the GPU", f"dtype {y.dtype}")
        if y.shape and y.shape[-1] > MAX_SK:
            raise arg_value_error("y", f"rows of at most {MAX_SK} elements", f"Sk = {y.shape[-1]}")
        prep = _remember(key, prepare_backward(dev, dy, y, dx, scale, aligned))
    launch(prep, dy.ptr, y.ptr, dx.ptr, 0, stream, ctx_ok)
