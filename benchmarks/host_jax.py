#!/usr/bin/env python3
"""Host time of one JAX call, [1,12,128,128] fp16 on the GPU: drvsoftmax beside JAX's own softmax.

    python benchmarks/host_jax.py [--calls N] [--repeats R]

Each row is the median (and min) over REPEATS runs of CALLS back-to-back calls, in
microseconds per call; no call waits for the GPU (one block_until_ready closes each run):

    drvsoftmax                drvsoftmax.scaled_masked_softmax(x, scale=s)       (the JAX door)
    jax.jit(jax.nn.softmax)   a jitted softmax of x * s                          (the mark)
    jax.nn.softmax (eager)    jax.nn.softmax(x * s) op by op
    from_dlpack(torch)        jax.dlpack.from_dlpack of a torch tensor (if torch with CUDA imports)

Needs jax with CUDA and a GPU; exits 2 without one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPE = (1, 12, 128, 128)
SCALE = 0.125


def time_us(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    """(median, min) microseconds per call over `repeats` runs of `calls` back-to-back calls."""
    last = None
    for _ in range(min(200, calls)):
        last = fn()
    _ready(last)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            last = fn()
        _ready(last)
        samples.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(samples), min(samples)


def _ready(a: object) -> None:
    block = getattr(a, "block_until_ready", None)
    if block is not None:
        block()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import drvsoftmax

    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        print("no JAX GPU device: this benchmark needs jax with CUDA", file=sys.stderr)
        return 2
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE), dtype=jnp.float16), dev)
    jitted = jax.jit(lambda t: jax.nn.softmax(t * SCALE, axis=-1))
    rows: dict[str, Callable[[], object]] = {
        "drvsoftmax": lambda: drvsoftmax.scaled_masked_softmax(x, scale=SCALE),
        "jax.jit(jax.nn.softmax)": lambda: jitted(x),
        "jax.nn.softmax (eager)": lambda: jax.nn.softmax(x * SCALE, axis=-1),
    }
    ours = np.asarray(drvsoftmax.scaled_masked_softmax(x, scale=SCALE), dtype=np.float32)
    err = float(np.max(np.abs(ours - np.asarray(jitted(x), dtype=np.float32))))
    try:
        import torch

        if torch.cuda.is_available():
            t = torch.randn(SHAPE, dtype=torch.float16, device=f"cuda:{dev.local_hardware_id}")
            rows["from_dlpack(torch)"] = lambda: jax.dlpack.from_dlpack(t)
    except ImportError:
        pass
    print(f"host us per call, x {list(SHAPE)} float16 on {dev} ({dev.device_kind}); jax {jax.__version__}")
    print(f"median (min) of {a.repeats} x {a.calls} back-to-back calls; max |ours - jitted| = {err:.2e}")
    for name, fn in rows.items():
        med, lo = time_us(fn, a.calls, a.repeats)
        print(f"  {name:<26} {med:8.2f} us  ({lo:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
