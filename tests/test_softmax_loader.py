"""build_ptx.py artifacts and the loader's fallback chain, on the CPU.

The driver is replaced by fakes: a fake driver version and fake device architectures
walk the chain (exact cubin, same-major cubin, cached cubin, PTX allowed, PTX too new,
no artifact, JIT forbidden), through real artifacts of two kernels and through
hand-written manifests (architectures no build makes, malformed manifests).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from drvsoftmax import _capi, _compiler, _loader, _params
from drvsoftmax._errors import KernelUnavailableError

ROOT = Path(__file__).resolve().parents[1]
K1 = "smx_fwd<smx_f16, MaskNone, 2, 1, true>"
K2 = "smx_bwd_loop<float, 4>"


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
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(tmp_path / "cache"))
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
        "drvsoftmax_sm_80_000.cubin",
        "drvsoftmax_sm_90_000.cubin",
        "drvsoftmax_compute_75_000.ptx",
        "drvsoftmax_compute_75_001.ptx",
        "drvsoftmax_compute_90_000.ptx",
        "drvsoftmax_compute_90_001.ptx",
    }
    for fname, e in m["files"].items():
        data = (artifacts_dir / fname).read_bytes()
        assert e["size"] == len(data)
        # cubins hold a group of kernels, PTX one kernel each (the driver JITs only what a call needs)
        want = {K1, K2} if e["kind"] == "cubin" else {[K1, K2][int(fname[-7:-4])]}
        assert set(e["lowered"]) == want
        if e["kind"] == "cubin":
            assert data[:4] == b"\x7fELF"
        else:
            assert b".version" in data and e["min_cuda"] >= 12000
            major, minor = (int(v) for v in e["ptx_version"].split("."))
            assert f".version {major}.{minor}".encode() in data
    # For programs in other languages: each kernel's symbol, signature and files, and the header.
    for k in (K1, K2):
        sym = m["symbols"][k]
        assert {sym["symbol"]} == {e["lowered"][k] for e in m["files"].values() if k in e["lowered"]}
        assert sym["params"] == _params.kernel_signature(k)
        assert sym["cubins"] == {a: f"drvsoftmax_{a}_000.cubin" for a in ("sm_80", "sm_90")}
        assert set(sym["ptx"]) == {"compute_75", "compute_90"}
    assert m["symbols"][K1]["params"][-1] == f"SmxFwdParams ({_params.FWD.size} bytes)"
    assert (artifacts_dir / m["header"]).read_text() == _capi.c_api_header()
    again = tmp_path / "again"
    _build(again, "--arch", "sm_80", "sm_90", "--ptx", "compute_75", "compute_90")
    assert (again / "manifest.json").read_bytes() == (artifacts_dir / "manifest.json").read_bytes()


def test_exact_cubin_first(chain):
    folder, loads, compiled = chain
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin == "packaged cubin drvsoftmax_sm_90_000.cubin"
    assert loads[-1][1][:4] == b"\x7fELF" and not compiled
    assert _loader.describe_source("sm_90", 13000).startswith("packaged cubin sm_90 for 2 of ")


def test_a_library_of_another_file_of_that_name_is_not_taken(chain, monkeypatch, tmp_path):
    """A library loaded earlier in the process from a file of the same name with other bytes
    (another package folder) is another library: the loader reads and loads this one."""
    import shutil

    folder, loads, compiled = chain

    def load(key, image):  # as the real one: remembered by key
        loads.append((key, image[:8]))
        lib = _loader._libraries[key] = ("lib", key)
        return lib

    monkeypatch.setattr(_loader, "_load_library", load)
    monkeypatch.setattr(_loader, "_libraries", {})
    k1, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin == "packaged cubin drvsoftmax_sm_90_000.cubin" and len(loads) == 1
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    fname = "drvsoftmax_sm_90_000.cubin"
    data = (other / fname).read_bytes() + b"\0" * 16
    (other / fname).write_bytes(data)
    m = json.loads((other / "manifest.json").read_text())
    m["files"][fname].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (other / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr(_loader, "ARTIFACT_DIR", other)
    _loader._read_artifacts.cache_clear()
    k2, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin == f"packaged cubin {fname}" and len(loads) == 2 and k2 != k1
    assert _loader.find_kernel(K1, "sm_90", 13000)[0] == k2 and len(loads) == 2  # and it is remembered


def _ptx_driver(folder) -> int:
    """The oldest driver version that takes the PTX this NVRTC wrote (13000 for NVRTC 13.0,
    13050 for 13.5: the build records it, and the loader compares against it)."""
    m = json.loads((folder / "manifest.json").read_text())
    return max(e["min_cuda"] for e in m["files"].values() if e["kind"] == "ptx")


def test_ptx_when_no_cubin_and_driver_is_new_enough(chain):
    folder, loads, compiled = chain
    drv = _ptx_driver(folder)
    k, origin = _loader.find_kernel(K1, "sm_75", drv)  # no sm_7x cubin; compute_90 is too new an arch
    assert origin.startswith("packaged PTX drvsoftmax_compute_75_000.ptx")
    k, origin = _loader.find_kernel(K1, "sm_100", drv)  # newest PTX the device can JIT
    assert origin.startswith("packaged PTX drvsoftmax_compute_90_000.ptx")
    assert not compiled


def test_ptx_too_new_for_the_driver_falls_back_to_nvrtc(chain):
    folder, loads, compiled = chain
    m = json.loads((folder / "manifest.json").read_text())
    need = m["files"]["drvsoftmax_compute_75_000.ptx"]["min_cuda"]
    k, origin = _loader.find_kernel(K1, "sm_75", need - 10)
    assert origin.startswith("NVRTC 13.0 cubin for sm_75")
    assert compiled == [("sm_75", (K1,))]


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
    need = m["files"]["drvsoftmax_compute_75_000.ptx"]["min_cuda"]
    with pytest.raises(KernelUnavailableError) as ei:
        _loader.find_kernel(K1, "sm_75", need - 10)
    msg = str(ei.value)
    assert "packaged cubin: none for sm_75" in msg
    assert "drvsoftmax_compute_75_000.ptx: needs a CUDA" in msg
    assert "forbidden (DRVSOFTMAX_NO_JIT" in msg
    assert not compiled
    assert _loader.describe_source("sm_75", need - 10, K1).startswith("nothing")
    assert "nothing (" in _loader.describe_source("sm_75", need - 10)


def test_force_jit_skips_artifacts(chain, monkeypatch):
    folder, loads, compiled = chain
    monkeypatch.setenv("DRVSOFTMAX_FORCE_JIT", "1")
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin.startswith("NVRTC") and not [ld for ld in loads if ld[0].startswith("pkg:")][:-1]


def test_corrupted_file_is_not_used(chain):
    folder, loads, compiled = chain
    p = folder / "drvsoftmax_sm_90_000.cubin"
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    k, origin = _loader.find_kernel(K1, "sm_90", _ptx_driver(folder))
    assert origin.startswith("packaged PTX drvsoftmax_compute_90_000.ptx")


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


@pytest.mark.requires_torch
def test_demo_checks_and_times_on_any_device(capsys):
    import torch

    from drvsoftmax.__main__ import run_demo

    assert run_demo(torch, torch.device("cpu"), shape=(1, 2, 16, 24), iters=2) == 0
    out = capsys.readouterr().out
    assert "max |drvsoftmax - float64 reference|" in out and "OK" in out
    assert "drvsoftmax" in out and "PyTorch eager" in out and "us/call" in out


def test_describe_each_kernel(chain, tmp_path, monkeypatch):
    folder, loads, compiled = chain
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(tmp_path / "cache"))
    other = "smx_bwd<float, 8, 1, false>"  # not in these (two-kernel) artifacts
    assert _loader.describe_source("sm_90", 13000, K1) == "packaged cubin drvsoftmax_sm_90_000.cubin"
    d = _loader.describe_source("sm_90", 13000, other)
    assert d.startswith("NVRTC") and "compiled on first use" in d and f"holding {other}" in d
    assert _loader.describe_source("sm_75", _ptx_driver(folder), K2).startswith(
        "packaged PTX drvsoftmax_compute_75_001"
    )


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

    # The section of sm_86 (a machine with a GPU lists its own architecture's too).
    lines = r.stdout.splitlines()
    start = lines.index("kernels for sm_86:") + 1
    listed = []
    for ln in lines[start:]:
        if not ln.startswith("  "):
            break
        listed.append(ln.strip().split(": ", 1)[0])
    assert listed == _plan.all_kernel_names()


# ----------------------------------------------------------------------------------
# The same-major rule, on hand-written manifests (fake cubins: the driver is faked).


def _fake_manifest(folder: Path, entries: dict, kernels=(K1, K2)) -> dict:
    """Write fake artifact files and a manifest of the installed sources for them."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for fname, (kind, arch) in entries.items():
        data = (b"\x7fELF" if kind == "cubin" else b"// ptx ") + fname.encode()
        (folder / fname).write_bytes(data)
        files[fname] = {
            "kind": kind,
            "arch": arch,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "lowered": {k: f"_Z{i}{arch}" for i, k in enumerate(kernels)},
        }
        if kind == "ptx":
            files[fname]["min_cuda"] = 13000
    m = {"format": 2, "source_hash": _compiler.source_hash(), "nvrtc": "13.0", "kernels": list(kernels), "files": files}
    (folder / "manifest.json").write_text(json.dumps(m))
    _loader._read_artifacts.cache_clear()
    return m


@pytest.fixture
def fake_chain(chain, tmp_path, monkeypatch):
    folder = tmp_path / "handmade"
    monkeypatch.setattr(_loader, "ARTIFACT_DIR", folder)
    _loader._read_artifacts.cache_clear()
    _, loads, compiled = chain
    return folder, loads, compiled


CUBINS = {f"c_{a}.cubin": ("cubin", a) for a in ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")}


@pytest.mark.parametrize(
    "device,want",
    [
        ("sm_87", "sm_86"),  # Jetson Orin: the newest sm_8x at or below 8.7
        ("sm_103", "sm_100"),  # B300
        ("sm_121", "sm_120"),  # DGX Spark
        ("sm_89", "sm_89"),  # exact first
        ("sm_86", "sm_86"),
        ("sm_88", "sm_86"),  # sm_89 is newer than the device: never
        ("sm_77", "sm_75"),
    ],
)
def test_newest_same_major_cubin(fake_chain, device, want):
    folder, loads, compiled = fake_chain
    _fake_manifest(folder, CUBINS)
    k, origin = _loader.find_kernel(K1, device, 13000)
    assert origin.startswith(f"packaged cubin c_{want}.cubin"), origin
    assert loads[-1][0].startswith(f"pkg:c_{want}.cubin:") and not compiled
    assert _loader.describe_source(device, 13000, K1) == f"packaged cubin c_{want}.cubin" + (
        "" if want == device else f" ({want})"
    )
    assert _loader.describe_source(device, 13000).startswith(f"packaged cubin {want} for 2 of ")


def test_sm_90_never_takes_sm_80_and_no_major_crosses(fake_chain):
    folder, loads, compiled = fake_chain
    _fake_manifest(folder, {k: v for k, v in CUBINS.items() if v[1] != "sm_90"})
    for device in ("sm_90", "sm_110", "sm_70"):
        k, origin = _loader.find_kernel(K1, device, 13000)
        assert origin.startswith(f"NVRTC 13.0 cubin for {device}"), origin
    assert not [ld for ld in loads if ld[0].startswith("pkg:")]
    assert [c[0] for c in compiled] == ["sm_90", "sm_110", "sm_70"]


def test_arch_specific_cubins_never_cross(fake_chain):
    folder, loads, compiled = fake_chain
    _fake_manifest(
        folder,
        {"a90.cubin": ("cubin", "sm_90a"), "a100.cubin": ("cubin", "sm_100a"), "a120.cubin": ("cubin", "sm_120a")},
    )
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)  # its own architecture: fine
    assert origin.startswith("packaged cubin a90.cubin")
    for device in ("sm_103", "sm_121", "sm_101"):
        k, origin = _loader.find_kernel(K1, device, 13000)
        assert origin.startswith("NVRTC"), (device, origin)
    assert [c[0] for c in compiled] == ["sm_103", "sm_121", "sm_101"]


def test_a_failing_cubin_falls_to_the_next_compatible_one(fake_chain):
    folder, loads, compiled = fake_chain
    _fake_manifest(folder, CUBINS)
    (folder / "c_sm_86.cubin").write_bytes(b"\x7fELF-tampered")  # fails its sha256
    k, origin = _loader.find_kernel(K1, "sm_87", 13000)
    assert origin.startswith("packaged cubin c_sm_80.cubin (sm_80)")
    assert "sha256" in _loader.describe_source("sm_87", 13000, K1)


def test_cached_run_time_cubin_comes_before_ptx_and_loads_under_no_jit(fake_chain, monkeypatch):
    folder, loads, compiled = fake_chain
    _fake_manifest(folder, {"p75.ptx": ("ptx", "compute_75")})
    img = _compiler.CompiledImage("sm_110", b"\x7fELF-cached", {K1: "_Zcached"}, "13.0", "")
    monkeypatch.setattr(_compiler, "cache_lookup", lambda arch, names: img if arch == "sm_110" else None)
    monkeypatch.setenv("DRVSOFTMAX_NO_JIT", "1")
    k, origin = _loader.find_kernel(K1, "sm_110", 13000)
    assert origin == "NVRTC 13.0 cubin for sm_110 (cached)" and k[2] == "_Zcached" and not compiled
    k, origin = _loader.find_kernel(K1, "sm_100", 13000)  # nothing cached for it: the PTX
    assert origin.startswith("packaged PTX p75.ptx")


# ----------------------------------------------------------------------------------
# Malformed manifests fall through; file names stay inside the artifact folder.


@pytest.mark.parametrize(
    "manifest",
    [
        "[]",
        "null",
        "1",
        '"text"',
        "{not json",
        '{"format": 2, "files": []}',
        '{"format": 2, "files": null}',
        '{"format": 99, "files": {}}',
    ],
)
def test_malformed_manifest_falls_through_to_nvrtc(fake_chain, manifest):
    folder, loads, compiled = fake_chain
    m = _fake_manifest(folder, CUBINS)
    text = manifest.replace('"format": 2,', f'"format": 2, "source_hash": "{m["source_hash"]}",')
    (folder / "manifest.json").write_text(text)
    _loader._read_artifacts.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k, origin = _loader.find_kernel(K1, "sm_90", 13000)
        assert origin.startswith("NVRTC") and not [ld for ld in loads if ld[0].startswith("pkg:")]
        from drvsoftmax.__main__ import collect_info

        info = collect_info(arch="sm_90")
    assert info["packaged"]["usable"] is False and info["packaged"]["problem"]


@pytest.mark.parametrize(
    "target,damage",
    [
        ("c90.cubin", lambda e: e.pop("kind")),
        ("c90.cubin", lambda e: e.update(kind="elf")),
        ("p75.ptx", lambda e: e.update(min_cuda="13.0")),
        ("p75.ptx", lambda e: e.update(min_cuda=None)),
        ("c90.cubin", lambda e: e.update(lowered=[K1])),
        ("c90.cubin", lambda e: e.update(lowered={K1: 5})),
        ("c90.cubin", lambda e: e.update(arch=90)),
        ("c90.cubin", lambda e: e.update(arch="compute_90")),
        ("c90.cubin", lambda e: e.pop("sha256")),
        ("c90.cubin", lambda e: e.clear()),
    ],
    ids=[
        "no kind",
        "bad kind",
        "text min_cuda",
        "null min_cuda",
        "list lowered",
        "int symbol",
        "int arch",
        "cubin as compute",
        "no sha",
        "empty",
    ],
)
def test_malformed_entry_is_skipped_and_the_rest_used(fake_chain, target, damage):
    folder, loads, compiled = fake_chain
    m = _fake_manifest(
        folder, {"c90.cubin": ("cubin", "sm_90"), "p75.ptx": ("ptx", "compute_75"), "c80.cubin": ("cubin", "sm_80")}
    )
    damage(m["files"][target])
    (folder / "manifest.json").write_text(json.dumps(m))
    _loader._read_artifacts.cache_clear()
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)
    art = _loader.artifacts()
    assert art.usable and set(art.rejected) == {target}, "the damaged entry must be reported"
    # The rest is used (the sm_80 cubin cannot serve sm_90; the compute_75 PTX can).
    assert origin == ("packaged cubin c90.cubin" if target == "p75.ptx" else "packaged PTX p75.ptx (JIT by the driver)")
    from drvsoftmax.__main__ import collect_info

    problems = {f["name"]: f["problem"] for f in collect_info(arch="sm_90")["packaged"]["files"]}
    assert all(problems[name] for name in art.rejected)


@pytest.mark.parametrize(
    "name", ["../outside.cubin", "../../etc/outside.cubin", "/tmp/outside.cubin", "sub/x.cubin", ".."]
)
def test_manifest_names_are_confined_to_the_folder(fake_chain, tmp_path, name):
    folder, loads, compiled = fake_chain
    outside = tmp_path / "outside.cubin"
    data = b"\x7fELF planted"
    outside.write_bytes(data)
    entry = {"kind": "cubin", "arch": "sm_90", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    entry["lowered"] = {K1: "_Zplanted"}
    m = {"format": 2, "source_hash": _compiler.source_hash(), "kernels": [K1], "files": {name: entry}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(m))
    _loader._read_artifacts.cache_clear()
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin.startswith("NVRTC") and not [ld for ld in loads if ld[0].startswith("pkg:")], (
        "a file outside the artifact folder was loaded"
    )
    assert name in _loader.artifacts().rejected


def test_symbolic_links_are_not_followed(fake_chain, tmp_path):
    folder, loads, compiled = fake_chain
    _fake_manifest(folder, {"c90.cubin": ("cubin", "sm_90")})
    real = tmp_path / "elsewhere.cubin"
    real.write_bytes((folder / "c90.cubin").read_bytes())  # same bytes: the sha256 matches
    (folder / "c90.cubin").unlink()
    (folder / "c90.cubin").symlink_to(real)
    k, origin = _loader.find_kernel(K1, "sm_90", 13000)
    assert origin.startswith("NVRTC") and not [ld for ld in loads if ld[0].startswith("pkg:")]


def test_info_does_not_report_missing_or_damaged_files(fake_chain):
    from drvsoftmax.__main__ import collect_info

    folder, loads, compiled = fake_chain
    _fake_manifest(
        folder, {"c90.cubin": ("cubin", "sm_90"), "c80.cubin": ("cubin", "sm_80"), "c86.cubin": ("cubin", "sm_86")}
    )
    (folder / "c90.cubin").unlink()
    (folder / "c80.cubin").write_bytes(b"\x7fELF other bytes")
    files = {f["name"]: f["problem"] for f in collect_info()["packaged"]["files"]}
    assert files == {"c80.cubin": "sha256 does not match the manifest", "c86.cubin": None, "c90.cubin": "missing"}
    assert _loader.describe_source("sm_90", 13000, K1).startswith("NVRTC")
    assert _loader.describe_source("sm_89", 13000, K1).startswith("packaged cubin c86.cubin (sm_86)")
    assert _loader.describe_source("sm_80", 13000, K1).startswith("NVRTC")


# ----------------------------------------------------------------------------------
# Environment switches and the logger.


@pytest.mark.parametrize("var", ["DRVSOFTMAX_NO_JIT", "DRVSOFTMAX_FORCE_JIT"])
@pytest.mark.parametrize("value", ["2", "maybe", "enabled", "1 0", "-1"])
def test_undocumented_switch_values_are_errors_naming_the_variable(chain, monkeypatch, var, value):
    from drvsoftmax import ArgumentValueError

    monkeypatch.setenv(var, value)
    with pytest.raises(ArgumentValueError, match=f"environment variable {var} must be one of .*got '{value}'"):
        _loader.find_kernel(K1, "sm_90", 13000)


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "0", "false", "No", "OFF", ""])
def test_documented_switch_values(monkeypatch, value):
    monkeypatch.setenv("DRVSOFTMAX_NO_JIT", value)
    assert _loader.jit_forbidden() is (value.strip().lower() in ("1", "true", "yes", "on"))


def test_no_jit_with_force_jit_warns(chain, monkeypatch):
    folder, loads, compiled = chain
    monkeypatch.setenv("DRVSOFTMAX_NO_JIT", "1")
    monkeypatch.setenv("DRVSOFTMAX_FORCE_JIT", "1")
    monkeypatch.setattr(_loader, "_warned_both", False)
    with (
        pytest.warns(RuntimeWarning, match="DRVSOFTMAX_NO_JIT and DRVSOFTMAX_FORCE_JIT are both set"),
        pytest.raises(KernelUnavailableError, match="forbidden"),
    ):
        _loader.find_kernel(K1, "sm_90", 13000)
    assert not loads and not compiled


def test_logger_reports_loader_decisions(chain, caplog):
    import logging

    folder, loads, compiled = chain
    with caplog.at_level(logging.DEBUG, logger="drvsoftmax"):
        _loader.find_kernel(K1, "sm_90", 13000)
        _loader.find_kernel(K1, "sm_75", 1000)  # PTX too new for this driver: NVRTC
    msgs = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "drvsoftmax"]
    assert ("INFO", next(m for lvl, m in msgs if "packaged cubin drvsoftmax_sm_90_000.cubin" in m)) in msgs
    assert any(lvl == "INFO" and "NVRTC 13.0 cubin for sm_75 (compiled now)" in m for lvl, m in msgs)


def test_logger_is_silent_by_default():
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import logging, drvsoftmax._loader as L; lg = logging.getLogger('drvsoftmax');"
            "print(lg.level, [type(h).__name__ for h in lg.handlers], lg.getEffectiveLevel() > logging.INFO)",
        ],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert r.stdout.split() == ["0", "['NullHandler']", "True"], r.stdout + r.stderr


def test_compile_is_logged_with_its_duration(tmp_path, monkeypatch, caplog):
    import logging

    try:
        _compiler.nvrtc_version()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(tmp_path / "c"))
    with caplog.at_level(logging.INFO, logger="drvsoftmax"):
        _compiler.cached_compile("sm_80", [K2])
    (msg,) = [r.getMessage() for r in caplog.records if "compiled 1 kernel(s) for sm_80" in r.getMessage()]
    secs = float(msg.rsplit(" in ", 1)[1].split()[0])
    assert 0 < secs < 600


# ----------------------------------------------------------------------------------
# What build_ptx builds.


def test_build_takes_the_packaged_kernels_and_resolves_architectures(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT))
    try:
        import build_ptx
    finally:
        sys.path.remove(str(ROOT))
    from drvsoftmax import _plan

    monkeypatch.setattr(_plan, "packaged_kernel_names", lambda: [K2])
    m = build_ptx.build([], [], tmp_path / "out")
    assert m["kernels"] == [K2] and m["files"] == {}
    assert json.loads((tmp_path / "out" / "build.json").read_text())["seconds"] >= 0
    assert build_ptx.resolve_archs(["all"]) == list(_compiler.ARCHS)
    assert build_ptx.resolve_archs(["sm_90", "all"])[0] == "sm_90"
    monkeypatch.setattr(build_ptx, "native_archs", lambda: ["sm_89"])
    assert build_ptx.resolve_archs(["native", "sm_120"]) == ["sm_89", "sm_120"]
    assert build_ptx._groups(list("abcdefg"), 3) == [["a", "b", "c"], ["d", "e", "f"], ["g"]]


# ----------------------------------------------------------------------------------
# On a GPU: the first call through per-kernel PTX is quick.


@pytest.mark.gpu
def test_first_call_through_packaged_ptx_takes_under_two_seconds(artifacts_dir, tmp_path):
    """A device with no cubin of its major and no NVRTC: the driver JITs one kernel's PTX."""
    script = f"""
import sys, time, numpy as np
from pathlib import Path
from drvsoftmax import _driver, _loader
_loader.ARTIFACT_DIR = Path({str(artifacts_dir)!r})
m = __import__("json").loads((_loader.ARTIFACT_DIR / "manifest.json").read_text())
drv = _driver.driver_version()
if min(e.get("min_cuda", 1 << 30) for e in m["files"].values()) > drv:
    print("SKIP this NVRTC writes PTX the driver cannot JIT"); sys.exit(0)
for f in list(m["files"]):
    if f.endswith(".cubin"):
        del m["files"][f]
(_loader.ARTIFACT_DIR / "manifest.json").write_text(__import__("json").dumps(m))
t = time.perf_counter()
dev = _driver.device(0)
dev.kernel({K1!r})
print("ORIGIN", dev.origins[{K1!r}], "SECONDS", time.perf_counter() - t)
"""
    import os
    import shutil

    art = tmp_path / "art"
    shutil.copytree(artifacts_dir, art)
    script = script.replace(repr(str(artifacts_dir)), repr(str(art)))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CUDA_CACHE_DISABLE": "1",
        "DRVSOFTMAX_NO_JIT": "1",
        "DRVSOFTMAX_CACHE_DIR": str(tmp_path / "empty-cache"),  # a cached cubin would come first
    }
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout)
    origin, secs = r.stdout.split("ORIGIN ", 1)[1].rsplit(" SECONDS ", 1)
    assert origin.startswith("packaged PTX drvsoftmax_compute_")
    assert float(secs) <= 2.0, f"first call through PTX took {float(secs):.2f} s"
