"""The command line: ``python -m drvsoftmax {demo,info,cache,precompile}`` and ``--version``.

demo                         an attention-shaped input through the fused op, timed
info [--json] [--kernels] [--arch sm_XY]
                             versions, devices, where each device's kernels load from
cache info [--json] | cache clear
                             the run-time compile cache
precompile [--arch sm_XY ...] [--jobs N] [--all]
                             fill the run-time cache (e.g. in a container image built
                             without a GPU, for GPUs no packaged cubin covers)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

import drvsoftmax

from . import _compiler, _errors, _loader, _plan, _reference

if TYPE_CHECKING:
    from types import ModuleType

    import torch as _torch


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def collect_info(list_kernels: bool = False, arch: str | None = None) -> dict[str, Any]:
    """Everything ``info`` reports, as plain data (the keys of ``info --json``)."""
    art = _loader.artifacts()
    files = []
    for fname, e in sorted(art.files.items()):
        files.append(
            {
                "name": fname,
                "kind": e["kind"],
                "arch": e["arch"],
                "size": e.get("size"),
                "kernels": len(e["lowered"]),
                "min_cuda": e.get("min_cuda") if e["kind"] == "ptx" else None,
                "problem": _loader.file_problem(art, fname),
            }
        )
    files += [
        {"name": f, "kind": None, "arch": None, "size": None, "kernels": 0, "min_cuda": None, "problem": why}
        for f, why in sorted(art.rejected.items())
    ]
    built = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        built = json.loads((art.folder / "build.json").read_text()).get("seconds")
    m = art.manifest if art.usable and art.manifest else {}
    cinfo = _compiler.cache_info()
    switch_problem = None
    switches: dict[str, bool | str | None] = {n: None for n in (_loader.NO_JIT, _loader.FORCE_JIT)}
    for n in switches:
        try:
            switches[n] = _loader._flag(n)
        except ValueError as e:
            switch_problem = str(e)
    switches[_compiler.CACHE_ENV] = os.environ.get(_compiler.CACHE_ENV) or None
    info: dict[str, Any] = {
        "drvsoftmax": drvsoftmax.__version__,
        "python": platform.python_version(),
        "packages": {n: _version(n) for n in ("cuda-bindings", "cuda-pathfinder", "nvidia-cuda-nvrtc", "torch")}
        | {"numpy": np.__version__},
        "nvrtc": _compiler.nvrtc_version_str(),
        "kernel_sources": {"folder": str(_compiler.source_dir()), "hash": _compiler.source_hash()},
        "kernels": len(_plan.all_kernel_names()),
        "packaged": {
            "folder": str(art.folder),
            "usable": art.usable,
            "problem": None if art.usable else art.why_not,
            "nvrtc": m.get("nvrtc"),
            "kernels": len(m.get("kernels", [])) if isinstance(m.get("kernels"), list) else 0,
            "build_seconds": built,
            "files": files,
        },
        "cache": {
            "folder": str(cinfo.folder),
            "problem": cinfo.problem,
            "entries": cinfo.entries,
            "bytes": cinfo.bytes,
        },
        "switches": switches | {"problem": switch_problem},
        "driver": {"cuda_version": None, "problem": None},
        "devices": [],
        "archs": {},
    }

    def source(a: str, ver: int | None, name: str | None = None) -> str:
        if switch_problem:
            return f"cannot tell: {switch_problem}"
        return _loader.describe_source(a, ver, name)

    ver = None
    archs = [arch] if arch else []
    try:
        from . import _driver

        ver = _driver.driver_version()
        count = _driver.device_count()
        info["driver"]["cuda_version"] = ver
        for i in range(count):
            dev = _driver.device(i)
            info["devices"].append(
                {
                    "ordinal": i,
                    "name": dev.name,
                    "arch": dev.arch,
                    "sm_count": dev.sm_count,
                    "kernels_from": source(dev.arch, ver),
                }
            )
            archs.append(dev.arch)
    except Exception as e:  # no driver or no GPU: say so, and describe an architecture instead
        info["driver"]["problem"] = _first_line(e)
        archs = archs or ["sm_90"]
    for a in dict.fromkeys(archs):
        entry: dict[str, Any] = {"kernels_from": source(a, ver)}
        if list_kernels:
            entry["kernels"] = {k: source(a, ver, k) for k in _plan.all_kernel_names()}
        info["archs"][a] = entry
    return info


def _cuda(v: object) -> str:
    return "?" if v is None else f"CUDA {_loader._cuda_str(v)}"


def info(list_kernels: bool = False, arch: str | None = None, as_json: bool = False) -> int:
    d = collect_info(list_kernels, arch)
    if as_json:
        print(json.dumps(d, indent=1, sort_keys=True))
        return 0
    pk = d["packages"]
    print(f"drvsoftmax {d['drvsoftmax']} (Python {d['python']})")
    print(
        f"cuda-bindings {pk['cuda-bindings'] or 'not installed'}, cuda-pathfinder {pk['cuda-pathfinder'] or 'not installed'}, "
        f"numpy {pk['numpy']}, torch {pk['torch'] or 'not installed'}"
    )
    print(f"NVRTC: {d['nvrtc']}")
    print(f"kernel sources: {d['kernel_sources']['folder']} (hash {d['kernel_sources']['hash'][:16]})")
    print(f"kernels: {d['kernels']}")
    p = d["packaged"]
    if p["usable"]:
        built = f", built in {p['build_seconds']:.0f} s" if isinstance(p["build_seconds"], (int, float)) else ""
        print(f"packaged artifacts: {p['folder']} (NVRTC {p['nvrtc']}, {p['kernels']} kernels{built})")
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for f in p["files"]:
            if f["problem"] is None:
                groups.setdefault((f["kind"], f["arch"]), []).append(f)
        for (kind, a), fs in sorted(groups.items()):
            extra = f", needs a {_cuda(fs[0]['min_cuda'])} driver" if kind == "ptx" else ""
            size = sum(f["size"] or 0 for f in fs)
            print(f"  {a}: {len(fs)} {kind} file(s), {sum(f['kernels'] for f in fs)} kernels, {size:,} bytes{extra}")
        for f in p["files"]:
            if f["problem"] is not None:
                print(f"  {f['name']}: not used: {f['problem']}")
    else:
        print(f"packaged artifacts: none usable: {p['problem']}")
    c = d["cache"]
    state = f"not used: {c['problem']}" if c["problem"] else f"{c['entries']} entries, {c['bytes']:,} bytes"
    print(f"run-time compile cache: {c['folder']} ({state})")
    sw = d["switches"]
    if sw["problem"]:
        print(f"switches: {sw['problem']}")
    else:
        on = [n for n in (_loader.NO_JIT, _loader.FORCE_JIT) if sw[n]]
        print(f"switches set: {', '.join(on) if on else 'none'}")
    drv = d["driver"]
    if drv["problem"]:
        print(f"CUDA driver: not available ({drv['problem']})")
    else:
        print(f"CUDA driver: {_cuda(drv['cuda_version'])} ({drv['cuda_version']}); {len(d['devices'])} device(s)")
    for dev in d["devices"]:
        print(
            f"  device {dev['ordinal']}: {dev['name']}, {dev['arch']}, {dev['sm_count']} SMs; "
            f"kernels load from: {dev['kernels_from']}"
        )
    device_archs = {dev["arch"] for dev in d["devices"]}
    for a, entry in d["archs"].items():
        if a not in device_archs:
            print(f"on an {a} GPU, kernels would load from: {entry['kernels_from']}")
        if "kernels" in entry:
            print(f"kernels for {a}:")
            for name, src in entry["kernels"].items():
                print(f"  {name}: {src}")
    return 0


def cache_command(action: str, as_json: bool = False) -> int:
    if action == "clear":
        n, freed = _compiler.cache_clear()
        print(f"removed {n} file(s), {freed:,} bytes, from {_compiler.cache_dir()}")
        return 0
    c = _compiler.cache_info()
    d = {
        "folder": str(c.folder),
        "problem": c.problem,
        "entries": c.entries,
        "files": c.files,
        "bytes": c.bytes,
        "archs": c.archs,
    }
    if as_json:
        print(json.dumps(d, indent=1, sort_keys=True))
        return 0
    print(f"run-time compile cache: {c.folder}")
    if c.problem:
        print(f"  not used: {c.problem}")
    print(f"  {c.entries} entries ({c.files} files), {c.bytes:,} bytes")
    for a, n in c.archs.items():
        print(f"  {a}: {n} entries")
    return 0


def _packaged_cubin_serves(name: str, arch: str) -> bool:
    return any(s.source == "packaged cubin" for s in _loader.plan(name, arch, None))


def precompile(archs: list[str] | None, jobs: int | None, everything: bool, kernels: list[str] | None = None) -> int:
    """Compile into the run-time cache what the packaged cubins do not cover."""
    import concurrent.futures
    import multiprocessing

    if not archs:
        try:
            from . import _driver

            archs = sorted({_driver.device(i).arch for i in range(_driver.device_count())})
        except Exception as e:
            archs = []
            why = _first_line(e)
        else:
            why = "the CUDA driver reports no device"
        if not archs:
            print(f"precompile: no GPU here ({why}); name the architectures, e.g. --arch sm_90", file=sys.stderr)
            return 2
    for a in archs:
        if _compiler.parse_arch(a)[0] != "sm":
            raise _errors.arg_value_error("--arch", "an sm_XY architecture", repr(a))
    problem = _compiler.cache_problem()
    if problem:
        print(f"precompile: the cache cannot be used: {problem}", file=sys.stderr)
        return 1
    known = _plan.all_kernel_names()
    for k in kernels or []:
        if k not in known:
            raise _errors.arg_value_error("--kernels", "kernel names that `info --kernels` lists", repr(k))
    work = []
    for a in archs:
        wanted = list(kernels) if kernels else known
        names = wanted if everything else [n for n in wanted if not _packaged_cubin_serves(n, a)]
        print(
            f"{a}: {len(names)} kernel(s) to compile or find in the cache, {len(wanted) - len(names)} in packaged cubins"
        )
        work += [(a, n) for n in names]
    t = time.perf_counter()
    hits = []
    if work:
        workers = max(1, min(len(work), jobs or os.cpu_count() or 1))
        ctx = multiprocessing.get_context("spawn")  # the parent may hold a CUDA context
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            hits = [hit for _, hit, _ in pool.map(_compiler.precompile_one, *zip(*work))]
    compiled, cached = hits.count(False), hits.count(True)
    print(
        f"precompile: {compiled} compiled, {cached} already cached, into {_compiler.cache_dir()} "
        f"in {time.perf_counter() - t:.0f} s"
    )
    return 0


def demo(shape: tuple[int, int, int, int] = (4, 12, 512, 512), iters: int = 50) -> int:
    scale = 1.0 / 8.0
    try:
        import torch
    except ImportError:
        return _cpu_demo("PyTorch is not installed", scale)
    if not torch.cuda.is_available():
        return _cpu_demo("no CUDA GPU is visible", scale)
    return run_demo(torch, torch.device("cuda"), shape, iters)


def _cpu_demo(why: str, scale: float) -> int:
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


def run_demo(
    torch: ModuleType,
    dev: _torch.device,
    shape: tuple[int, int, int, int] = (4, 12, 512, 512),
    iters: int = 50,
    scale: float = 1.0 / 8.0,
) -> int:
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

    def eager() -> Any:
        causal = torch.ones(shape[2], shape[3], dtype=torch.bool, device=dev).triu(1)
        return torch.softmax((x * scale).masked_fill(mask | causal, float("-inf")), -1)

    def ours() -> Any:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drvsoftmax", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"drvsoftmax {drvsoftmax.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run an attention-shaped input through the fused op and time it")
    pi = sub.add_parser("info", help="versions, devices, where kernels load from, cache folder")
    pi.add_argument("--kernels", action="store_true", help="list every kernel and where it would load from")
    pi.add_argument("--arch", default=None, help="also for this architecture (sm_XY), e.g. without a GPU")
    pi.add_argument("--json", action="store_true", help="machine-readable output (keys documented in README.md)")
    pc = sub.add_parser("cache", help="the run-time compile cache: info or clear")
    pc.add_argument("action", choices=["info", "clear"])
    pc.add_argument("--json", action="store_true", help="machine-readable output (cache info)")
    pp = sub.add_parser("precompile", help="fill the run-time cache for GPUs no packaged cubin covers")
    pp.add_argument("--arch", nargs="+", default=None, help="architectures (sm_XY); default: this machine's GPUs")
    pp.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    pp.add_argument("--all", action="store_true", help="also the kernels packaged cubins serve")
    pp.add_argument("--kernels", nargs="+", default=None, help="only these kernels (names as `info --kernels` lists)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "demo":
            return demo()
        if args.cmd == "info":
            if args.arch is not None:
                _compiler.parse_arch(args.arch)
            return info(args.kernels, args.arch, args.json)
        if args.cmd == "cache":
            return cache_command(args.action, args.json)
        return precompile(args.arch, args.jobs, args.all, args.kernels)
    except _errors.DrvSoftmaxError as e:
        print(f"python -m drvsoftmax {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
