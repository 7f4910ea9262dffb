"""``python -m drvsoftmax``: --version, info --json (stable keys), cache info/clear, precompile.

Runs without a GPU: device entries are empty there, and ``info`` describes an
architecture instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import drvsoftmax
from drvsoftmax import _compiler, _plan
from drvsoftmax.__main__ import main

ROOT = Path(__file__).resolve().parents[1]

# The documented keys of `info --json` (README.md); changing them breaks users' scripts.
INFO_KEYS = {
    "drvsoftmax",
    "python",
    "packages",
    "nvrtc",
    "kernel_sources",
    "kernels",
    "packaged",
    "cache",
    "switches",
    "driver",
    "devices",
    "archs",
}
PACKAGED_KEYS = {"folder", "usable", "problem", "nvrtc", "kernels", "build_seconds", "files"}
FILE_KEYS = {"name", "kind", "arch", "size", "kernels", "min_cuda", "problem"}
DEVICE_KEYS = {"ordinal", "name", "arch", "sm_count", "kernels_from"}


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "drvsoftmax", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_version():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"drvsoftmax {drvsoftmax.__version__}"
    from importlib.metadata import PackageNotFoundError, version

    with contextlib.suppress(PackageNotFoundError):  # a source tree that is not installed has no metadata
        assert version("drvsoftmax") == drvsoftmax.__version__, "installed metadata and __version__ differ"


def test_info_json_has_the_documented_keys(tmp_path):
    r = _cli("info", "--json", "--kernels", "--arch", "sm_86", env={"DRVSOFTMAX_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d) == INFO_KEYS
    assert set(d["packaged"]) == PACKAGED_KEYS
    assert all(set(f) == FILE_KEYS for f in d["packaged"]["files"])
    assert all(set(dev) == DEVICE_KEYS for dev in d["devices"])
    assert set(d["cache"]) == {"folder", "problem", "entries", "bytes"} and d["cache"]["folder"] == str(tmp_path)
    assert set(d["switches"]) == {"DRVSOFTMAX_NO_JIT", "DRVSOFTMAX_FORCE_JIT", "DRVSOFTMAX_CACHE_DIR", "problem"}
    assert set(d["driver"]) == {"cuda_version", "problem"}
    assert d["drvsoftmax"] == drvsoftmax.__version__ and d["kernels"] == len(_plan.all_kernel_names())
    assert d["kernel_sources"]["hash"] == _compiler.source_hash()
    assert sorted(d["archs"]["sm_86"]["kernels"]) == sorted(_plan.all_kernel_names())
    assert d["archs"]["sm_86"]["kernels_from"].endswith(f"of {d['kernels']} kernels")


def test_info_reports_a_bad_switch_instead_of_failing():
    r = _cli("info", "--json", env={"DRVSOFTMAX_FORCE_JIT": "sometimes"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert "DRVSOFTMAX_FORCE_JIT must be one of" in d["switches"]["problem"]
    assert all(a["kernels_from"].startswith("cannot tell") for a in d["archs"].values())


def test_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setattr(
        _compiler,
        "compile_kernels",
        lambda arch, names: _compiler.CompiledImage(arch, b"\x7fELF x", {n: "_Z" for n in names}, "13.0", ""),
    )
    for name in _plan.all_kernel_names()[:3]:
        _compiler.cached_compile("sm_90", [name])
    assert main(["cache", "info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["entries"], d["files"], d["archs"], d["problem"]) == (3, 6, {"sm_90": 3}, None)
    assert main(["cache", "clear"]) == 0
    assert "removed 6 file(s)" in capsys.readouterr().out
    assert main(["cache", "info"]) == 0
    assert "0 entries (0 files), 0 bytes" in capsys.readouterr().out
    assert list((tmp_path / "c").iterdir()) == []


def test_precompile_fills_the_cache_the_loader_reads(tmp_path):
    try:
        _compiler.nvrtc_version()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    name = _plan.all_kernel_names()[-1]
    env = {"DRVSOFTMAX_CACHE_DIR": str(tmp_path), "DRVSOFTMAX_FORCE_JIT": "1"}
    r = _cli("precompile", "--arch", "sm_80", "--kernels", name, "--jobs", "1", env=env)
    assert r.returncode == 0, r.stderr
    assert "1 compiled, 0 already cached" in r.stdout
    r = _cli("precompile", "--arch", "sm_80", "--kernels", name, env=env)
    assert "0 compiled, 1 already cached" in r.stdout
    r = _cli("info", "--json", "--kernels", "--arch", "sm_80", env={**env, "DRVSOFTMAX_NO_JIT": "0"})
    kernels = json.loads(r.stdout)["archs"]["sm_80"]["kernels"]
    assert kernels[name].startswith("cached cubin NVRTC")
    assert sum(v.startswith("cached cubin") for v in kernels.values()) == 1


def test_precompile_needs_an_architecture_without_a_gpu(tmp_path):
    from helpers import cuda_available

    if cuda_available():
        pytest.skip("a GPU is visible: precompile takes its architecture")
    r = _cli("precompile", env={"DRVSOFTMAX_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 2 and "--arch sm_90" in r.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["precompile", "--arch", "compute_75"], "--arch must be an sm_XY architecture, got 'compute_75'"),
        (["precompile", "--arch", "sm_80", "--kernels", "nope"], "--kernels must be kernel names"),
        (["info", "--arch", "gfx90a"], "arch must be of the form 'sm_XY' or 'compute_XY', got 'gfx90a'"),
    ],
)
def test_bad_arguments_are_reported_not_raised(tmp_path, args, needle):
    r = _cli(*args, env={"DRVSOFTMAX_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
