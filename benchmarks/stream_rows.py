"""The streamed cluster forward and backward at several shared-memory caps beside the
planned, looped and split tiers, for rows the cluster tier does not hold, as % of a copy.

    python3 benchmarks/stream_rows.py [--reps N] [--only WORD ...]

Needs a GPU of sm_90 or newer and PyTorch with CUDA.  Forward: fp32 x of rows of 1M keys (4
to 256 rows) and of 512K keys (128 and 1024 rows), without a mask and with a bool padding
mask `[1, Sk]`.  Backward: fp32 and fp16 rows of 1M keys (4 to 512 rows) and fp32 rows of
512K keys.  It prepares each launch as planned, as the looped tier plans it (the launch
planned for the device without clusters or shared memory to hold rows), with the split
tier forced (`_plan.FORCE_SPLIT`), and streamed with each block's shared memory capped at 0
to 200 KB (`_plan.FORCE_STREAM`).  It checks that every output agrees with the planned one
to rounding (the tiers add their terms in different orders; the exit status is 1 where one
does not), then prints each launch's median time over three alternating rounds as % of a
device-to-device copy timed in the same run (GB/s over the operands read and written, a
mask at its own size), with its tier, its cluster size and shared memory (or grid), and
its kernel's registers.  Prints only; writes nothing.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):  # drvsoftmax, and long_rows' timing
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# (rows, Sk) of fp32 x: few and many rows of 1M keys, and rows of 512K keys, which a cluster
# of 16 holds without a mask but with a bool mask only at more shared memory per block than
# the planner gives a masked cluster (CLUSTER_LOOP_SMEM).
SHAPES = [(4, 2**20), (16, 2**20), (64, 2**20), (256, 2**20), (128, 2**19), (1024, 2**19)]
CASES = [(f"{kind} float32 {rows}x{sk}", rows, sk, kind, "float32") for rows, sk in SHAPES for kind in ("none", "bool")]
# The backward: fp32 and fp16 rows of 1M keys (the benchmark's long rows: 256 fp32, 512
# fp16), few of them, and fp32 rows of 512K keys.
BWD_SHAPES = [(4, 2**20), (16, 2**20), (64, 2**20), (256, 2**20), (256, 2**19)]
CASES += [(f"bwd float32 {rows}x{sk}", rows, sk, "bwd", "float32") for rows, sk in BWD_SHAPES]
CASES += [(f"bwd float16 {rows}x{sk}", rows, sk, "bwd", "float16") for rows, sk in [(16, 2**20), (512, 2**20)]]
# Shared memory per block of the forced streamed launches.
STREAM_CAPS_KB = (0, 64, 100, 112, 150, 200)


def main(argv: list[str] | None = None) -> int:
    from long_rows import cluster_device, operand, report_runs, tier_args

    args = tier_args(__doc__, argv, 15)
    found = cluster_device(args.reps)
    if found is None:
        return 2
    torch, dev, ceil = found
    caps = dev.caps
    from drvsoftmax import _core, _plan

    def prepared(x, m, y, label: str, dy=None) -> _core.Prepared:
        """The forward (the backward where `dy` is given: y is then the forward's output, x
        dx) as `label` plans it: "planned", "loop", "split" or "stream <bytes>"."""
        saved = _plan.FORCE_SPLIT, _plan.SPLIT, _plan.FORCE_STREAM, dev.caps
        if label == "loop":
            dev.caps = _plan.DeviceCaps(caps.cc, 0)  # no shared memory to hold rows
        elif label == "split":
            _plan.FORCE_SPLIT, _plan.SPLIT = True, True
        elif label.startswith("stream"):
            _plan.FORCE_STREAM = int(label.split()[1])
        try:
            if dy is not None:
                return _core.prepare_backward(dev, operand(dy), operand(y), operand(x), 0.125, True)
            return _core.prepare_forward(
                dev, operand(x), operand(y), None if m is None else operand(m), None, False, 0.125, True, True
            )
        finally:
            _plan.FORCE_SPLIT, _plan.SPLIT, _plan.FORCE_STREAM, dev.caps = saved

    labels = ["planned", "loop", "split"] + [f"stream {kb * 1024}" for kb in STREAM_CAPS_KB]
    gen = torch.Generator(device="cuda").manual_seed(20261206)
    status = 0
    for name, rows, sk, kind, dt in CASES:
        if args.only and not any(w in name for w in args.only):
            continue
        dtype = getattr(torch, dt)
        x = (torch.randn((rows, sk), device="cuda", generator=gen) * 3).to(dtype)
        m = None if kind != "bool" else torch.rand((1, sk), device="cuda", generator=gen) < 0.2
        dy = yb = None
        if kind == "bwd":  # x: dx; y: the forward's output of random scores; dy random
            yb = torch.softmax(torch.randn((rows, sk), device="cuda", generator=gen) * 3, -1).to(dtype)
            dy = (torch.randn((rows, sk), device="cuda", generator=gen) / sk).to(dtype)
        nbytes = (3 if kind == "bwd" else 2) * x.nbytes + (0 if m is None else m.nbytes)
        s = torch.cuda.current_stream().cuda_stream
        mp = 0 if m is None else m.data_ptr()
        runs = []
        for label in labels:
            out = torch.full_like(x, float("nan"))
            if kind == "bwd":
                prep = prepared(out, None, yb, label, dy)
                args_ = (dy.data_ptr(), yb.data_ptr(), out.data_ptr(), 0)
            else:
                prep = prepared(x, m, out, label)
                args_ = (x.data_ptr(), out.data_ptr(), mp, 0)
            if label == "split" and prep.plan.tier != "split":
                continue  # (the split tier does not take these rows)
            if label.startswith("stream") and "stream" not in prep.plan.kernel:
                continue  # (no streamed kernel for these rows)
            runs.append((label, prep, out, functools.partial(_core.launch, prep, *args_, s, True)))
        for _, _, _, run in runs:
            run()
        torch.cuda.synchronize()
        ref = runs[0][2].float()
        tol = (1e-4 if dt == "float32" else 1e-2) * ref.abs().max().item()
        print(f"{name}:")
        status |= report_runs(torch, runs, ref, tol, nbytes, ceil, args.reps, "the planned output")
        x = m = ref = dy = yb = None
        runs = []
        torch.cuda.empty_cache()
    return status


if __name__ == "__main__":
    sys.exit(main())
