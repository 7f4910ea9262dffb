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


# Every sm_90 kernel must have no stack frame and no spills (ptxas's report, NVRTC 13.0); a
# kernel that starts spilling fails the test.  Mask elements of 8 bytes (int64/uint64/float64
# masks: 64-byte mask chunks, rare) are exempt as a family.  Other architectures are compiled
# (above) but not held to this rule.
def _exempt(name, known):
    return name in known or "smx_u64" in name or "double" in name


def _check_no_spills(img, arch, known=frozenset()):
    """ptxas's report of every kernel: no stack frame and no spills (an array or the
    kernel parameters sent to local memory show up as a stack frame), but for `known`."""
    pattern = (
        r"Function properties for (\S+)\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    )
    props = re.findall(pattern, img.log)
    assert {sym for sym, *_ in props} >= set(img.lowered.values()), f"{arch}: no resource report for some kernels"
    name_of = {low: name for name, low in img.lowered.items()}
    bad = [
        (name_of.get(sym, sym), frame, st, ld)
        for sym, frame, st, ld in props
        if (frame, st, ld) != ("0", "0", "0") and not _exempt(name_of.get(sym, sym), known)
    ]
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
    _check_no_spills(results["sm_90"], "sm_90")
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
    clean = SimpleNamespace(log=entry.format(0, 0, 0), lowered={"k": "_Zk"})
    _check_no_spills(clean, "sm_90")
    for bad in [(8, 0, 0), (0, 4, 4)]:
        with pytest.raises(AssertionError, match="local memory"):
            _check_no_spills(SimpleNamespace(log=entry.format(*bad), lowered={"k": "_Zk"}), "sm_90")
    with pytest.raises(AssertionError, match="no resource report"):
        _check_no_spills(SimpleNamespace(log="", lowered={"k": "_Zk"}), "sm_90")
