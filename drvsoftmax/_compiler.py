"""NVRTC through cuda.bindings: the kernel sources, their hash, and compiling them.

Used by the loader (run-time fallback, cached on disk) and by ``build_ptx.py``.
Everything here works without a GPU or a driver.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ._errors import NvrtcError, arg_value_error
from ._plan import all_kernel_names

# The architectures prebuilt cubins are made for, and that the CPU tests compile.
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
# Options common to every compile; part of every cache key and artifact hash.
BASE_OPTIONS = ("-std=c++17", "-DNDEBUG")
MAIN_NAME = "drvsoftmax_kernels.cu"
MAIN_SOURCE = '#include "softmax_fwd.cu"\n#include "softmax_bwd.cu"\n'


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


def _nvrtc():
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


def parse_arch(arch: str) -> tuple[str, int]:
    """'sm_90' -> ('sm', 90); 'compute_75' -> ('compute', 75)."""
    kind, _, num = arch.partition("_")
    if kind not in ("sm", "compute") or not num.isdigit():
        raise arg_value_error("arch", "of the form 'sm_XY' or 'compute_XY'", repr(arch))
    return kind, int(num)


@dataclass
class CompiledImage:
    arch: str  # 'sm_90' (cubin) or 'compute_90' (PTX)
    image: bytes  # cubin or PTX text (NUL-terminated for the driver)
    lowered: dict[str, str]  # name expression -> mangled symbol
    nvrtc: str  # 'major.minor'
    log: str


def compile_kernels(arch: str, names: list[str] | None = None) -> CompiledImage:
    """Compile every kernel (or `names`) for `arch`: a cubin for sm_XY, PTX for compute_XY."""
    nvrtc = _nvrtc()
    kind, _ = parse_arch(arch)
    names = list(names) if names is not None else all_kernel_names()
    srcs = sources()
    hdr_names = [n.encode() for n in srcs]
    hdr_texts = [t.encode() for t in srcs.values()]
    ver = nvrtc_version_str()

    def ok(res, call, prog=None):
        err = res[0]
        if int(err) != 0:
            raise NvrtcError(call, getattr(err, "name", str(int(err))), _log(prog) if prog else "", ver)
        return res[1:]

    def _log(prog):
        try:
            (n,) = nvrtc.nvrtcGetProgramLogSize(prog)[1:]
            buf = b" " * n
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
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in BASE_OPTIONS]
        ok(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram", prog)
        log = _log(prog)
        lowered = {}
        for n in names:
            (low,) = ok(nvrtc.nvrtcGetLoweredName(prog, n.encode()), "nvrtcGetLoweredName")
            lowered[n] = bytes(low).decode()  # copy before the program is destroyed
        if kind == "sm":
            (size,) = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = b" " * size
            ok(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        else:
            (size,) = ok(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            buf = b" " * size
            ok(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return CompiledImage(arch, bytes(buf), lowered, ver, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ----------------------------------------------------------------------------------
# Disk cache of run-time compiled cubins.


def cache_dir() -> Path:
    env = os.environ.get("DRVSOFTMAX_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "drvsoftmax"


def cache_key(arch: str, names: list[str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([source_hash(), arch, nvrtc_version_str(), list(BASE_OPTIONS), names]).encode())
    return h.hexdigest()[:32]


def cache_paths(arch: str, names: list[str]) -> tuple[Path, Path]:
    stem = cache_dir() / f"{arch}-{cache_key(arch, names)}"
    return stem.with_suffix(".cubin"), stem.with_suffix(".json")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic on POSIX and Windows
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cache_lookup(arch: str, names: list[str]) -> CompiledImage | None:
    """The cached cubin of `names` for `arch`, if present and intact."""
    cubin_path, meta_path = cache_paths(arch, names)
    try:
        meta = json.loads(meta_path.read_text())
        data = cubin_path.read_bytes()
        if meta.get("sha256") == hashlib.sha256(data).hexdigest():
            return CompiledImage(arch, data, meta["lowered"], meta["nvrtc"], "")
    except (OSError, ValueError, KeyError):
        pass
    return None


def cached_compile(arch: str, names: list[str]) -> tuple[CompiledImage, bool]:
    """A cubin of the kernels `names` for `arch`, from the disk cache or compiled now.

    Returns (image, came_from_cache).  The metadata file is written last, so a reader
    that finds it finds a complete cubin too; concurrent writers each write whole files.
    """
    hit = cache_lookup(arch, names)
    if hit is not None:
        return hit, True
    img = compile_kernels(arch, names)
    meta = {
        "arch": arch,
        "nvrtc": img.nvrtc,
        "source_hash": source_hash(),
        "options": list(BASE_OPTIONS),
        "sha256": hashlib.sha256(img.image).hexdigest(),
        "lowered": img.lowered,
    }
    cubin_path, meta_path = cache_paths(arch, names)
    try:
        _atomic_write(cubin_path, img.image)
        _atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
    except OSError:
        pass  # an unwritable cache costs a compile next time, nothing more
    return img, False
