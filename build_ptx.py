#!/usr/bin/env python3
"""Precompile the packaged drvsoftmax kernels into artifacts that ship inside the package.

    python build_ptx.py [--arch sm_90 ... | native | all] [--ptx compute_75 ...] [--out DIR]
                        [--group N] [--jobs N] [-v]

Builds the kernels of ``_plan.packaged_kernel_names()`` (the others compile at run time):
cubins per architecture in groups of ``--group`` kernels, PTX one kernel per module (so
that a driver JIT-compiles only the kernel a call needs, in about a second), a
manifest.json and drvsoftmax.h.  The manifest holds each file's kind, architecture, size,
sha256 and kernels with their symbols, the hash of the sources and options, the NVRTC
version, for PTX the oldest driver CUDA version that can JIT it, and a ``symbols`` table
for programs in other languages: each kernel's mangled symbol, parameter signature and
files.  drvsoftmax.h is the C header of the parameter structs and the launch-shape rule
(drvsoftmax/_capi.py; the same file as drvsoftmax/include/drvsoftmax.h).  Runs on a
machine without a GPU.  The same sources and NVRTC give a byte-identical manifest (no
dates, sorted keys); how long the build took goes to build.json beside it.

``--arch native`` builds cubins for the GPUs of this machine only (none without a GPU:
PTX and run-time compiles then serve every device); ``all`` (the default) is every
architecture of ``drvsoftmax._compiler.ARCHS``.

PTX is only useful when drivers older than the NVRTC can JIT it: NVRTC 13.0 writes PTX
ISA 9.0, which CUDA 13.0 drivers accept; NVRTC 13.5 writes 9.5, which they reject.  The
wheel build pins NVRTC 13.0 (pyproject.toml) for that reason; the manifest records what
each PTX file needs, and the loader never hands a driver PTX it cannot take.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from drvsoftmax import _capi, _compiler, _params, _plan  # noqa: E402

DEFAULT_PTX = ("compute_75",)  # kernels use no newer features: one PTX serves every arch >= 7.5
DEFAULT_GROUP = 16  # kernels per cubin: spreads one architecture over many cores
MANIFEST_FORMAT = 2


def ptx_min_cuda(ptx: bytes) -> tuple[str, int]:
    """(PTX ISA version, minimal driver CUDA version as cuDriverGetVersion reports it)."""
    from cuda.bindings import utils

    text = ptx.decode(errors="replace")
    ver = utils.get_ptx_ver(text)
    need = utils.get_minimal_required_cuda_ver_from_ptx_ver(ver)
    return str(ver), int(need)


def native_archs() -> list[str]:
    """sm_XY of every GPU the CUDA driver sees here (none without a driver or GPU)."""
    try:
        from cuda.bindings import driver

        from drvsoftmax._errors import check

        check(driver.cuInit(0), "cuInit")
        A = driver.CUdevice_attribute
        out = set()
        for i in range(int(check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))):
            dev = check(driver.cuDeviceGet(i), "cuDeviceGet")
            major = check(driver.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
            minor = check(driver.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
            out.add(int(major) * 10 + int(minor))
    except Exception as e:  # no driver, no GPU: nothing native to build for
        print(f"build_ptx: no GPU found for --arch native ({type(e).__name__}); building no cubins")
        return []
    return [f"sm_{cc}" for cc in sorted(out)]


def resolve_archs(archs: list[str]) -> list[str]:
    out: list[str] = []
    for a in archs:
        for b in native_archs() if a == "native" else _compiler.ARCHS if a == "all" else [a]:
            _compiler.parse_arch(b)
            if b not in out:
                out.append(b)
    return out


def _build_one(job: tuple[str, int, list[str]]):
    arch, index, names = job
    t = time.perf_counter()
    img = _compiler.compile_kernels(arch, names)
    return arch, index, img.image, img.lowered, img.nvrtc, time.perf_counter() - t


def _groups(names: list[str], size: int) -> list[list[str]]:
    return [names[i : i + size] for i in range(0, len(names), size)]


def symbol_table(names: list[str], files: dict) -> dict:
    """For C and other non-Python programs: each kernel's mangled symbol, its parameter
    signature, and the files holding it (cubins by sm_XY, PTX by compute_XY)."""
    table = {}
    for n in names:
        entry: dict = {"params": _params.kernel_signature(n), "cubins": {}, "ptx": {}}
        symbols = set()
        for fname, e in sorted(files.items()):
            if n in e["lowered"]:
                symbols.add(e["lowered"][n])
                entry["cubins" if e["kind"] == "cubin" else "ptx"][e["arch"]] = fname
        if len(symbols) > 1:
            raise SystemExit(f"build_ptx: {n} has several symbols: {sorted(symbols)}")
        if symbols:
            entry["symbol"] = symbols.pop()
        table[n] = entry
    return table


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def build(archs, ptx_archs, out: Path, names=None, jobs=None, verbose=False, group=DEFAULT_GROUP) -> dict:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("drvsoftmax_*.cubin")) + list(out.glob("drvsoftmax_*.ptx")):
        old.unlink()  # a rebuild into the same folder leaves no file of another layout behind
    names = list(names) if names is not None else _plan.packaged_kernel_names()
    for t in list(archs) + list(ptx_archs):
        if _compiler.parse_arch(t)[0] != ("sm" if t in archs else "compute"):
            raise SystemExit(f"build_ptx: {t}: --arch takes sm_XY, --ptx takes compute_XY")
    work = [(a, i, g) for a in archs for i, g in enumerate(_groups(names, group))]
    work += [(a, i, g) for a in ptx_archs for i, g in enumerate(_groups(names, 1))]
    jobs = max(1, min(len(work) or 1, jobs or default_jobs()))
    files = {}
    nvrtc = _compiler.nvrtc_version_str()
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        for arch, index, image, lowered, ver, secs in ex.map(_build_one, work):
            nvrtc = ver
            kind = "cubin" if arch.startswith("sm_") else "ptx"
            fname = f"drvsoftmax_{arch}_{index:03d}.{kind}"
            if kind == "ptx":
                image = image.rstrip(b"\0")
            (out / fname).write_bytes(image)
            entry = {
                "kind": kind,
                "arch": arch,
                "size": len(image),
                "sha256": hashlib.sha256(image).hexdigest(),
                "lowered": lowered,
            }
            if kind == "ptx":
                entry["ptx_version"], entry["min_cuda"] = ptx_min_cuda(image)
            files[fname] = entry
            if verbose:
                extra = (
                    f", PTX ISA {entry['ptx_version']}, needs a CUDA {entry['min_cuda']} driver"
                    if kind == "ptx"
                    else ""
                )
                print(f"  {fname}: {len(image):,} bytes, {len(lowered)} kernels, {secs:.1f} s{extra}", flush=True)
    manifest = {
        "format": MANIFEST_FORMAT,
        "symbols": symbol_table(names, files),
        "header": _capi.HEADER_NAME,
        "source_hash": _compiler.source_hash(),
        "options": list(_compiler.BASE_OPTIONS),
        "nvrtc": nvrtc,
        "kernels": names,
        "files": files,
    }
    (out / _capi.HEADER_NAME).write_text(_capi.c_api_header())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    info = {"seconds": round(time.perf_counter() - t0, 1), "jobs": jobs, "archs": list(archs), "ptx": list(ptx_archs)}
    (out / "build.json").write_text(json.dumps(info, sort_keys=True) + "\n")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="*", default=["all"], help="cubin architectures: sm_XY, native or all (default)")
    p.add_argument("--ptx", nargs="*", default=list(DEFAULT_PTX), help="PTX architectures (compute_XY); none to skip")
    p.add_argument("--out", type=Path, default=HERE / "drvsoftmax" / "_prebuilt", help="output folder")
    p.add_argument("--kernels", nargs="*", default=None, help="only these kernel name expressions (for tests)")
    p.add_argument("--group", type=int, default=DEFAULT_GROUP, help="kernels per cubin (default %(default)s)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    p.add_argument("-v", "--verbose", action="store_true", help="list what was built, with sizes")
    a = p.parse_args(argv)
    if a.group < 1:
        p.error(f"--group must be at least 1, got {a.group}")
    archs = resolve_archs(a.arch)
    t = time.perf_counter()
    m = build(archs, a.ptx, a.out, a.kernels, a.jobs, a.verbose, a.group)
    total = sum(e["size"] for e in m["files"].values())
    print(
        f"build_ptx: {len(m['kernels'])} kernels for {' '.join(archs + list(a.ptx)) or 'nothing'}: "
        f"{len(m['files'])} files, {total:,} bytes, NVRTC {m['nvrtc']}, into {a.out} "
        f"in {time.perf_counter() - t:.0f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
