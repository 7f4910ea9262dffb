"""The benchmark's own logic, on the CPU: plan, dry run, peers' rules, reference checks, report.

The timed run needs a GPU; everything it decides and computes around the timings is tested here.
"""

from __future__ import annotations

import csv
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

from softbench import cases as C  # noqa: E402
from softbench import peers as P  # noqa: E402
from softbench import report as R  # noqa: E402

REQUIRED_COLUMNS = [
    "gpu",
    "driver",
    "torch",
    "commit",
    "date",
    "case",
    "provider",
    "dtype",
    "shape",
    "ms",
    "GB/s",
    "pct_copy",
]
ENV = {"gpu": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130", "commit": "abc1234", "date": "2026-12-01"}


def bench(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "bench_softmax.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


# ----------------------------------------------------------------------------------
# The plan.


def test_plan_covers_the_targets():
    cases = C.plan()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    for direction in ("fwd", "bwd"):
        for dt in C.DTYPES:
            sks = sorted(c.sk for c in cases if c.section == direction and c.dtype == dt)
            assert sks == sorted([32, 64, 128, 256, 512, 1000, 1024, 2048, 4096, 4097, 8192, 16384])
    for c in cases:
        if c.section in ("fwd", "bwd", "long"):
            # fixed total: within one row-multiple of rows of 2^29 (16-bit) / 2^28 (fp32) elements
            total = {2: 2**29, 4: 2**28}[c.itemsize]
            assert total - C.ROW_MULTIPLE * c.sk <= C.numel(c.shape) <= total, c.name
        if c.mask in ("bool", "add"):
            b, sq, sk = c.shape[0], c.shape[-2], c.sk
            assert c.mask_shape in ((b, 1, sq, sk), (b, 1, 1, sk)), c.name
    masked = {(c.mask, c.dtype, c.sk) for c in cases if c.section == "mask"}
    assert masked == {(m, dt, sk) for m in ("bool", "add") for dt in C.DTYPES for sk in (128, 1000, 2048, 4096, 16384)}
    assert C.MASK_SHAPES[128][-2:] == (128, 128) and C.MASK_SHAPES[128][0] >= 64  # a BERT-sized batch
    causal = [c for c in cases if c.section == "causal"]
    assert [(c.dtype, c.shape) for c in causal] == [("float16", (8, 32, 2048, 2048))]
    longs = {(c.direction, c.mask, c.dtype, c.sk) for c in cases if c.section == "long"}
    assert longs == {
        (d, m, dt, sk)
        for sk in (65536, 262144, 1048576)
        for dt in ("float16", "float32")
        for d, m in (("fwd", "none"), ("fwd", "bool"), ("bwd", "none"))
    }


def test_min_bytes_count_x_mask_and_y_once():
    rng = random.Random(7)
    for c in C.plan():
        n = math.prod(c.shape)
        item = {"float16": 2, "bfloat16": 2, "float32": 4}[c.dtype]
        if c.direction == "bwd":
            want = 3 * n * item  # y, dy read; dx written
        elif c.mask == "causal":  # x's visible keys only (query i sees keys j <= i + Sk - Sq)
            sq, sk = c.shape[-2], c.shape[-1]
            vis = sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)
            want = (n // (sq * sk) * vis + n) * item
        else:
            mask = math.prod(c.mask_shape) if c.mask_shape else 0
            want = 2 * n * item + mask * {"bool": 1, "add": item}.get(c.mask, 0)
        assert c.min_bytes == want, c.name
    c = rng.choice([c for c in C.plan() if c.mask == "causal"])
    sq = c.shape[-2]  # Sq == Sk: x's lower triangle and the diagonal, y whole
    assert c.min_bytes == (math.prod(c.shape) // sq * (sq + 1) // 2 + math.prod(c.shape)) * 2
    assert C.visible_keys((1, 1, 2, 5)) == 4 + 5  # Sq < Sk: keys 0..3, then all 5


def test_only_and_quick_select():
    assert {c.section for c in C.plan(C.parse_only("mask,causal"))} == {"mask", "causal"}
    sweep = C.plan(C.parse_only("sweep"))
    assert sweep and all(c.mask == "none" and c.section in ("fwd", "bwd", "long") for c in sweep)
    assert len(sweep) == sum(c.mask == "none" and c.section in ("fwd", "bwd", "long") for c in C.plan())
    quick = C.plan(quick=True)
    assert [c.name for c in quick] == list(C.QUICK)
    assert sum(c.compile for c in quick) == len(C.QUICK_COMPILE)
    assert not any(c.compile for c in C.plan(compile_on=False))
    with pytest.raises(ValueError, match="--only"):
        C.parse_only("fwd,bogus")


def test_dry_run_lists_cases_and_providers():
    r = bench("--dry-run")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for c in C.plan():
        assert c.name in out
    for p in P.PROVIDERS:
        assert p in out
    assert "DRY RUN" in out and "[host]" in out and "[memory]" in out and "[coldstart]" in out
    total = float(out.rsplit("total ", 1)[1].split(" s")[0])
    assert 0 < total < 420, "the full plan must fit the 7-minute budget by the dry run's own model"
    q = bench("--dry-run", "--quick")
    assert q.returncode == 0, q.stderr
    quick_total = float(q.stdout.rsplit("total ", 1)[1].split(" s")[0])
    assert quick_total < 90
    listed = [line.split()[0] for line in q.stdout.splitlines() if line.startswith("  ") and "providers:" in line]
    assert listed == list(C.QUICK)
    bad = bench("--dry-run", "--only", "fwd,nope")
    assert bad.returncode == 2 and "--only" in bad.stderr and "nope" in bad.stderr


# ----------------------------------------------------------------------------------
# Who can take what.


def _case(**kw) -> C.Case:
    base = dict(name="t", section="fwd", direction="fwd", dtype="float16", shape=(4096, 1024))
    base.update(kw)
    return C.Case(**base)


def test_apex_rows_per_block_matches_its_launch():
    # apex: warp = min(next_pow2(Sk), 32); 128 threads per block; 2 rows per warp up to 128 keys
    for sk in (1, 2, 7, 16, 31, 32, 33, 100, 128, 129, 1000, 4096, 4097, 16384):
        p = 1 << (sk - 1).bit_length()
        warp = min(p, 32)
        assert P.apex_rows_per_block(sk) == (128 // warp) * (2 if p <= 128 else 1), sk


def test_peer_rules():
    assert P.why_not("apex", _case(dtype="float32"))
    assert P.apex_kernel(_case())[0] == "scaled_softmax_cuda"
    assert P.why_not("apex", _case(shape=(4096, 32768)))
    add = _case(section="mask", shape=(8, 16, 512, 1000), mask="add", mask_shape=(8, 1, 512, 1000))
    assert "additive" in P.why_not("apex", add)
    boolean = _case(section="mask", shape=(8, 16, 512, 1000), mask="bool", mask_shape=(8, 1, 512, 1000))
    assert P.apex_kernel(boolean)[0] == "scaled_masked_softmax_cuda"
    wide = _case(section="mask", shape=(2, 16, 512, 8192), mask="bool", mask_shape=(2, 1, 512, 8192))
    assert P.apex_kernel(wide)[0] == "generic_scaled_masked_softmax_cuda"
    wider = _case(section="mask", shape=(2, 16, 512, 16384), mask="bool", mask_shape=(2, 1, 512, 16384))
    assert P.apex_kernel(wider)[0] is None  # 64 KB of shared memory: over the 48 KB apex gets
    padding = _case(section="long", shape=(2, 8, 512, 65536), mask="bool", mask_shape=(2, 1, 1, 65536))
    assert P.why_not("apex", padding)
    causal = _case(section="causal", shape=(8, 32, 2048, 2048), mask="causal")
    assert P.apex_kernel(causal)[0] == "scaled_upper_triang_masked_softmax_cuda"
    assert P.why_not("apex", _case(section="causal", shape=(1, 12, 128, 128), mask="causal"))  # 12 % 8
    assert P.apex_kernel(_case(direction="bwd", shape=(4096, 4096)))[0] == "scaled_masked_softmax_cuda"
    assert P.apex_kernel(_case(direction="bwd", shape=(4096, 8192)))[0] == "generic_scaled_masked_softmax_cuda"
    assert P.apex_kernel(_case(direction="bwd", shape=(4096, 16384)))[0] is None
    for p in ("quack", "liger", "torch.softmax"):
        assert P.why_not(p, _case()) is None
        assert P.why_not(p, boolean)
    assert P.why_not("liger", _case(shape=(64, 131072)))
    assert P.why_not("quack", _case(shape=(64, 1048576))) is None  # 16-bit forward still launches
    assert P.why_not("quack", _case(shape=(64, 1048576), direction="bwd"))
    assert P.why_not("quack", _case(shape=(64, 1048576), dtype="float32"))
    assert P.why_not("compile", _case()) and P.why_not("compile", _case(compile=True)) is None
    for c in C.plan():  # every case has us and at least one other provider
        assert P.applicable(c)[:2] == ["drvsoftmax", "eager"]


# ----------------------------------------------------------------------------------
# Inputs, the reference and the check, on CPU tensors against NumPy float64.

torch = pytest.importorskip("torch")
from softbench import runner  # noqa: E402

SMALL = [
    _case(name="plain", dtype="float32", shape=(37, 64)),
    _case(name="bool", section="mask", dtype="float32", shape=(2, 3, 6, 33), mask="bool", mask_shape=(2, 1, 6, 33)),
    _case(name="pad", section="long", dtype="float16", shape=(2, 3, 4, 40), mask="bool", mask_shape=(2, 1, 1, 40)),
    _case(name="add", section="mask", dtype="bfloat16", shape=(3, 2, 5, 9), mask="add", mask_shape=(3, 1, 5, 9)),
    _case(name="causal", section="causal", dtype="float32", shape=(2, 2, 5, 7), mask="causal"),
    _case(name="bwd", section="bwd", direction="bwd", dtype="float32", shape=(2, 3, 4, 17)),
]


def numpy_reference(case: C.Case, d: dict, scale: float) -> np.ndarray:
    """softmax / its backward over every row, float64, masks broadcast by NumPy."""
    if case.direction == "bwd":
        y = d["y"].double().numpy()
        dy = d["dy"].double().numpy()
        return (scale * y * (dy - (dy * y).sum(-1, keepdims=True))).reshape(-1, case.sk)
    z = d["x"].double().numpy() * scale
    if case.mask == "bool":
        z = np.where(np.broadcast_to(d["mask"].numpy(), z.shape), -np.inf, z)
    elif case.mask == "add":
        z = z + d["mask"].double().numpy()
    elif case.mask == "causal":
        sq, sk = z.shape[-2:]
        i, j = np.indices((sq, sk))
        z = np.where(j > i + (sk - sq), -np.inf, z)
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).reshape(-1, case.sk)


@pytest.mark.parametrize("case", SMALL, ids=[c.name for c in SMALL])
def test_reference_rows_match_numpy(case):
    torch.manual_seed(3)
    (d,) = runner.make_inputs(torch, case, 1, device="cpu")
    if case.mask in ("bool", "add"):
        hidden = d["mask"] if case.mask == "bool" else torch.isinf(d["mask"])
        assert not hidden[..., 0].any() and hidden.any()
    rows = runner.check_rows(torch, case.rows, case.sk, "cpu")
    assert rows[0] == 0 and rows[-1] == case.rows - 1
    for scale in (C.SCALE, 1.0):
        got = runner.reference(torch, case, d, rows, scale).numpy()
        want = numpy_reference(case, d, scale)[rows.numpy()]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_a_cpu_run_leaves_out_the_peers_that_take_cuda_tensors_only(monkeypatch):
    """Even where they import (a GPU machine with the peers installed): a --cpu-smoke run
    would hand them CPU tensors."""
    loaded = []
    for name in P.CUDA_ONLY:
        monkeypatch.setattr(P.Peers, "_load_" + name, lambda self, n=name: loaded.append(n), raising=False)
    peers = P.Peers(torch, P.PROVIDERS, cpu=True)
    assert loaded == []
    assert {n: peers.missing.get(n) for n in P.CUDA_ONLY} == {n: P.CPU_RUN for n in P.CUDA_ONLY}
    assert all(peers.available(n) for n in ("drvsoftmax", "eager", "torch.softmax"))
    on_gpu = P.Peers(torch, P.PROVIDERS)  # a GPU run loads them
    assert loaded == list(P.CUDA_ONLY) and all(on_gpu.available(n) for n in P.CUDA_ONLY)


@pytest.mark.parametrize("case", SMALL, ids=[c.name for c in SMALL])
def test_providers_agree_with_the_reference_on_cpu(case):
    """drvsoftmax (CPU path), the eager expression and torch.softmax pass the benchmark's check; a
    perturbed output fails it."""
    torch.manual_seed(5)
    (d,) = runner.make_inputs(torch, case, 1, device="cpu")
    rows = runner.check_rows(torch, case.rows, case.sk, "cpu")
    peers = P.Peers(torch, ("drvsoftmax", "eager", "torch.softmax"))
    assert not peers.missing, peers.missing
    for p in ("drvsoftmax", "eager", "torch.softmax"):
        if P.why_not(p, case):
            continue
        scale = 1.0 if p in P.PLAIN else C.SCALE
        ref = runner.reference(torch, case, d, rows, scale)
        out = peers.make(p, case)(d)
        rel, ok = runner.agree(out, ref, rows, case)
        assert ok, (p, rel)
        bad = out.clone().reshape(-1, case.sk)
        bad[rows[len(rows) // 2], 0] += 0.1 * float(ref.abs().max()) + 0.05
        assert not runner.agree(bad, ref, rows, case)[1], p
    scale_wrong = runner.reference(torch, case, d, rows, C.SCALE * 2)
    if case.direction == "fwd":  # the check tells a missing or doubled scale apart
        out = peers.make("drvsoftmax", case)(d)
        assert not runner.agree(out, scale_wrong, rows, case)[1]


def test_commit_from_argument_or_environment(monkeypatch):
    monkeypatch.setenv("DRVSOFTMAX_COMMIT", "feed123")
    assert runner.commit_id() == "feed123"
    assert runner.commit_id("cafe456") == "cafe456"


# ----------------------------------------------------------------------------------
# The report, on synthetic numbers.


def synthetic_rows(seed: int) -> tuple[list[R.Row], dict[str, float]]:
    """Rows for fwd/bwd/mask/host cases with random times; returns also the expected ratio per case."""
    rng = random.Random(seed)
    rows: list[R.Row] = [R.Row("copy", "copy", "float16", "1073741824", "copy", ms=1.0, gbps=4200.0, pct=100.0)]
    expected: dict[str, float] = {}
    picks = [c for c in C.plan() if c.section in ("fwd", "bwd", "mask")]
    for c in rng.sample(picks, 12):
        ours = rng.uniform(0.1, 3.0)
        rows.append(R.timed_row(c, "drvsoftmax", ours, 4200.0))
        peers = [p for p in P.applicable(c) if p != "drvsoftmax"]
        times = {p: rng.uniform(0.05, 4.0) for p in rng.sample(peers, rng.randint(1, len(peers)))}
        for p, t in times.items():
            rows.append(R.timed_row(c, p, t * 3.0, 4200.0))  # measured twice: the last one counts
            rows.append(R.timed_row(c, p, t, 4200.0))
        rows.append(R.error_row(c, "liger", "first call: RuntimeError: boom"))
        expected[c.name] = min(times.values()) / ours
    lone = C.plan()[0]
    rows.append(R.timed_row(lone, "drvsoftmax", 1.0, 4200.0))  # no peer: no ratio
    for p, us in (("drvsoftmax", 9.7), ("torch.softmax", 6.05), ("apex", 6.0), ("eager", 13.0)):
        rows.append(R.Row("host-f16-1x12x128x128", p, "float16", "1x12x128x128", "host", "fwd", "none", 128, us / 1e3))
    expected["host-f16-1x12x128x128"] = 6.0 / 9.7
    return rows, expected


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ratio_and_ahead_counting(seed):
    rows, expected = synthetic_rows(seed)
    comps = {c.case: c for c in R.compare(rows)}
    for name, ratio in expected.items():
        assert comps[name].ratio == pytest.approx(ratio, rel=1e-12), name
        assert comps[name].ahead == (ratio > 1.0)
        assert comps[name].within_noise == (ratio >= 0.98)
    assert comps[C.plan()[0].name].ratio is None
    assert comps["host-f16-1x12x128x128"].best == "apex"
    a, w, m = R.tally(comps.values())
    assert m == len(expected)
    assert a == sum(r > 1.0 for r in expected.values())
    assert w == sum(r >= 0.98 for r in expected.values())
    lines = R.summary_lines(ENV, rows)
    assert f"== ahead in {a} of {m} cases (within 2% of the best peer: {w} of {m})" in lines
    assert any(line.startswith("== host us per eager call") and "apex 6.00" in line for line in lines)
    c0 = next(iter(expected))
    line = R.case_line(comps[c0])
    assert line.startswith(c0) and f"ratio {expected[c0]:.2f}" in line and "%" in line


def test_gbps_and_pct_of_copy():
    c = C.plan(C.parse_only("mask"))[0]
    r = R.timed_row(c, "drvsoftmax", 0.5, 4000.0)
    assert r.gbps == pytest.approx(c.min_bytes / 0.5e6)
    assert r.pct == pytest.approx(100 * r.gbps / 4000.0)


def test_csv_columns_and_round_trip(tmp_path):
    rows, _ = synthetic_rows(4)
    path = tmp_path / (R.file_stem(ENV) + ".csv")
    sink = R.CsvSink(path, ENV)
    for r in rows:
        sink.add(r)
    assert path.name == "2026-12-01-nvidia-h200-580.159.04-abc1234.csv"
    with path.open(newline="") as f:
        header = next(csv.reader(f))
    assert header[: len(REQUIRED_COLUMNS)] == REQUIRED_COLUMNS
    assert header == list(R.CSV_FIELDS)
    env, back = R.read_csv(path)
    assert env == ENV
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        assert (a.case, a.provider, a.dtype, a.shape, a.section, a.note) == (
            b.case,
            b.provider,
            b.dtype,
            b.shape,
            b.section,
            b.note,
        )
        for x, y in ((a.ms, b.ms), (a.gbps, b.gbps), (a.pct, b.pct)):
            assert (x is None and y is None) or y == pytest.approx(x, rel=1e-5, abs=0.06)
    assert R.tally(R.compare(back)) == R.tally(R.compare(rows))
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        R.read_csv(bad)


def test_markdown_and_from_csv(tmp_path):
    rows, expected = synthetic_rows(5)
    md = R.markdown(
        ENV, rows, absent=[("x", "apex", "apex has no additive-mask kernel")], skipped=[("y", "time budget")]
    )
    assert "## Summary" in md and "| case | shape | GB/s | % of copy | best peer | ratio |" in md
    assert "apex has no additive-mask kernel" in md and "## Errors" in md and "## Skipped" in md
    path = tmp_path / "r.csv"
    sink = R.CsvSink(path, ENV)
    for r in rows:
        sink.add(r)
    res = bench("--from-csv", str(path))
    assert res.returncode == 0, res.stderr
    a, w, m = R.tally(R.compare(rows))
    assert f"ahead in {a} of {m} cases" in res.stdout
    assert (tmp_path / "r.md").is_file()


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [R.Row("copy", "copy", "float16", "1", "copy", ms=1.0, gbps=4200.0)]
    for c in C.plan(C.parse_only("sweep")):
        for p in ("drvsoftmax", "quack"):
            if P.why_not(p, c) is None:
                rows.append(R.timed_row(c, p, c.min_bytes / 4e12 * 1e3 * (1.1 if p == "quack" else 1.0), 4200.0))
    series = R.sweep_series(rows)
    assert set(series) == {(d, dt) for d in ("fwd", "bwd") for dt in C.DTYPES}
    out = tmp_path / "f.png"
    assert R.write_png(out, ENV, rows) is None
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------
# The whole run, on the CPU (tiny shapes, meaningless times): wiring, checks, files.


def test_cpu_smoke_run(tmp_path):
    r = bench("--cpu-smoke", "--no-compile", "--out", str(tmp_path), "--commit", "smoke01", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = tmp_path.glob("*.csv")
    assert path.name.endswith("-cpu-none-smoke01.csv")
    assert (tmp_path / (path.stem + ".md")).is_file() and (tmp_path / (path.stem + ".log")).is_file()
    env, rows = R.read_csv(path)
    assert env["commit"] == "smoke01" and env["gpu"] == "cpu"
    by = {(row.case, row.provider): row for row in rows}
    for name in C.QUICK:
        ours = by[(name, "drvsoftmax")]
        assert ours.ms and ours.ms > 0 and ours.gbps is not None and ours.pct is not None, name
        assert "max rel diff" in ours.note and "MISMATCH" not in ours.note, (name, ours.note)
        assert "max rel diff" in by[(name, "eager")].note
    assert not [row for row in rows if row.note.startswith("error")]
    assert ("host-f16-1x12x128x128", "torch.softmax") in by
    a, w, m = R.tally(R.compare(rows))
    assert m == len(C.QUICK) + 1  # every case has eager, and the host row its peers
    assert f"== ahead in {a} of {m} cases" in r.stdout


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")), reason="torch.compile on the CPU needs a C++ compiler"
)
def test_prewarm_shards_the_plan():
    """--prewarm makes the first call of each JIT-compiled provider once, on its shard of the cases."""
    # shard 1 of 4 of the quick plan holds its one torch.compile case
    assert [c.name for c in C.plan(quick=True)[1::4] if c.compile] == list(C.QUICK_COMPILE)
    r = bench("--prewarm", "compile", "--shard", "1/4", "--cpu-smoke", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[prewarm 1/4] 1 first calls, 0 failed" in r.stdout
    assert bench("--prewarm", "compile", "--shard", "4/4").returncode == 2
    assert bench("--prewarm", "apex").returncode == 2


def test_plan_note_names_the_tier_of_the_gpu_it_ran_on():
    """The note beside our timings is the planner's plan for the GPU's architecture: on sm_90
    the cluster tier for long rows, which a device-independent plan would call the loop tier."""
    import drvsoftmax

    long = next(c for c in C.all_cases() if c.name == "long-fwd-f16-sk65536")
    assert "cluster tier" in runner.plan_note(drvsoftmax, long, "sm_90")
    assert "loop tier" in runner.plan_note(drvsoftmax, long, "sm_80")
    short = next(c for c in C.all_cases() if c.name == "fwd-f16-sk16384")
    assert runner.plan_note(drvsoftmax, short, "sm_90").startswith("plan: register tier")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize(
    "script", ["long_rows", "loop_rows", "pipe_rows", "split_rows", "stream_rows", "xs_rows", "size_ceiling"]
)
def test_tier_scripts_parse_their_arguments_and_stop_without_a_gpu(script, capsys):
    """The scripts that time one tier beside another import on any machine, take their
    arguments, and without a CUDA GPU (or without torch) stop with status 2 and say what
    they need."""
    if _cuda_available():
        pytest.skip("a CUDA GPU is here: the scripts would run")
    import importlib

    mod = importlib.import_module(script)
    assert mod.main(["--reps", "1"]) == 2
    assert "needs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.main(["--reps", "one"])  # argparse refuses it


def test_tier_script_helpers():
    """The shared helpers of the tier scripts: % of copy per time, and --only."""
    import long_rows

    assert long_rows.pct(2e9, [1.0, 2.0], 4000.0) == " 50.0  25.0"
    args = long_rows.tier_args("doc", ["--only", "a", "b"], 7)
    assert args.reps == 7 and args.only == ["a", "b"]
    assert not hasattr(long_rows.tier_args("doc", [], 3, only=False), "only")


def test_host_launch_script_parses_its_arguments_and_stops_without_a_gpu(capsys):
    """benchmarks/host_launch.py imports on any machine, takes --calls and --repeats, and
    without a CUDA GPU (or without torch) stops with status 2 and says what it needs."""
    if _cuda_available():
        pytest.skip("a CUDA GPU is here: the script would run")
    import host_launch

    assert host_launch.main(["--calls", "1", "--repeats", "1"]) == 2
    assert "needs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_launch.main(["--calls", "one"])  # argparse refuses it


def test_host_times_take_turns_and_leave_out_a_failing_provider():
    """The host section's timing: providers take turns run by run; one that raises (on its
    first calls or later) is reported with its exception and the others are still timed;
    host_torch.py's rows take turns the same way."""
    import time

    import host_torch
    from softbench import timing as T

    seq = []

    class Dev:
        def sync(self):
            seq.append("sync")

    def call(name, fail_after=None):
        n = [0]

        def fn():
            n[0] += 1
            if fail_after is not None and n[0] > fail_after:
                raise RuntimeError(f"{name} broke")
            seq.append(name)

        return fn

    fns = {"a": call("a"), "dead": call("dead", 0), "late": call("late", 4), "b": call("b")}
    got = T.host_times_us(Dev(), fns, calls=2, repeats=3)
    assert list(got) == ["a", "dead", "late", "b"]
    assert isinstance(got["dead"], RuntimeError) and isinstance(got["late"], RuntimeError)
    for name in ("a", "b"):
        med, lo = got[name]
        assert 0 < lo <= med
    timed = [s for s in seq if s != "sync"][6:]  # after the warm-up calls (2 each of a, late, b)
    # turns a, late, b, a, b, ...: late ran its first run and broke in its second
    assert timed == ["a", "a", "late", "late", "b", "b"] + ["a", "a", "b", "b"] * 2, timed
    rows = {"x": lambda: seq.append("x"), "y": lambda: seq.append("y")}
    seq.clear()
    res = host_torch.time_rows_us(rows, lambda: None, 2, 2, time.perf_counter)
    assert set(res) == {"x", "y"} and seq[4:] == ["x", "x", "y", "y", "x", "x", "y", "y"]


# A stand-in for the cold-start child on the CPU: what it imported drvsoftmax from, and
# whether that copy's modules came with bytecode.
_COLD_PROBE = r"""
import importlib.util, json, os, sys
import drvsoftmax
from drvsoftmax import _plan
pyc = importlib.util.cache_from_source(_plan.__file__)
print(json.dumps({"from": drvsoftmax.__file__, "bytecode": os.path.isfile(pyc),
                  "sources": os.path.isdir(os.path.join(os.path.dirname(drvsoftmax.__file__), "cuda_src")),
                  "no_jit": os.environ.get("DRVSOFTMAX_NO_JIT"), "shape": sys.argv[1]}))
"""


def test_cold_start_children_run_a_copy_laid_out_as_installed(monkeypatch):
    from softbench import runner

    monkeypatch.setattr(runner, "COLD_CHILD", _COLD_PROBE)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    compiled, from_source = runner._cold_children()
    for res, with_bytecode in ((compiled, True), (from_source, False)):
        assert not res["from"].startswith(str(REPO)), res["from"]
        assert res["from"].endswith("drvsoftmax/__init__.py")
        assert res["bytecode"] is with_bytecode
        assert res["sources"] and res["no_jit"] == "1"
        assert res["shape"] == C.shape_str(C.COLDSTART_SHAPE)


def test_cold_start_children_refuse_a_package_imported_from_elsewhere(monkeypatch):
    from softbench import runner

    probe = "import json, sys; print(json.dumps({'from': sys.argv[0]}))"
    monkeypatch.setattr(runner, "COLD_CHILD", probe)
    with pytest.raises(RuntimeError, match="not from the copy"):
        runner._cold_children()


# ----------------------------------------------------------------------------------
# The peers' packing (benchmarks/peers_pack.py) and their setup on the GPU machine
# (benchmarks/peers_setup.sh), with small fake wheels: the groups a call carries, then the
# setup staging them call by call, joining the split wheel and installing every group.

# The wheels peers_setup.sh installs, by the names it looks for.
_PEER_WHEELS = (
    "liger_kernel",
    "quack_kernels",
    "apache_tvm_ffi",
    "torch_c_dlpack_ext",
    "nvidia_cutlass_dsl",
    "nvidia_cutlass_dsl_libs_core",
    "nvidia_cutlass_dsl_libs_base",
    "nvidia_cutlass_dsl_libs_cu13",
)


def _fake_wheel(folder: Path, dist: str, payload: bytes) -> Path:
    """An installable wheel of `dist` 0.1 with one module `fake_<dist>` holding `payload`."""
    import base64
    import hashlib
    import zipfile

    info = f"{dist}-0.1.dist-info"
    files = {
        f"fake_{dist}/__init__.py": b"",
        f"fake_{dist}/blob.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for name, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    path = folder / f"{dist}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def _fake_apex(root: Path) -> Path:
    for rel in (
        "csrc/megatron/scaled_softmax.cpp",
        "csrc/megatron/scaled_softmax_cuda.cu",
        "csrc/type_shim.h",
        "LICENSE",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"// {rel}\n")
    (root / "csrc/megatron/fused_dense.cpp").write_text("// not a softmax source\n")
    return root


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_peers_pack_groups_and_setup_joins_and_installs(tmp_path):
    import peers_pack

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    rng = random.Random(7)
    big = rng.randbytes(1_500_000)  # incompressible: split over groups of 1 MB
    for dist in _PEER_WHEELS:
        _fake_wheel(wheels, dist, big if dist.endswith("cu13") else dist.encode() * 1000)
    repo = tmp_path / "repo"  # the setup reads .peers/ beside its benchmarks/ folder
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy2(BENCH / "peers_setup.sh", repo / "benchmarks")
    out = repo / ".peers"
    args = ["--wheels", str(wheels), "--apex", str(_fake_apex(tmp_path / "apex")), "--out", str(out)]
    assert peers_pack.main([*args, "--group-mb", "1"]) == 0

    groups = sorted(p for p in out.iterdir() if p.is_dir())
    assert [g.name for g in groups] == ["c1", "c2"]
    for g in groups:
        assert sum(p.stat().st_size for p in g.rglob("*") if p.is_file()) <= 1_000_000
    # The small wheels and apex's softmax sources (nothing else of apex) in the first group,
    # the split wheel's parts filling the room left, each group with the split's sums.
    c1, c2 = groups
    assert sorted(p.name for p in (c1 / "whl").iterdir()) == sorted(
        f"{d}-0.1-py3-none-any.whl" for d in _PEER_WHEELS if not d.endswith("cu13")
    )
    assert sorted(p.name for p in (c1 / "apex_megatron").iterdir()) == [
        "LICENSE",
        "scaled_softmax.cpp",
        "scaled_softmax_cuda.cu",
        "type_shim.h",
    ]
    name = "nvidia_cutlass_dsl_libs_cu13"
    parts = sorted(p.name for g in groups for p in (g / "parts").glob(f"{name}.tar.xz.part-*"))
    assert parts == [f"{name}.tar.xz.part-00", f"{name}.tar.xz.part-01"]
    sums = (c1 / "parts" / f"{name}.sha256").read_text()
    assert sums == (c2 / "parts" / f"{name}.sha256").read_text()
    assert sums.splitlines()[0] == "parts 2"
    assert (
        "c1 (" in (out / "README.txt").read_text()
        and f"parts/{name}.tar.xz.part-01" in (out / "README.txt").read_text()
    )

    def setup() -> subprocess.CompletedProcess:
        env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "DRVSOFTMAX_PEERS": str(tmp_path / "peers")}
        env["PYTHON"] = sys.executable
        env["HOME"] = str(tmp_path)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the builds stop here even on a GPU machine
        return subprocess.run(
            ["bash", str(repo / "benchmarks" / "peers_setup.sh")], capture_output=True, text=True, env=env, timeout=300
        )

    # Call 1 carries c1: its wheels install, the split wheel waits for its other part.
    shutil.move(str(c2), tmp_path / "c2")
    r = setup()
    assert f"{name}: 1 of 2 parts here" in r.stdout, r.stdout + r.stderr
    assert "installed liger (1 wheels)" in r.stdout, r.stdout + r.stderr
    assert "quack: waiting for" in r.stdout
    # Call 2 carries c2 alone (what call 1 staged stays): joined, checked, installed.
    shutil.rmtree(c1)
    shutil.move(str(tmp_path / "c2"), c2)
    r = setup()
    assert f"joined {name} -> {name}-0.1-py3-none-any.whl" in r.stdout, r.stdout + r.stderr
    assert "installed quack (7 wheels)" in r.stdout, r.stdout + r.stderr
    peers = tmp_path / "peers"
    assert (peers / f"fake_{name}" / "blob.bin").read_bytes() == big
    assert all((peers / f"fake_{d}" / "__init__.py").is_file() for d in _PEER_WHEELS)
    # Without a GPU (none visible) the setup stops before the builds, saying so.
    assert r.returncode == 1 and "torch sees no GPU" in r.stdout


def test_peers_pack_refuses_a_group_below_1_mb(capsys):
    import peers_pack

    with pytest.raises(SystemExit):
        peers_pack.main(["--group-mb", "0.5", "--no-apex"])
    assert "--group-mb: expected at least 1 MB a group; got 0.50" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peers_pack.main(["--group-mb", "0", "--no-apex"])
    assert "--group-mb: expected at least 1 MB a group; got 0.00" in capsys.readouterr().err
