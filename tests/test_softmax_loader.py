"""build_ptx.py artifacts and the loader's fallback chain, on the CPU.

The driver is replaced by fakes: a fake driver version and fake device architectures
walk the chain (exact cubin, PTX allowed, PTX too new, no artifact, JIT forbidden).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from drvsoftmax import _compiler, _loader
from drvsoftmax._errors import KernelUnavailableError

ROOT = Path(__file__).resolve().parents[1]
K1 = "smx_fwd_reg<smx_f16, MaskNone, 4>"
K2 = "smx_bwd_loop<float>"


def _build(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "build_ptx.py"), "--out", str(out), "--kernels", K1, K2, "-v", *extra],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )


@pytest.fixture(scope="module")
def artifacts_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("prebuilt")
    _build(out, "--arch", "sm_80", "sm_90", "--ptx", "compute_75", "compute_90")
    return out


@pytest.fixture
def chain(monkeypatch, artifacts_dir, tmp_path):
    """The loader pointed at `artifacts_dir`, with a fake driver and a fake NVRTC."""
    import shutil

    folder = tmp_path / "pkg"
    shutil.copytree(artifacts_dir, folder)
    monkeypatch.setattr(_loader, "ARTIFACT_DIR", folder)
    monkeypatch.setattr(_loader, "_warned_stale", False)
    monkeypatch.delenv("DRVSOFTMAX_NO_JIT", raising=False)
    monkeypatch.delenv("DRVSOFTMAX_FORCE_JIT", raising=False)
    _loader._read_artifacts.cache_clear()
    loads = []

    def fake_load(key, image):
        loads.append((key, image[:8]))
        return ("lib", key)

    def fake_get_kernel(lib, lowered):
        return ("kernel", lib[1], lowered)

    compiled = []

    def fake_compile(arch, names):
        compiled.append((arch, tuple(names)))
        return _compiler.CompiledImage(
            arch, b"\x7fELF-fake", {n: "sym_" + str(len(n)) for n in names}, "13.0", ""
        ), False

    monkeypatch.setattr(_loader, "_load_library", fake_load)
    monkeypatch.setattr(_loader, "_get_kernel", fake_get_kernel)
    monkeypatch.setattr(_compiler, "cached_compile", fake_compile)
    yield folder, loads, compiled
    _loader._read_artifacts.cache_clear()


def test_manifest_content_and_byte_identical_rebuild(artifacts_dir, tmp_path):
    m = json.loads((artifacts_dir / "manifest.json").read_text())
    assert m["source_hash"] == _compiler.source_hash()
    assert m["nvrtc"] == _compiler.nvrtc_version_str()
    assert m["kernels"] == [K1, K2]
    assert set(m["files"]) == {
        "drvsoftmax_sm_80.cubin",
        "drvsoftmax_sm_90.cubin",
        "drvsoftmax_compute_75.ptx",
        "drvsoftmax_compute_90.ptx",
    }
    for fname, e in m["files"].items():
        data = (artifacts_dir / fname).read_bytes()
        assert e["size"] == len(data)
        assert set(e["lowered"]) == {K1, K2}
        if e["kind"] == "cubin":
            assert data[:4] == b"\x7fELF"
        else:
            assert b".version" in data and e["min_cuda"] >= 12000
            major, minor = (int(v) for v in e["ptx_version"].split("."))
            assert f".version {major}.{minor}".encode() in data
    again = tmp_path / "again"
    _build(again, "--arch", "sm_80", "sm_90", "--ptx", "compute_75", "compute_90")
    assert (again / "manifest.json").read_bytes() == (artifacts_dir / "manifest.json").read_bytes()


def test_exact_cubin_first(chain):
    folder, loads, compiled = chain
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin == "packaged cubin drvsoftmax_sm_90.cubin"
    assert loads[-1][1][:4] == b"\x7fELF" and not compiled
    assert _loader.describe_source("sm_90", 13000).startswith("packaged cubin drvsoftmax_sm_90")


def _ptx_driver(folder) -> int:
    """The oldest driver version that takes the PTX this NVRTC wrote (13000 for NVRTC 13.0,
    13050 for 13.5: the build records it, and the loader compares against it)."""
    m = json.loads((folder / "manifest.json").read_text())
    return max(e["min_cuda"] for e in m["files"].values() if e["kind"] == "ptx")


def test_ptx_when_no_cubin_and_driver_is_new_enough(chain):
    folder, loads, compiled = chain
    drv = _ptx_driver(folder)
    k, origin = _loader.find_kernel(K1, "sm_89", drv)  # no sm_89 cubin; compute_90 is too new an arch
    assert origin.startswith("packaged PTX drvsoftmax_compute_75.ptx")
    k, origin = _loader.find_kernel(K1, "sm_100", drv)  # newest PTX the device can JIT
    assert origin.startswith("packaged PTX drvsoftmax_compute_90.ptx")
    assert not compiled


def test_ptx_too_new_for_the_driver_falls_back_to_nvrtc(chain):
    folder, loads, compiled = chain
    m = json.loads((folder / "manifest.json").read_text())
    need = m["files"]["drvsoftmax_compute_75.ptx"]["min_cuda"]
    k, origin = _loader.find_kernel(K1, "sm_89", need - 10)
    assert origin.startswith("NVRTC 13.0 cubin for sm_89")
    assert compiled == [("sm_89", (K1,))]


def test_no_artifacts_uses_nvrtc(chain, tmp_path, monkeypatch):
    monkeypatch.setattr(_loader, "ARTIFACT_DIR", tmp_path / "nothing")
    _loader._read_artifacts.cache_clear()
    folder, loads, compiled = chain
    k, origin = _loader.find_kernel(K2, "sm_90", 13000)
    assert origin.startswith("NVRTC") and compiled == [("sm_90", (K2,))]


def test_jit_forbidden_lists_every_step(chain, monkeypatch):
    folder, loads, compiled = chain
    monkeypatch.setenv("DRVSOFTMAX_NO_JIT", "1")
    m = json.loads((folder / "manifest.json").read_text())
    need = m["files"]["drvsoftmax_compute_75.ptx"]["min_cuda"]
    with pytest.raises(KernelUnavailableError) as ei:
        _loader.find_kernel(K1, "sm_86", need - 10)
    msg = str(ei.value)
    assert "packaged cubin: none for sm_86" in msg
    assert "drvsoftmax_compute_75.ptx: needs a CUDA" in msg
    assert "forbidden (DRVSOFTMAX_NO_JIT" in msg
    assert not compiled
    assert _loader.describe_source("sm_86", need - 10).startswith("nothing")


def test_force_jit_skips_artifacts(chain, monkeypatch):
    folder, loads, compiled = chain
    monkeypatch.setenv("DRVSOFTMAX_FORCE_JIT", "1")
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin.startswith("NVRTC") and not loads[:-1]


def test_corrupted_file_is_not_used(chain):
    folder, loads, compiled = chain
    p = folder / "drvsoftmax_sm_90.cubin"
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    k, origin = _loader.find_kernel(K1, "sm_90", _ptx_driver(folder))
    assert origin.startswith("packaged PTX drvsoftmax_compute_90.ptx")


def test_stale_artifacts_are_ignored_and_reported_once(chain):
    folder, loads, compiled = chain
    m = json.loads((folder / "manifest.json").read_text())
    m["source_hash"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(m))
    _loader._read_artifacts.cache_clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            k, origin = _loader.find_kernel(K1, "sm_90", 13000)
            assert origin.startswith("NVRTC")
    stale = [x for x in w if "other kernel sources" in str(x.message)]
    assert len(stale) == 1


def test_info_without_a_gpu_still_reports():
    r = subprocess.run(
        [sys.executable, "-m", "drvsoftmax", "info"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr
    for needle in ("drvsoftmax ", "cuda-bindings", "NVRTC", "run-time compile cache", "packaged artifacts"):
        assert needle in r.stdout


def test_demo_checks_and_times_on_any_device(capsys):
    torch = pytest.importorskip("torch")
    from drvsoftmax.__main__ import run_demo

    assert run_demo(torch, torch.device("cpu"), shape=(1, 2, 16, 24), iters=2) == 0
    out = capsys.readouterr().out
    assert "max |drvsoftmax - float64 reference|" in out and "OK" in out
    assert "drvsoftmax" in out and "PyTorch eager" in out and "us/call" in out


def test_describe_each_kernel(chain, tmp_path, monkeypatch):
    folder, loads, compiled = chain
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(tmp_path / "cache"))
    other = "smx_bwd_short<float, 4>"  # not in these (two-kernel) artifacts
    assert _loader.describe_source("sm_90", 13000, K1) == "packaged cubin drvsoftmax_sm_90.cubin"
    d = _loader.describe_source("sm_90", 13000, other)
    assert d.startswith("NVRTC") and "compiled on first use" in d and f"holding {other}" in d
    assert _loader.describe_source("sm_89", _ptx_driver(folder), K2).startswith("packaged PTX drvsoftmax_compute_75")


def test_info_lists_every_kernel_for_an_architecture():
    r = subprocess.run(
        [sys.executable, "-m", "drvsoftmax", "info", "--kernels", "--arch", "sm_86"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr
    from drvsoftmax import _plan

    listed = [ln.strip().split(": ", 1)[0] for ln in r.stdout.splitlines() if ln.startswith("  smx_")]
    assert listed == _plan.all_kernel_names()
