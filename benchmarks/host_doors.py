"""Host time per call of each front door, beside the frameworks' own small ops.

    python benchmarks/host_doors.py            # on a GPU machine: CuPy, Numba, DLPack, raw, torch
    python benchmarks/host_doors.py --fake     # any machine: the intake's Python cost, no GPU

GPU mode: x is [1, 12, 128, 128] float16 (``--shape``, ``--dtype``).  Each call is timed
alone with perf_counter_ns; the stream is not synchronised between calls (only every
``--sync-every`` calls, outside the timed region, so that the launch queue never fills).
Prints a markdown table of the median, 10th and 90th percentile in microseconds; a door
whose library is missing is listed as such.  ``--fake`` times reading one array through
the intake (a CUDA-array-interface object, a DLPack capsule) and a whole call through
the DLPack and interface doors with the launch replaced by a no-op, on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np  # noqa: E402

import drvsoftmax  # noqa: E402
import drvsoftmax.raw as raw  # noqa: E402


def timed(fn: Callable[[], object], n: int, sync: Callable[[], object] | None, sync_every: int) -> list[float]:
    for _ in range(50):  # warm-up: kernels loaded, caches filled
        fn()
    if sync:
        sync()
    out = []
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
        if sync and i % sync_every == sync_every - 1:
            sync()
    if sync:
        sync()
    return out


def row(name: str, times: list[float] | str) -> str:
    if isinstance(times, str):
        return f"| {name} | {times} | | |"
    q = statistics.quantiles(times, n=10)
    return f"| {name} | {statistics.median(times):.1f} | {q[0]:.1f} | {q[-1]:.1f} |"


HEADER = "| door | median us/call | p10 | p90 |\n|---|---:|---:|---:|"


def gpu(args: argparse.Namespace) -> None:
    import cupy as cp

    shape, n, every = tuple(args.shape), args.n, args.sync_every
    dt = np.dtype(args.dtype)
    sync = cp.cuda.get_current_stream().synchronize
    x = cp.asarray(np.random.default_rng(0).standard_normal(shape).astype(dt))
    y = cp.empty_like(x)
    rows = []
    rows.append(
        row("CuPy door (allocates y)", timed(lambda: drvsoftmax.scaled_masked_softmax(x, scale=0.125), n, sync, every))
    )
    rows.append(
        row("CuPy door, out=", timed(lambda: drvsoftmax.scaled_masked_softmax(x, scale=0.125, out=y), n, sync, every))
    )

    class Producer:  # DLPack only
        def __init__(self, a: object) -> None:
            self.a = a

        def __dlpack__(self, stream: object = None, max_version: object = None) -> object:
            try:
                return self.a.__dlpack__(stream=stream, max_version=max_version)  # type: ignore[attr-defined]
            except TypeError:
                return self.a.__dlpack__(stream=stream)  # type: ignore[attr-defined]

        def __dlpack_device__(self) -> object:
            return self.a.__dlpack_device__()  # type: ignore[attr-defined]

    px, py = Producer(x), Producer(y)
    rows.append(
        row(
            "DLPack-only producer, out=",
            timed(lambda: drvsoftmax.scaled_masked_softmax(px, scale=0.125, out=py), n, sync, every),
        )
    )
    try:
        from numba import cuda

        nx = cuda.as_cuda_array(x)
        ny = cuda.as_cuda_array(y)
        rows.append(
            row(
                "Numba door (allocates y)",
                timed(lambda: drvsoftmax.scaled_masked_softmax(nx, scale=0.125), n, sync, every),
            )
        )
        rows.append(
            row(
                "Numba door, out=",
                timed(lambda: drvsoftmax.scaled_masked_softmax(nx, scale=0.125, out=ny), n, sync, every),
            )
        )
    except ImportError:
        rows.append(row("Numba door", "numba not installed"))
    xp, yp, s = x.data.ptr, y.data.ptr, cp.cuda.get_current_stream().ptr
    rows.append(
        row(
            "raw pointers", timed(lambda: raw.forward(xp, yp, shape, args.dtype, scale=0.125, stream=s), n, sync, every)
        )
    )
    rows.append(row("CuPy elementwise: x * 0.125", timed(lambda: x * 0.125, n, sync, every)))
    rows.append(row("CuPy: cp.exp(x)", timed(lambda: cp.exp(x), n, sync, every)))
    try:
        import cupyx.scipy.special as sp

        rows.append(row("cupyx.scipy.special.softmax", timed(lambda: sp.softmax(x, axis=-1), n // 4, sync, every)))
    except ImportError:
        rows.append(row("cupyx.scipy.special.softmax", "not available"))
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError
        t = torch.randn(shape, device="cuda", dtype=getattr(torch, args.dtype))
        tsync = torch.cuda.synchronize
        rows.append(row("torch door", timed(lambda: drvsoftmax.scaled_masked_softmax(t, scale=0.125), n, tsync, every)))
        rows.append(row("torch.softmax", timed(lambda: torch.softmax(t, -1), n, tsync, every)))
    except ImportError:
        rows.append(row("torch door", "torch with CUDA not installed"))
    dev = cp.cuda.runtime.getDeviceProperties(x.device.id)["name"].decode()
    print(f"host time per call, x {list(shape)} {args.dtype}, {n} calls each, {dev}\n")
    print(HEADER)
    print("\n".join(rows))


def fake(args: argparse.Namespace) -> None:
    from dlpack_fakes import FakeDLPack

    from drvsoftmax import _intake

    class CAI:
        __module__ = "fake"

        def __init__(self, ptr: int) -> None:
            self.__cuda_array_interface__ = {
                "shape": (1, 12, 128, 128),
                "typestr": "<f2",
                "data": (ptr, False),
                "strides": None,
                "version": 3,
                "stream": 1,
            }

            class _Dev:
                id = 0

            self.device = _Dev()

    n = args.n
    ca, cb = CAI(1 << 40), CAI(2 << 40)
    da, db = (
        FakeDLPack((1, 12, 128, 128), "float16", ptr=1 << 40),
        FakeDLPack((1, 12, 128, 128), "float16", ptr=2 << 40),
    )
    da.capsules, db.capsules = _NoList(), _NoList()  # keep only the newest capsules

    def read_dlpack() -> None:
        _intake.read(da, "x", 0).release()

    raw.run_forward = lambda *a: None  # type: ignore[assignment]
    raw._ordinal = lambda d: d  # type: ignore[assignment]
    rows = [
        row("intake: one __cuda_array_interface__ array", timed(lambda: _intake.read(ca, "x", 0), n, None, 1)),
        row("intake: one DLPack array (capsule built by the fake)", timed(read_dlpack, n, None, 1)),
        row(
            "the fake producer's __dlpack__ alone",
            timed(lambda: da.__dlpack__(stream=1, max_version=(1, 1)), n, None, 1),
        ),
        row(
            "door: interface x and out, no launch",
            timed(lambda: drvsoftmax.scaled_masked_softmax(ca, out=cb), n, None, 1),
        ),
        row(
            "door: DLPack x and out, no launch", timed(lambda: drvsoftmax.scaled_masked_softmax(da, out=db), n, None, 1)
        ),
        row(
            "raw.forward, no launch",
            timed(lambda: raw.forward(1 << 40, 2 << 40, (1, 12, 128, 128), "float16", scale=0.125), n, None, 1),
        ),
    ]
    print(f"CPU only (no GPU, launches replaced by a no-op), {n} calls each\n")
    print(HEADER)
    print("\n".join(rows))


class _NoList(list):  # type: ignore[type-arg]
    """Keeps only the newest few capsules (their memory must outlive the read)."""

    def append(self, v: object) -> None:
        if len(self) > 4:
            del self[:2]
        super().append(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fake", action="store_true", help="CPU only: the intake's cost with fake arrays")
    p.add_argument("--n", type=int, default=5000, help="timed calls per door")
    p.add_argument("--shape", type=int, nargs="+", default=[1, 12, 128, 128])
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--sync-every", type=int, default=200)
    args = p.parse_args()
    if args.fake:
        fake(args)
        return 0
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("needs CuPy and a GPU (or --fake)", file=sys.stderr)
        return 2
    gpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
