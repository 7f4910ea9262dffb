"""The looped tier beside the planned one on rows the register tier holds, as % of a copy.

    python3 benchmarks/loop_rows.py [--reps N] [--only WORD ...]

Needs a CUDA GPU and PyTorch with CUDA.  For bench_softmax.py's forwards of 2048 to 16384
keys (without a mask, with a bool or additive mask [B,1,Sq,Sk], causal) it prepares the
launch as planned and as the looped tier would run it (a block per row, two passes over
the row: the second from L2 where the row is still there), checks that the two write the
same values to the dtype's rounding, and prints the median time of each over three
alternating rounds as % of a device-to-device copy timed in the same run (GB/s over x, the
mask at its own size and y).  Prints only; writes nothing.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# name, x shape, dtype, mask ("none", "bool", "add", "causal")
CASES = [
    ("fwd f32 16384", (16384, 16384), "float32", "none"),
    ("fwd f32 8192", (32768, 8192), "float32", "none"),
    ("fwd f16 16384", (32768, 16384), "float16", "none"),
    ("fwd bf16 16384", (32768, 16384), "bfloat16", "none"),
    ("bool f16 16384", (2, 16, 512, 16384), "float16", "bool"),
    ("add f16 16384", (2, 16, 512, 16384), "float16", "add"),
    ("bool bf16 16384", (2, 16, 512, 16384), "bfloat16", "bool"),
    ("bool f32 16384", (2, 16, 512, 16384), "float32", "bool"),
    ("add f32 16384", (2, 16, 512, 16384), "float32", "add"),
    ("bool f16 4096", (2, 32, 4096, 4096), "float16", "bool"),
    ("add bf16 4096", (2, 32, 4096, 4096), "bfloat16", "add"),
    ("add f32 4096", (2, 32, 4096, 4096), "float32", "add"),
    ("add f16 2048", (8, 32, 2048, 2048), "float16", "add"),
    ("causal f16 2048", (8, 32, 2048, 2048), "float16", "causal"),
]


def main(argv: list[str] | None = None) -> int:
    from long_rows import _copy_ceiling, _median_ms, cuda_torch, operand, pct, tier_args

    args = tier_args(__doc__, argv, 15)

    torch = cuda_torch()
    if torch is None:
        return 2
    from drvsoftmax import _core, _driver, _params, _plan

    dev = _driver.device(torch.cuda.current_device())
    ceil = _copy_ceiling(torch, args.reps)
    print(f"{dev.name}, copy ceiling {ceil:.0f} GB/s", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(20261203)
    for name, shape, dt, kind in CASES:
        if args.only and not any(w in name for w in args.only):
            continue
        x = torch.randn(shape, device="cuda", dtype=getattr(torch, dt), generator=gen) * 3
        mshape = (shape[0], 1, *shape[2:])
        m = None
        if kind == "bool":
            m = torch.rand(mshape, device="cuda", generator=gen) < 0.2
        elif kind == "add":
            m = (torch.randn(mshape, device="cuda", generator=gen) * 2).to(x.dtype)
        causal = kind == "causal"
        outs = [torch.full_like(x, float("nan")) for _ in range(2)]
        args_of = [
            (operand(x), operand(o), None if m is None else operand(m), None, causal, 0.125, True, True) for o in outs
        ]
        planned = _core.prepare_forward(dev, *args_of[0])
        item = _plan.X_DTYPES[dt][1]
        saved = dict(_plan.MAX_CHUNKS)
        _plan.MAX_CHUNKS[item] = shape[-1] * item // 16 - 1
        try:
            values, plan = _core.forward_params(*args_of[1])
        finally:
            _plan.MAX_CHUNKS.clear()
            _plan.MAX_CHUNKS.update(saved)
        looped = _core.Prepared(dev, plan, _params.FWD.pack(values), 5)
        s = torch.cuda.current_stream().cuda_stream
        mp = 0 if m is None else m.data_ptr()
        runs = [
            functools.partial(_core.launch, prep, x.data_ptr(), o.data_ptr(), mp, 0, s, True)
            for prep, o in zip((planned, looped), outs)
        ]
        for r in runs:
            r()
        torch.cuda.synchronize()
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        times: list[list[float]] = [[], []]
        for _ in range(3):
            for i, r in enumerate(runs):
                times[i].append(_median_ms(torch, r, args.reps))
        nbytes = 2 * x.nbytes + (0 if m is None else m.nbytes)
        print(f"{name} {'x'.join(map(str, shape))}: max |difference| {diff:.3g}")
        for prep, t in zip((planned, looped), times):
            print(f"   {prep.plan.tier:8s} {pct(nbytes, t, ceil)} % ({min(t):.4f} ms; {prep.plan.kernel})")
        sys.stdout.flush()
        x = m = outs = runs = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
