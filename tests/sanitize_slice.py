"""A small GPU slice of every kernel tier, for compute-sanitizer (see tests/sanitize.sh).

Every dtype (fp16, bf16, fp32) through every register-tier variant and the looped tier, forward and
backward, with each mask family (none, bool, integer, float16/float64 additive), causal,
key_lengths (int32, int64), strided and misaligned views and in-place output.  It needs
only numpy, cuda-bindings and drvsoftmax (no torch): arrays are device allocations made
here through the driver API, handed over by ``__cuda_array_interface__``.  Outputs start
as NaN bytes and every result is checked against the float64 reference, so the run fails
(exit status 1) on a wrong answer as the sanitizer fails on a bad access.

    PYTHONPATH=$PWD python3 tests/sanitize_slice.py [--quiet]
"""

from __future__ import annotations

import sys

import numpy as np
from cuda.bindings import driver

import drvsoftmax
from drvsoftmax import _driver, _reference
from drvsoftmax._errors import check

ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1, "int32": 4, "int64": 8}
TYPESTR = {
    "float16": "<f2",
    "bfloat16": "<V2",
    "float32": "<f4",
    "float64": "<f8",
    "bool": "|b1",
    "int32": "<i4",
    "int64": "<i8",
}
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5}
BWD_RTOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5}


class Buffer:
    """One device allocation (freed by close())."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(driver.cuMemAlloc(nbytes), "cuMemAlloc"))
        check(driver.cuMemsetD8(self.ptr, 0xFF, nbytes), "cuMemsetD8")  # NaN bytes: initialised

    def close(self) -> None:
        check(driver.cuMemFree(self.ptr), "cuMemFree")


class DevArray:
    """A strided view of a Buffer, speaking ``__cuda_array_interface__`` (v3)."""

    class _Dev:
        id = 0

    device = _Dev()

    def __init__(self, buf: Buffer, dtype: str, shape, strides=None, offset: int = 0):
        shape = tuple(int(n) for n in shape)
        if strides is None:
            strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        self.buf, self.dtype, self.shape, self.strides, self.offset = buf, dtype, shape, tuple(strides), offset
        item = ITEM[dtype]
        span = item * (1 + sum((n - 1) * s for n, s in zip(shape, strides)))
        assert offset * item + span <= buf.nbytes, "view beyond its buffer"
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": TYPESTR[dtype],
            "data": (buf.ptr + offset * item, False),
            "strides": tuple(s * item for s in strides),
            "version": 3,
            "stream": None,
        }

    def _bytes_index(self):
        """Byte offsets (in the buffer) of every element, in C order."""
        idx = np.zeros(self.shape, dtype=np.int64) + self.offset
        for d, (n, s) in enumerate(zip(self.shape, self.strides)):
            sh = [1] * len(self.shape)
            sh[d] = n
            idx = idx + (np.arange(n) * s).reshape(sh)
        return idx * ITEM[self.dtype]

    def read(self) -> np.ndarray:
        """The elements as float64 (bf16 decoded), or their own dtype for integer/bool."""
        raw = np.empty(self.buf.nbytes, np.uint8)
        check(driver.cuMemcpyDtoH(raw.ctypes.data, self.buf.ptr, self.buf.nbytes), "cuMemcpyDtoH")
        at = self._bytes_index().reshape(-1)
        gathered = raw[at[:, None] + np.arange(ITEM[self.dtype])].reshape(-1)
        return decode(gathered, self.dtype).reshape(self.shape)


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = raw.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return raw.view(dtype if dtype != "bool" else np.bool_).copy()


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """Host bytes of `values` in `dtype` (bf16 rounded to nearest even)."""
    if dtype == "bfloat16":
        f = np.asarray(values, np.float32).view(np.uint32)
        r = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)
        return r.view(np.uint8)
    return np.ascontiguousarray(np.asarray(values).astype(dtype)).view(np.uint8).reshape(-1)


def upload(values: np.ndarray, dtype: str, pool: list) -> DevArray:
    data = encode(values, dtype)
    buf = Buffer(max(data.size, 1))
    pool.append(buf)
    check(driver.cuMemcpyHtoD(buf.ptr, data.ctypes.data, data.size), "cuMemcpyHtoD")
    return DevArray(buf, dtype, np.shape(values))


def empty(shape, dtype: str, pool: list, strides=None, extra: int = 0) -> DevArray:
    n = int(np.prod(shape)) if strides is None else 1 + sum((a - 1) * s for a, s in zip(shape, strides))
    buf = Buffer((n + extra) * ITEM[dtype])
    pool.append(buf)
    return DevArray(buf, dtype, shape, strides)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    return decode(encode(values, dtype), dtype).reshape(np.shape(values)).astype(np.float64)


# ----------------------------------------------------------------------------------
# The slice.

# Sk per kernel variant, forward and backward: 7 and 200 (2 chunks x 2 rows per thread,
# odd rows off a 16-byte boundary), 1000 and 4097 (8 chunks per thread, rows spanning
# warps), 12000 (fp32: 16 chunks per thread), 40000 (the looped tier, past 16384).
FWD_SK = [7, 200, 1000, 4097, 12000, 40000]
BWD_SK = [7, 200, 1000, 4097, 12000, 40000]


def _mask(rng, kind, b, sq, sk):
    if kind == "none":
        return None, None
    if kind == "bool_b1qk":
        return rng.random((b, 1, sq, sk)) < 0.3, "bool"
    if kind == "int64_qk":
        return np.where(rng.random((sq, sk)) < 0.3, rng.integers(1, 9, (sq, sk)), 0), "int64"
    if kind == "add_f16_b11k":
        return np.where(rng.random((b, 1, 1, sk)) < 0.2, -np.inf, rng.standard_normal((b, 1, 1, sk))), "float16"
    if kind == "add_f64_bhqk":
        return np.where(rng.random((b, 2, sq, sk)) < 0.2, -np.inf, rng.standard_normal((b, 2, sq, sk))), "float64"
    raise ValueError(kind)


def _tiers(dtype: str, direction: str) -> set[str]:
    """Every tier the planner picks for some row length (names as explain() gives them)."""
    sks = [1, 2, 7, 8, 31, 32, 33, 64, 128, 200, 256, 257, 512, 1000, 1024, 4097, 8192, 16384, 16385]
    sks += [32768, 32769, 40000, 65536, 262144, 1048576]
    back = direction == "backward"
    return {drvsoftmax.explain((2, sk), dtype, backward=back).split(" ", 1)[0] for sk in sks}


def run(quiet: bool) -> int:
    dev = _driver.device(0)
    check(driver.cuCtxPushCurrent(dev.ctx), "cuCtxPushCurrent")
    stream = int(check(driver.cuStreamCreate(1), "cuStreamCreate"))  # non-blocking
    rng = np.random.default_rng(20261130)
    failures: list[str] = []
    tiers: set[tuple[str, str, str]] = set()
    n_cases = 0

    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    def sync() -> None:
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def compare(what: str, got: np.ndarray, ref: np.ndarray, rtol: float) -> None:
        nan_ref = np.isnan(ref)
        bad = (np.isnan(got) != nan_ref).any()
        err = np.abs(got[~nan_ref] - ref[~nan_ref])
        bad = bad or bool((err > 1e-5 + rtol * np.abs(ref[~nan_ref])).any())
        bad = bad or bool((got[ref == 0] != 0).any())
        if bad:
            failures.append(what)
            print(f"MISMATCH {what}: max |got - ref| = {np.nanmax(err) if err.size else 0:.3g}", flush=True)

    for dtype in ("float16", "bfloat16", "float32"):
        for sk in FWD_SK:
            b, h, sq = (2, 2, 3) if sk < 10000 else (1, 2, 2)
            for kind, causal, klen, layout in [
                ("none", False, None, "dense"),
                ("bool_b1qk", True, "int64", "dense"),
                ("int64_qk", False, "int32", "sliced"),
                ("add_f16_b11k", True, None, "transposed"),
                ("add_f64_bhqk", False, "int64", "in_place"),
            ]:
                pool: list[Buffer] = []
                try:
                    xv = rounded(rng.standard_normal((b, h, sq, sk)) * 3, dtype)
                    if layout == "sliced":  # rows 2*sk + 3 apart, starting 1 element in: unaligned
                        x = empty(
                            (b, h, sq, sk), dtype, pool, (h * sq * (2 * sk + 3), sq * (2 * sk + 3), 2 * sk + 3, 1), 1
                        )
                        x = DevArray(x.buf, dtype, x.shape, x.strides, offset=1)
                        full = np.full(x.buf.nbytes // ITEM[dtype], 0.0)
                        at = x._bytes_index() // ITEM[dtype]
                        full[at] = xv
                        host = encode(full, dtype)  # (held: the copy reads it)
                        check(driver.cuMemcpyHtoD(x.buf.ptr, host.ctypes.data, x.buf.nbytes), "cuMemcpyHtoD")
                    elif layout == "transposed":  # [B, Sq, H, Sk] memory seen as [B, H, Sq, Sk]
                        xt = upload(np.ascontiguousarray(xv.transpose(0, 2, 1, 3)), dtype, pool)
                        x = DevArray(xt.buf, dtype, (b, h, sq, sk), (sq * h * sk, sk, h * sk, 1))
                    else:
                        x = upload(xv, dtype, pool)
                    mv, mdt = _mask(rng, kind, b, sq, sk)
                    m = None if mv is None else upload(mv, mdt, pool)
                    kv = None
                    k = None
                    if klen is not None:
                        kv = np.array([sk, max(1, sk // 3)][:b] + [0] * max(0, b - 2))
                        k = upload(kv, klen, pool)
                    out = x if layout == "in_place" else empty((b, h, sq, sk), dtype, pool)
                    y = drvsoftmax.scaled_masked_softmax(
                        x, m, scale=0.6, causal=causal, key_lengths=k, out=out, stream=stream
                    )
                    sync()
                    mref = mv if mv is None or not mdt.startswith("float") else rounded(mv, mdt)
                    ref = _reference.softmax_forward(xv, mref, 0.6, causal, kv)
                    what = f"forward {dtype} Sk={sk} {kind} causal={causal} klen={klen} {layout}"
                    compare(what, y.read(), ref, RTOL[dtype])
                    tier = drvsoftmax.explain((b, h, sq, sk), dtype, mask_dtype=mdt, causal=causal).split(" ", 1)[0]
                    tiers.add((dtype, "forward", tier))
                    n_cases += 1
                    say(f"ok {what} ({tier})")
                finally:
                    for buf in pool:
                        buf.close()
        for sk in BWD_SK:
            b, h, sq = (2, 2, 3) if sk < 10000 else (1, 2, 2)
            for layout in ("dense", "out_is_dy"):
                pool = []
                try:
                    yv = rounded(_reference.softmax_forward(rng.standard_normal((b, h, sq, sk)) * 2), dtype)
                    dyv = rounded(rng.standard_normal((b, h, sq, sk)), dtype)
                    yd, dyd = upload(yv, dtype, pool), upload(dyv, dtype, pool)
                    out = dyd if layout == "out_is_dy" else empty((b, h, sq, sk), dtype, pool)
                    dx = drvsoftmax.scaled_masked_softmax_backward(dyd, yd, scale=0.6, out=out, stream=stream)
                    sync()
                    ref = _reference.softmax_backward(dyv, yv, 0.6)
                    got = dx.read()
                    mag = np.abs(yv) * (np.abs(dyv) + np.abs((dyv * yv).sum(-1, keepdims=True))) * 0.6
                    what = f"backward {dtype} Sk={sk} {layout}"
                    if not (np.all(np.abs(got - ref) <= BWD_RTOL[dtype] * mag + 1e-7) and np.all(got[yv == 0] == 0)):
                        failures.append(what)
                        print(f"MISMATCH {what}", flush=True)
                    tier = drvsoftmax.explain((b, h, sq, sk), dtype, backward=True).split(" ", 1)[0]
                    tiers.add((dtype, "backward", tier))
                    n_cases += 1
                    say(f"ok {what} ({tier})")
                finally:
                    for buf in pool:
                        buf.close()
    check(driver.cuStreamDestroy(stream), "cuStreamDestroy")
    check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
    want = {
        (d, w, t) for d in ("float16", "bfloat16", "float32") for w in ("forward", "backward") for t in _tiers(d, w)
    }
    missing = sorted(want - tiers)
    if missing:
        failures.append(f"tiers not reached: {missing}")
    print(
        f"sanitize slice: {n_cases} launches, {len(tiers)} (dtype, direction, tier) combinations, {len(failures)} failures"
    )
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run("--quiet" in sys.argv[1:]))
