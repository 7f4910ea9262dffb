"""Long 16-bit rows with a bool mask: the x-held cluster forward (the mask read from global
memory) beside the cluster kernel that holds the mask beside x and the looped tier, as % of
a copy.

    python3 benchmarks/xs_rows.py [--reps N] [--only WORD ...]

Needs a GPU of sm_90 or newer and PyTorch with CUDA.  fp16 and bf16 x `[rows, Sk]` of 2^29
elements (Sk = 65536, 262144 and 1048576), with a bool padding mask `[1, Sk]` (one row of
mask for every row of x) and with a bool mask of x's shape.  It prepares each launch with
`_plan.CLUSTER_XS` on (`x-held`: wherever a cluster holds x) and off (`held`: the mask
beside x in shared memory where a cluster holds both, else the planner's other tier), and
as the looped tier plans it (the launch planned for the device without shared memory to
hold rows).  It checks that every output agrees with the looped one to rounding (the exit
status is 1 where one does not), then prints each launch's median time in each of three
alternating rounds as % of a device-to-device copy timed in the same run (GB/s over x, the
mask at its own size and y), with its tier, cluster size and shared memory (or grid), its
kernel's registers, the largest difference and the kernel.  Prints only; writes nothing.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):  # drvsoftmax, and long_rows' timing
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

ELEMS = 2**29
CASES = [
    (f"{dt} {ELEMS // sk}x{sk} mask {m}", ELEMS // sk, sk, dt, m)
    for sk in (2**16, 2**18, 2**20)
    for dt in ("float16", "bfloat16")
    for m in ("[1,Sk]", "full")
]
LABELS = ("x-held", "held", "loop")


def main(argv: list[str] | None = None) -> int:
    from long_rows import cluster_device, operand, report_runs, tier_args

    args = tier_args(__doc__, argv, 15)
    found = cluster_device(args.reps)
    if found is None:
        return 2
    torch, dev, ceil = found
    caps = dev.caps
    from drvsoftmax import _core, _plan

    def prepared(x, m, y, label: str) -> _core.Prepared:
        saved = _plan.CLUSTER_XS, dev.caps
        if label == "loop":
            dev.caps = _plan.DeviceCaps(caps.cc, 0)  # no shared memory to hold rows
        else:
            _plan.CLUSTER_XS = label == "x-held"
        try:
            return _core.prepare_forward(dev, operand(x), operand(y), operand(m), None, False, 0.125, True, True)
        finally:
            _plan.CLUSTER_XS, dev.caps = saved

    gen = torch.Generator(device="cuda").manual_seed(20261207)
    status = 0
    for name, rows, sk, dt, mk in CASES:
        if args.only and not any(w in name for w in args.only):
            continue
        x = (torch.randn((rows, sk), device="cuda", generator=gen) * 3).to(getattr(torch, dt))
        m = torch.rand((1 if mk == "[1,Sk]" else rows, sk), device="cuda", generator=gen) < 0.2
        m[:, 0] = False  # no row wholly hidden
        nbytes = 2 * x.nbytes + m.nbytes
        s = torch.cuda.current_stream().cuda_stream
        runs = []
        for label in LABELS:
            out = torch.full_like(x, float("nan"))
            prep = prepared(x, m, out, label)
            args_ = (x.data_ptr(), out.data_ptr(), m.data_ptr(), 0)
            runs.append((label, prep, out, functools.partial(_core.launch, prep, *args_, s, True)))
        for *_, run in runs:
            run()
        torch.cuda.synchronize()
        ref = runs[-1][2].float()  # the looped tier's
        tol = 1e-2 * ref.abs().max().item()
        print(f"{name}:")
        status |= report_runs(torch, runs, ref, tol, nbytes, ceil, args.reps, "the looped tier's output")
        x = m = ref = None
        runs = []
        torch.cuda.empty_cache()
    return status


if __name__ == "__main__":
    sys.exit(main())
