"""The run-time compile cache: damaged entries are rebuilt, nobody else's files are
trusted, concurrent processes compile an entry once, stale temporaries go, and
``cache clear`` empties it.  Compiles are faked (except in the concurrency test, which
counts real NVRTC compiles across processes), so this needs no GPU."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drvsoftmax import _compiler, _plan

ROOT = Path(__file__).resolve().parents[1]
NAMES = [_plan.all_kernel_names()[0]]
ELF = b"\x7fELF"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", str(d))
    monkeypatch.setattr(_compiler, "_warned", set())
    calls = []

    def fake(arch, names=None):
        calls.append((arch, list(names)))
        return _compiler.CompiledImage(arch, ELF + b" fake " + arch.encode(), {n: "_Zfake" for n in names}, "13.0", "")

    monkeypatch.setattr(_compiler, "compile_kernels", fake)
    monkeypatch.setattr(_compiler, "nvrtc_version_str", lambda: "13.0")
    return d, calls


def _fill(arch="sm_90"):
    img, hit = _compiler.cached_compile(arch, NAMES)
    assert hit is False
    return _compiler.cache_paths(arch, NAMES)


def test_folder_is_created_0700_and_entries_0600(cache):
    d, calls = cache
    cubin, meta = _fill()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cubin).st_mode) == 0o600 and stat.S_IMODE(os.stat(meta).st_mode) == 0o600
    assert _compiler.cached_compile("sm_90", NAMES)[1] is True and len(calls) == 1


@pytest.mark.parametrize(
    "meta",
    [
        "[]",
        "null",
        "1",
        '"x"',
        "{",
        "{}",
        '{"lowered": []}',
        '{"lowered": null}',
        '{"lowered": "sym"}',
        "WRONG_SYMBOL_TYPE",
        "OTHER_KERNEL",
        "OTHER_ARCH",
        "NO_SHA",
    ],
)
def test_damaged_metadata_is_rebuilt(cache, meta):
    d, calls = cache
    cubin, meta_path = _fill()
    good = json.loads(meta_path.read_text())
    special = {
        "WRONG_SYMBOL_TYPE": {**good, "lowered": {NAMES[0]: 7}},
        "OTHER_KERNEL": {**good, "lowered": {"k": "_Zk"}},
        "OTHER_ARCH": {**good, "arch": "sm_80"},
        "NO_SHA": {k: v for k, v in good.items() if k != "sha256"},
    }
    meta_path.write_text(json.dumps(special[meta]) if meta in special else meta)
    img, hit = _compiler.cached_compile("sm_90", NAMES)
    assert hit is False and len(calls) == 2 and img.lowered == {NAMES[0]: "_Zfake"}
    assert json.loads(meta_path.read_text()) == good, "the damaged entry was not rewritten"
    assert _compiler.cached_compile("sm_90", NAMES)[1] is True and len(calls) == 2


def test_tilde_in_the_cache_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DRVSOFTMAX_CACHE_DIR", "~/kernels")
    assert _compiler.cache_dir() == tmp_path / "kernels"
    monkeypatch.delenv("DRVSOFTMAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert _compiler.cache_dir() == tmp_path / "xdg" / "drvsoftmax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _compiler.cache_dir() == tmp_path / ".cache" / "drvsoftmax"


@pytest.mark.parametrize("mode", [0o775, 0o777, 0o722])
def test_group_or_world_writable_folder_is_refused(cache, mode):
    d, calls = cache
    d.mkdir(mode=0o700)
    os.chmod(d, mode)
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        img, hit = _compiler.cached_compile("sm_90", NAMES)
    assert hit is False and img.image.startswith(ELF)
    assert list(d.iterdir()) == [], "nothing may be written into a refused folder"
    _compiler.cached_compile("sm_90", NAMES)
    assert len(calls) == 2, "a refused folder is never read"


def _need_root():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to hand files to another user")


def test_folder_of_another_user_is_refused(cache):
    _need_root()
    d, calls = cache
    cubin, meta = _fill()
    os.chown(d, 12345, 12345)
    with pytest.warns(RuntimeWarning, match="owned by uid 12345"):
        assert _compiler.cached_compile("sm_90", NAMES)[1] is False
    assert len(calls) == 2


@pytest.mark.parametrize("which", ["cubin", "meta"])
@pytest.mark.parametrize("how", ["other owner", "group writable", "world writable", "symlink"])
def test_untrusted_entries_are_not_loaded(cache, tmp_path, which, how):
    d, calls = cache
    paths = dict(zip(("cubin", "meta"), _fill()))
    p = paths[which]
    if how == "other owner":
        _need_root()
        os.chown(p, 12345, 12345)
    elif how == "group writable":
        os.chmod(p, 0o620)
    elif how == "world writable":
        os.chmod(p, 0o602)
    else:  # a link to a copy elsewhere (same bytes, so only the link itself is wrong)
        outside = tmp_path / ("outside" + p.suffix)
        outside.write_bytes(p.read_bytes())
        p.unlink()
        p.symlink_to(outside)
    if how == "symlink":
        assert _compiler.cache_lookup("sm_90", NAMES) is None
    else:
        with pytest.warns(RuntimeWarning, match="owned by uid 12345|writable by group or others"):
            assert _compiler.cache_lookup("sm_90", NAMES) is None
    img, hit = _compiler.cached_compile("sm_90", NAMES)
    assert hit is False and len(calls) == 2
    assert not p.is_symlink() and p.stat().st_uid == os.geteuid() and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert _compiler.cached_compile("sm_90", NAMES)[1] is True, "the rebuilt entry is trusted again"


def test_stale_temporaries_are_removed(cache):
    d, calls = cache
    cubin, meta = _compiler.cache_paths("sm_90", NAMES)
    d.mkdir(mode=0o700)
    mine = d / (cubin.name + ".x1y2z3.tmp")  # this entry's, left by a killed writer
    old = d / "sm_80-0123456789abcdef0123456789abcdef.json.k9.tmp"  # another entry's, hours old
    fresh = d / "sm_86-0123456789abcdef0123456789abcdef.cubin.q7.tmp"  # another writer's, just now
    foreign = d / "notes.tmp"  # not ours
    for p in (mine, old, fresh, foreign):
        p.write_bytes(b"partial")
    past = time.time() - 2 * _compiler.STALE_TMP_SECONDS
    os.utime(old, (past, past))
    os.utime(foreign, (past, past))
    _compiler.cached_compile("sm_90", NAMES)
    assert not mine.exists() and not old.exists()
    assert fresh.exists() and foreign.exists()
    assert not cubin.with_suffix(".lock").exists(), "the entry lock is removed after use"


def test_cache_info_and_clear(cache):
    d, calls = cache
    _fill("sm_90")
    _fill("sm_80")
    (d / "sm_80-0123456789abcdef0123456789abcdef.cubin.a.tmp").write_bytes(b"x")
    (d / "README").write_text("not ours")
    info = _compiler.cache_info()
    assert (info.entries, info.files, info.archs) == (2, 5, {"sm_80": 1, "sm_90": 1})
    assert info.problem is None and info.bytes == sum(p.stat().st_size for p in d.iterdir() if p.name != "README")
    removed, freed = _compiler.cache_clear()
    assert removed == 5 and freed == info.bytes
    assert [p.name for p in d.iterdir()] == ["README"], "cache clear removes only the cache's own files"
    assert _compiler.cache_info().entries == 0


_WORKER = """
import hashlib, sys, time
from drvsoftmax import _compiler
real = _compiler.compile_kernels
def counted(arch, names=None):
    with open(sys.argv[1], "a") as f:
        f.write("compile\\n")
    time.sleep(1.0)  # a slow compile: the other processes arrive meanwhile
    return real(arch, names)
_compiler.compile_kernels = counted
img, hit = _compiler.cached_compile("sm_80", [sys.argv[2]])
print("RESULT", "hit" if hit else "compiled", hashlib.sha256(img.image).hexdigest())
"""


def test_concurrent_processes_compile_an_entry_once(tmp_path):
    try:
        _compiler.nvrtc_version()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    counter = tmp_path / "compiles"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRVSOFTMAX_CACHE_DIR": str(tmp_path / "cache")}
    name = _plan.all_kernel_names()[-1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(counter), name], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=600)[0].split("RESULT ", 1)[1].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert counter.read_text().count("compile") == 1, "the entry was compiled more than once"
    assert sorted(o[0] for o in outs) == ["compiled", "hit", "hit", "hit"]
    assert len({o[1] for o in outs}) == 1
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".cubin", ".json"]


def test_compiling_leaves_shared_one_byte_constants_alone():
    """NVRTC writes into the buffers it is given; a 1-byte `b" " * 1` is CPython's shared
    constant (also what `" ".encode()` returns), which once turned every printed space
    into a NUL after a compile with an empty log."""
    try:
        _compiler.nvrtc_version()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    code = (
        "from drvsoftmax import _compiler, _plan\n"
        "_compiler.compile_kernels('sm_80', [_plan.all_kernel_names()[-1]])\n"
        "print(b' ' * 1 == bytes([32]), ' '.encode() == bytes([32]), 'a b')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "True True a b\n"
