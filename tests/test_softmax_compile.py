"""NVRTC compiles every kernel for every prebuilt architecture, and the disk cache behaves.

Needs NVRTC (cuda-bindings + nvidia-cuda-nvrtc), not a GPU.  The full compile of all
architectures runs in one test, two architectures at a time in separate processes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import re
import struct

import pytest

from drvsoftmax import _compiler, _plan
from drvsoftmax._errors import ArgumentValueError, NvrtcError


def _nvrtc_or_skip():
    try:
        return _compiler.nvrtc_version()
    except Exception as e:  # no NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {type(e).__name__}: {e}")


ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190


def _check_cubin(img, arch, names):
    assert img.arch == arch
    assert img.image[:4] == ELF_MAGIC, f"{arch}: not an ELF image"
    assert img.image[4] == 2, f"{arch}: not a 64-bit ELF"
    (e_machine,) = struct.unpack_from("<H", img.image, 18)
    assert e_machine == EM_CUDA, f"{arch}: e_machine {e_machine} is not EM_CUDA"
    assert set(img.lowered) == set(names), f"{arch}: lowered names differ"
    for name, low in img.lowered.items():
        assert low.startswith("_Z"), (name, low)
        assert low.encode() + b"\0" in img.image, f"{arch}: symbol of {name} ({low}) missing from the cubin"
    assert len(set(img.lowered.values())) == len(names), "two name expressions lowered to one symbol"
    assert img.nvrtc == _compiler.nvrtc_version_str()


RESOURCE_REPORT = ("--ptxas-options=-v",)


# Kernels allowed local memory, by architecture: at most these (stack frame, spill stores,
# spill loads) bytes each, the most ptxas reported with NVRTC 13.0 (the build's pin) and 13.5
# (which `pip` installs today) for the kernel sources of commit 6079bf0; an entry marked
# with one version is local memory under that one alone.  Entries that neither reported
# any more were dropped then, so that a kernel that starts to spill again fails here.  The
# entries of the 16-bit lean and edged lean kernels (8 chunks, no mask) were taken again
# for the fold (SmxFold, SmxEdgedFold in softmax_fwd.cu; commit e900113 and after).
# Every other kernel of every architecture must have no stack frame and no spills; a
# kernel that starts spilling, or spills more, fails the test.  Why each is allowed:
# - ptxas caps registers to keep occupancy (64 where two 512-thread blocks share an SM, 40
#   for full occupancy on the 1536-thread SMs of sm_86/89/120) and spills a few values
#   rather than cross the cap: the fp32 whole-chunk kernels of 4 or 8 chunks, some general
#   fp32 kernels of 2 chunks, the backward's general 16-bit kernels of 2 rows x 2 chunks (and
#   of 4 chunks on sm_120 with 13.5).  `__launch_bounds__(512, 1)`
#   removes the spill of the fp32 8-chunk kernel with a bool mask on sm_80 at 80 registers,
#   one block per SM instead of two: not clearly faster, so not taken without a GPU
#   measurement.
# - the bf16 lean kernel (8 chunks per thread, no mask, whole-chunk rows; see SMX_HELD_VALUES)
#   on sm_75: held to 64 registers for four 256-thread blocks per SM, it keeps its 32
#   registers of raw chunks and spills a few row values (the y row pointer among them: a
#   store and a load per thread).  The fp16 one fits, and so does the bf16 one from sm_80
#   on, where the passes fold (no local memory with NVRTC 13.0 and 13.5; before the fold
#   8-32 bytes on sm_80 to sm_89).  Measured on the H200 against
#   the 4-chunk kernel without spills: 94.5 against 81.8% of copy at Sk 16384, 95.6 against
#   91.7 at 8192.
# - the STORE of a row's partial first and last chunk as aligned 2/4/8-byte pieces (rows off
#   the 16-byte grid: at most 4 stores where there were up to 7 element stores; on the H200
#   Sk 4097 forward 68 -> 72% of copy fp16, 85 -> 94% fp32, backward 92 -> 98% bf16) keeps
#   a few more values live: 4-12 bytes of spills in the general fp32 kernels of 2 chunks with
#   a 1- or 2-byte mask on sm_86/89, in the looped fp32 kernels with a 1- or 4-byte mask on
#   sm_80 to sm_90, 4-20 bytes more in the backward's general 16-bit kernel of 2 rows x 2
#   chunks on sm_100/120, and in the 8-byte-mask kernels below.
# - edged rows (16-bit x, no mask, rows off the 16-byte grid; smx_fwd_edged in
#   softmax_fwd.cu): the general kernels hold a lane's edge key (its index and value) beside
#   their chunks.  The 4-chunk ones spill 8 bytes on sm_80/86/89 (and on sm_100/120 with
#   13.5); the 8-chunk ones (edged rows in the lean shape, held to the lean kernels' 64
#   registers on sm_75 to sm_90; their max and sum fold) 16-24 bytes on sm_75 to sm_89,
#   none on sm_90, and with 13.5 alone 8 (sm_100) and 28 (sm_120) in bf16, where the
#   bf16 kernel does not fold.  On the H200 the 8-chunk kernels with 24 bytes of spills
#   measured faster than at 80 registers without any (three blocks per SM): Sk 4097 fp16 /
#   bf16 92.9 / 91.8% of copy against 91.7 / 88.0, Sk 16383 91.8 / 90.2 against 88.7 / 86.6.
# - 8-byte masks (int64/uint64/float64, rare): a mask chunk is 2 to 4 times x's, so these
#   kernels hold the most raw registers in flight, at the caps above or at the hard 128 of
#   a 512-thread row (fp32 rows of 8 chunks: 32 registers of x, 64 of mask).
# - the max subtracted before the exponent's scaling (smx_term: exact for scores of any
#   size) is one instruction more per element where the values are held: 8 bytes more in
#   the 4-chunk edged bf16 kernel on sm_86/89 and the fp32 8-chunk whole-chunk kernel on
#   sm_75.  Where the passes compute the values again, x * scale is rounded before the
#   shift (smx_fwd_values): 4 bytes more in the bf16 lean kernels on sm_75, which do not
#   fold there.  Without a shift it is an FMA with -0 (on sm_90 the causal fp16 kernel's 54
#   registers, 63 otherwise): 8 bytes more on sm_86/89 in the 4-chunk bf16 kernel of rows
#   off the 16-byte grid and the fp32 8-chunk kernel with a 1-byte mask than as __fmul_rn.
# sm_86 and sm_89 (the same SM: 1536 threads, 64K registers) report the same.
_SM86_89: dict[str, tuple[int, int, int]] = {
    "smx_fwd<float, MaskHide<smx_u8>, 8, 1, true>": (24, 28, 20),
    "smx_fwd<float, MaskAdd<double>, 8, 1, false>": (24, 20, 20),
    "smx_fwd<float, MaskHide<smx_u8>, 2, 1, false>": (8, 4, 4),  # NVRTC 13.0 only
    "smx_fwd<float, MaskHide<smx_u16>, 2, 1, false>": (8, 4, 4),
    "smx_fwd<float, MaskAdd<smx_f16>, 2, 1, false>": (8, 4, 4),
    "smx_fwd<float, MaskAdd<smx_bf16>, 2, 1, false>": (8, 4, 4),
    "smx_fwd_loop<float, MaskHide<smx_u8>, 4>": (8, 4, 4),  # NVRTC 13.5 only
    "smx_fwd<smx_f16, MaskNone, 8, 1, false>": (16, 12, 16),
    "smx_fwd<smx_f16, MaskNone, 4, 1, false>": (8, 8, 8),
    "smx_fwd<smx_bf16, MaskNone, 8, 1, false>": (16, 12, 16),
    "smx_fwd<smx_bf16, MaskNone, 4, 1, false>": (16, 16, 16),
}
KNOWN_LOCAL_MEMORY: dict[str, dict[str, tuple[int, int, int]]] = {
    "sm_75": {
        "smx_fwd<smx_bf16, MaskNone, 8, 1, true>": (24, 36, 28),
        "smx_fwd_loop<float, MaskHide<smx_u8>, 4>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<float, MaskNone, 8, 1, true>": (16, 16, 12),
        "smx_fwd<float, MaskHide<smx_u64>, 8, 1, false>": (16, 16, 16),
        "smx_fwd<float, MaskAdd<double>, 8, 1, false>": (24, 20, 20),
        "smx_fwd<smx_f16, MaskNone, 8, 1, false>": (16, 16, 24),
        "smx_fwd<smx_bf16, MaskNone, 8, 1, false>": (16, 12, 20),
    },
    "sm_80": {
        "smx_fwd_loop<float, MaskHide<smx_u8>, 4>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<float, MaskHide<smx_u8>, 8, 1, true>": (16, 16, 12),
        "smx_fwd<float, MaskHide<smx_u64>, 8, 1, false>": (16, 16, 16),
        "smx_fwd<float, MaskAdd<double>, 8, 1, false>": (24, 20, 20),
        "smx_fwd<smx_f16, MaskNone, 8, 1, false>": (16, 12, 16),
        "smx_fwd<smx_f16, MaskNone, 4, 1, false>": (8, 8, 8),
        "smx_fwd<smx_bf16, MaskNone, 8, 1, false>": (16, 12, 16),
        "smx_fwd<smx_bf16, MaskNone, 4, 1, false>": (8, 8, 8),
    },
    "sm_86": _SM86_89,
    "sm_89": _SM86_89,
    "sm_90": {
        "smx_fwd<float, MaskAdd<double>, 8, 1, false>": (24, 20, 20),
        "smx_fwd_loop<float, MaskHide<smx_u32>, 4>": (16, 12, 12),  # NVRTC 13.0 only
        "smx_fwd_loop<float, MaskAdd<float>, 4>": (16, 12, 12),  # NVRTC 13.0 only
        "smx_fwd_loop<float, MaskHide<smx_u8>, 4>": (8, 8, 8),  # NVRTC 13.5 only
    },
    "sm_100": {
        "smx_fwd<smx_bf16, MaskNone, 8, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<float, MaskHide<smx_u8>, 8, 1, true>": (8, 16, 8),  # NVRTC 13.0 only
        "smx_fwd<float, MaskHide<smx_u64>, 8, 1, false>": (32, 48, 48),
        "smx_fwd<float, MaskAdd<double>, 8, 1, false>": (32, 48, 48),
        "smx_bwd<smx_f16, 2, 2, false>": (16, 12, 52),
        "smx_bwd<smx_bf16, 2, 2, false>": (16, 12, 52),
        "smx_fwd<smx_f16, MaskNone, 4, 1, false>": (8, 8, 8),  # NVRTC 13.5 only
        "smx_fwd<float, MaskNone, 4, 1, true>": (8, 8, 8),  # NVRTC 13.5 only
    },
    "sm_120": {
        "smx_fwd<float, MaskNone, 4, 1, true>": (16, 12, 12),
        "smx_fwd<float, MaskHide<smx_u8>, 4, 1, true>": (24, 24, 24),  # NVRTC 13.0 only
        "smx_fwd<float, MaskHide<smx_u64>, 8, 1, false>": (40, 52, 56),
        "smx_fwd<float, MaskAdd<double>, 8, 1, false>": (40, 52, 56),
        "smx_bwd<smx_f16, 2, 2, false>": (8, 4, 20),  # NVRTC 13.0 only
        "smx_bwd<smx_bf16, 2, 2, false>": (8, 4, 20),  # NVRTC 13.0 only
        "smx_fwd<smx_f16, MaskNone, 4, 1, false>": (8, 8, 8),  # NVRTC 13.5 only
        "smx_fwd<smx_f16, MaskHide<smx_u16>, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<smx_f16, MaskAdd<smx_f16>, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<smx_f16, MaskAdd<smx_bf16>, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<smx_bf16, MaskHide<smx_u16>, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<smx_bf16, MaskAdd<smx_f16>, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<smx_bf16, MaskAdd<smx_bf16>, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_bwd<smx_f16, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_bwd<smx_bf16, 4, 1, false>": (8, 4, 4),  # NVRTC 13.5 only
        "smx_fwd<smx_bf16, MaskNone, 8, 1, false>": (16, 24, 28),  # NVRTC 13.5 only
    },
}


def _check_no_spills(img, arch, known=None):
    """ptxas's report of every kernel: no stack frame and no spills (an array or the
    kernel parameters sent to local memory show up as a stack frame), but for the kernels
    of `known` (name -> the most bytes of stack frame, spill stores, spill loads allowed)."""
    known = known or {}
    pattern = (
        r"Function properties for (\S+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    )
    props = re.findall(pattern, img.log)
    assert {sym for sym, *_ in props} >= set(img.lowered.values()), f"{arch}: no resource report for some kernels"
    name_of = {low: name for name, low in img.lowered.items()}
    bad = []
    for sym, *used in props:
        name = name_of.get(sym, sym)
        got = tuple(int(b) for b in used)
        if any(g > cap for g, cap in zip(got, known.get(name, (0, 0, 0)))):
            bad.append((name, *got))
    assert not bad, f"{arch}: kernels with local memory (kernel, stack frame, spill stores, spill loads): {bad}"


def test_every_kernel_compiles_for_every_architecture():
    _nvrtc_or_skip()
    names = _plan.all_kernel_names()
    jobs = [*_compiler.ARCHS, "compute_75"]
    assert set(_compiler.ARCHS) == {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"}
    # spawn, not fork: the parent may hold torch's thread pools, and children need no torch.
    ctx = multiprocessing.get_context("spawn")
    workers = max(2, min(len(_compiler.ARCHS), os.cpu_count() or 2))
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        # Cubins with ptxas's resource report: every kernel is checked for spills below.
        futures = {
            arch: pool.submit(_compiler.compile_kernels, arch, None, RESOURCE_REPORT if arch.startswith("sm_") else ())
            for arch in jobs
        }
        results = {arch: f.result(timeout=600) for arch, f in futures.items()}
    for arch in _compiler.ARCHS:
        _check_cubin(results[arch], arch, names)
    spills = []
    for arch in _compiler.ARCHS:
        try:
            _check_no_spills(results[arch], arch, KNOWN_LOCAL_MEMORY.get(arch))
        except AssertionError as e:
            spills.append(str(e).split("\n")[0])
    assert not spills, "\n".join(spills)
    ptx = results["compute_75"]
    assert ptx.arch == "compute_75"
    assert ptx.image.endswith(b"\0"), "PTX handed to the driver must be NUL-terminated"
    text = ptx.image.rstrip(b"\0").decode()
    assert text.startswith("//") and ".version" in text and ".target sm_75" in text
    assert set(ptx.lowered) == set(names)
    for low in ptx.lowered.values():
        assert f".entry {low}(" in text, f"PTX lacks .entry {low}"
    # The mangled names do not depend on the architecture: the loader looks them up by name.
    assert all(results[a].lowered == ptx.lowered for a in _compiler.ARCHS)


@pytest.mark.parametrize("bad", ["sm90", "gfx90a", "sm_", "compute_x", "", "SM_90"])
def test_parse_arch_rejects_bad_names(bad):
    with pytest.raises(ArgumentValueError, match=r"^arch must be of the form 'sm_XY' or 'compute_XY', got "):
        _compiler.parse_arch(bad)


def test_parse_arch():
    assert _compiler.parse_arch("sm_90") == ("sm", 90)
    assert _compiler.parse_arch("compute_75") == ("compute", 75)
    assert _compiler.parse_arch("sm_120") == ("sm", 120)


def test_errors_with_fields_survive_pickling():
    """precompile compiles in worker processes: their NVRTC and driver errors come back
    pickled, and must arrive whole (not as a broken process pool)."""
    import pickle

    from drvsoftmax._errors import CudaDriverError, NvrtcError

    e = NvrtcError("nvrtcCompileProgram", "NVRTC_ERROR_COMPILATION", "kernel.cu(3): error: x", "13.0")
    got = pickle.loads(pickle.dumps(e))
    assert type(got) is NvrtcError and str(got) == str(e) and "kernel.cu(3)" in str(got)
    assert (got.call, got.name, got.log, got.version) == (e.call, e.name, e.log, e.version)
    d = CudaDriverError("cuLaunchKernel", 701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources")
    got = pickle.loads(pickle.dumps(d))
    assert type(got) is CudaDriverError and str(got) == str(d) and got.code == 701


def test_unknown_architecture_is_an_nvrtc_error_with_the_log():
    _nvrtc_or_skip()
    with pytest.raises(NvrtcError) as info:
        _compiler.compile_kernels("sm_10", [_plan.all_kernel_names()[0]])
    e = info.value
    assert e.call == "nvrtcCompileProgram" and e.name == "NVRTC_ERROR_INVALID_OPTION"
    assert "gpu-architecture" in e.log and "--- NVRTC log ---" in str(e)
    assert e.version == _compiler.nvrtc_version_str() and f"NVRTC {e.version}" in str(e)


def test_broken_source_raises_nvrtc_error_with_the_log(monkeypatch):
    _nvrtc_or_skip()
    broken = {
        "softmax_common.cuh": "#pragma once\n",
        "softmax_fwd.cu": '#include "softmax_common.cuh"\n__global__ void k(int* p) { *p = undeclared_thing; }\n',
        "softmax_bwd.cu": "\n",
    }
    try:
        with monkeypatch.context() as mp:
            mp.setattr(_compiler, "sources", lambda: broken)
            with pytest.raises(NvrtcError) as info:
                _compiler.compile_kernels("sm_80", ["k"])
    finally:
        _compiler.source_hash.cache_clear()
    e = info.value
    assert e.call == "nvrtcCompileProgram" and e.name == "NVRTC_ERROR_COMPILATION"
    assert "undeclared_thing" in e.log and "softmax_fwd.cu" in e.log and "error" in e.log
    assert "undeclared_thing" in str(e) and e.version in str(e)
    # Restored: the real sources are back and hash as before.
    assert "FwdParams" in _compiler.sources()["softmax_fwd.cu"]


def test_sources_and_hash():
    srcs = _compiler.sources()
    assert {"softmax_common.cuh", "softmax_fwd.cu", "softmax_bwd.cu"} <= set(srcs)
    h = _compiler.source_hash()
    assert len(h) == 64 and int(h, 16) >= 0
    _compiler.source_hash.cache_clear()
    assert _compiler.source_hash() == h, "the source hash must be deterministic"


# ----------------------------------------------------------------------------------
# The disk cache of run-time compiled cubins.


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(d))
    assert _compiler.cache_dir() == d
    return d


def _no_compile(*a, **k):
    raise AssertionError("compile_kernels was called although the cache should have answered")


def test_cache_writes_then_answers_without_compiling(cache_dir, monkeypatch):
    _nvrtc_or_skip()
    names = [_plan.all_kernel_names()[0], _plan.all_kernel_names()[-1]]
    img, hit = _compiler.cached_compile("sm_80", names)
    assert hit is False
    _check_cubin(img, "sm_80", names)
    cubin, meta_path = _compiler.cache_paths("sm_80", names)
    assert cubin.parent == cache_dir and cubin.read_bytes() == img.image
    meta = json.loads(meta_path.read_text())
    assert meta["sha256"] == hashlib.sha256(img.image).hexdigest()
    assert meta["lowered"] == img.lowered and meta["arch"] == "sm_80"
    assert meta["source_hash"] == _compiler.source_hash() and meta["nvrtc"] == _compiler.nvrtc_version_str()
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([cubin.name, meta_path.name]), "temp files left"

    monkeypatch.setattr(_compiler, "compile_kernels", _no_compile)
    img2, hit2 = _compiler.cached_compile("sm_80", names)
    assert hit2 is True and img2.image == img.image and img2.lowered == img.lowered


def _fake_compiler(calls):
    def fake(arch, names=None):
        calls.append((arch, list(names)))
        return _compiler.CompiledImage(
            arch, ELF_MAGIC + b"fake " + arch.encode(), {n: "_Zfake" for n in names}, _compiler.nvrtc_version_str(), ""
        )

    return fake


def test_cache_recompiles_a_corrupted_cubin(cache_dir, monkeypatch):
    names = [_plan.all_kernel_names()[3]]
    calls = []
    monkeypatch.setattr(_compiler, "compile_kernels", _fake_compiler(calls))
    img, hit = _compiler.cached_compile("sm_90", names)
    assert hit is False and calls == [("sm_90", names)]
    cubin, meta_path = _compiler.cache_paths("sm_90", names)
    cubin.write_bytes(img.image[:-1] + b"X")  # same size, wrong sha256
    assert _compiler.cache_lookup("sm_90", names) is None
    img2, hit2 = _compiler.cached_compile("sm_90", names)
    assert hit2 is False and len(calls) == 2 and img2.image == img.image
    assert cubin.read_bytes() == img.image, "the corrupted cubin was not replaced"
    monkeypatch.setattr(_compiler, "compile_kernels", _no_compile)
    assert _compiler.cached_compile("sm_90", names)[1] is True


@pytest.mark.parametrize("damage", ["delete_cubin", "delete_meta", "garbage_meta", "meta_without_lowered"])
def test_cache_recompiles_when_files_are_missing_or_damaged(cache_dir, monkeypatch, damage):
    names = [_plan.all_kernel_names()[5]]
    calls = []
    monkeypatch.setattr(_compiler, "compile_kernels", _fake_compiler(calls))
    _compiler.cached_compile("sm_86", names)
    cubin, meta_path = _compiler.cache_paths("sm_86", names)
    if damage == "delete_cubin":
        cubin.unlink()
    elif damage == "delete_meta":
        meta_path.unlink()
    elif damage == "garbage_meta":
        meta_path.write_text("{not json")
    else:
        meta = json.loads(meta_path.read_text())
        del meta["lowered"]
        meta_path.write_text(json.dumps(meta))
    img, hit = _compiler.cached_compile("sm_86", names)
    assert hit is False and len(calls) == 2 and img.lowered == {names[0]: "_Zfake"}


def test_cache_keys_separate_arch_names_and_sources(cache_dir, monkeypatch):
    a, b = _plan.all_kernel_names()[:2]
    p = _compiler.cache_paths("sm_80", [a])
    assert p != _compiler.cache_paths("sm_90", [a])
    assert p != _compiler.cache_paths("sm_80", [b])
    assert p != _compiler.cache_paths("sm_80", [a, b])
    assert p == _compiler.cache_paths("sm_80", [a])
    try:
        with monkeypatch.context() as mp:
            srcs = dict(_compiler.sources())
            srcs["softmax_fwd.cu"] += "\n// edited\n"
            mp.setattr(_compiler, "sources", lambda: srcs)
            _compiler.source_hash.cache_clear()
            assert _compiler.cache_paths("sm_80", [a]) != p, "an edited source must not hit the old cache entry"
    finally:
        _compiler.source_hash.cache_clear()
    assert _compiler.cache_paths("sm_80", [a]) == p


def test_unwritable_cache_costs_only_a_compile(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(blocker / "cache"))
    calls = []
    monkeypatch.setattr(_compiler, "compile_kernels", _fake_compiler(calls))
    names = [_plan.all_kernel_names()[0]]
    for _ in range(2):
        img, hit = _compiler.cached_compile("sm_75", names)
        assert hit is False and img.image.startswith(ELF_MAGIC)
    assert len(calls) == 2


def test_the_spill_check_has_teeth():
    from types import SimpleNamespace

    entry = "ptxas info    : Function properties for _Zk\nptxas         .     {} bytes stack frame, {} bytes spill stores, {} bytes spill loads\n"

    def img(*b):
        return SimpleNamespace(log=entry.format(*b), lowered={"k": "_Zk"})

    _check_no_spills(img(0, 0, 0), "sm_90")
    for bad in [(8, 0, 0), (0, 4, 4), (0, 0, 4)]:
        with pytest.raises(AssertionError, match=r"sm_90: kernels with local memory .*\('k', "):
            _check_no_spills(img(*bad), "sm_90")
    # A known kernel may use up to its bytes, not more in any of the three.
    known = {"k": (8, 12, 4)}
    for ok in [(8, 12, 4), (0, 12, 0), (0, 0, 0)]:
        _check_no_spills(img(*ok), "sm_80", known)
    for bad in [(16, 12, 4), (8, 16, 4), (8, 12, 8)]:
        with pytest.raises(AssertionError, match="local memory"):
            _check_no_spills(img(*bad), "sm_80", known)
    with pytest.raises(AssertionError, match="local memory"):
        _check_no_spills(img(8, 12, 4), "sm_80", {"other": (8, 12, 4)})
    with pytest.raises(AssertionError, match="no resource report"):
        _check_no_spills(SimpleNamespace(log="", lowered={"k": "_Zk"}), "sm_90")


def test_known_local_memory_names_real_kernels():
    assert set(KNOWN_LOCAL_MEMORY) <= set(_compiler.ARCHS)
    names = set(_plan.all_kernel_names())
    for arch, known in KNOWN_LOCAL_MEMORY.items():
        assert set(known) <= names, f"{arch}: not kernels: {set(known) - names}"
        for name, caps in known.items():
            assert len(caps) == 3 and all(isinstance(c, int) and c >= 0 for c in caps) and any(caps), (arch, name)
