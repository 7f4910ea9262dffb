"""The pipelined register tier beside the register tier, case by case, as % of a copy.

    python3 benchmarks/pipe_rows.py [--reps N] [--only WORD ...]

Needs a CUDA GPU of sm_90 or newer and PyTorch with CUDA.  For the rows the tier's kernels
take (fp32 x with an fp32 additive mask, 8 chunks per thread; `_plan.pipe_rows` decides
where the planner takes the tier by default: rows of more than 256 threads), it prepares the same
forward twice, once planned without the tier and once with it forced
(`_plan.FORCE_PIPE`), checks that the two write the same bits (their arithmetic is the
same), and prints the median time of each over three alternating rounds, as % of a
device-to-device copy timed in the same run (GB/s over x, the mask at its own size and y;
a causal forward counts the chunks of x holding a visible key), with each kernel's
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

# name, x shape, x dtype, mask ("bool", a float dtype name or None), causal
CASES = [
    ("add f32 2x16x512x16384", (2, 16, 512, 16384), "float32", "float32", False),
    ("add f32 causal 2x16x512x16384", (2, 16, 512, 16384), "float32", "float32", True),
    ("add f32 2x16x512x12000", (2, 16, 512, 12000), "float32", "float32", False),
    ("add f32 4x32x1024x8192", (4, 32, 1024, 8192), "float32", "float32", False),
    ("add f32 2x32x4096x4096", (2, 32, 4096, 4096), "float32", "float32", False),
    ("add f32 16x16x512x1000", (16, 16, 512, 1000), "float32", "float32", False),
]


def main(argv: list[str] | None = None) -> int:
    from long_rows import cuda_torch, operand, pct, tier_args

    args = tier_args(__doc__, argv, 25)

    torch = cuda_torch()
    if torch is None:
        return 2
    from drvsoftmax import _core, _driver, _plan

    dev = _driver.device(torch.cuda.current_device())
    if dev.cc < _plan.PIPE_MIN_CC:
        print(f"the pipelined register tier needs sm_{_plan.PIPE_MIN_CC}+, this GPU is {dev.arch}", file=sys.stderr)
        return 2
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

    from long_rows import _copy_ceiling, _median_ms

    def med(fn) -> float:
        return _median_ms(torch, fn, args.reps)

    ceil = _copy_ceiling(torch, args.reps)
    print(f"{dev.name}, copy ceiling {ceil:.0f} GB/s", flush=True)

    def prepared(x, mask, causal, y, force: bool) -> _core.Prepared:
        saved = _plan.PIPE_MIN_CC, _plan.FORCE_PIPE
        _plan.PIPE_MIN_CC, _plan.FORCE_PIPE = (saved[0], True) if force else (10**9, False)
        try:
            m = None if mask is None else operand(mask)
            return _core.prepare_forward(dev, operand(x), operand(y), m, None, causal, 0.125, True, True)
        finally:
            _plan.PIPE_MIN_CC, _plan.FORCE_PIPE = saved

    def regs(prep: _core.Prepared) -> str:
        from cuda.bindings import driver as drv

        A = drv.CUfunction_attribute
        r = _driver.check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, prep.func), "cuFuncGetAttribute")
        per_sm = _driver.check(
            drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(prep.func, prep.block, prep.smem), "cuOccupancy"
        )
        return f"{r} regs, {per_sm} blocks/SM"

    gen = torch.Generator(device="cuda").manual_seed(20261203)
    for name, shape, xdt, mk, causal in CASES:
        if args.only and not any(w in name for w in args.only):
            continue
        x = torch.randn(shape, device="cuda", dtype=dt[xdt], generator=gen) * 3
        mask = None
        mshape = (shape[0], 1, *shape[2:]) if len(shape) == 4 else shape
        if mk == "bool":
            mask = torch.rand(mshape, device="cuda", generator=gen) < 0.2
        elif mk is not None:
            mask = torch.randn(mshape, device="cuda", generator=gen).to(dt[mk])
        y1, y2 = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        reg = prepared(x, mask, causal, y1, False)
        pipe = prepared(x, mask, causal, y2, True)
        if pipe.plan.tier != "pipe":
            print(f"{name}: no pipelined plan ({pipe.plan.describe()})")
            continue
        mp = 0 if mask is None else mask.data_ptr()
        s = torch.cuda.current_stream().cuda_stream
        run_reg = functools.partial(_core.launch, reg, x.data_ptr(), y1.data_ptr(), mp, 0, s, True)
        run_pipe = functools.partial(_core.launch, pipe, x.data_ptr(), y2.data_ptr(), mp, 0, s, True)
        run_reg()
        run_pipe()
        torch.cuda.synchronize()
        it = torch.int16 if x.element_size() == 2 else torch.int32
        same = torch.equal(y1.view(it), y2.view(it))
        nbytes = 2 * x.nbytes + (0 if mask is None else mask.nbytes)
        if causal:
            sq, sk, e = shape[-2], shape[-1], 16 // x.element_size()
            vis = sum(min(sk, -(-(i + 1) // e) * e) for i in range(sq)) / (sq * sk)
            nbytes = x.nbytes * (1 + vis)
        t_reg, t_pipe = [], []
        for _ in range(3):
            t_reg.append(med(run_reg))
            t_pipe.append(med(run_pipe))
        print(f"{name}: same bits {same}")
        print(f"   register {pct(nbytes, t_reg, ceil)} % ({min(t_reg):.4f} ms; {reg.plan.kernel}, {regs(reg)})")
        print(f"   pipe     {pct(nbytes, t_pipe, ceil)} % ({min(t_pipe):.4f} ms; {regs(pipe)}, grid {pipe.grid})")
        sys.stdout.flush()
        x = mask = y1 = y2 = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
