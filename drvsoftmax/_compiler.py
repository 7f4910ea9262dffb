"""NVRTC through cuda.bindings: the kernel sources, their hash, and compiling them.

Used by the loader (run-time fallback, cached on disk), by ``build_ptx.py`` and by
``python -m drvsoftmax precompile``.  Everything here works without a GPU or a driver.

The disk cache holds one entry per (kernel set, architecture, NVRTC version, sources,
options): ``<arch>-<key>.cubin`` and its ``.json`` metadata, written under a per-entry
file lock (concurrent processes compile an entry once) through temporary files renamed
into place.  The cache folder is created 0700 and, like ssh and pip, refused when it or
an entry is owned by another user or writable by group or others: a planted cubin would
run in this process.  A refused or damaged cache costs a compile, nothing more.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import json
import os
import stat
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import NvrtcError, arg_value_error
from ._log import log
from ._plan import all_kernel_names

# The architectures prebuilt cubins are made for, and that the CPU tests compile.
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
# Options common to every compile; part of every cache key and artifact hash.
BASE_OPTIONS = ("-std=c++17", "-DNDEBUG")
MAIN_NAME = "drvsoftmax_kernels.cu"
MAIN_SOURCE = (
    '#include "softmax_fwd.cu"\n#include "softmax_bwd.cu"\n#include "softmax_cluster.cu"\n#include "softmax_pipe.cu"\n'
    '#include "softmax_split.cu"\n'
)


def source_dir() -> Path:
    """cuda_src: inside the installed package, or beside it in a source tree."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / "softmax_fwd.cu").is_file():
            return cand
    raise FileNotFoundError(
        f"drvsoftmax kernel sources not found: looked in {here / 'cuda_src'} and "
        f"{here.parent / 'cuda_src'}; the installation is incomplete"
    )


@functools.lru_cache(maxsize=1)
def sources() -> dict[str, str]:
    """Every kernel source file by name (the headers NVRTC is given)."""
    d = source_dir()
    return {p.name: p.read_text() for p in sorted(d.iterdir()) if p.suffix in (".cu", ".cuh")}


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the sources, the common options and the kernel list."""
    h = hashlib.sha256()
    for name, text in sorted(sources().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    h.update(json.dumps([BASE_OPTIONS, all_kernel_names()]).encode())
    return h.hexdigest()


# Where the nvidia-cuda-nvrtc wheels put the library, relative to an import path entry.
_NVRTC_WHEEL_LIBS = ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")


@functools.lru_cache(maxsize=1)
def _preload_nvrtc_from_sys_path() -> str | None:
    """Load the NVRTC of the first nvidia-cuda-nvrtc wheel on ``sys.path``, if any.

    cuda.bindings finds NVRTC through cuda.pathfinder, which looks in the interpreter's
    site-packages folders only.  pip's isolated build environment (and ``--target`` or
    PYTHONPATH installs) put the wheel elsewhere on ``sys.path``; there the build must use
    the NVRTC it pinned, not whatever a site-packages folder holds.  Once the library is
    loaded, cuda.pathfinder takes the loaded one.
    """
    if not sys.platform.startswith("linux"):
        return None
    for entry in sys.path:
        for rel in _NVRTC_WHEEL_LIBS:
            lib = os.path.join(entry or os.getcwd(), rel)
            if not os.path.isfile(lib):
                continue
            try:
                # NVRTC loads its builtins library by name: load the sibling first.
                for builtins in sorted(glob.glob(os.path.join(os.path.dirname(lib), "libnvrtc-builtins.so.*"))):
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                log.debug("could not load %s: %s", lib, e)
                continue
            log.debug("NVRTC loaded from %s", lib)
            return lib
    return None


def _nvrtc() -> Any:
    _preload_nvrtc_from_sys_path()
    from cuda.bindings import nvrtc

    return nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    from ._errors import check

    major, minor = check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def nvrtc_version_str() -> str:
    try:
        major, minor = nvrtc_version()
        return f"{major}.{minor}"
    except Exception as e:  # NVRTC missing: say so rather than fail while reporting
        return f"unavailable ({type(e).__name__})"


def arch_parts(arch: object) -> tuple[str, int, str]:
    """'sm_90' -> ('sm', 90, ''); 'sm_90a' -> ('sm', 90, 'a'); 'compute_75' -> ('compute', 75, '').

    An ``a`` suffix marks architecture-specific code, which runs on exactly that
    architecture and no other.
    """
    kind, _, num = arch.partition("_") if isinstance(arch, str) else ("", "", "")
    suffix = "a" if num.endswith("a") else ""
    digits = num[: len(num) - len(suffix)]
    if kind not in ("sm", "compute") or not digits.isdigit() or not digits.isascii():
        raise arg_value_error("arch", "of the form 'sm_XY' or 'compute_XY'", repr(arch))
    return kind, int(digits), suffix


def parse_arch(arch: str) -> tuple[str, int]:
    """'sm_90' -> ('sm', 90); 'compute_75' -> ('compute', 75)."""
    kind, cc, _ = arch_parts(arch)
    return kind, cc


@dataclass
class CompiledImage:
    arch: str  # 'sm_90' (cubin) or 'compute_90' (PTX)
    image: bytes  # cubin or PTX text (NUL-terminated for the driver)
    lowered: dict[str, str]  # name expression -> mangled symbol
    nvrtc: str  # 'major.minor'
    log: str


def compile_kernels(arch: str, names: list[str] | None = None, extra_options: tuple[str, ...] = ()) -> CompiledImage:
    """Compile every kernel (or `names`) for `arch`: a cubin for sm_XY, PTX for compute_XY.
    `extra_options` (for checks such as ptxas's resource report) are not part of any cache key.
    """
    nvrtc = _nvrtc()
    kind, _ = parse_arch(arch)
    names = list(names) if names is not None else all_kernel_names()
    srcs = sources()
    hdr_names = [n.encode() for n in srcs]
    hdr_texts = [t.encode() for t in srcs.values()]
    ver = nvrtc_version_str()

    def ok(res: tuple[Any, ...], call: str, prog: Any = None) -> tuple[Any, ...]:
        err = res[0]
        if int(err) != 0:
            raise NvrtcError(call, getattr(err, "name", str(int(err))), _log(prog) if prog else "", ver)
        return res[1:]

    def _log(prog: Any) -> str:
        try:
            (n,) = nvrtc.nvrtcGetProgramLogSize(prog)[1:]
            buf = bytearray(n)  # never `b" " * n`: a 1-byte result is a shared constant NVRTC would overwrite
            nvrtc.nvrtcGetProgramLog(prog, buf)
            return buf.rstrip(b"\0 ").decode(errors="replace")
        except Exception:
            return ""

    (prog,) = ok(
        nvrtc.nvrtcCreateProgram(MAIN_SOURCE.encode(), MAIN_NAME.encode(), len(srcs), hdr_texts, hdr_names),
        "nvrtcCreateProgram",
    )
    try:
        for n in names:
            ok(nvrtc.nvrtcAddNameExpression(prog, n.encode()), "nvrtcAddNameExpression")
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in BASE_OPTIONS + extra_options]
        t0 = time.perf_counter()
        ok(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram", prog)
        log.info("NVRTC %s compiled %d kernel(s) for %s in %.2f s", ver, len(names), arch, time.perf_counter() - t0)
        compile_log = _log(prog)
        lowered = {}
        for n in names:
            (low,) = ok(nvrtc.nvrtcGetLoweredName(prog, n.encode()), "nvrtcGetLoweredName")
            lowered[n] = bytes(low).decode()  # copy before the program is destroyed
        if kind == "sm":
            (size,) = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = bytearray(size)
            ok(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        else:
            (size,) = ok(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            buf = bytearray(size)
            ok(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return CompiledImage(arch, bytes(buf), lowered, ver, compile_log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ----------------------------------------------------------------------------------
# Disk cache of run-time compiled cubins.

CACHE_ENV = "DRVSOFTMAX_CACHE_DIR"
# A temporary file this old belongs to a writer that died (a compile takes seconds).
STALE_TMP_SECONDS = 3600.0
# Names of the files the cache writes: <arch>-<32 hex>.{cubin,json,lock} and temporaries.
_ENTRY_SUFFIXES = (".cubin", ".json", ".lock")


def cache_dir() -> Path:
    """The cache folder: $DRVSOFTMAX_CACHE_DIR, else $XDG_CACHE_HOME/drvsoftmax, else
    ~/.cache/drvsoftmax (``~`` expanded in each)."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return Path(os.path.expanduser(base)) / "drvsoftmax"


def cache_key(arch: str, names: list[str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([source_hash(), arch, nvrtc_version_str(), list(BASE_OPTIONS), names]).encode())
    return h.hexdigest()[:32]


def cache_paths(arch: str, names: list[str]) -> tuple[Path, Path]:
    stem = cache_dir() / f"{arch}-{cache_key(arch, names)}"
    return stem.with_suffix(".cubin"), stem.with_suffix(".json")


def _is_cache_file(name: str) -> bool:
    if name.endswith(".tmp"):
        name = name.split(".", 1)[0] + ".cubin"  # <entry name>.<random>.tmp
    stem, dot, suffix = name.rpartition(".")
    arch, dash, key = stem.rpartition("-")
    return (
        "." + suffix in _ENTRY_SUFFIXES
        and dash == "-"
        and len(key) == 32
        and all(c in "0123456789abcdef" for c in key)
        and (arch.startswith("sm_") or arch.startswith("compute_"))
    )


def _unsafe_reason(st: os.stat_result, what: str, path: Path) -> str | None:
    """Why a folder or file may not be trusted: another owner, or group/other write."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is not None and st.st_uid != uid:
        return f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)
        warnings.warn("drvsoftmax: " + msg, RuntimeWarning, stacklevel=4)


def cache_problem(create: bool = True) -> str | None:
    """None if the cache folder can be used (creating it 0700 if `create`), else why not."""
    d = cache_dir()
    try:
        if create and not d.exists():
            d.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                d.mkdir(mode=0o700)
        st = os.stat(d)
    except OSError as e:
        return f"cache folder {d} is unusable ({e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"cache folder {d} is not a folder"
    return _unsafe_reason(st, "cache folder", d)


def _trusted_cache() -> bool:
    why = cache_problem()
    if why is None:
        return True
    _warn_once(why + "; it is not used (kernels compile in memory)")
    return False


def read_regular_file(path: Path) -> tuple[bytes, os.stat_result] | None:
    """(bytes, stat) of a regular file, not following a symbolic link; None when the path
    is absent, a link, or not a regular file.  Used for the cache and packaged artifacts."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        return f.read(), st


def _read_entry_file(path: Path) -> bytes | None:
    """The bytes of a cache file, if it is a regular file of ours (links are not followed)."""
    got = read_regular_file(path)
    if got is None:
        return None
    why = _unsafe_reason(got[1], "cache entry", path)
    if why is not None:
        _warn_once(why + "; it is ignored and rebuilt")
        return None
    return got[0]


def _valid_meta(meta: object, arch: str, names: list[str]) -> bool:
    if not isinstance(meta, dict):
        return False
    lowered = meta.get("lowered")
    return (
        meta.get("arch") == arch
        and meta.get("source_hash") == source_hash()
        and isinstance(meta.get("nvrtc"), str)
        and isinstance(meta.get("sha256"), str)
        and isinstance(lowered, dict)
        and set(lowered) == set(names)
        and all(isinstance(v, str) and v for v in lowered.values())
    )


def cache_lookup(arch: str, names: list[str]) -> CompiledImage | None:
    """The cached cubin of `names` for `arch`, if present, intact and trustworthy."""
    if cache_problem(create=False) is not None:
        return None
    cubin_path, meta_path = cache_paths(arch, names)
    raw = _read_entry_file(meta_path)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        meta = None
    if not _valid_meta(meta, arch, names):
        log.info("cache entry %s is damaged; it is rebuilt", meta_path)
        return None
    data = _read_entry_file(cubin_path)
    if data is None or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        log.info("cache entry %s does not match its metadata; it is rebuilt", cubin_path)
        return None
    return CompiledImage(arch, data, dict(meta["lowered"]), meta["nvrtc"], "")


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic on POSIX and Windows
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_stale_temporaries(folder: Path, prefix: str = "", older_than: float = STALE_TMP_SECONDS) -> int:
    """Remove temporaries of killed writers: those of `prefix` (whose entry lock we hold:
    any of them is stale) and any older than `older_than` seconds."""
    removed = 0
    now = time.time()
    with contextlib.suppress(OSError):
        for p in folder.iterdir():
            if not (p.name.endswith(".tmp") and _is_cache_file(p.name)):
                continue
            with contextlib.suppress(OSError):
                if (prefix and p.name.startswith(prefix)) or now - p.lstat().st_mtime > older_than:
                    p.unlink()
                    removed += 1
    return removed


@contextlib.contextmanager
def _entry_lock(stem: Path) -> Iterator[None]:
    """An exclusive lock on one cache entry across processes (flock on <stem>.lock).

    The lock file is removed on release; a waiter that then holds a lock on the removed
    file notices (the path no longer names its file) and locks afresh.
    """
    try:
        import fcntl
    except ImportError:  # no flock (Windows): atomic renames alone keep entries whole
        yield
        return
    path = stem.with_suffix(".lock")
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            log.debug("no lock for %s (%s); going on without it", path, e)
            yield
            return
        t0 = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if same:
            break
        os.close(fd)  # the holder before us removed this lock file: take the new one
    waited = time.perf_counter() - t0
    if waited > 0.05:
        log.debug("waited %.2f s for the lock of %s", waited, path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def cached_compile(arch: str, names: list[str]) -> tuple[CompiledImage, bool]:
    """A cubin of the kernels `names` for `arch`, from the disk cache or compiled now.

    Returns (image, came_from_cache).  Concurrent processes wanting the same entry wait
    on its lock, and all but the first find it cached.  The metadata file is written
    last, so a reader that finds it finds a complete cubin too.
    """
    names = list(names)
    if not _trusted_cache():
        return compile_kernels(arch, names), False
    hit = cache_lookup(arch, names)
    if hit is not None:
        log.debug("cache hit: %s for %s", names, arch)
        return hit, True
    cubin_path, meta_path = cache_paths(arch, names)
    with _entry_lock(cubin_path.with_suffix("")):
        hit = cache_lookup(arch, names)  # another process may have compiled it meanwhile
        if hit is not None:
            log.debug("cache hit after waiting: %s for %s", names, arch)
            return hit, True
        _remove_stale_temporaries(cubin_path.parent, cubin_path.stem + ".")
        img = compile_kernels(arch, names)
        meta = {
            "arch": arch,
            "nvrtc": img.nvrtc,
            "source_hash": source_hash(),
            "options": list(BASE_OPTIONS),
            "sha256": hashlib.sha256(img.image).hexdigest(),
            "lowered": img.lowered,
        }
        try:
            _atomic_write(cubin_path, img.image)
            _atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
        except OSError as e:
            log.info("could not write the cache entry %s: %s", cubin_path, e)  # costs a compile next time
    return img, False


@dataclass
class CacheInfo:
    folder: Path
    problem: str | None  # why the folder is not used, or None
    entries: int  # complete entries (cubin + metadata)
    files: int  # every cache file, temporaries and locks included
    bytes: int
    archs: dict[str, int]  # entries per architecture


def cache_info() -> CacheInfo:
    """What the cache folder holds, reading nothing but names and sizes."""
    d = cache_dir()
    problem = cache_problem(create=False) if d.exists() else None
    files = size = 0
    metas: set[str] = set()
    cubins: set[str] = set()
    with contextlib.suppress(OSError):
        for p in d.iterdir():
            if not _is_cache_file(p.name):
                continue
            files += 1
            with contextlib.suppress(OSError):
                size += p.lstat().st_size
            if p.suffix == ".json":
                metas.add(p.stem)
            elif p.suffix == ".cubin":
                cubins.add(p.stem)
    complete = metas & cubins
    archs: dict[str, int] = {}
    for stem in complete:
        a = stem.rpartition("-")[0]
        archs[a] = archs.get(a, 0) + 1
    return CacheInfo(d, problem, len(complete), files, size, dict(sorted(archs.items())))


def cache_clear() -> tuple[int, int]:
    """Remove every file the cache wrote (entries, locks, temporaries), nothing else.

    Returns (files removed, bytes freed).  Other files in the folder are left alone, so a
    cache folder pointed at a shared place loses nothing of anyone else's.
    """
    d = cache_dir()
    removed = freed = 0
    with contextlib.suppress(OSError):
        for p in d.iterdir():
            if not _is_cache_file(p.name):
                continue
            try:
                n = p.lstat().st_size
                p.unlink()
            except OSError:
                continue
            removed += 1
            freed += n
    log.info("cache %s cleared: %d files, %d bytes", d, removed, freed)
    return removed, freed


def precompile_one(arch: str, name: str) -> tuple[str, bool, float]:
    """Fill the cache entry of one kernel (a process-pool task): (name, was cached, seconds)."""
    t = time.perf_counter()
    _, cached = cached_compile(arch, [name])
    return name, cached, time.perf_counter() - t
