"""The copy ceiling at each benchmark case's own size, as % of the 1 GiB copy.

    python3 benchmarks/size_ceiling.py [--reps N]

Needs a CUDA GPU and PyTorch with CUDA.  A short kernel pays the launch, the filling and the
draining of the GPU on fewer bytes: for each shape of bench_softmax.py's mask and causal
sections (and a few of its other sizes) this times `y.copy_(x)` of x's dtype and shape
(bytes read + written; a mask adds 1/16 of x's bytes or less), and prints it as GB/s and % of
a copy of 1 GiB timed in the same run.  Prints only; writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# (shape, dtype): bench_softmax.py's mask-section shapes, its causal shape, a row-sweep size.
SHAPES = [
    ((256, 12, 128, 128), "float16"),
    ((256, 12, 128, 128), "float32"),
    ((16, 16, 512, 1000), "float16"),
    ((8, 32, 2048, 2048), "float16"),
    ((2, 32, 4096, 4096), "float16"),
    ((2, 16, 512, 16384), "float16"),
    ((2, 16, 512, 16384), "float32"),
    ((16777216, 32), "float16"),
]


def main(argv: list[str] | None = None) -> int:
    from long_rows import _copy_ceiling, _median_ms, cuda_torch, tier_args

    args = tier_args(__doc__, argv, 30, only=False)

    torch = cuda_torch()
    if torch is None:
        return 2
    big = _copy_ceiling(torch, args.reps)
    print(f"{torch.cuda.get_device_name()}: copy of 1 GiB {big:.0f} GB/s")
    for shape, dt in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=getattr(torch, dt))
        y = torch.empty_like(x)
        ms = _median_ms(torch, lambda x=x, y=y: y.copy_(x), args.reps)
        gbs = 2 * x.nbytes / ms / 1e6
        print(
            f"  {dt:8s} {'x'.join(map(str, shape)):>18s}: copy {ms:.4f} ms, {gbs:5.0f} GB/s, {gbs / big * 100:5.1f} %"
        )
        x = y = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
