"""Long rows: the planner's tier (cluster or coop) beside the coop and looped tiers, as %
of a device-to-device copy.

    python3 benchmarks/long_rows.py [--reps N]

Needs a CUDA GPU and PyTorch with CUDA.  For Sk = 65536, 262144 and 1048576 (16-bit and
fp32 at 2^28 / 2^27 elements: x `[rows, Sk]`), forward without and with a bool padding
mask `[1, Sk]`, and backward, it prints the tier each launch takes on this device and its
blocks per row (CTAs of a cluster, or co-resident blocks of the coop tier), the median
time of that planned launch, of the coop tier (forced where the cluster tier would run:
`_plan.FORCE_COOP`) and of the looped tier (the same launch planned for a device without
either), and each as % of the copy ceiling: GB/s over the minimum bytes (x, the mask at
its own size and y forward; dy, y and dx backward) against a device-to-device copy timed
in the same run.  Prints only; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def _median_ms(torch, fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _copy_ceiling(torch, reps: int) -> float:
    """GB/s of a device-to-device copy of 1 GiB (bytes read + written)."""
    nbytes = 2**30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_ms(torch, lambda: dst.copy_(src), reps) / 1e6


def tier_args(doc: str, argv: list[str] | None, reps: int, only: bool = True) -> argparse.Namespace:
    """--reps (and --only) of the scripts that time one tier beside another."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=reps, help=f"timed calls per median (default {reps})")
    if only:
        ap.add_argument("--only", nargs="*", default=[], help="cases whose name holds one of these words")
    return ap.parse_args(argv)


def cuda_torch():
    """torch where it sees a CUDA GPU, else None (and a line on stderr saying what is missing)."""
    try:
        import torch
    except ImportError:
        print("needs PyTorch with CUDA", file=sys.stderr)
        return None
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    return torch


def cluster_device(reps: int):
    """(torch, the package's device, the copy ceiling in GB/s) on a GPU of sm_90 or newer
    (thread-block clusters), with a line naming the device and the ceiling printed; else
    None, with a line on stderr saying what is missing."""
    torch = cuda_torch()
    if torch is None:
        return None
    if torch.cuda.get_device_capability() < (9, 0):
        print("needs a GPU of sm_90 or newer (thread-block clusters)", file=sys.stderr)
        return None
    from drvsoftmax import _driver

    dev = _driver.device(torch.cuda.current_device())
    ceil = _copy_ceiling(torch, reps)
    print(f"{dev.name} ({dev.caps.sm_count} SMs), copy ceiling {ceil:.0f} GB/s", flush=True)
    return torch, dev, ceil


def kernel_regs(prep) -> int:
    """Registers per thread of a prepared launch's kernel."""
    from cuda.bindings import driver as drv

    from drvsoftmax import _driver

    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
    return _driver.check(drv.cuFuncGetAttribute(attr, prep.func), "cuFuncGetAttribute")


def report_runs(torch, runs: list, ref, tol: float, nbytes: float, ceil: float, reps: int, versus: str) -> int:
    """Times each of `runs` ((label, prepared launch, output, call)) in three alternating
    rounds of `reps`-call medians, checks each output against `ref` to within `tol`
    (`versus` names `ref`), and prints per label its % of copy in each round (`nbytes`
    moved, a copy of `ceil` GB/s), its best time, tier, cluster size and shared memory (or
    grid), registers, largest difference and kernel.  Returns 1 where an output disagreed
    (or holds a NaN the reference does not), else 0."""
    times: dict[str, list[float]] = {label: [] for label, *_ in runs}
    for _ in range(3):
        for label, _, _, run in runs:
            times[label].append(_median_ms(torch, run, reps))
    width = max(len(label) for label, *_ in runs)
    status = 0
    for label, prep, y, _ in runs:
        diff = (y.float() - ref).abs().max().item()
        if not diff <= tol:  # (NaN: an element left unwritten)
            print(f"   {label}: max |difference| {diff:.3g} from {versus} (tolerance {tol:.3g})")
            status = 1
        p = prep.plan
        shape = f"cluster {p.cluster}, {p.smem // 1024} KB" if p.cluster else f"grid {p.grid}"
        print(
            f"   {label:<{width}} {pct(nbytes, times[label], ceil)} % ({min(times[label]):.4f} ms; {p.tier}, {shape}; "
            f"{kernel_regs(prep)} regs; max |diff| {diff:.2g}; {p.kernel})"
        )
    sys.stdout.flush()
    return status


def operand(t):
    """The _core.Operand of a torch tensor."""
    from drvsoftmax import _core

    return _core.Operand(t.data_ptr(), str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()))


def pct(nbytes: float, times: list[float], ceil: float) -> str:
    """Each time (ms) of moving `nbytes` as % of a copy of `ceil` GB/s."""
    return " ".join(f"{nbytes / t / 1e6 / ceil * 100:5.1f}" for t in times)


def _cases(torch, drvsoftmax, dtype, rows: int, sk: int) -> list:
    """(name, call, minimum bytes moved) of the forward, the forward with a bool padding
    mask and the backward on fresh `[rows, sk]` inputs."""
    x = torch.randn((rows, sk), device="cuda", dtype=dtype)
    mask = torch.rand((1, sk), device="cuda") < 0.1
    mask[0, 0] = False
    y = torch.empty_like(x)
    dy = torch.randn_like(x)
    dx = torch.empty_like(x)
    return [
        ("fwd", lambda: drvsoftmax.scaled_masked_softmax(x, scale=0.125, out=y), 2 * x.nbytes),
        ("fwd+bool", lambda: drvsoftmax.scaled_masked_softmax(x, mask, scale=0.125, out=y), 2 * x.nbytes + mask.nbytes),
        ("bwd", lambda: drvsoftmax.scaled_masked_softmax_backward(dy, y, scale=0.125, out=dx), 3 * x.nbytes),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed calls per case (median)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("long_rows.py needs PyTorch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("long_rows.py needs a CUDA GPU", file=sys.stderr)
        return 2

    import drvsoftmax
    import drvsoftmax.torch as dtorch
    from drvsoftmax import _core, _driver, _plan

    dev = _driver.device(torch.cuda.current_device())
    caps = dev.caps
    print(f"{dev.name} (sm_{caps.cc}), {caps.smem_per_block} bytes of shared memory per block, {caps.sm_count} SMs")

    ceiling = _copy_ceiling(torch, args.reps)
    print(f"copy ceiling: {ceiling:.0f} GB/s\n")

    def use(c: _plan.DeviceCaps, force_coop: bool = False) -> None:
        dev.caps = c
        _plan.FORCE_COOP = force_coop
        _core._cache.clear()
        dtorch._forget_launches()  # every prepared launch of the torch door, the eager fast path's too

    def last_plan() -> _plan.LaunchPlan:
        """The launch that ran (one since the clear): the forward's or the backward's."""
        for entry in dtorch._prepared.values():
            return entry[0].plan
        return next(iter(_core._cache.values())).plan

    no_clusters = _plan.DeviceCaps(caps.cc, 0)  # no shared memory to hold rows: the looped tier
    head = (
        f"{'case':<34} {'tier':<8} {'blks':>4} {'planned ms':>10} {'%copy':>6} {'coop ms':>9} {'%copy':>6} "
        f"{'loop ms':>9} {'%copy':>6}"
    )
    print(head)
    print("-" * len(head))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        item = torch.tensor([], dtype=dtype).element_size()
        total = 2**28 if item == 2 else 2**27
        for sk in (65536, 262144, 1048576):
            rows = max(1, total // sk)
            for name, fn, moved in _cases(torch, drvsoftmax, dtype, rows, sk):
                use(caps)
                t_pl = _median_ms(torch, fn, args.reps)
                plan = last_plan()
                use(caps, force_coop=True)
                t_co = _median_ms(torch, fn, args.reps)
                coop = last_plan()
                use(no_clusters)
                t_lp = _median_ms(torch, fn, args.reps)
                use(caps)
                label = f"{str(dtype).replace('torch.', '')} [{rows}, {sk}] {name}"
                pct = [moved / t / 1e6 / ceiling * 100 for t in (t_pl, t_co, t_lp)]
                t_co_s = f"{t_co:>9.3f} {pct[1]:>6.1f}" if coop.tier == "coop" else f"{'-':>9} {'-':>6}"
                print(
                    f"{label:<34} {plan.tier:<8} {plan.cluster or plan.coop:>4} {t_pl:>10.3f} {pct[0]:>6.1f} "
                    f"{t_co_s} {t_lp:>9.3f} {pct[2]:>6.1f}"
                )
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
