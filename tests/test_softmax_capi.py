"""drvsoftmax.h, the manifest's symbols table and examples/c: the packaged kernels for C.

* The header in the tree is what `_capi.c_api_header()` writes, and build_ptx.py puts the
  same text beside the cubins.
* It compiles as C (C99, C11) and C++ with warnings as errors; a wrong size or offset in
  its static checks fails the compile.
* Its launch-shape rule and parameter filling agree with the Python planner and
  `_core.forward_params`/`backward_params` byte for byte over many random layouts (a C
  harness, tests/capi_harness.c, built with `cc`), and a header with a planner table or a
  magic-number rule off by one disagrees.
* The manifest of installed artifacts gives every packaged kernel's symbol and signature.
* examples/c/main.c compiles against the real cuda.h where it is present, and runs on the CPU
  against a stand-in driver library (tests/fake_cuda) on real build_ptx.py artifacts: exact,
  same-major and PTX files, a kernel that ignores the mask fails its check, missing kernels
  are named.
* GPU (skipped without one, cc or cuda.h): main.c built with the system compiler against
  cuda.h and libcuda, run on the packaged cubins (built here when none serves the device).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from drvsoftmax import _capi, _core, _params, _plan
from drvsoftmax._errors import DrvSoftmaxError

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).resolve().parent / "capi_harness.c"
CC = shutil.which("cc")
CXX = shutil.which("c++")
needs_cc = pytest.mark.skipif(CC is None, reason="needs a C compiler (cc)")
DTYPES = list(_plan.X_DTYPES)
KINDS = list(_plan.MASK_KINDS)
ERR = {"ok": 0, "broadcastable": 2, "unmergeable": 3, "blocks of rows": 4}


def test_the_header_in_the_tree_is_current():
    assert _capi.header_path().read_text() == _capi.c_api_header(), "run `python -m drvsoftmax._capi`"


def test_the_header_carries_the_one_layout_and_the_planner_tables():
    h = _capi.c_api_header()
    assert "\n".join(_params.c_layout()) in h
    for limit, nch, rpt, _ in _plan.FWD_TABLE:
        assert f"{{{limit}, {nch}, {rpt}}}" in h
    for n in _plan.packaged_kernel_names():
        assert f'"{n}",' in h
    assert f"SMX_FWD_NUM_ARGS {len(_params.kernel_signature(_plan.kernel_fwd('float32', 'none', 2, 2)))}" in h


def _compile(
    tmp_path: Path, text: str, lang: str, std: str, compiler: str | None = None
) -> subprocess.CompletedProcess:
    hdr = tmp_path / "drvsoftmax.h"
    hdr.write_text(text)
    src = tmp_path / ("t.c" if lang == "c" else "t.cpp")
    src.write_text('#include "drvsoftmax.h"\nint main(void) { return 0; }\n')
    cmd = [compiler or CC, "-x", lang, f"-std={std}", "-Wall", "-Wextra", "-Werror", "-fsyntax-only"]
    return subprocess.run([*cmd, f"-I{tmp_path}", str(src)], capture_output=True, text=True)


@needs_cc
@pytest.mark.parametrize("lang,std", [("c", "c99"), ("c", "c11"), ("c++", "c++11"), ("c++", "c++17")])
def test_the_header_compiles(tmp_path, lang, std):
    compiler = CC if lang == "c" else CXX
    if compiler is None:
        pytest.skip("needs a C++ compiler (c++)")
    r = _compile(tmp_path, _capi.c_api_header(), lang, std, compiler)
    assert r.returncode == 0, r.stderr


@needs_cc
@pytest.mark.parametrize("what", ["size", "offset"])
def test_a_wrong_layout_fails_the_compile(tmp_path, what):
    h = _capi.c_api_header()
    if what == "size":
        good = f"sizeof(SmxBwdParams) == {_params.BWD.size}"
        bad = f"sizeof(SmxBwdParams) == {_params.BWD.size + 8}"
        expect = "SmxBwdParams size"
    else:
        off = _params.FWD.offsets["map_m.stride"]
        good = f"SMX_CHECK_OFFSET(SmxFwdParams, map_m.stride, {off})"
        bad = f"SMX_CHECK_OFFSET(SmxFwdParams, map_m.stride, {off + 8})"
        expect = "SmxFwdParams.map_m.stride"
    assert good in h
    r = _compile(tmp_path, h.replace(good, bad), "c", "c11")
    assert r.returncode != 0 and expect in r.stderr


# ----------------------------------------------------------------------------------
# The C launch-shape rule and parameter filling against Python's.


def _build_harness(tmp_path: Path, header: str) -> Path:
    inc = tmp_path / "inc"
    inc.mkdir(exist_ok=True)
    (inc / "drvsoftmax.h").write_text(header)
    exe = tmp_path / "harness"
    r = subprocess.run(
        [CC, "-O1", "-std=c11", "-Wall", "-Werror", f"-I{inc}", str(HARNESS), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return exe


SKS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 511, 512, 513]
SKS += [1000, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 8193, 16383, 16384, 16385, 32768, 65537]


def _dense(shape: list[int], r: random.Random, order: list[int] | None = None) -> list[int]:
    """Strides of a dense (possibly padded, possibly permuted) layout of `shape`."""
    nd = len(shape)
    strides = [0] * nd
    inner = 1 if r.random() < 0.85 else r.choice([2, 3])
    strides[-1] = inner
    pitch = shape[-1] * inner + (r.choice([0, 0, 1, 3, 8]) if r.random() < 0.3 else 0)
    lead = list(range(nd - 1)) if order is None else order
    for i in reversed(lead):
        strides[i] = pitch
        pitch *= shape[i]
        if r.random() < 0.15:
            pitch += r.choice([1, 8, 16])
    return strides


def _fwd_case(r: random.Random) -> dict:
    nd = r.randint(1, 5)
    sk = r.choice(SKS)
    lead = [r.choice([1, 1, 2, 3, 4, 5, 7, 8, 12, 16]) for _ in range(nd - 1)]
    if r.random() < 0.05 and nd >= 3:  # more than 2**31 rows: the 64-bit division path
        lead[0], lead[1] = 50000, 50000
        sk = r.choice([1, 8, 100])
    if r.random() < 0.03:  # the looped tier beyond the grid limit, or too many unmergeable dims
        nd, lead, sk = 3, [65536, 65536], 70000
    elif r.random() < 0.03:
        nd, lead, sk = 9, [2] * 8, 4
    shape = lead + [sk]
    perm = list(range(nd - 1))
    if r.random() < 0.3:
        r.shuffle(perm)
    xs = _dense(shape, r, perm)
    ys = list(xs) if r.random() < 0.5 else _dense(shape, r)
    if nd == 9:  # every dim padded: nothing merges
        xs = [0] * nd
        xs[-1], pitch = 1, 5
        for i in reversed(range(nd - 1)):
            xs[i] = pitch
            pitch = pitch * 2 + 1
        ys = list(xs)
    c = {"dtype": r.choice(DTYPES), "shape": shape, "xs": xs, "ys": ys, "mask": None, "klen": None}
    if r.random() < 0.6:
        mshape = [n if r.random() < 0.5 else 1 for n in shape]
        mshape = mshape[r.randint(0, nd - 1) :] if r.random() < 0.3 else mshape
        if r.random() < 0.03:
            mshape[-1] = sk + 1  # not broadcastable
        c["mask"] = (r.choice(KINDS[1:]), mshape, _dense(mshape, r))
    if r.random() < 0.3:
        c["klen"] = (r.choice([4, 8]), r.choice([1, 1, 2]))
    c["causal"] = nd >= 2 and r.random() < 0.3
    c["scale"] = r.choice([1.0, 0.125, -0.5, r.uniform(-4, 4)])
    c["aligned"] = r.random() < 0.8
    c["mask_aligned"] = r.random() < 0.8
    return c


def _bwd_case(r: random.Random) -> dict:
    f = _fwd_case(r)
    shape = f["shape"]
    return {
        "dtype": f["dtype"],
        "shape": shape,
        "dys": f["xs"],
        "ys": f["ys"],
        "dxs": list(f["xs"]) if r.random() < 0.5 else _dense(shape, r),
        "scale": f["scale"],
        "aligned": f["aligned"],
    }


def _ints(v: list[int]) -> str:
    return " ".join(str(int(a)) for a in v)


def _fwd_line(c: dict) -> str:
    shape = c["shape"]
    kind, mshape, mst = c["mask"] if c["mask"] else ("none", [], [])
    kb, kst = c["klen"] or (0, 0)
    return (
        f"F {DTYPES.index(c['dtype'])} {len(shape)} {_ints(shape)} {_ints(c['xs'])} {_ints(c['ys'])} "
        f"{KINDS.index(kind)} {len(mshape)} {_ints(mshape)} {_ints(mst)} {kb} {kst} {int(c['causal'])} "
        f"{c['scale']!r} {int(c['aligned'])} {int(c['mask_aligned'])}"
    )


def _bwd_line(c: dict) -> str:
    shape = c["shape"]
    return (
        f"B {DTYPES.index(c['dtype'])} {len(shape)} {_ints(shape)} {_ints(c['dys'])} {_ints(c['ys'])} "
        f"{_ints(c['dxs'])} {c['scale']!r} {int(c['aligned'])}"
    )


def _err_code(e: Exception) -> int:
    for key, code in ERR.items():
        if key in str(e):
            return code
    raise AssertionError(f"unexpected error {e!r}")


def _python_fwd(c: dict) -> tuple[int, str]:
    """(error code, 'kernel|launch numbers|params hex') as the harness prints it."""
    shape, dt = tuple(c["shape"]), c["dtype"]
    ptr = 0 if c["aligned"] else 2
    x = _core.Operand(ptr, dt, shape, tuple(c["xs"]))
    y = _core.Operand(ptr, dt, shape, tuple(c["ys"]))
    mask = None
    if c["mask"]:
        kind, mshape, mst = c["mask"]
        mdt = {"hide1": "bool", "hide2": "int16", "hide4": "int32", "hide8": "int64"}.get(kind, kind[4:])
        mask = _core.Operand(0, mdt, tuple(mshape), tuple(mst))
    klen = None
    if c["klen"]:
        klen = _core.Operand(0, "int32" if c["klen"][0] == 4 else "int64", (shape[0],), (c["klen"][1],))
    try:
        v, plan = _core.forward_params(x, y, mask, klen, c["causal"], c["scale"], c["aligned"], c["mask_aligned"])
    except DrvSoftmaxError as e:
        return _err_code(e), ""
    return 0, _describe(plan, _params.FWD.pack(v))


def _python_bwd(c: dict) -> tuple[int, str]:
    shape, dt = tuple(c["shape"]), c["dtype"]
    ptr = 0 if c["aligned"] else 2
    ops = [_core.Operand(ptr, dt, shape, tuple(c[k])) for k in ("dys", "ys", "dxs")]
    try:
        v, plan = _core.backward_params(*ops, c["scale"], c["aligned"])
    except DrvSoftmaxError as e:
        return _err_code(e), ""
    return 0, _describe(plan, _params.BWD.pack(v))


def _describe(plan: _plan.LaunchPlan, packed: bytes) -> str:
    loop = int(plan.tier == "loop")
    packaged = int(plan.kernel in _plan.packaged_kernel_names())
    nums = f"{loop} {plan.nch} {plan.rpt} {plan.tpr_log2} {plan.block} {plan.grid} {int(plan.vector)} {int(plan.whole)}"
    nums += f" {packaged}"
    return f"{plan.kernel}|{nums}|{packed.hex()}"


def _run(exe: Path, lines: list[str]) -> list[str]:
    r = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _disagreements(exe: Path, seed: int, n: int) -> tuple[int, list[str]]:
    r = random.Random(seed)
    cases = [("F", _fwd_case(r)) if i % 3 else ("B", _bwd_case(r)) for i in range(n)]
    lines = [_fwd_line(c) if k == "F" else _bwd_line(c) for k, c in cases]
    out = _run(exe, lines)
    assert len(out) == n
    bad, errors = [], 0
    for (k, c), line, got in zip(cases, lines, out):
        code, want = _python_fwd(c) if k == "F" else _python_bwd(c)
        rc, _, rest = got.partition("|")
        errors += code != 0
        if int(rc) != code or (code == 0 and rest != want):
            bad.append(f"{line}\n  C:      {got[:200]}\n  Python: {code}|{want[:200]}")
    return errors, bad


@needs_cc
def test_c_launch_shapes_and_params_match_python(tmp_path):
    exe = _build_harness(tmp_path, _capi.c_api_header())
    seed = int.from_bytes(os.urandom(4), "little")
    errors, bad = _disagreements(exe, seed, 3000)
    assert not bad, f"seed {seed}: {len(bad)} of 3000 disagree, e.g.\n" + "\n".join(bad[:3])
    assert errors > 10, f"seed {seed}: the error paths were hardly exercised ({errors} cases)"


@needs_cc
def test_c_packaged_kernel_list_matches_python(tmp_path):
    exe = _build_harness(tmp_path, _capi.c_api_header())
    out = _run(exe, ["P"])
    assert out[:-1] == _plan.packaged_kernel_names() and out[-1] == "--"


_ROW0 = "{" + ", ".join(str(v) for v in _plan.FWD_TABLE[0][:3]) + "}"  # the first forward table row


@needs_cc
@pytest.mark.parametrize(
    "good,bad",
    [
        (_ROW0, _ROW0.replace("{", "{1", 1)),  # a planner table limit changed
        ("block = warps;", "block = SMX_BLOCK_THREADS;"),  # rows of whole warps given a power-of-two block
        ("*shr = (smx_u32)(p - 32);", "*shr = (smx_u32)(p - 31);"),  # a magic shift off by one
        ("if (mst[nd - 1] == 1) flags |= SMX_F_MVEC;", ""),  # a flag forgotten
    ],
)
def test_a_header_that_drifts_from_python_is_caught(tmp_path, good, bad):
    h = _capi.c_api_header()
    assert good in h
    exe = _build_harness(tmp_path, h.replace(good, bad))
    _, disagree = _disagreements(exe, int.from_bytes(os.urandom(4), "little"), 3000)
    assert disagree, f"a header with {bad!r} for {good!r} went unnoticed"


# ----------------------------------------------------------------------------------
# The example program compiles against the real driver header.

CUDA_HOME = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


@needs_cc
@pytest.mark.skipif(not (CUDA_HOME / "include" / "cuda.h").is_file(), reason=f"needs {CUDA_HOME}/include/cuda.h")
@pytest.mark.parametrize("std", ["c99", "c11"])
def test_the_c_example_compiles(tmp_path, std):
    src = ROOT / "examples" / "c" / "main.c"
    cmd = [CC, f"-std={std}", "-Wall", "-Wextra", "-Werror", "-O2", f"-I{_capi.header_path().parent}"]
    cmd += [f"-I{CUDA_HOME / 'include'}", "-c", str(src), "-o", str(tmp_path / "main.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # No runtime API: the driver API alone.
    text = src.read_text()
    assert not re.search(r"\bcuda[A-Z]\w*\(", text) and "cuda_runtime" not in text


def test_the_installed_artifacts_list_every_packaged_kernel_for_c_programs():
    """Where the package carries prebuilt kernels (a wheel), its manifest gives every packaged
    kernel's symbol and signature, and the header beside it is the package's."""
    from drvsoftmax import _loader

    art = _loader.artifacts()
    if not art.usable or art.manifest is None:
        pytest.skip(f"no packaged artifacts here: {art.why_not}")
    assert "symbols" in art.manifest, f"{art.folder} was built by an older build_ptx.py: rebuild it"
    sym = art.manifest["symbols"]
    for n in _plan.packaged_kernel_names():
        assert sym[n]["params"] == _params.kernel_signature(n)
        if sym[n]["cubins"] or sym[n]["ptx"]:
            assert sym[n]["symbol"] == next(e["lowered"][n] for e in art.files.values() if n in e["lowered"])
    assert (art.folder / art.manifest["header"]).read_text() == _capi.c_api_header()


# ----------------------------------------------------------------------------------
# examples/c/main.c run on the CPU against a stand-in driver library (tests/fake_cuda:
# the driver API's declarations, and a libcuda that runs the forward kernel's contract on
# the host from the kernel's symbol and its SmxFwdParams), on real artifacts of build_ptx.py.

EXAMPLE_CASES = [  # (dtype, shape): a row misaligned to 16 bytes; fp32 mid-length; bf16 wide rows
    ("float16", (2, 3, 37, 203)),
    ("float32", (2, 4, 64, 1000)),
    ("bfloat16", (1, 2, 3, 4097)),
]

_ARCH = "from cuda.bindings import driver as d; d.cuInit(0); A = d.CUdevice_attribute; dev = d.cuDeviceGet(0)[1]; "
_ARCH += "print(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)[1] * 10 + "
_ARCH += "d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)[1])"


def _example_kernel(dtype: str, shape: tuple[int, ...], mask: bool = True) -> str:
    """The kernel examples/c/main.c picks: contiguous x, a bool mask [B, 1, Sq, Sk], all aligned."""
    B, H, Sq, Sk = shape
    x = _core.Operand(0, dtype, shape, (H * Sq * Sk, Sq * Sk, Sk, 1))
    m = _core.Operand(0, "bool", (B, 1, Sq, Sk), (Sq * Sk, Sq * Sk, Sk, 1)) if mask else None
    return _core.forward_params(x, x, m, None, False, 1.0, True, True)[1].kernel


FAKE = Path(__file__).resolve().parent / "fake_cuda"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """(folder with libcuda.so and softmax_demo, artifacts folder: sm_80 cubins + compute_75 PTX)."""
    if CC is None:
        pytest.skip("needs a C compiler (cc)")
    tmp = tmp_path_factory.mktemp("stand_in")
    inc = [f"-I{FAKE}", f"-I{_capi.header_path().parent}"]
    lib = [CC, "-O2", "-std=c11", "-Wall", "-Werror", "-shared", "-fPIC", *inc, str(FAKE / "libcuda.c")]
    subprocess.run([*lib, "-o", str(tmp / "libcuda.so"), "-lm"], check=True)
    exe = [CC, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", *inc, str(ROOT / "examples" / "c" / "main.c")]
    subprocess.run([*exe, "-o", str(tmp / "softmax_demo"), f"-L{tmp}", "-lcuda"], check=True)
    names = sorted({_example_kernel(dt, shape) for dt, shape in EXAMPLE_CASES})
    names.append(_example_kernel(*EXAMPLE_CASES[0], mask=False))
    cmd = [
        sys.executable,
        str(ROOT / "build_ptx.py"),
        "--arch",
        "sm_80",
        "--ptx",
        "compute_75",
        "--out",
        str(tmp / "a"),
    ]
    subprocess.run([*cmd, "--kernels", *names], check=True, capture_output=True, timeout=600)
    return tmp, tmp / "a"


def _demo(stand_in, cc: int, *args: str) -> subprocess.CompletedProcess:
    tmp, _ = stand_in
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp), FAKE_CUDA_CC=str(cc))
    return subprocess.run([str(tmp / "softmax_demo"), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("cc,source", [(80, "drvsoftmax_sm_80_000.cubin"), (86, "drvsoftmax_sm_80_000.cubin")])
@pytest.mark.parametrize("dtype,shape", EXAMPLE_CASES)
def test_the_c_example_on_a_stand_in_driver(stand_in, dtype, shape, cc, source):
    """Exact and same-major cubins; the header's kernel choice is Python's."""
    r = _demo(stand_in, cc, "--dtype", dtype, "--shape", *map(str, shape), str(stand_in[1]))
    assert r.returncode == 0 and "PASS" in r.stdout, (r.stdout, r.stderr)
    assert f"kernel {_example_kernel(dtype, shape)}:" in r.stdout and f"/{source} (device sm_{cc})" in r.stdout


def test_the_c_example_takes_ptx_checks_its_result_and_names_missing_kernels(stand_in):
    tmp, art = stand_in
    r = _demo(stand_in, 75, str(art))  # no sm_7x cubin: the compute_75 PTX
    assert r.returncode == 0 and "PASS" in r.stdout and ".ptx (device sm_75)" in r.stdout, (r.stdout, r.stderr)
    # A kernel that ignores the mask must fail the program's check.
    import json

    wrong = json.loads((art / "manifest.json").read_text())["symbols"][_example_kernel(*EXAMPLE_CASES[0], mask=False)]
    r = _demo(stand_in, 80, "--cubin", str(art / wrong["cubins"]["sm_80"]), "--symbol", wrong["symbol"])
    assert r.returncode == 1 and "FAIL" in r.stdout, (r.stdout, r.stderr)
    # A symbol the file does not hold is the driver's error.
    r = _demo(stand_in, 80, "--cubin", str(art / wrong["cubins"]["sm_80"]), "--symbol", wrong["symbol"] + "x")
    assert r.returncode == 2 and "cuLibraryGetKernel" in r.stderr and "CUDA_ERROR_NOT_FOUND" in r.stderr
    # A kernel the artifacts lack (rows past the register tier): named, with how to build it.
    r = _demo(stand_in, 80, "--shape", "1", "1", "2", "20000", str(art))
    assert r.returncode == 2 and _example_kernel("float16", (1, 1, 2, 20000)) in r.stderr, r.stderr
    # An architecture of another major with no PTX old enough: the build command to run.
    r = _demo(stand_in, 70, str(art))
    assert r.returncode == 2 and "build_ptx.py --arch sm_70" in r.stderr, r.stderr


# ----------------------------------------------------------------------------------
# GPU: examples/c built with the system compiler against cuda.h and libcuda, run on the
# packaged cubins (or, where the installed package has none for this GPU, on the few
# kernels it needs, built here by build_ptx.py with NVRTC).


def _device_cc() -> int:
    r = subprocess.run([sys.executable, "-c", _ARCH], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


def _artifacts_for(cc: int, names: list[str], tmp_path: Path) -> Path:
    """The installed package's artifact folder if it holds a cubin of every kernel in `names`
    for this device (same major, minor at most the device's), else a folder built now."""
    from drvsoftmax import _loader

    art = _loader.artifacts()
    if art.usable and art.manifest is not None and "symbols" in art.manifest:
        sym = art.manifest["symbols"]

        def serves(n: str) -> bool:
            archs = [int(a[3:]) for a in sym.get(n, {}).get("cubins", {}) if a[3:].isdigit()]
            return any(a // 10 == cc // 10 and a <= cc for a in archs)

        if all(serves(n) for n in names):
            return art.folder
    out = tmp_path / "prebuilt"
    cmd = [sys.executable, str(ROOT / "build_ptx.py"), "--arch", f"sm_{cc}", "--ptx", "--out", str(out)]
    subprocess.run([*cmd, "--kernels", *names], check=True, capture_output=True, text=True, timeout=600)
    return out


def _link_options() -> list[list[str]]:
    """Ways to link libcuda, tried in order: the toolkit's stub library (the driver's
    libcuda.so.1 is what loads at run time), the linker's own search, the driver's file."""
    import ctypes.util

    opts = [
        ["-L" + str(d), "-lcuda"] for d in (CUDA_HOME / "lib64" / "stubs", CUDA_HOME / "lib" / "stubs") if d.is_dir()
    ]
    opts += [["-lcuda"], ["-l:libcuda.so.1"]]
    found = ctypes.util.find_library("cuda")
    if found:
        opts.append([found if os.path.isabs(found) else "-l:" + found])
    return opts


@pytest.mark.gpu
@needs_cc
@pytest.mark.skipif(not (CUDA_HOME / "include" / "cuda.h").is_file(), reason=f"needs {CUDA_HOME}/include/cuda.h")
def test_the_c_example_runs_a_masked_forward_on_the_gpu(tmp_path):
    cc = _device_cc()
    names = sorted({_example_kernel(dt, shape) for dt, shape in EXAMPLE_CASES})
    wrong = _example_kernel(*EXAMPLE_CASES[0], mask=False)  # the same shape without the mask
    folder = _artifacts_for(cc, [*names, wrong], tmp_path)
    exe = tmp_path / "softmax_demo"
    # No -Werror here: warnings are the CPU tests' business; this one runs the program.
    base = [CC, "-O2", "-std=c11", "-Wall", f"-I{_capi.header_path().parent}", f"-I{CUDA_HOME / 'include'}"]
    base += [str(ROOT / "examples" / "c" / "main.c"), "-o", str(exe)]
    tried = []
    for link in _link_options():
        r = subprocess.run(base + link, capture_output=True, text=True)
        tried.append(f"{' '.join(link)}: {r.stderr.strip()[-300:]}")
        if r.returncode == 0:
            break
    else:
        pytest.fail("examples/c/main.c does not build:\n" + "\n".join(tried))
    for dt, shape in EXAMPLE_CASES:
        args = [str(exe), "--dtype", dt, "--shape", *map(str, shape), "--scale", "0.35", str(folder)]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "PASS" in r.stdout, (args, r.stdout, r.stderr)
        assert _example_kernel(dt, shape) in r.stdout  # the header chose what Python chooses
    # The checker has teeth: the kernel of the same shape that ignores the mask must FAIL.
    import json

    sym = json.loads((folder / "manifest.json").read_text())["symbols"][wrong]
    cubin = next(f for a, f in sorted(sym["cubins"].items()) if int(a[3:]) // 10 == cc // 10 and int(a[3:]) <= cc)
    dt, shape = EXAMPLE_CASES[0]
    args = [str(exe), "--dtype", dt, "--shape", *map(str, shape), "--cubin", str(folder / cubin)]
    r = subprocess.run([*args, "--symbol", sym["symbol"]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "FAIL" in r.stdout, (r.stdout, r.stderr)
