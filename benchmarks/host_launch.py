#!/usr/bin/env python3
"""Host time of one launch through cuda.bindings, by the form of the call: the floor of
the eager path.

    python benchmarks/host_launch.py [--calls N] [--repeats N]

Needs a CUDA GPU and PyTorch with CUDA.  The launch is the one the eager torch call
`drvsoftmax.torch.scaled_masked_softmax(x, scale=0.125)` prepares for x `[1,12,128,128]`
fp16; every row launches that kernel with the same argument slots on torch's current
stream, back to back (no per-call sync; one sync closes each run), and prints the median
(min) microseconds per call over REPEATS runs of CALLS calls, the rows taking turns run by
run (a host whose speed drifts slows every row alike):

    cuLaunchKernel (CUfunction)       11 arguments: function, grid, block, shared memory,
                                      CUstream object, kernelParams address, extra
    cuLaunchKernel (CUkernel)         the same with the library's kernel handle
    cuLaunchKernelEx (config)         a CUlaunchConfig built once (grid, block, stream)
    cuLaunchKernelEx (stream set)     the same config with its stream assigned per call
    cuLaunchKernelEx (ctypes)         the driver's entry point (cuGetProcAddress) called
                                      through ctypes with the config's address: what is left
                                      without cuda.bindings' argument handling
    _core.launch                      drvsoftmax's launcher (argument slots written per call)

Before the timing, one launch of each form writes a y poisoned with NaN, checked against
torch.softmax: a form that fails is marked WRONG and the script exits 1.  Prints only;
writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from host_torch import CALLS, REPEATS, SCALE, SHAPE, time_rows_us  # noqa: E402
from long_rows import cuda_torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    a = ap.parse_args(argv)
    torch = cuda_torch()
    if torch is None:
        return 2
    from cuda.bindings import driver as drv

    import drvsoftmax.torch as dt
    from drvsoftmax import _core

    x = torch.randn(SHAPE, dtype=torch.float16, device="cuda")
    with torch.no_grad():
        ref = torch.softmax(x.float() * SCALE, -1)
        y = dt.scaled_masked_softmax(x, scale=SCALE)
    prep = next((e[0] for e in dt._prepared.values() if isinstance(e[0], _core.Prepared)), None)
    if prep is None:
        print("no prepared launch of the eager call was found", file=sys.stderr)
        return 1
    stream = torch.cuda.current_stream().cuda_stream
    sobj = drv.CUstream(stream)
    xp, yp = x.data_ptr(), y.data_ptr()
    _core.launch(prep, xp, yp, 0, 0, stream, True)  # writes the argument slots
    argv_addr = (_core._targs.a5 if prep.nargs == 5 else _core._targs.a4)[1]
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = prep.grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = prep.block, 1, 1
    cfg.sharedMemBytes = prep.smem
    cfg.hStream = sobj
    cfg.numAttrs = 0

    import ctypes

    flag = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    err, entry, _ = drv.cuGetProcAddress(b"cuLaunchKernelEx", 12000, flag)
    vp = ctypes.c_void_p
    ex_ct = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, vp)(entry) if int(err) == 0 and entry else None
    cfg_addr, func_addr = cfg.getPtr(), int(prep.func)

    def ex_stream_set() -> object:
        cfg.hStream = sobj
        return drv.cuLaunchKernelEx(cfg, prep.func, argv_addr, 0)

    rows = {
        "cuLaunchKernel (CUfunction)": lambda: drv.cuLaunchKernel(
            prep.func, prep.grid, 1, 1, prep.block, 1, 1, prep.smem, sobj, argv_addr, 0
        ),
        "cuLaunchKernel (CUkernel)": lambda: drv.cuLaunchKernel(
            prep.kernel, prep.grid, 1, 1, prep.block, 1, 1, prep.smem, sobj, argv_addr, 0
        ),
        "cuLaunchKernelEx (config)": lambda: drv.cuLaunchKernelEx(cfg, prep.func, argv_addr, 0),
        "cuLaunchKernelEx (stream set)": ex_stream_set,
        "cuLaunchKernelEx (ctypes)": lambda: (ex_ct(cfg_addr, func_addr, argv_addr, None),),
        "_core.launch": lambda: _core.launch(prep, xp, yp, 0, 0, stream, True),
    }
    if ex_ct is None:
        print(f"cuGetProcAddress(cuLaunchKernelEx): error {int(err)}; the ctypes row is left out")
        del rows["cuLaunchKernelEx (ctypes)"]
    print(f"host us per launch, x {list(SHAPE)} float16 ({prep.plan.kernel}); {torch.cuda.get_device_name()}")
    print(f"median (min) of {a.repeats} x {a.calls} back-to-back calls, the rows taking turns")
    checks = {}
    for name, fn in rows.items():
        y.fill_(float("nan"))
        out = fn()  # (the cuda.bindings forms return (CUresult,); the launcher raises instead)
        err = int(out[0]) if isinstance(out, tuple) else 0
        torch.cuda.synchronize()
        diff = (y.float() - ref).abs().max().item()
        checks[name] = (err == 0 and diff < 1e-3, err, diff)
    bad = 0
    for name, (med, lo) in time_rows_us(rows, torch.cuda.synchronize, a.calls, a.repeats).items():
        ok, err, diff = checks[name]
        bad += not ok
        print(f"  {name:<30} {med:7.2f} us  ({lo:.2f})  {'ok' if ok else f'WRONG: error {err}, max diff {diff}'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
