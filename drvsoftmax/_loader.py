"""Kernel images for a device: the fallback chain.

For each kernel on each device, in order:
  1. the packaged cubin for the device's architecture (``drvsoftmax/_prebuilt``);
  2. the packaged cubin of the newest architecture of the same major with a lower minor
     (a cubin for sm_XY runs on sm_XZ when Z >= Y; never across majors, and an
     ``a``-suffixed cubin only on exactly its architecture);
  3. a cubin compiled earlier by NVRTC for this architecture, from the disk cache
     (``python -m drvsoftmax precompile`` fills it);
  4. packaged PTX (one small module per kernel) for an architecture the device can run,
     if the driver's CUDA version is at least the one that PTX needs (PTX from a newer
     NVRTC than the driver is rejected with CUDA_ERROR_UNSUPPORTED_PTX_VERSION, so we
     never try it);
  5. a cubin compiled now by NVRTC for the exact architecture, cached on disk;
  6. KernelUnavailableError listing every step and why it failed.

Packaged artifacts whose source hash differs from the installed ``cuda_src``, a
malformed manifest, and files missing or failing their sha256 are never used; the
first two are reported once per process.  Manifest file names are plain names inside the
artifact folder; symbolic links are not followed.

Environment switches (values ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/
``off``/empty, any case; anything else is an error naming the variable):
  DRVSOFTMAX_CACHE_DIR   where run-time compiled cubins are cached (``~`` expanded)
  DRVSOFTMAX_NO_JIT=1    never compile at run time (cached run-time cubins still load)
  DRVSOFTMAX_FORCE_JIT=1 ignore packaged artifacts (cache and NVRTC only)
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from . import _compiler
from ._errors import DrvSoftmaxError, KernelUnavailableError, arg_value_error, check
from ._log import log

ARTIFACT_DIR = Path(__file__).resolve().parent / "_prebuilt"
MANIFEST = "manifest.json"
MANIFEST_FORMATS = (1, 2)

NO_JIT = "DRVSOFTMAX_NO_JIT"
FORCE_JIT = "DRVSOFTMAX_FORCE_JIT"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    """The boolean environment switch `name`; an undocumented value is an error."""
    raw = os.environ.get(name, "")
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise arg_value_error(
        f"the environment variable {name}", "one of 1, true, yes, on, 0, false, no, off or empty", repr(raw)
    )


_warned_both = False


def switches() -> tuple[bool, bool]:
    """(jit forbidden, jit forced), checked; warns once when both are set."""
    global _warned_both
    no_jit, force_jit = _flag(NO_JIT), _flag(FORCE_JIT)
    if no_jit and force_jit and not _warned_both:
        _warned_both = True
        msg = (
            f"drvsoftmax: {NO_JIT} and {FORCE_JIT} are both set: packaged kernels are ignored and "
            "nothing may compile, so only cubins already in the run-time cache can load"
        )
        log.warning("%s", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return no_jit, force_jit


def jit_forbidden() -> bool:
    return switches()[0]


def jit_forced() -> bool:
    return switches()[1]


# ----------------------------------------------------------------------------------
# The packaged artifacts.


class _EntryRequired(TypedDict):
    kind: str  # "cubin" or "ptx"
    arch: str  # sm_XY (cubin) or compute_XY (PTX)
    sha256: str
    lowered: dict[str, str]  # kernel name expression -> symbol


class ManifestEntry(_EntryRequired, total=False):
    """One file of the manifest (written by build_ptx.py).  `_entry_problem` checks kind,
    arch, sha256, lowered and, for PTX, min_cuda before an entry is used."""

    size: int
    ptx_version: str
    min_cuda: float  # PTX only: the oldest driver CUDA version (1000 * major + 10 * minor) that JITs it


@dataclass
class Artifacts:
    """The packaged artifacts, validated against the installed sources."""

    folder: Path
    manifest: dict[str, Any] | None = None
    usable: bool = False
    why_not: str = ""
    files: dict[str, ManifestEntry] = field(default_factory=dict)  # file name -> entry (only well-formed entries)
    rejected: dict[str, str] = field(default_factory=dict)  # file name -> why the entry is unusable

    def cubins_for(self, arch: str, name: str) -> list[tuple[str, ManifestEntry, str]]:
        """Cubins holding `name` that run on an `arch` device, best first:
        (file, entry, 'exact' or 'same major')."""
        _, cc, _ = _compiler.arch_parts(arch)
        ranked: list[tuple[int, int, str, ManifestEntry, str]] = []
        for fname, e in self.files.items():
            if e["kind"] != "cubin" or name not in e["lowered"]:
                continue
            _, ecc, suffix = _compiler.arch_parts(e["arch"])
            if ecc == cc:
                ranked.append((0, 1 if suffix else 0, fname, e, "exact"))
            elif not suffix and ecc // 10 == cc // 10 and ecc < cc:
                ranked.append((1, cc - ecc, fname, e, "same major"))
        ranked.sort(key=lambda r: r[:3])
        return [(f, e, how) for _, _, f, e, how in ranked]

    def ptx_for(self, arch: str, name: str) -> list[tuple[str, ManifestEntry]]:
        """PTX holding `name` that an `arch` device can JIT (compute_XY, XY <= cc), newest first."""
        _, cc, _ = _compiler.arch_parts(arch)
        out = []
        for fname, e in self.files.items():
            if e["kind"] != "ptx" or name not in e["lowered"]:
                continue
            _, ecc, suffix = _compiler.arch_parts(e["arch"])
            if ecc == cc or (not suffix and ecc < cc):
                out.append((fname, e))
        out.sort(key=lambda fe: (-_compiler.arch_parts(fe[1]["arch"])[1], fe[0]))
        return out


_warned_stale = False


def _warn_stale_once(msg: str) -> None:
    global _warned_stale
    if not _warned_stale:
        _warned_stale = True
        log.warning("%s", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _entry_problem(fname: object, e: object) -> str | None:
    """Why a manifest file entry cannot be used, or None."""
    if not isinstance(fname, str) or not fname or fname in (".", "..") or fname != os.path.basename(fname):
        return "not a plain file name inside the artifact folder"
    if "/" in fname or "\\" in fname or "\0" in fname:
        return "not a plain file name inside the artifact folder"
    if not isinstance(e, dict):
        return f"entry is {type(e).__name__}, not an object"
    kind = e.get("kind")
    if kind not in ("cubin", "ptx"):
        return f"kind is {kind!r}, not 'cubin' or 'ptx'"
    try:
        akind, _, _ = _compiler.arch_parts(e.get("arch"))
    except (DrvSoftmaxError, AttributeError):
        return f"arch {e.get('arch')!r} is not sm_XY or compute_XY"
    if (akind == "sm") != (kind == "cubin"):
        return f"a {kind} for {e.get('arch')}"
    sha = e.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        return "no sha256"
    lowered = e.get("lowered")
    if not isinstance(lowered, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in lowered.items()):
        return "lowered is not a map of kernel names to symbols"
    if kind == "ptx":
        mc = e.get("min_cuda")
        if isinstance(mc, bool) or not isinstance(mc, (int, float)) or not math.isfinite(mc):
            return f"min_cuda {mc!r} is not a number"
    return None


@functools.lru_cache(maxsize=4)
def _read_artifacts(folder: str) -> Artifacts:
    path = Path(folder)
    art = Artifacts(path)
    mpath = path / MANIFEST
    raw = _read_plain_file(mpath)
    if raw is None:
        art.why_not = f"no packaged artifacts ({mpath} not found)"
        return art
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        art.why_not = f"unreadable manifest {mpath}: {e}"
        return art
    if not isinstance(manifest, dict):
        art.why_not = f"malformed manifest {mpath}: a {type(manifest).__name__}, not an object"
        return art
    art.manifest = manifest
    if manifest.get("format") not in MANIFEST_FORMATS:
        art.why_not = f"manifest {mpath} has format {manifest.get('format')!r}, this version reads {MANIFEST_FORMATS}"
        return art
    want = _compiler.source_hash()
    have = manifest.get("source_hash")
    if have != want:
        art.why_not = (
            f"packaged artifacts were built from other kernel sources (manifest source hash "
            f"{str(have)[:12]}..., installed cuda_src {want[:12]}...); they are ignored"
        )
        return art
    files = manifest.get("files")
    if not isinstance(files, dict):
        art.why_not = f"malformed manifest {mpath}: 'files' is {type(files).__name__}, not an object"
        return art
    for fname, entry in files.items():
        why = _entry_problem(fname, entry)
        if why is None:
            art.files[fname] = entry
        else:
            art.rejected[str(fname)] = why
            log.info("packaged artifact %r ignored: %s", fname, why)
    art.usable = True
    return art


def artifacts() -> Artifacts:
    art = _read_artifacts(str(ARTIFACT_DIR))
    if not art.usable and art.manifest is not None:
        _warn_stale_once("drvsoftmax: " + art.why_not)
    return art


def _read_plain_file(path: Path) -> bytes | None:
    """A regular file's bytes, not following a symbolic link; None when absent or not one."""
    got = _compiler.read_regular_file(path)
    return None if got is None else got[0]


_verified: dict[tuple[str, int, int, str], str | None] = {}


def file_problem(art: Artifacts, fname: str) -> str | None:
    """Why a packaged file cannot be used (missing, a link, wrong sha256), or None.
    Checked once per file state (path, size, modification time)."""
    p = art.folder / fname
    try:
        st = os.lstat(p)
    except OSError:
        return "missing"
    key = (str(p), st.st_size, st.st_mtime_ns, art.files[fname]["sha256"])
    if key not in _verified:
        data = _read_plain_file(p)
        if data is None:
            _verified[key] = "not a regular file"
        elif hashlib.sha256(data).hexdigest() != art.files[fname]["sha256"]:
            _verified[key] = "sha256 does not match the manifest"
        else:
            _verified[key] = None
    return _verified[key]


def _verified_bytes(art: Artifacts, fname: str) -> bytes:
    data = _read_plain_file(art.folder / fname)
    if data is None:
        raise DrvSoftmaxError(f"{fname}: missing or not a regular file")
    if hashlib.sha256(data).hexdigest() != art.files[fname]["sha256"]:
        raise DrvSoftmaxError(f"{fname}: sha256 does not match the manifest")
    return data


# ----------------------------------------------------------------------------------
# Loaded libraries: one per image (by content), shared by every device that uses it.

_lib_lock = threading.Lock()
_libraries: dict[str, object] = {}


def _load_library(key: str, image: bytes) -> object:
    from cuda.bindings import driver

    with _lib_lock:
        lib = _libraries.get(key)
        if lib is None:
            if not image.endswith(b"\0") and image.lstrip().startswith(b"//"):
                image = image + b"\0"  # PTX text must be NUL-terminated
            lib = check(driver.cuLibraryLoadData(image, None, None, 0, None, None, 0), "cuLibraryLoadData")
            _libraries[key] = lib
        return lib


def _get_kernel(lib: object, lowered: str) -> Any:
    from cuda.bindings import driver

    return check(driver.cuLibraryGetKernel(lib, lowered.encode()), "cuLibraryGetKernel")


def ptx_allowed(entry: ManifestEntry, driver_version: int) -> bool:
    return float(entry.get("min_cuda", 1 << 30)) <= driver_version


# ----------------------------------------------------------------------------------
# The chain.


@dataclass
class Step:
    """One step of the chain for one kernel: a source that would be tried, or why not."""

    source: str  # "packaged cubin", "cached cubin", "packaged PTX", "NVRTC", or "" for a note
    detail: str  # the file, or the reason
    fname: str = ""
    entry: ManifestEntry | None = None
    image: _compiler.CompiledImage | None = None  # a cached run-time cubin, already read and verified

    def __str__(self) -> str:
        return f"{self.source} {self.detail}".strip()


def _cache_hit(arch: str, name: str) -> _compiler.CompiledImage | None:
    try:
        return _compiler.cache_lookup(arch, [name])
    except Exception as e:  # no NVRTC to name the entry: no cached entry either
        log.debug("no cache lookup for %s on %s: %s: %s", name, arch, type(e).__name__, e)
        return None


def plan(name: str, arch: str, driver_version: int | None) -> list[Step]:
    """The sources the chain would try for kernel `name` on an `arch` device, in order,
    each with the file it would load; steps that cannot apply carry their reason with
    an empty ``source``.  Loads nothing.  `driver_version` None: unknown (no driver)."""
    return list(_steps(name, arch, driver_version))


def _steps(name: str, arch: str, driver_version: int | None) -> Iterator[Step]:
    """`plan`, lazily: the cache is looked at (and NVRTC loaded to name the entry) only
    when no packaged cubin came first."""
    no_jit, force_jit = switches()
    if force_jit:
        yield Step("", f"packaged artifacts: skipped ({FORCE_JIT} is set)")
    else:
        art = artifacts()
        if not art.usable:
            yield Step("", art.why_not)
        else:
            cubins = art.cubins_for(arch, name)
            if not cubins:
                yield Step("", f"packaged cubin: none for {arch} or an older {arch[:-1]}x holding {name}")
            for fname, e, how in cubins:
                why = file_problem(art, fname)
                if why:
                    yield Step("", f"packaged cubin {fname}: {why}")
                else:
                    yield Step("packaged cubin", fname + ("" if how == "exact" else f" ({e['arch']})"), fname, e)
    hit = _cache_hit(arch, name)
    if hit is not None:
        yield Step("cached cubin", f"NVRTC {hit.nvrtc} for {arch} in {_compiler.cache_dir()}", image=hit)
    if not force_jit:
        art = artifacts()
        if art.usable:
            ptx = art.ptx_for(arch, name)
            if not ptx:
                yield Step("", f"packaged PTX: none for compute capability <= {arch} holding {name}")
            for fname, e in ptx:
                why = file_problem(art, fname)
                if why:
                    yield Step("", f"packaged PTX {fname}: {why}")
                elif driver_version is not None and not ptx_allowed(e, driver_version):
                    need, have = _cuda_str(e.get("min_cuda")), _cuda_str(driver_version)
                    yield Step("", f"packaged PTX {fname}: needs a CUDA {need} driver, this one is CUDA {have}")
                else:
                    yield Step("packaged PTX", fname, fname, e)
    if no_jit:
        yield Step("", f"NVRTC at run time: forbidden ({NO_JIT} is set)")
    else:
        yield Step("NVRTC", f"{_compiler.nvrtc_version_str()} cubin for {arch}")


def find_kernel(name: str, arch: str, driver_version: int) -> tuple[Any, str]:
    """(CUkernel, origin) for kernel `name` on an `arch` device, walking the chain."""
    tried: list[str] = []
    for step in _steps(name, arch, driver_version):
        if not step.source:
            tried.append(step.detail)
            continue
        t0 = time.perf_counter()
        try:
            if step.source in ("packaged cubin", "packaged PTX"):
                assert step.entry is not None
                # A file holds several kernels: read and verify it once.  Its library is known
                # by name and content (another folder's file of that name is another library).
                key = f"pkg:{step.fname}:{step.entry['sha256']}"
                lib = _libraries.get(key) or _load_library(key, _verified_bytes(artifacts(), step.fname))
                k = _get_kernel(lib, step.entry["lowered"][name])
                origin = str(step) + (" (JIT by the driver)" if step.source == "packaged PTX" else "")
            else:
                if step.image is not None:  # the cached cubin step
                    img, cached = step.image, True
                else:
                    img, cached = _compiler.cached_compile(arch, [name])
                lib = _load_library(f"jit:{arch}:{name}:{hashlib.sha256(img.image).hexdigest()}", img.image)
                k = _get_kernel(lib, img.lowered[name])
                how = "cached" if cached else "compiled now"
                origin = f"NVRTC {img.nvrtc} cubin for {arch} ({how})"
        except (ImportError, OSError, RuntimeError, KeyError, DrvSoftmaxError) as err:
            log.debug("kernel %s for %s: %s failed: %s: %s", name, arch, step, type(err).__name__, err)
            tried.append(f"{step}: {type(err).__name__}: {err}")
            continue
        log.info("kernel %s for %s: %s, %.3f s", name, arch, origin, time.perf_counter() - t0)
        if tried:
            log.debug("kernel %s for %s: before that: %s", name, arch, "; ".join(tried))
        return k, origin
    raise KernelUnavailableError(
        f"no image of kernel {name} for {arch} could be loaded; tried:\n  - " + "\n  - ".join(tried)
    )


def describe_source(arch: str, driver_version: int | None, name: str | None = None) -> str:
    """Where the kernel `name` for `arch` would come from, loading nothing; without a
    name, a summary over every kernel ("packaged cubin sm_86 for 90 of 90 kernels")."""
    if name is not None:
        return _describe_one(arch, driver_version, name)
    from ._plan import all_kernel_names

    names = all_kernel_names()
    counts: dict[tuple[int, str], int] = {}
    for n in names:
        key = _summary_label(_steps(n, arch, driver_version))
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{label} for {c} of {len(names)} kernels" for (_, label), c in sorted(counts.items()))


def _describe_one(arch: str, driver_version: int | None, name: str) -> str:
    notes: list[str] = []
    for s in _steps(name, arch, driver_version):
        if not s.source:
            notes.append(s.detail)
            continue
        if s.source == "NVRTC":
            what = f"NVRTC {_compiler.nvrtc_version_str()} at run time, compiled on first use"
        else:
            what = str(s) + (" (JIT by the driver)" if s.source == "packaged PTX" else "")
        return "; ".join([what, *notes])
    return "nothing: " + "; ".join(notes)


def _summary_label(steps: Iterator[Step]) -> tuple[int, str]:
    """(rank in the chain, label) of the source a kernel's chain would take first."""
    notes = []
    for s in steps:
        notes.append(s.detail)
        if s.source == "packaged cubin":
            assert s.entry is not None
            return 0, f"packaged cubin {s.entry['arch']}"
        if s.source == "cached cubin":
            return 1, "cached run-time cubin"
        if s.source == "packaged PTX":
            assert s.entry is not None
            return 2, f"packaged PTX {s.entry['arch']} (JIT by the driver)"
        if s.source == "NVRTC":
            return 3, f"NVRTC {_compiler.nvrtc_version_str()} at run time (cached in {_compiler.cache_dir()})"
    return 4, "nothing (" + "; ".join(notes) + ")"


def _cuda_str(v: Any) -> str:
    try:
        v = int(v)
    except (TypeError, ValueError, OverflowError):
        return "?"
    return f"{v // 1000}.{(v % 1000) // 10}"


__all__ = ["find_kernel", "describe_source", "artifacts", "plan"]
