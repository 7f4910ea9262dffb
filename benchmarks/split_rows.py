"""The split tier beside the tier planned without it (cluster or looped), as % of a copy.

    python3 benchmarks/split_rows.py [--reps N] [--only WORD ...]

Needs a CUDA GPU and PyTorch with CUDA.  For the long-row cases of bench_softmax.py (rows
of 65536, 262144 and 1M keys; forward without a mask and with a bool mask, backward), and
for fewer rows of 1M and 4M keys than the device has SMs, it
prepares the same launch twice, once as planned without the split tier and once with it
forced (`_plan.FORCE_SPLIT`), checks that the two outputs agree to the dtype's rounding
(the tiers merge their partial sums in different orders), and prints the median time of
each over three alternating rounds as % of a device-to-device copy timed in the same run
(GB/s over x, the mask at its own size and y; y, dy and dx backward), with each kernel's
registers and blocks per SM.  Prints only; writes nothing.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):  # drvsoftmax, and long_rows' timing
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# name, shape, dtype, kind ("none", "bool" or "bwd"): bench_softmax.py's long rows, then
# few rows of 1M and 4M keys (fewer rows than the device has SMs).
LONG = [
    ("float16", [(2, 8, 512, 65536), (2, 8, 128, 262144), (2, 8, 32, 1048576)]),
    ("float32", [(2, 8, 256, 65536), (2, 8, 64, 262144), (2, 8, 16, 1048576)]),
]
FEW = [
    ("float32", [(1, 4194304), (4, 1048576), (16, 1048576), (64, 1048576)]),
    ("float16", [(2, 4194304), (8, 1048576), (32, 1048576), (128, 1048576)]),
]
CASES = [
    (f"{kind} {dt} {'x'.join(map(str, shape))}", shape, dt, kind)
    for table in (LONG, FEW)
    for dt, shapes in table
    for shape in shapes
    for kind in ("none", "bool", "bwd")
]


def main(argv: list[str] | None = None) -> int:
    from long_rows import cuda_torch, operand, pct, tier_args

    args = tier_args(__doc__, argv, 15)

    torch = cuda_torch()
    if torch is None:
        return 2
    from drvsoftmax import _core, _driver, _plan

    dev = _driver.device(torch.cuda.current_device())
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

    from long_rows import _copy_ceiling, _median_ms

    def med(fn) -> float:
        return _median_ms(torch, fn, args.reps)

    ceil = _copy_ceiling(torch, args.reps)
    print(f"{dev.name}, copy ceiling {ceil:.0f} GB/s", flush=True)

    def prepared(kind, a, b, c, force: bool) -> _core.Prepared:
        saved = _plan.FORCE_SPLIT, _plan.SPLIT
        _plan.FORCE_SPLIT, _plan.SPLIT = force, force
        try:
            if kind == "bwd":
                return _core.prepare_backward(dev, operand(a), operand(b), operand(c), 0.125, True)
            return _core.prepare_forward(
                dev, operand(a), operand(c), None if b is None else operand(b), None, False, 0.125, True, True
            )
        finally:
            _plan.FORCE_SPLIT, _plan.SPLIT = saved

    def regs(prep: _core.Prepared) -> str:
        from cuda.bindings import driver as drv

        A = drv.CUfunction_attribute
        r = _driver.check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, prep.func), "cuFuncGetAttribute")
        per_sm = _driver.check(
            drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(prep.func, prep.block, prep.smem or prep.plan.smem),
            "cuOccupancy",
        )
        return f"{r} regs, {per_sm} blocks/SM"

    gen = torch.Generator(device="cuda").manual_seed(20261204)
    for name, shape, xdt, kind in CASES:
        if args.only and not any(w in name for w in args.only):
            continue
        x = torch.randn(shape, device="cuda", dtype=dt[xdt], generator=gen) * 3
        if kind == "bwd":
            a, b = (
                torch.randn(shape, device="cuda", dtype=dt[xdt], generator=gen),
                torch.softmax(x.float(), -1).to(x.dtype),
            )
            nbytes = 3 * x.nbytes
        else:
            a = x
            mshape = (shape[0], 1, *shape[2:]) if len(shape) == 4 else shape
            b = None if kind == "none" else torch.rand(mshape, device="cuda", generator=gen) < 0.2
            nbytes = 2 * x.nbytes + (0 if b is None else b.nbytes)
        o1, o2 = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        base = prepared(kind, a, b, o1, False)
        split = prepared(kind, a, b, o2, True)
        s = torch.cuda.current_stream().cuda_stream
        bp = 0 if b is None else b.data_ptr()
        if kind == "bwd":
            run_base = functools.partial(_core.launch, base, a.data_ptr(), b.data_ptr(), o1.data_ptr(), 0, s, True)
            run_split = functools.partial(_core.launch, split, a.data_ptr(), b.data_ptr(), o2.data_ptr(), 0, s, True)
        else:
            run_base = functools.partial(_core.launch, base, a.data_ptr(), o1.data_ptr(), bp, 0, s, True)
            run_split = functools.partial(_core.launch, split, a.data_ptr(), o2.data_ptr(), bp, 0, s, True)
        run_base()
        run_split()
        torch.cuda.synchronize()
        diff = (o1.float() - o2.float()).abs().max().item()
        scale = o1.float().abs().max().item()
        t_base, t_split = [], []
        for _ in range(3):
            t_base.append(med(run_base))
            t_split.append(med(run_split))
        print(f"{name}: max |difference| {diff:.3g} (max |out| {scale:.3g})")
        print(
            f"   {base.plan.tier:8s} {pct(nbytes, t_base, ceil)} % ({min(t_base):.4f} ms; {base.plan.kernel}, {regs(base)})"
        )
        print(f"   split    {pct(nbytes, t_split, ceil)} % ({min(t_split):.4f} ms; {split.plan.kernel}, {regs(split)})")
        sys.stdout.flush()
        x = a = b = o1 = o2 = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
