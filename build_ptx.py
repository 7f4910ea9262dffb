#!/usr/bin/env python3
"""Precompile every drvsoftmax kernel into artifacts that ship inside the package.

    python build_ptx.py [--arch sm_90 ...] [--ptx compute_75 ...] [--out DIR] [-v] [--jobs N]

Writes one cubin per architecture (all kernels in it), PTX for forward compatibility and
a manifest.json: kernel names and their symbols, each file's architecture, size and
sha256, the hash of the sources and options, the NVRTC version, and for PTX the oldest
driver CUDA version that can JIT it.  Runs on a machine without a GPU.  The same sources
and NVRTC give a byte-identical manifest (no dates, sorted keys).

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

from drvsoftmax import _compiler, _plan  # noqa: E402

DEFAULT_PTX = ("compute_75",)  # kernels use no newer features: one PTX serves every arch >= 7.5
MANIFEST_FORMAT = 1


def ptx_min_cuda(ptx: bytes) -> tuple[str, int]:
    """(PTX ISA version, minimal driver CUDA version as cuDriverGetVersion reports it)."""
    from cuda.bindings import utils

    text = ptx.decode(errors="replace")
    ver = utils.get_ptx_ver(text)
    need = utils.get_minimal_required_cuda_ver_from_ptx_ver(ver)
    return str(ver), int(need)


def _build_one(arch: str, names: list[str] | None):
    t = time.perf_counter()
    img = _compiler.compile_kernels(arch, names)
    return arch, img.image, img.lowered, img.nvrtc, time.perf_counter() - t


def build(archs, ptx_archs, out: Path, names=None, jobs=None, verbose=False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    targets = list(archs) + list(ptx_archs)
    for t in targets:
        _compiler.parse_arch(t)
    jobs = jobs or max(1, min(len(targets), os.cpu_count() or 1))
    files = {}
    nvrtc = None
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        for arch, image, lowered, ver, secs in ex.map(_build_one, targets, [names] * len(targets)):
            nvrtc = ver
            kind = "cubin" if arch.startswith("sm_") else "ptx"
            fname = f"drvsoftmax_{arch}.{kind}"
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
                    f", PTX ISA {entry['ptx_version']}, needs CUDA driver >= {entry['min_cuda']}"
                    if kind == "ptx"
                    else ""
                )
                print(f"  {fname}: {len(image):,} bytes, {len(lowered)} kernels, {secs:.1f} s{extra}")
    manifest = {
        "format": MANIFEST_FORMAT,
        "source_hash": _compiler.source_hash(),
        "options": list(_compiler.BASE_OPTIONS),
        "nvrtc": nvrtc,
        "kernels": list(names) if names is not None else _plan.all_kernel_names(),
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=list(_compiler.ARCHS), help="cubin architectures (sm_XY)")
    p.add_argument("--ptx", nargs="*", default=list(DEFAULT_PTX), help="PTX architectures (compute_XY); none to skip")
    p.add_argument("--out", type=Path, default=HERE / "drvsoftmax" / "_prebuilt", help="output folder")
    p.add_argument("--kernels", nargs="*", default=None, help="only these kernel name expressions (for tests)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    p.add_argument("-v", "--verbose", action="store_true", help="list what was built, with sizes")
    a = p.parse_args(argv)
    t = time.perf_counter()
    m = build(a.arch, a.ptx, a.out, a.kernels, a.jobs, a.verbose)
    total = sum(e["size"] for e in m["files"].values())
    print(
        f"build_ptx: {len(m['files'])} files, {len(m['kernels'])} kernels each, {total:,} bytes, "
        f"NVRTC {m['nvrtc']}, into {a.out} in {time.perf_counter() - t:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
