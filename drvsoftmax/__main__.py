"""``python -m drvsoftmax demo`` and ``python -m drvsoftmax info``."""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

import drvsoftmax

from . import _compiler, _loader, _plan, _reference


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "not installed"


def info(list_kernels: bool = False, arch: str | None = None) -> int:
    print(f"drvsoftmax {drvsoftmax.__version__} (Python {platform.python_version()})")
    print(
        f"cuda-bindings {_version('cuda-bindings')}, cuda-pathfinder {_version('cuda-pathfinder')}, "
        f"numpy {np.__version__}, torch {_version('torch')}"
    )
    print(f"NVRTC: {_compiler.nvrtc_version_str()}")
    print(f"kernel sources: {_compiler.source_dir()} (hash {_compiler.source_hash()[:16]})")
    print(f"kernels: {len(_plan.all_kernel_names())}")
    art = _loader.artifacts()
    if art.usable:
        m = art.manifest or {}
        print(f"packaged artifacts: {art.folder} (NVRTC {m.get('nvrtc')}, built for {m.get('source_hash', '')[:16]})")
        for fname, e in sorted(art.files.items()):
            extra = f", needs a CUDA {_loader._cuda_str(e.get('min_cuda'))} driver" if e["kind"] == "ptx" else ""
            print(f"  {fname}: {e['kind']} {e['arch']}, {e['size']} bytes{extra}")
    else:
        print(f"packaged artifacts: none usable: {art.why_not}")
    print(f"run-time compile cache: {_compiler.cache_dir()}")
    switches = [n for n in ("DRVSOFTMAX_NO_JIT", "DRVSOFTMAX_FORCE_JIT") if _loader._flag(n)]
    print(f"switches set: {', '.join(switches) if switches else 'none'}")
    try:
        from . import _driver

        ver = _driver.driver_version()
        n = _driver.device_count()
    except Exception as e:
        print(f"CUDA driver: not available ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        a = arch or "sm_90"
        print(f"devices: none; kernels would load, on an {a} GPU, from: " + _loader.describe_source(a, None))
        if list_kernels:
            _list_kernels([a], None)
        return 0
    print(f"CUDA driver: CUDA {ver // 1000}.{(ver % 1000) // 10} ({ver}); {n} device(s)")
    archs = []
    for i in range(n):
        dev = _driver.device(i)
        archs.append(dev.arch)
        print(
            f"  device {i}: {dev.name}, {dev.arch}, {dev.sm_count} SMs; kernels load from: "
            f"{_loader.describe_source(dev.arch, ver)}"
        )
    if list_kernels:
        _list_kernels(sorted(set(archs + ([arch] if arch else []))), ver)
    return 0


def _list_kernels(archs, driver_version) -> None:
    for a in archs:
        print(f"kernels for {a}:")
        for name in _plan.all_kernel_names():
            print(f"  {name}: {_loader.describe_source(a, driver_version, name)}")


def demo(shape=(4, 12, 512, 512), iters=50) -> int:
    scale = 1.0 / 8.0
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        why = "PyTorch is not installed" if torch is None else "no CUDA GPU is visible"
        print(f"No GPU run: {why}. Running the CPU reference path instead.")
        rng = np.random.default_rng(0)
        small = (1, 2, 64, 64)
        x = rng.standard_normal(small).astype(np.float32)
        mask = rng.random((small[0], 1, small[2], small[3])) < 0.1
        t = time.perf_counter()
        y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=True)
        dt = time.perf_counter() - t
        print(
            f"scaled_masked_softmax{small} float32 (bool mask + causal) on the CPU: {dt * 1e3:.2f} ms; "
            f"rows sum to 1: {np.allclose(y.sum(-1), 1, atol=1e-5)}"
        )
        return 0
    return run_demo(torch, torch.device("cuda"), shape, iters)


def run_demo(torch, dev, shape=(4, 12, 512, 512), iters=50, scale=1.0 / 8.0) -> int:
    """The attention-shaped check and timing on `dev` (the GPU; the CPU in tests)."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(
        f"{'GPU' if dev.type == 'cuda' else 'device'}: {name}; input {tuple(shape)} float16, "
        f"bool mask [B,1,Sq,Sk], scale {scale}, causal"
    )
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dev, torch.float16)
    mask = (torch.rand((shape[0], 1, shape[2], shape[3]), generator=gen) < 0.1).to(dev)
    y = drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=True)
    ref = _reference.softmax_forward(x.float().cpu().numpy(), mask.cpu().numpy(), scale, True)
    err = float(np.max(np.abs(y.float().cpu().numpy() - ref)))
    ok = err < 2e-3
    print(f"max |drvsoftmax - float64 reference| = {err:.2e} ({'OK' if ok else 'TOO LARGE'})")

    def eager():
        causal = torch.ones(shape[2], shape[3], dtype=torch.bool, device=dev).triu(1)
        return torch.softmax((x * scale).masked_fill(mask | causal, float("-inf")), -1)

    def ours():
        return drvsoftmax.scaled_masked_softmax(x, mask, scale=scale, causal=True)

    for label, fn in (("drvsoftmax", ours), ("PyTorch eager", eager)):
        for _ in range(3):
            fn()
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / iters
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            ms = (time.perf_counter() - t) * 1e3 / iters
        gbs = (x.numel() * 2 * 2 + mask.numel()) / ms / 1e6
        print(f"  {label:14s} {ms * 1e3:8.1f} us/call  {gbs:7.0f} GB/s (x + mask + y, minimum bytes)")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m drvsoftmax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run an attention-shaped input through the fused op and time it")
    pi = sub.add_parser("info", help="versions, devices, where kernels load from, cache folder")
    pi.add_argument("--kernels", action="store_true", help="list every kernel and where it would load from")
    pi.add_argument("--arch", default=None, help="also for this architecture (sm_XY), e.g. without a GPU")
    args = p.parse_args(argv)
    return demo() if args.cmd == "demo" else info(args.kernels, args.arch)


if __name__ == "__main__":
    sys.exit(main())
