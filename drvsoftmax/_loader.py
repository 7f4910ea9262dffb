"""Kernel images for a device: the fallback chain.

For each kernel on each device, in order:
  1. the packaged cubin for the device's architecture (``drvsoftmax/_prebuilt``);
  2. packaged PTX for an architecture the device can run, if the driver's CUDA version
     is at least the one that PTX needs (PTX from a newer NVRTC than the driver is
     rejected with CUDA_ERROR_UNSUPPORTED_PTX_VERSION, so we never try it);
  3. a cubin compiled now by NVRTC for the exact architecture, cached on disk;
  4. KernelUnavailableError listing every step and why it failed.

Packaged artifacts whose source hash differs from the installed ``cuda_src`` are never
used; that is reported once per process.

Environment switches:
  DRVSOFTMAX_CACHE_DIR   where run-time compiled cubins are cached
  DRVSOFTMAX_NO_JIT=1    never compile at run time (steps 1-2 only)
  DRVSOFTMAX_FORCE_JIT=1 ignore packaged artifacts (step 3 only)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from . import _compiler
from ._errors import DrvSoftmaxError, KernelUnavailableError, check

ARTIFACT_DIR = Path(__file__).resolve().parent / "_prebuilt"
MANIFEST = "manifest.json"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def jit_forbidden() -> bool:
    return _flag("DRVSOFTMAX_NO_JIT")


def jit_forced() -> bool:
    return _flag("DRVSOFTMAX_FORCE_JIT")


@dataclass
class Artifacts:
    """The packaged artifacts, validated against the installed sources."""

    folder: Path
    manifest: dict | None = None
    usable: bool = False
    why_not: str = ""
    files: dict = field(default_factory=dict)  # file name -> entry

    def cubin_for(self, arch: str):
        for fname, e in self.files.items():
            if e["kind"] == "cubin" and e["arch"] == arch:
                return fname, e
        return None

    def ptx_candidates(self, cc: int):
        """PTX entries the device can JIT (compute_XY with XY <= cc), newest first."""
        out = []
        for fname, e in self.files.items():
            if e["kind"] == "ptx" and _compiler.parse_arch(e["arch"])[1] <= cc:
                out.append((fname, e))
        out.sort(key=lambda fe: -_compiler.parse_arch(fe[1]["arch"])[1])
        return out


_warned_stale = False


def _warn_stale_once(msg: str) -> None:
    global _warned_stale
    if not _warned_stale:
        _warned_stale = True
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=4)
def _read_artifacts(folder: str) -> Artifacts:
    path = Path(folder)
    art = Artifacts(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        art.why_not = f"no packaged artifacts ({mpath} not found)"
        return art
    try:
        art.manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        art.why_not = f"unreadable manifest {mpath}: {e}"
        return art
    want = _compiler.source_hash()
    have = art.manifest.get("source_hash")
    if have != want:
        art.why_not = (
            f"packaged artifacts were built from other kernel sources (manifest source hash "
            f"{str(have)[:12]}..., installed cuda_src {want[:12]}...); they are ignored"
        )
        return art
    art.files = dict(art.manifest.get("files", {}))
    art.usable = True
    return art


def artifacts() -> Artifacts:
    art = _read_artifacts(str(ARTIFACT_DIR))
    if not art.usable and art.manifest is not None:
        _warn_stale_once("drvsoftmax: " + art.why_not)
    return art


def _verified_bytes(art: Artifacts, fname: str, entry: dict) -> bytes:
    data = (art.folder / fname).read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise DrvSoftmaxError(f"{fname}: sha256 does not match the manifest")
    return data


# ----------------------------------------------------------------------------------
# Loaded libraries: one per (image identity), shared by every device that uses it.

_lib_lock = threading.Lock()
_libraries: dict[str, object] = {}


def _load_library(key: str, image: bytes):
    from cuda.bindings import driver

    with _lib_lock:
        lib = _libraries.get(key)
        if lib is None:
            if not image.endswith(b"\0") and image.lstrip().startswith(b"//"):
                image = image + b"\0"  # PTX text must be NUL-terminated
            lib = check(driver.cuLibraryLoadData(image, None, None, 0, None, None, 0), "cuLibraryLoadData")
            _libraries[key] = lib
        return lib


def _get_kernel(lib, lowered: str):
    from cuda.bindings import driver

    return check(driver.cuLibraryGetKernel(lib, lowered.encode()), "cuLibraryGetKernel")


def ptx_allowed(entry: dict, driver_version: int) -> bool:
    return int(entry.get("min_cuda", 1 << 30)) <= driver_version


def find_kernel(name: str, arch: str, driver_version: int):
    """(CUkernel, origin) for kernel `name` on an `arch` device, walking the chain."""
    cc = _compiler.parse_arch(arch)[1]
    tried: list[str] = []
    if jit_forced():
        tried.append("packaged artifacts: skipped (DRVSOFTMAX_FORCE_JIT is set)")
    else:
        art = artifacts()
        if not art.usable:
            tried.append(art.why_not)
        else:
            hit = art.cubin_for(arch)
            if hit is None:
                tried.append(f"packaged cubin: none for {arch}")
            else:
                fname, e = hit
                try:
                    lib = _load_library("pkg:" + fname, _verified_bytes(art, fname, e))
                    return _get_kernel(lib, e["lowered"][name]), f"packaged cubin {fname}"
                except (OSError, KeyError, DrvSoftmaxError) as err:
                    tried.append(f"packaged cubin {fname}: {err}")
            cands = art.ptx_candidates(cc)
            if not cands:
                tried.append(f"packaged PTX: none for compute capability <= {cc}")
            for fname, e in cands:
                if not ptx_allowed(e, driver_version):
                    tried.append(
                        f"packaged PTX {fname}: needs a CUDA {_cuda_str(e.get('min_cuda'))} driver, "
                        f"this one is CUDA {_cuda_str(driver_version)}"
                    )
                    continue
                try:
                    lib = _load_library("pkg:" + fname, _verified_bytes(art, fname, e))
                    return _get_kernel(lib, e["lowered"][name]), f"packaged PTX {fname} (JIT by the driver)"
                except (OSError, KeyError, DrvSoftmaxError) as err:
                    tried.append(f"packaged PTX {fname}: {err}")
    if jit_forbidden():
        tried.append("NVRTC at run time: forbidden (DRVSOFTMAX_NO_JIT is set)")
    else:
        try:
            img, cached = _compiler.cached_compile(arch, [name])
            lib = _load_library(f"jit:{arch}:{name}:{hashlib.sha256(img.image).hexdigest()}", img.image)
            how = "cached" if cached else "compiled now"
            return _get_kernel(lib, img.lowered[name]), f"NVRTC {img.nvrtc} cubin for {arch} ({how})"
        except (ImportError, OSError, RuntimeError, DrvSoftmaxError) as err:
            tried.append(f"NVRTC at run time for {arch}: {type(err).__name__}: {err}")
    raise KernelUnavailableError(
        f"no image of kernel {name} for {arch} could be loaded; tried:\n  - " + "\n  - ".join(tried)
    )


def describe_source(arch: str, driver_version: int | None, name: str | None = None) -> str:
    """Where kernels for `arch` (or the kernel `name`) would come from, loading nothing."""
    steps = []
    if not jit_forced():
        art = artifacts()
        if art.usable:
            hit = art.cubin_for(arch)
            if hit and (name is None or name in hit[1]["lowered"]):
                return f"packaged cubin {hit[0]}"
            steps.append(f"no packaged cubin for {arch}" + ("" if hit is None else f" holding {name}"))
            for fname, e in art.ptx_candidates(_compiler.parse_arch(arch)[1]):
                if name is not None and name not in e["lowered"]:
                    continue
                if driver_version is not None and ptx_allowed(e, driver_version):
                    return f"packaged PTX {fname} (JIT by the driver); " + "; ".join(steps)
                steps.append(f"{fname} needs CUDA {_cuda_str(e.get('min_cuda'))}")
        else:
            steps.append(art.why_not)
    else:
        steps.append("DRVSOFTMAX_FORCE_JIT is set")
    if jit_forbidden():
        return "nothing: " + "; ".join(steps + ["DRVSOFTMAX_NO_JIT is set"])
    where = f"cached in {_compiler.cache_dir()}"
    if name is not None:
        try:
            cached = _compiler.cache_lookup(arch, [name]) is not None
        except Exception:  # no NVRTC to name the cache entry: it would compile (and fail) then
            cached = False
        where = "from the disk cache" if cached else "compiled on first use"
    return f"NVRTC {_compiler.nvrtc_version_str()} at run time, {where}; " + "; ".join(steps)


def _cuda_str(v) -> str:
    try:
        v = int(v)
    except (TypeError, ValueError):
        return "?"
    return f"{v // 1000}.{(v % 1000) // 10}"


__all__ = ["find_kernel", "describe_source", "artifacts"]
