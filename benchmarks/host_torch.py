#!/usr/bin/env python3
"""Host time of one eager torch call, [1,12,128,128] fp16, no mask, no grad: drvsoftmax beside its floor.

    python benchmarks/host_torch.py            # on a GPU: us per call, median of REPEATS x CALLS
    python benchmarks/host_torch.py --stub     # on any machine: the Python overhead alone

Each row is the median over REPEATS runs of CALLS back-to-back calls (no per-call sync; one
sync closes each run; the rows take turns run by run, so that a host whose speed drifts
slows every row alike), in microseconds per call:

    drvsoftmax.torch      drvsoftmax.torch.scaled_masked_softmax(x, scale=s)
    drvsoftmax            drvsoftmax.scaled_masked_softmax(x, scale=s) (the framework-agnostic door)
    launch only           cuLaunchKernel of the same prepared launch through cuda.bindings (the floor)
    torch.empty_like      the output allocation alone
    torch.softmax         torch.softmax(x, -1)

``--stub`` runs on the CPU with the driver replaced by a no-op and a CPU tensor dressed as a
CUDA one: what remains is drvsoftmax's own Python work per call (and the cuda.bindings
argument conversion when a driver library, real or stub, is loadable).  The numbers measure
this machine's Python speed; compare them before and after a change, not across machines.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPE = (1, 12, 128, 128)
SCALE = 0.125
CALLS, REPEATS = 2000, 9


def time_rows_us(
    rows: dict[str, Callable[[], object]],
    sync: Callable[[], None],
    calls: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, tuple[float, float]]:
    """(median, min) microseconds per call of each row over `repeats` runs of `calls`
    back-to-back calls, the rows taking turns run by run (softbench.timing.host_times_us,
    the benchmark's host section); a row that raises stops the script."""
    from types import SimpleNamespace

    from softbench.timing import host_times_us

    out = {}
    for name, got in host_times_us(SimpleNamespace(sync=sync), rows, calls, repeats, clock).items():
        if isinstance(got, Exception):
            raise got
        out[name] = got
    return out


class _NoDriver:
    """cuda.bindings.driver with every launch a no-op (for --stub without a driver library)."""

    class CUlaunchConfig:
        pass

    @staticmethod
    def cuLaunchKernel(*args: object) -> tuple[int]:
        return (0,)

    @staticmethod
    def cuLaunchKernelEx(*args: object) -> tuple[int]:
        return (0,)


def _stub(torch: Any, use_bindings: bool) -> Any:
    """Make a CPU tensor take the CUDA eager path with the driver stubbed.  Returns x."""
    import drvsoftmax.torch as dt
    from drvsoftmax import _core, _driver

    class FakeDevice:
        ordinal, arch, cc, sm_count, name, ctx = 0, "sm_90", 90, 132, "stub", None

        def kernel(self, name: str) -> Any:
            return 0

        def function(self, name: str) -> Any:
            return 0

    fake = FakeDevice()
    torch.Tensor.is_cuda = property(lambda self: True)  # a Python property: slower than the real one
    torch.Tensor.get_device = lambda self: 0
    dt._raw_stream = lambda dev: 0x7F00  # a stream handle of a non-default stream
    dt._current_device = lambda: 0
    _driver.device = lambda ordinal: fake
    if use_bindings:
        from cuda.bindings import driver

        _core._drv = driver
    else:
        _core._drv = _NoDriver
    n = 1
    for d in SHAPE:
        n *= d
    buf = torch.randn(n + 128).to(torch.float16)
    off = (-buf.data_ptr() % 256) // 2  # a 256-byte aligned x, as CUDA allocations are
    return buf[off : off + n].view(SHAPE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stub", action="store_true", help="CPU: the Python overhead with the launch stubbed")
    ap.add_argument(
        "--bindings",
        action="store_true",
        help="with --stub: keep cuda.bindings' cuLaunchKernel (needs a loadable libcuda.so.1, e.g. a stub)",
    )
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    a = ap.parse_args(argv)

    import torch

    import drvsoftmax
    import drvsoftmax.torch as dt
    from drvsoftmax import _core

    if a.stub:
        x = _stub(torch, a.bindings)

        def sync() -> None:
            return None

        where = "stub (CPU, launch " + ("through cuda.bindings" if a.bindings else "a no-op") + "; process CPU time)"
        clock = time.process_time  # CPU time of this process: steadier than wall time on a shared machine
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --stub for the Python overhead alone", file=sys.stderr)
            return 2
        x = torch.randn(SHAPE, dtype=torch.float16, device="cuda")
        sync = torch.cuda.synchronize
        where = torch.cuda.get_device_name()
        clock = time.perf_counter
    with torch.no_grad():
        y = dt.scaled_masked_softmax(x, scale=SCALE)
        rows: dict[str, Callable[[], object]] = {
            "drvsoftmax.torch": lambda: dt.scaled_masked_softmax(x, scale=SCALE),
            "drvsoftmax": lambda: drvsoftmax.scaled_masked_softmax(x, scale=SCALE),
        }
        prep = next((e[0] for e in dt._prepared.values() if isinstance(e[0], _core.Prepared)), None)
        if prep is not None:
            xp, yp = x.data_ptr(), y.data_ptr()
            stream = 0x7F00 if a.stub else torch.cuda.current_stream().cuda_stream
            rows["launch only"] = lambda: _core.launch(prep, xp, yp, 0, 0, stream, True)
        rows["torch.empty_like"] = lambda: torch.empty_like(x)
        if not a.stub:
            rows["torch.softmax"] = lambda: torch.softmax(x, -1)
        print(f"host us per call, x {list(SHAPE)} float16, no mask, no grad; {where}")
        print(f"median (min) of {a.repeats} x {a.calls} back-to-back calls, the rows taking turns")
        for name, (med, lo) in time_rows_us(rows, sync, a.calls, a.repeats, clock).items():
            print(f"  {name:<18} {med:7.2f} us  ({lo:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
