#!/usr/bin/env python3
"""drvsoftmax benchmarks: GB/s over the minimum bytes, beside a copy ceiling measured in the same run.

Usage (repository root, on a GPU machine):

    python3 benchmarks/bench_softmax.py --out DIR       # everything, about 5 minutes on an H200
    python3 benchmarks/bench_softmax.py --quick         # a subset, under a minute
    python3 benchmarks/bench_softmax.py --only sweep    # one section: fwd, bwd, sweep or host
    python3 benchmarks/bench_softmax.py --dry-run       # the plan, estimates and a CPU self-check; no CUDA

Sections, in the order they run (most important first, so that the time budget cuts the least):

    copy      device-to-device copy of 2 GiB (read + write): the ceiling every row is compared with
    host      host microseconds per eager call, [1,12,128,128] float16
    fwd       baseline shapes x {fp16, bf16, fp32}: drvsoftmax (add mask, bool mask, causal, none)
              against PyTorch eager
    bwd       the same shapes: drvsoftmax backward against torch._softmax_backward_data * scale
    sweep     row length 32 .. 1,048,576 at a fixed total (2^29 fp16 / 2^28 fp32 elements)
    compiled  torch.compile of the eager functions (fp16 and fp32 baseline shapes, the sweep and
              the host row), a fresh graph per shape and dtype; slow to compile, so it runs last
              (--no-compile leaves it out; --quick always does)

Every result is appended as it is measured to DIR/<date>-<gpu>-<commit>.csv (long format) and
summarised in DIR/<same>.md; the last lines printed are a compact table. benchmarks/README.md
says how time is measured and how bytes are counted.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import inspect
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

T0 = time.monotonic()  # the time budget counts from here, imports included
REPO = Path(__file__).resolve().parent.parent
if (REPO / "drvsoftmax" / "__init__.py").is_file() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark the checkout this script belongs to

torch = None  # imported by _import_torch(): a dry run touches no CUDA, and needs torch only for its self-check
DEVICE = "cuda"

# ----------------------------------------------------------------------------------
# What runs.

SCALE = 0.125  # 1/sqrt(64); a power of two, so x*s is exact in every dtype and eager and fused agree
SHAPES = (  # the baseline shapes (shared/baselines/h200-2026-11-29.md)
    (8, 32, 2048, 2048),
    (16, 16, 512, 1000),
    (2, 16, 512, 16384),
    (4, 32, 4096, 4096),
    (1, 8, 64, 65536),
    (1, 1, 64, 1048576),
    (1, 12, 128, 128),
)
DTYPES = ("float16", "bfloat16", "float32")
COMPILE_DTYPES = ("float16", "float32")  # torch.compile is slow to compile: not bf16
SWEEP_TOTAL = {"float16": 2**29, "float32": 2**28}  # elements: 1 GiB of x either way
SWEEP_SK = tuple(2**k for k in range(5, 21))  # 32 .. 1,048,576
HOST_SHAPE = (1, 12, 128, 128)
HOST_CALLS = 2000
HOST_REPEATS = 5
HOST_WARMUP_CALLS = 200
COPY_BYTES = 2 * 2**30
CASE_MAX_BYTES = 24e9  # a case whose own tensors need more is skipped
MASK_HIDDEN_FRACTION = 0.1

QUICK_SHAPES = ((8, 32, 2048, 2048), (16, 16, 512, 1000), (1, 12, 128, 128))
QUICK_DTYPES = ("float16",)
QUICK_SWEEP_DTYPES = ("float16",)
QUICK_SWEEP_SK = (128, 4096, 65536, 1048576)

# Timing (do_bench-like): warm-up, then MIN_REPS..MAX_REPS timed calls, median.
EST_CALLS = 5
WARMUP_MS = 25.0
TARGET_MS = 100.0
MIN_REPS, MAX_REPS = 20, 100
L2_FLUSH_BYTES = 200e6  # working sets below this rotate through several input copies (L2 is 60 MB)
MAX_COPIES = 256
QUEUE_FILL_BELOW_MS = 1.0  # calls shorter than this are timed behind a GPU sleep that lets the host run ahead
QUEUE_FILL_MS_PER_REP = 0.1
QUEUE_FILL_MAX_MS = 20.0
SLEEP_CYCLES_PER_MS = 2.0e6  # ~2 GHz SM clock; a slower clock only sleeps longer
CHECK_ELEMS = 2**22  # elements of each output compared with the eager reference

DEFAULT_BUDGET_S = 330.0
QUICK_BUDGET_S = 55.0
COMPILE_RESERVE_S = 12.0  # a compile starts only with this much budget left
FIRST_COMPILE_RESERVE_S = 30.0  # the first one also starts Inductor's workers
MAX_CONSECUTIVE_ERRORS = 15  # then the run stops (a broken CUDA context fails everything after it)
MAX_COMPILE_FAILURES = 3  # then the remaining torch.compile rows are skipped

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
SHORT_DTYPE = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-4}  # max |diff| / max |reference|


@dataclass(frozen=True)
class Method:
    key: str
    label: str  # the `method` column
    provider: str  # drvsoftmax | eager | compiled
    group: str  # add | bool | causal | none | plain | bwd: what it computes


METHODS = {
    m.key: m
    for m in (
        Method("ours-add", "drvsoftmax add-mask", "drvsoftmax", "add"),
        Method("eager-add", "eager softmax(x*s+m)", "eager", "add"),
        Method("compiled-add", "compiled softmax(x*s+m)", "compiled", "add"),
        Method("ours-bool", "drvsoftmax bool-mask", "drvsoftmax", "bool"),
        Method("eager-bool", "eager masked_fill(bool)+softmax", "eager", "bool"),
        Method("compiled-bool", "compiled masked_fill(bool)+softmax", "compiled", "bool"),
        Method("ours-causal", "drvsoftmax causal", "drvsoftmax", "causal"),
        Method("eager-causal", "eager masked_fill(triu)+softmax", "eager", "causal"),
        Method("compiled-causal", "compiled masked_fill(triu)+softmax", "compiled", "causal"),
        Method("ours-none", "drvsoftmax no-mask", "drvsoftmax", "none"),
        Method("eager-none", "eager softmax(x*s)", "eager", "none"),
        Method("compiled-none", "compiled softmax(x*s)", "compiled", "none"),
        Method("eager-plain", "torch.softmax(x) (no scale)", "eager", "plain"),
        Method("ours-bwd", "drvsoftmax bwd", "drvsoftmax", "bwd"),
        Method("eager-bwd", "eager _softmax_backward_data*s", "eager", "bwd"),
    )
}
REFERENCE = {
    "add": "eager-add",
    "bool": "eager-bool",
    "causal": "eager-causal",
    "none": "eager-none",
    "bwd": "eager-bwd",
}  # what each group's outputs are checked against (plain: nothing)
ARG_NAMES = {
    "add": ("x", "add"),
    "bool": ("x", "bool"),
    "causal": ("x",),
    "none": ("x",),
    "plain": ("x",),
    "bwd": ("dy", "y"),
}
FWD_METHODS = (
    "ours-add",
    "eager-add",
    "ours-bool",
    "eager-bool",
    "ours-causal",
    "eager-causal",
    "ours-none",
    "eager-none",
    "eager-plain",
)
BWD_METHODS = ("ours-bwd", "eager-bwd")
SWEEP_FWD_METHODS = ("ours-none", "eager-plain", "eager-none")
COMPILED_FWD_METHODS = ("compiled-add", "compiled-bool", "compiled-causal")
HOST_METHODS = (  # (key, label); measured in section host, the compiled one in section compiled
    ("host-ours", "drvsoftmax no-mask"),
    ("host-ours-out", "drvsoftmax no-mask, out="),
    ("host-ours-bool", "drvsoftmax bool-mask"),
    ("host-ours-stream", "drvsoftmax no-mask, side stream"),
    ("host-launcher", "drvsoftmax launcher only (_core.launch)"),
    ("host-bare", "bare cuLaunchKernel, empty kernel"),
    ("host-eager-none", "eager softmax(x*s)"),
    ("host-eager-plain", "torch.softmax(x) (no scale)"),
)
HOST_COMPILED = ("host-compiled-none", "compiled softmax(x*s)")


# ----------------------------------------------------------------------------------
# The functions under test.  Eager and compiled run the same Python functions.


def f_add(x, m):
    return torch.softmax(x * SCALE + m, -1)


def f_bool(x, m):
    return torch.softmax((x * SCALE).masked_fill(m, float("-inf")), -1)


def f_causal(x):
    # Bottom-right aligned like drvsoftmax: key j is hidden from query i when j > i + (Sk - Sq).
    sq, sk = x.shape[-2], x.shape[-1]
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
    return torch.softmax((x * SCALE).masked_fill(hidden, float("-inf")), -1)


def f_none(x):
    return torch.softmax(x * SCALE, -1)


def f_plain(x):
    return torch.softmax(x, -1)


def f_bwd(dy, y):
    return torch._softmax_backward_data(dy, y, -1, y.dtype) * SCALE


EAGER_FNS = {"add": f_add, "bool": f_bool, "causal": f_causal, "none": f_none, "plain": f_plain, "bwd": f_bwd}


def make_caller(key: str):
    """fn(inputs) for method `key`; inputs is one dict of make_inputs()."""
    m = METHODS[key]
    if m.provider == "drvsoftmax":
        import drvsoftmax

        fwd = drvsoftmax.scaled_masked_softmax
        bwd = drvsoftmax.scaled_masked_softmax_backward
        return {
            "add": lambda d: fwd(d["x"], d["add"], scale=SCALE),
            "bool": lambda d: fwd(d["x"], d["bool"], scale=SCALE),
            "causal": lambda d: fwd(d["x"], scale=SCALE, causal=True),
            "none": lambda d: fwd(d["x"], scale=SCALE),
            "bwd": lambda d: bwd(d["dy"], d["y"], scale=SCALE),
        }[m.group]
    fn = EAGER_FNS[m.group]
    if m.provider == "compiled":
        fn = torch.compile(fn, dynamic=False)
    names = ARG_NAMES[m.group]
    if len(names) == 1:
        (a,) = names
        return lambda d: fn(d[a])
    a, b = names
    return lambda d: fn(d[a], d[b])


# ----------------------------------------------------------------------------------
# Cases and bytes (pure Python: the dry run plans with these).


def numel(shape) -> int:
    return math.prod(shape)


def mask_shape(shape: tuple) -> tuple:
    """[B,1,Sq,Sk] for [B,H,Sq,Sk] (the masks the baselines used)."""
    return (shape[0], 1, shape[-2], shape[-1]) if len(shape) == 4 else tuple(shape)


def shape_str(shape: tuple) -> str:
    return "x".join(str(n) for n in shape)


def min_bytes(key: str, shape: tuple, dtype: str) -> int:
    """Minimum bytes: x read once, mask read once (its own size), y written once; bwd y, dy read, dx written."""
    n = numel(shape) * ITEMSIZE[dtype]
    group = METHODS[key].group
    if group == "bwd":
        return 3 * n
    b = 2 * n
    if group == "add":
        b += numel(mask_shape(shape)) * ITEMSIZE[dtype]
    elif group == "bool":
        b += numel(mask_shape(shape))
    return b


def causal_visible_fraction(shape: tuple) -> float:
    sq, sk = shape[-2], shape[-1]
    visible = sum(min(max(i + (sk - sq) + 1, 0), sk) for i in range(sq))
    return visible / (sq * sk)


def visible_bytes(shape: tuple, dtype: str) -> int:
    """Causal: x read only where visible, y written in full."""
    n = numel(shape) * ITEMSIZE[dtype]
    return int(n * causal_visible_fraction(shape)) + n


def needed_inputs(methods) -> set:
    need = set()
    for key in methods:
        need.update(ARG_NAMES[METHODS[key].group])
    return need


@dataclass
class Case:
    section: str  # the section that runs it: fwd | bwd | sweep | compiled
    direction: str  # the CSV direction: fwd | bwd | sweep-fwd | sweep-bwd
    dtype: str
    shape: tuple
    methods: tuple

    @property
    def working_set(self) -> int:
        """Bytes one call touches with one input set (inputs and the output)."""
        need = needed_inputs(self.methods)
        n = numel(self.shape) * ITEMSIZE[self.dtype]
        mn = numel(mask_shape(self.shape))
        b = n  # the output
        b += n * sum(k in need for k in ("x", "y", "dy"))
        b += mn * ITEMSIZE[self.dtype] * ("add" in need) + mn * ("bool" in need)
        return b

    @property
    def copies(self) -> int:
        return int(min(MAX_COPIES, max(1, math.ceil(L2_FLUSH_BYTES / self.working_set))))

    @property
    def skip_reason(self) -> str:
        if self.working_set > CASE_MAX_BYTES:
            return f"tensors need {self.working_set / 1e9:.1f} GB > {CASE_MAX_BYTES / 1e9:.0f} GB"
        return ""

    def title(self) -> str:
        return f"{self.direction} {self.dtype} {shape_str(self.shape)}"


@dataclass
class Plan:
    sections: dict  # name -> list of Case (copy and host: a list with no cases, run specially)
    host_compiled: bool = False


def build_plan(args) -> Plan:
    quick = args.quick
    shapes = QUICK_SHAPES if quick else SHAPES
    dtypes = QUICK_DTYPES if quick else DTYPES
    sweep_dtypes = QUICK_SWEEP_DTYPES if quick else tuple(SWEEP_TOTAL)
    sweep_sk = QUICK_SWEEP_SK if quick else SWEEP_SK
    compile_on = not (quick or args.no_compile)

    def want(name):
        return args.only in (None, name)

    sections: dict = {"copy": []}
    if want("host"):
        sections["host"] = []
    if want("fwd"):
        sections["fwd"] = [Case("fwd", "fwd", dt, s, FWD_METHODS) for s in shapes for dt in dtypes]
    if want("bwd"):
        sections["bwd"] = [Case("bwd", "bwd", dt, s, BWD_METHODS) for s in shapes for dt in dtypes]

    def sweep_shape(dt, sk):
        return (SWEEP_TOTAL[dt] // sk, sk)

    if want("sweep"):
        sections["sweep"] = [
            c
            for dt in sweep_dtypes
            for sk in sweep_sk
            for c in (
                Case("sweep", "sweep-fwd", dt, sweep_shape(dt, sk), SWEEP_FWD_METHODS),
                Case("sweep", "sweep-bwd", dt, sweep_shape(dt, sk), BWD_METHODS),
            )
        ]
    plan = Plan(sections)
    if compile_on:
        comp = []
        # In order of importance, so that the budget cuts the least: fp16 shapes, the sweep (the README
        # figure) in fp16 then fp32, fp32 shapes last.
        fp16, fp32 = COMPILE_DTYPES
        if want("fwd") and fp16 in dtypes:
            comp += [Case("compiled", "fwd", fp16, s, COMPILED_FWD_METHODS) for s in shapes]
        if want("sweep"):
            for dt in (d for d in (fp16, fp32) if d in sweep_dtypes):
                comp += [Case("compiled", "sweep-fwd", dt, sweep_shape(dt, sk), ("compiled-none",)) for sk in sweep_sk]
        if want("fwd") and fp32 in dtypes:
            comp += [Case("compiled", "fwd", fp32, s, COMPILED_FWD_METHODS) for s in shapes]
        plan.host_compiled = want("host")
        if comp or plan.host_compiled:
            sections["compiled"] = comp
    return plan


# ----------------------------------------------------------------------------------
# Run-time estimates for the dry run (a rough model of an H200, not a measurement).

EST_BW = 4.0e12  # bytes/s that a good kernel moves
EST_FLOOR_S = 6e-6  # shortest GPU time of a call
EST_FACTOR = {  # time of a method relative to the minimum bytes at EST_BW (from the baseline file)
    "drvsoftmax": 1.1,
    "compiled": 2.5,
    "eager-plain": 2.2,
    "eager-none": 4.0,
    "eager-add": 7.0,
    "eager-bool": 8.0,
    "eager-causal": 7.5,
    "eager-bwd": 2.6,
}
EST_COMPILE_FIRST_S, EST_COMPILE_S = 25.0, 4.0
EST_STARTUP_S = 12.0  # import torch, CUDA context, first kernel loads


def est_call_s(key: str, case: Case) -> float:
    m = METHODS[key]
    factor = EST_FACTOR.get(m.provider) if m.provider != "eager" else EST_FACTOR[key]
    return max(min_bytes(key, case.shape, case.dtype) * factor / EST_BW, EST_FLOOR_S)


def est_measure_s(t: float) -> float:
    warm = min(max(WARMUP_MS / (t * 1e3), 1), 50)
    reps = min(max(TARGET_MS / (t * 1e3), MIN_REPS), MAX_REPS)
    sleep = min(reps * QUEUE_FILL_MS_PER_REP, QUEUE_FILL_MAX_MS) / 1e3 if t * 1e3 < QUEUE_FILL_BELOW_MS else 0
    host = 15e-6 * (2 + EST_CALLS + warm + reps)
    return max(t, 10e-6) * (2 + EST_CALLS + warm + reps) + sleep + host


def est_case_s(case: Case, compiles_before: int) -> tuple[float, int]:
    """(seconds, compiles) for one case."""
    s = 0.05 + case.working_set * case.copies / 2e11  # setup: random inputs
    compiles = 0
    refs = set()
    for key in case.methods:
        m = METHODS[key]
        s += est_measure_s(est_call_s(key, case))
        if m.provider == "compiled":
            s += EST_COMPILE_FIRST_S if compiles_before + compiles == 0 else EST_COMPILE_S
            compiles += 1
        ref = REFERENCE.get(m.group)
        if ref and ref != key and ref not in refs:
            refs.add(ref)
            s += est_call_s(ref, case)
    return s, compiles


def est_host_s() -> float:
    n = len(HOST_METHODS)
    return n * (HOST_WARMUP_CALLS + HOST_CALLS * HOST_REPEATS) * 10e-6 + 1.0


# ----------------------------------------------------------------------------------
# Timing.


def time_gpu(fn, argsets) -> tuple[float, int]:
    """(median ms, reps) of fn(argsets[i]) rotating through argsets, each call between CUDA events.

    With several input sets the outputs rotate too (each slot keeps its last output alive, so
    the allocator hands out a different block), so that L2 serves neither inputs nor outputs.
    Calls shorter than QUEUE_FILL_BELOW_MS are queued behind a GPU sleep, so that the host runs
    ahead and the events time the GPU, not the launch rate (host cost is the host section's).
    """
    n = len(argsets)
    keep = [None] * n

    def call(i):
        out = fn(argsets[i % n])
        if n > 1:
            keep[i % n] = out

    Event = torch.cuda.Event
    call(0)
    torch.cuda.synchronize()
    e0, e1 = Event(enable_timing=True), Event(enable_timing=True)
    e0.record()
    for i in range(1, 1 + EST_CALLS):
        call(i)
    e1.record()
    e1.synchronize()
    est = max(e0.elapsed_time(e1) / EST_CALLS, 1e-4)
    warm = int(min(max(WARMUP_MS / est, 1), 50))
    reps = int(min(max(TARGET_MS / est, MIN_REPS), MAX_REPS))
    off = 1 + EST_CALLS
    for i in range(off, off + warm):
        call(i)
    off += warm
    starts = [Event(enable_timing=True) for _ in range(reps)]
    ends = [Event(enable_timing=True) for _ in range(reps)]
    sleep = getattr(torch.cuda, "_sleep", None)
    if est < QUEUE_FILL_BELOW_MS and sleep is not None:
        sleep(int(min(reps * QUEUE_FILL_MS_PER_REP, QUEUE_FILL_MAX_MS) * SLEEP_CYCLES_PER_MS))
    for i in range(reps):
        starts[i].record()
        call(off + i)
        ends[i].record()
    ends[-1].synchronize()
    keep.clear()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), reps


def time_host(fn, stream=None) -> tuple[float, float]:
    """(median, min) host microseconds per call over HOST_REPEATS runs of HOST_CALLS back-to-back calls."""
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    samples = []
    with ctx:
        for _ in range(HOST_WARMUP_CALLS):
            fn()
        torch.cuda.synchronize()
        for _ in range(HOST_REPEATS):
            t = time.perf_counter()
            for _ in range(HOST_CALLS):
                fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t) / HOST_CALLS * 1e6)
    return statistics.median(samples), min(samples)


# ----------------------------------------------------------------------------------
# Inputs and checks.


def make_inputs(case: Case, copies: int, device: str) -> list:
    """`copies` dicts of the inputs the case's methods read (x, add, bool, y, dy)."""
    dt = getattr(torch, case.dtype)
    need = needed_inputs(case.methods)
    shape, mshape = case.shape, mask_shape(case.shape)
    sets = []
    for _ in range(copies):
        d = {}
        if "x" in need:
            d["x"] = torch.randn(shape, dtype=dt, device=device)
        if "add" in need or "bool" in need:
            hidden = torch.rand(mshape, device=device) < MASK_HIDDEN_FRACTION
            hidden[..., 0] = False  # no fully hidden rows: eager would give NaN there, drvsoftmax zeros
            if "bool" in need:
                d["bool"] = hidden
            if "add" in need:
                d["add"] = torch.zeros(mshape, dtype=dt, device=device).masked_fill_(hidden, float("-inf"))
        if "y" in need or "dy" in need:
            d["y"] = torch.softmax(torch.randn(shape, dtype=dt, device=device), -1)
            d["dy"] = torch.randn(shape, dtype=dt, device=device)
        sets.append(d)
    return sets


def check_rows(t):
    """Rows spread over the whole output (every leading dim), at most CHECK_ELEMS elements."""
    sk = t.shape[-1]
    flat = t.reshape(-1, sk)
    want = max(1, min(flat.shape[0], CHECK_ELEMS // max(sk, 1)))
    step = max(1, flat.shape[0] // want)
    return flat[::step][:want]


def compare(out, ref, dtype: str) -> tuple[float, bool]:
    got = check_rows(out).float()
    err = (got - ref).abs().max().item()
    top = ref.abs().max().item()
    rel = err / max(top, 1e-30)
    # fp16 outputs below 2^-14 are subnormal with a spacing of 2^-24: long rows (tiny
    # probabilities) get that absolute rounding, whoever computes them.
    floor = 2.0**-24 if dtype in ("float16", "f16") else 0.0
    return rel, err <= TOL[dtype] * top + floor  # NaN compares False: a mismatch


# ----------------------------------------------------------------------------------
# Results.

CSV_FIELDS = (
    "date",
    "gpu",
    "driver",
    "cuda",
    "torch",
    "commit",
    "direction",
    "dtype",
    "shape",
    "method",
    "ms",
    "gbps",
    "pct_of_copy",
    "copy_gbps",
    "notes",
)


@dataclass
class Row:
    direction: str
    dtype: str
    shape: tuple
    key: str
    label: str
    ms: float | None = None
    gbps: float | None = None
    pct: float | None = None
    us: float | None = None  # host rows
    notes: str = ""
    error: bool = False
    mismatch: bool = False
    compile_failed: bool = False  # does not count towards MAX_CONSECUTIVE_ERRORS


class Terminated(BaseException):
    """SIGTERM (timeout) or Ctrl-C: stop measuring, write and print what there is."""


class Aborted(BaseException):
    """Too many errors in a row (a broken CUDA context fails everything after it)."""


def _on_signal(signum, frame):
    raise Terminated(f"signal {signum}")


def _fmt(v, spec: str) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


class Run:
    def __init__(self, args, env: dict, plan: Plan, budget_s: float):
        self.args, self.env, self.plan = args, env, plan
        self.budget_s = budget_s
        self.rows: list[Row] = []
        self.skipped: list[tuple[str, str, str]] = []  # (section, what, why)
        self.copy_gbps: float | None = None
        self.copy_gbps_end: float | None = None
        self.section_s: dict = {}
        self.compiles = 0
        self.compile_s = 0.0
        self.compile_failures = 0
        self.consecutive_errors = 0
        self.checks = 0
        self.stopped = ""
        self.announced: set = set()
        self.csv_paths: list[Path] = []
        self.md_paths: list[Path] = []

    # -- budget --
    def elapsed(self) -> float:
        return time.monotonic() - T0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def allows(self, section: str, need: float = 0.0) -> bool:
        if self.left() > need:
            return True
        if section not in self.announced:
            self.announced.add(section)
            log(
                f"!! time budget: {self.elapsed():.0f} s of {self.budget_s:.0f} s used"
                f"{f', {need:.0f} s needed' if need else ''}: skipping the rest of section {section}"
            )
        return False

    def allows_compile(self, section: str, what: str) -> bool:
        """Budget left for a compile (the first one needs more), and torch.compile not failing every time."""
        if self.compile_failures >= MAX_COMPILE_FAILURES:
            self.skip(section, what, f"torch.compile failed {self.compile_failures} times in a row")
            return False
        if not self.allows(section, FIRST_COMPILE_RESERVE_S if self.compiles == 0 else COMPILE_RESERVE_S):
            self.skip(section, what, "time budget")
            return False
        return True

    def skip(self, section: str, what: str, why: str) -> None:
        self.skipped.append((section, what, why))

    # -- files --
    def open_files(self) -> None:
        name = f"{self.env['date']}-{slug(self.env['gpu'])}-{self.env['commit']}"
        out = Path(self.args.out) if self.args.out else REPO / "benchmarks" / "results"
        dirs = [out]
        repo_results = REPO / "benchmarks" / "results"
        with contextlib.suppress(OSError):
            if repo_results.is_dir() and os.access(repo_results, os.W_OK) and repo_results.resolve() != out.resolve():
                dirs.append(repo_results)
        for i, d in enumerate(dirs):
            try:
                d.mkdir(parents=True, exist_ok=True)
                path = d / f"{name}.csv"
                new = not path.exists() or path.stat().st_size == 0
                with path.open("a", newline="") as f:
                    if new:
                        csv.writer(f).writerow(CSV_FIELDS)
                self.csv_paths.append(path)
                self.md_paths.append(d / f"{name}.md")
            except OSError as e:
                if i == 0:
                    raise
                log(f"(not copying results into {d}: {e})")

    def add(self, row: Row) -> None:
        self.rows.append(row)
        env = self.env
        rec = [
            env["date"],
            env["gpu"],
            env["driver"],
            env["cuda"],
            env["torch"],
            env["commit"],
            row.direction,
            row.dtype,
            shape_str(row.shape),
            row.label,
            _fmt(row.ms, ".6g"),
            _fmt(row.gbps, ".1f"),
            _fmt(row.pct, ".1f"),
            _fmt(self.copy_gbps, ".1f"),
            row.notes,
        ]
        for path in list(self.csv_paths):
            try:
                with path.open("a", newline="") as f:
                    csv.writer(f).writerow(rec)
            except OSError as e:
                log(f"(cannot append to {path}: {e})")
                if path != self.csv_paths[0]:
                    self.csv_paths.remove(path)
        log(format_row(row))
        if row.compile_failed:
            self.compile_failures += 1
        elif row.error:
            self.consecutive_errors += 1
            if self.consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
                raise Aborted(f"{self.consecutive_errors} errors in a row; last: {row.notes}")
        else:
            self.consecutive_errors = 0

    def result(self, case: Case, key: str, ms: float, notes: list) -> Row:
        m = METHODS[key]
        b = min_bytes(key, case.shape, case.dtype)
        gbps = b / (ms * 1e6)
        pct = 100.0 * gbps / self.copy_gbps if self.copy_gbps else None
        if m.group == "causal":
            vis = visible_bytes(case.shape, case.dtype) / (ms * 1e6)
            notes.append(f"visible-only {vis:.0f} GB/s ({causal_visible_fraction(case.shape):.0%} of x visible)")
        return Row(case.direction, case.dtype, case.shape, key, m.label, ms, gbps, pct, notes="; ".join(notes))


def log(msg: str = "") -> None:
    print(msg, flush=True)


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "gpu"


def format_row(row: Row) -> str:
    head = f"{row.direction:9s} {SHORT_DTYPE.get(row.dtype, row.dtype):4s} {shape_str(row.shape):16s} {row.label:38s}"
    if row.error:
        return f"{head} ERROR {row.notes}"
    if row.us is not None:
        return f"{head} {row.us:8.2f} us/call  {row.notes}"
    pct = f"{row.pct:5.1f}%" if row.pct is not None else "   - %"
    flag = "  MISMATCH" if row.mismatch else ""
    return f"{head} {row.ms:9.4f} ms {row.gbps:7.0f} GB/s {pct}{flag}"


def error_text(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


# ----------------------------------------------------------------------------------
# Sections.


def run_copy(run: Run, tag: str = "") -> float | None:
    try:
        src = torch.empty(COPY_BYTES // 2, dtype=torch.float16, device=DEVICE).fill_(1.0)
        dst = torch.empty_like(src)
        ms, reps = time_gpu(lambda d: d["dst"].copy_(d["src"]), [{"src": src, "dst": dst}])
        del src, dst
    except Exception as e:
        run.add(Row("copy", "float16", (COPY_BYTES // 2,), "copy", "d2d copy 2 GiB", notes=error_text(e), error=True))
        return None
    gbps = 2 * COPY_BYTES / (ms * 1e6)
    notes = f"dst.copy_(src), 2 GiB, read+write counted, median of {reps}{tag}"
    if run.copy_gbps is None:
        run.copy_gbps = gbps
        notes += f"; drvsoftmax sources {run.env.get('src_hash', '?')}"
    row = Row(
        "copy",
        "float16",
        (COPY_BYTES // 2,),
        "copy",
        "d2d copy 2 GiB",
        ms,
        gbps,
        100.0 * gbps / run.copy_gbps,
        notes=notes,
    )
    run.add(row)
    return gbps


def plan_note(case: Case, key: str) -> str:
    """The drvsoftmax planner's choice, shortened (tier, threads per row, access width)."""
    try:
        import drvsoftmax

        g = METHODS[key].group
        if g == "bwd":
            s = drvsoftmax.explain(case.shape, case.dtype, backward=True)
        else:
            mdt = {"add": case.dtype, "bool": "bool"}.get(g)
            s = drvsoftmax.explain(case.shape, case.dtype, mask_dtype=mdt, causal=(g == "causal"))
    except Exception:
        return ""
    tpr = re.search(r"(\d+) threads per row", s)
    return (
        f"plan: {s.split(':', 1)[0]}, {tpr.group(1) if tpr else '?'} thr/row, {'vec16' if '16-byte' in s else 'scalar'}"
    )


def run_case(run: Run, case: Case) -> None:
    section = case.section
    if case.skip_reason:
        for key in case.methods:
            run.skip(section, f"{case.title()} {METHODS[key].label}", case.skip_reason)
        return
    if not run.allows(section):
        for key in case.methods:
            run.skip(section, f"{case.title()} {METHODS[key].label}", "time budget")
        return
    if case.section == "compiled":
        torch._dynamo.reset()  # a fresh graph per shape and dtype
    copies = case.copies
    try:
        argsets = make_inputs(case, copies, DEVICE)
    except Exception as e:
        for key in case.methods:
            run.add(
                Row(
                    case.direction,
                    case.dtype,
                    case.shape,
                    key,
                    METHODS[key].label,
                    notes=f"inputs: {error_text(e)}",
                    error=True,
                )
            )
        torch.cuda.empty_cache()
        return
    refs: dict = {}
    try:
        for key in case.methods:
            m = METHODS[key]
            if m.provider == "compiled":
                if not run.allows_compile(section, f"{case.title()} {m.label}"):
                    continue
            elif not run.allows(section):
                run.skip(section, f"{case.title()} {m.label}", "time budget")
                continue
            run_method(run, case, key, argsets, refs, copies)
    finally:
        del argsets, refs
        torch.cuda.empty_cache()


def run_method(run: Run, case: Case, key: str, argsets: list, refs: dict, copies: int) -> None:
    m = METHODS[key]
    notes = []
    if m.provider == "drvsoftmax":
        note = plan_note(case, key)
        if note:
            notes.append(note)
    try:
        fn = make_caller(key)
        t = time.monotonic()
        out = fn(argsets[0])
        torch.cuda.synchronize()
        if m.provider == "compiled":
            run.compiles += 1
            run.compile_s += time.monotonic() - t
            run.compile_failures = 0
            notes.append(f"compile+first call {time.monotonic() - t:.1f} s")
    except Exception as e:
        comp = m.provider == "compiled"
        what = "torch.compile failed" if comp else "first call failed"
        row = Row(case.direction, case.dtype, case.shape, key, m.label, notes=f"{what}: {error_text(e)}", error=True)
        row.compile_failed = comp
        run.add(row)
        torch.cuda.empty_cache()
        return
    mismatch = False
    ref_key = REFERENCE.get(m.group)
    if ref_key is not None and ref_key != key:
        try:
            if ref_key not in refs:
                r = make_caller(ref_key)(argsets[0])
                refs[ref_key] = check_rows(r).float().clone()
                del r
            rel, ok = compare(out, refs[ref_key], case.dtype)
            run.checks += 1
            mismatch = not ok
            notes.append(f"check vs eager: max rel diff {rel:.1e}{'' if ok else ' MISMATCH'}")
        except Exception as e:  # the reference may not fit where the method does: time it anyway
            notes.append(f"no check ({error_text(e)[:120]})")
            torch.cuda.empty_cache()
    del out
    try:
        ms, reps = time_gpu(fn, argsets)
    except Exception as e:
        run.add(Row(case.direction, case.dtype, case.shape, key, m.label, notes=error_text(e), error=True))
        torch.cuda.empty_cache()
        return
    notes.append(f"median of {reps}" + (f", {copies} input copies rotated" if copies > 1 else ""))
    row = run.result(case, key, ms, notes)
    row.mismatch = mismatch
    run.add(row)


def _ok(res, what: str):
    """Value of a cuda.bindings result tuple, or RuntimeError."""
    if int(res[0]) != 0:
        raise RuntimeError(f"{what} failed: {res[0]!r}")
    return res[1] if len(res) == 2 else (res[1:] or None)


def bare_launch_fn():
    """A cuLaunchKernel of an empty kernel (NVRTC cubin for this GPU) on the current stream."""
    from cuda.bindings import driver, nvrtc

    major, minor = torch.cuda.get_device_capability()
    prog = _ok(
        nvrtc.nvrtcCreateProgram(
            b'extern "C" __global__ void drvsoftmax_bench_empty() {}\n', b"bench_empty.cu", 0, [], []
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        _ok(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram")
        size = _ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    lib = _ok(driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData")
    kernel = _ok(driver.cuLibraryGetKernel(lib, b"drvsoftmax_bench_empty"), "cuLibraryGetKernel")
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    launch = driver.cuLaunchKernel
    _ok(launch(kernel, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0), "cuLaunchKernel")

    def fn(_lib=lib):  # the library stays referenced as long as the function
        return launch(kernel, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0)

    return fn


def launcher_only_fn(x, y):
    """drvsoftmax's launcher alone: a prepared no-mask forward, one cuLaunchKernel per call (internals)."""
    from drvsoftmax import _core, _driver

    def op(t):
        return _core.Operand(t.data_ptr(), str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()))

    xo, yo = op(x), op(y)
    prep = _core.prepare_forward(_driver.device(x.get_device()), xo, yo, None, None, False, SCALE, True)
    stream = torch.cuda.current_stream().cuda_stream
    launch = _core.launch
    # ctx_ok: what the torch front door tells the launcher when the tensor's device is current
    extra = (True,) if "ctx_ok" in inspect.signature(launch).parameters else ()
    return lambda: launch(prep, xo.ptr, yo.ptr, 0, 0, stream, *extra)


def host_row(run: Run, key: str, label: str, fn, stream=None, note: str = "") -> None:
    shape = HOST_SHAPE
    try:
        us, us_min = time_host(fn, stream)
    except Exception as e:
        run.add(Row("host", "float16", shape, key, label, notes=error_text(e), error=True))
        return
    notes = f"host us/call {us:.2f} (min {us_min:.2f}), median of {HOST_REPEATS} x {HOST_CALLS} back-to-back calls"
    run.add(Row("host", "float16", shape, key, label, ms=us / 1e3, us=us, notes=notes + note))


def run_host(run: Run) -> None:
    import drvsoftmax

    fwd = drvsoftmax.scaled_masked_softmax
    x = torch.randn(HOST_SHAPE, dtype=torch.float16, device=DEVICE)
    hidden = torch.rand(mask_shape(HOST_SHAPE), device=DEVICE) < MASK_HIDDEN_FRACTION
    y = torch.empty_like(x)
    side = None
    with contextlib.suppress(Exception):
        side = torch.cuda.Stream()
    builders = {
        "host-ours": lambda: lambda: fwd(x, scale=SCALE),
        "host-ours-out": lambda: lambda: fwd(x, scale=SCALE, out=y),
        "host-ours-bool": lambda: lambda: fwd(x, hidden, scale=SCALE),
        "host-ours-stream": lambda: lambda: fwd(x, scale=SCALE),
        "host-launcher": lambda: launcher_only_fn(x, y),
        "host-bare": bare_launch_fn,
        "host-eager-none": lambda: lambda: f_none(x),
        "host-eager-plain": lambda: lambda: f_plain(x),
    }
    for key, label in HOST_METHODS:
        if not run.allows("host"):
            run.skip("host", label, "time budget")
            continue
        stream = side if key == "host-ours-stream" else None
        if key == "host-ours-stream" and side is None:
            continue
        try:
            fn = builders[key]()
        except Exception as e:
            run.add(Row("host", "float16", HOST_SHAPE, key, label, notes=f"setup: {error_text(e)}", error=True))
            continue
        host_row(run, key, label, fn, stream)


def run_host_compiled(run: Run) -> None:
    key, label = HOST_COMPILED
    if not run.allows_compile("compiled", f"host {label}"):
        return
    torch._dynamo.reset()
    x = torch.randn(HOST_SHAPE, dtype=torch.float16, device=DEVICE)
    try:
        t = time.monotonic()
        cf = torch.compile(f_none, dynamic=False)
        cf(x)
        torch.cuda.synchronize()
        run.compiles += 1
        run.compile_s += time.monotonic() - t
        run.compile_failures = 0
        note = f"; compile+first call {time.monotonic() - t:.1f} s"
    except Exception as e:
        row = Row("host", "float16", HOST_SHAPE, key, label, notes=f"torch.compile failed: {error_text(e)}", error=True)
        row.compile_failed = True
        run.add(row)
        return
    host_row(run, key, label, lambda: cf(x), note=note)


def run_all(run: Run) -> None:
    plan = run.plan
    for name, cases in plan.sections.items():
        t = time.monotonic()
        if name == "copy":
            run_copy(run)
        elif name == "host":
            run_host(run)
        else:
            if name == "compiled" and plan.host_compiled:
                run_host_compiled(run)
            for case in cases:
                run_case(run, case)
        run.section_s[name] = time.monotonic() - t
    if len(plan.sections) > 1:
        run.copy_gbps_end = run_copy(run, tag="; measured again at the end (drift check)")


# ----------------------------------------------------------------------------------
# Summaries.

PEERS = {  # group -> (our method, peers): the compact table's cells
    "add": ("ours-add", ("eager-add", "compiled-add")),
    "bool": ("ours-bool", ("eager-bool", "compiled-bool")),
    "causal": ("ours-causal", ("eager-causal", "compiled-causal")),
    "none": ("ours-none", ("eager-none", "eager-plain")),
    "bwd": ("ours-bwd", ("eager-bwd",)),
}


PEER_TITLE = {"add": "add", "bool": "bool", "causal": "causal", "none": "no-mask", "bwd": "bwd"}


def _k(v: float) -> str:
    return f"{v // 1048576}M" if v >= 1048576 else f"{v // 1024}K" if v >= 1024 else str(v)


def summary_lines(run: Run) -> list[str]:
    env = run.env
    rows = [r for r in run.rows if not r.error and r.ms is not None]
    by = {}
    for r in rows:
        by[(r.direction, r.dtype, r.shape, r.key)] = r  # the last measurement wins
    pct_mode = bool(run.copy_gbps)

    def val(r):
        if r is None:
            return None
        return r.pct if pct_mode else r.gbps

    out = [
        f"== drvsoftmax bench | {env['gpu']} | driver {env['driver']} | torch {env['torch']} (CUDA {env['cuda']}) | "
        f"commit {env['commit']} | {env['date']}",
    ]
    if run.copy_gbps:
        end = f", {run.copy_gbps_end:.0f} at the end" if run.copy_gbps_end else ""
        out.append(
            f"== copy ceiling {run.copy_gbps:.0f} GB/s (d2d 2 GiB, read+write{end}); cells: % of it, "
            f"ours/best-peer over minimum bytes, '<' where ours is slower"
        )
    else:
        out.append("== copy ceiling: not measured; cells are GB/s, ours/best-peer, '<' where ours is slower")

    shapes_dt = []
    for r in rows:
        if r.direction in ("fwd", "bwd") and (r.shape, r.dtype) not in shapes_dt:
            shapes_dt.append((r.shape, r.dtype))
    if shapes_dt:
        order = {s: i for i, s in enumerate(SHAPES)}
        shapes_dt.sort(key=lambda sd: (order.get(sd[0], 99), DTYPES.index(sd[1]) if sd[1] in DTYPES else 9))
        keys = {k[3] for k in by}
        groups = [g for g, (o, p) in PEERS.items() if keys & {o, *p}]  # columns with data
        out.append(f"{'shape':17s}{'dtype':5s}" + "".join(f"{PEER_TITLE[g]:>10s}" for g in groups))
        for shape, dt in shapes_dt:
            cells = []
            for g in groups:
                ours_key, peer_keys = PEERS[g]
                d = "bwd" if g == "bwd" else "fwd"
                a = val(by.get((d, dt, shape, ours_key)))
                peers = [v for v in (val(by.get((d, dt, shape, k))) for k in peer_keys) if v is not None]
                b = max(peers) if peers else None
                sep = "<" if a is not None and b is not None and a < b else "/"
                cells.append(f"{_fmt(a, '.0f') or '-':>5s}{sep}{_fmt(b, '.0f') or '-':<4s}")
            out.append(f"{shape_str(shape):17s}{SHORT_DTYPE[dt]:5s}" + "".join(cells))

    sweep = [r for r in rows if r.direction.startswith("sweep")]
    if sweep:
        sks = sorted({r.shape[-1] for r in sweep})
        head = f"sweep, {'% of copy' if pct_mode else 'GB/s'}, Sk:"
        out.append(f"{head:27s}" + "".join(f"{_k(s):>5s}" for s in sks))
        lines = (
            ("sweep-fwd", "ours-none", "fwd drvsoftmax"),
            ("sweep-fwd", "eager-plain", "fwd torch.softmax"),
            ("sweep-fwd", "compiled-none", "fwd compiled x*s"),
            ("sweep-bwd", "ours-bwd", "bwd drvsoftmax"),
            ("sweep-bwd", "eager-bwd", "bwd eager"),
        )
        for dt in [d for d in DTYPES if any(r.dtype == d for r in sweep)]:
            for direction, key, label in lines:
                vals = {
                    r.shape[-1]: val(r) for r in sweep if r.dtype == dt and r.direction == direction and r.key == key
                }
                if vals:
                    out.append(
                        f"{SHORT_DTYPE[dt]:4s} {label:22s}"
                        + "".join(f"{_fmt(vals.get(s), '.0f') or '-':>5s}" for s in sks)
                    )

    host = {r.key: r for r in run.rows if r.direction == "host" and r.us is not None}
    if host:
        names = {
            "host-ours": "ours",
            "host-ours-out": "ours out=",
            "host-ours-bool": "ours bool",
            "host-ours-stream": "ours side-stream",
            "host-launcher": "launcher only",
            "host-bare": "bare empty launch",
            "host-eager-none": "eager softmax(x*s)",
            "host-eager-plain": "torch.softmax(x)",
            "host-compiled-none": "compiled softmax(x*s)",
        }
        parts = [f"{names.get(k, k)} {r.us:.1f}" for k, r in host.items()]
        out.append(f"host us/call {shape_str(HOST_SHAPE)} f16: " + ", ".join(parts[:4]))
        if parts[4:]:
            out.append("    " + ", ".join(parts[4:]))
        if "host-ours" in host and "host-bare" in host:
            d = host["host-ours"].us - host["host-bare"].us
            out.append(f"    ours - bare launch = {d:+.2f} us (design target <= +1.5 us)")

    errors = sum(r.error for r in run.rows)
    mism = sum(r.mismatch for r in run.rows)
    by_sec: dict = {}
    for sec, _what, why in run.skipped:
        by_sec[f"{sec} ({why})"] = by_sec.get(f"{sec} ({why})", 0) + 1
    skipped = ", ".join(f"{k}: {v}" for k, v in by_sec.items()) or "none"
    secs = ", ".join(f"{k} {v:.0f}" for k, v in run.section_s.items())
    out.append(
        f"== checks vs eager: {run.checks} compared, {mism} MISMATCH | errors: {errors} | "
        f"time {run.elapsed():.0f} s of budget {run.budget_s:.0f} s (sections, s: {secs})"
    )
    if run.compiles:
        out.append(f"== torch.compile: {run.compiles} graphs, {run.compile_s:.0f} s compiling; skipped: {skipped}")
    else:
        out.append(f"== skipped: {skipped}")
    if run.stopped:
        out.append(f"== STOPPED EARLY: {run.stopped}")
    if run.csv_paths:
        out.append(
            f"== results: {run.csv_paths[0]} (+ .md)"
            + (f"; copied to {run.csv_paths[1].parent}" if len(run.csv_paths) > 1 else "")
        )
    return out


def markdown(run: Run, summary: list[str]) -> str:
    env = run.env
    rows = run.rows
    md = [f"# drvsoftmax benchmark: {env['gpu']}, {env['date']}", ""]
    md.append(
        f"driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, Python {env['python']}, "
        f"commit {env['commit']}{env.get('dirty', '')}, drvsoftmax kernel sources {env.get('src_hash', '?')}."
    )
    md.append(f"drvsoftmax kernels loaded from: {env.get('kernel_origins', '?')}.")
    md.append("")
    if run.copy_gbps:
        md.append(
            f"Copy ceiling (device-to-device copy of 2 GiB, read + write counted): **{run.copy_gbps:.0f} GB/s**"
            + (f"; {run.copy_gbps_end:.0f} GB/s when measured again at the end." if run.copy_gbps_end else ".")
        )
    md.append(
        "GB/s count the minimum bytes: x read once, mask read once (its own size), y written once; "
        "causal counts x and y (its notes add a visible-only figure); backward reads y and dy and writes dx. "
        f"Scale {SCALE}; masks are [B,1,Sq,Sk], {MASK_HIDDEN_FRACTION:.0%} hidden. Times are medians of "
        "CUDA-event-timed calls; see benchmarks/README.md."
    )
    md += ["", "## Summary", "", "```text", *summary, "```", ""]

    def table(sel):
        t = ["| method | ms | GB/s | % of copy | notes |", "|---|---|---|---|---|"]
        for r in sel:
            if r.error:
                t.append(f"| {r.label} | error | | | {r.notes} |")
            else:
                t.append(f"| {r.label} | {r.ms:.4f} | {r.gbps:.0f} | {_fmt(r.pct, '.1f')} | {r.notes} |")
        return t

    groups: dict = {}
    for r in rows:
        if r.direction in ("fwd", "bwd"):
            groups.setdefault((r.shape, r.dtype), []).append(r)
    if groups:
        md += ["## Forward and backward at the baseline shapes", ""]
        order = {s: i for i, s in enumerate(SHAPES)}
        for (shape, dt), sel in sorted(
            groups.items(), key=lambda kv: (order.get(kv[0][0], 99), DTYPES.index(kv[0][1]))
        ):
            md += [f"### {tuple(shape)} {dt}", ""]
            md += table(sorted(sel, key=lambda r: r.direction != "fwd"))
            md.append("")
    sweep = [r for r in rows if r.direction.startswith("sweep") and not r.error]
    if sweep:
        md += ["## Row-length sweep (GB/s)", ""]
        cols = (
            ("sweep-fwd", "ours-none", "fwd drvsoftmax"),
            ("sweep-fwd", "eager-plain", "fwd torch.softmax(x)"),
            ("sweep-fwd", "eager-none", "fwd eager softmax(x*s)"),
            ("sweep-fwd", "compiled-none", "fwd compiled softmax(x*s)"),
            ("sweep-bwd", "ours-bwd", "bwd drvsoftmax"),
            ("sweep-bwd", "eager-bwd", "bwd eager"),
        )
        for dt in [d for d in DTYPES if any(r.dtype == d for r in sweep)]:
            sel = [r for r in sweep if r.dtype == dt]
            total = numel(sel[0].shape)
            md += [f"### {dt}, {total} elements (2^{int(math.log2(total))}) per call", ""]
            md.append("| Sk | rows | " + " | ".join(title for _, _, title in cols) + " |")
            md.append("|---|---|" + "---|" * len(cols))
            for sk in sorted({r.shape[-1] for r in sel}):
                cells = []
                for d, k, _ in cols:
                    hit = [r for r in sel if r.direction == d and r.key == k and r.shape[-1] == sk]
                    cells.append(f"{hit[-1].gbps:.0f}" if hit else "")
                md.append(f"| {sk} | {total // sk} | " + " | ".join(cells) + " |")
            md.append("")
    host = [r for r in rows if r.direction == "host"]
    if host:
        md += [
            f"## Host time per call, {tuple(HOST_SHAPE)} float16",
            "",
            "| method | us/call | notes |",
            "|---|---|---|",
        ]
        for r in host:
            md.append(f"| {r.label} | {'error' if r.error else f'{r.us:.2f}'} | {r.notes} |")
        md.append("")
    errs = [r for r in rows if r.error]
    if errs:
        md += (
            ["## Errors", ""]
            + [f"- {r.direction} {r.dtype} {shape_str(r.shape)} {r.label}: {r.notes}" for r in errs]
            + [""]
        )
    if run.skipped:
        md += ["## Skipped", ""] + [f"- [{sec}] {what}: {why}" for sec, what, why in run.skipped] + [""]
    return "\n".join(md)


def kernel_origins() -> str:
    """Where drvsoftmax's kernels came from in this run (packaged cubin, PTX, NVRTC), with counts."""
    try:
        from drvsoftmax import _driver

        origins = [o for d in _driver._devices.values() for o in d.origins.values()]
    except Exception:
        return "?"
    counts: dict = {}
    for o in origins:
        counts[o] = counts.get(o, 0) + 1
    return "; ".join(f"{o} (x{n})" for o, n in sorted(counts.items())) or "none loaded"


def finish(run: Run) -> None:
    run.env["kernel_origins"] = kernel_origins()
    lines = summary_lines(run)
    for path in run.md_paths:
        try:
            path.write_text(markdown(run, lines))
        except OSError as e:
            log(f"(cannot write {path}: {e})")
    log()
    for line in lines:
        log(line)


# ----------------------------------------------------------------------------------
# Environment.


def _cmd(argv: list) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def collect_env(dry: bool) -> dict:
    import platform

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        # A copy of the tree without .git (a remote GPU machine) names it with DRVSOFTMAX_COMMIT.
        "commit": _cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
        or os.environ.get("DRVSOFTMAX_COMMIT", "unknown"),
        "python": platform.python_version(),
    }
    if env["commit"] != "unknown" and _cmd(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]):
        env["dirty"] = " (with uncommitted changes)"
    try:
        from drvsoftmax import _compiler

        env["src_hash"] = _compiler.source_hash()[:12]
    except Exception:
        env["src_hash"] = "?"
    if dry:
        env.update(gpu="(dry run)", driver="?", cuda="?", torch="?")
        return env
    env["gpu"] = torch.cuda.get_device_name(0)
    env["driver"] = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]) or "unknown"
    env["cuda"] = str(torch.version.cuda or "unknown")
    env["torch"] = torch.__version__
    return env


def _import_torch():
    global torch
    import torch as _torch

    torch = _torch
    return _torch


# ----------------------------------------------------------------------------------
# Dry run: the plan, estimates, and the semantics of every method checked on the CPU.


def dry_run(args, plan: Plan, budget_s: float) -> int:
    env = collect_env(True)
    log(
        f"DRY RUN: nothing touches CUDA. Budget {budget_s:.0f} s; copy ceiling {COPY_BYTES / 2**30:.0f} GiB; "
        f"scale {SCALE}; commit {env['commit']}; drvsoftmax sources {env['src_hash']}"
    )
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results"
    log(f"results would go to {out}/{env['date']}-<gpu>-{env['commit']}.csv and .md")
    t = EST_STARTUP_S
    compiles = 0
    for name, cases in plan.sections.items():
        if name == "copy":
            s = 1.5
            log(f"\n[copy] d2d copy of {COPY_BYTES / 2**30:.0f} GiB, at the start and again at the end; est {s:.1f} s")
        elif name == "host":
            s = est_host_s()
            log(
                f"\n[host] {shape_str(HOST_SHAPE)} float16, {HOST_REPEATS} x {HOST_CALLS} calls each: "
                + "; ".join(label for _, label in HOST_METHODS)
                + f"; est {s:.1f} s"
            )
        else:
            s = 0.0
            methods = dict.fromkeys(k for c in cases for k in c.methods)
            log(f"\n[{name}] {len(cases)} cases; methods: " + "; ".join(METHODS[k].label for k in methods))
            if name == "compiled" and plan.host_compiled:
                s += EST_COMPILE_FIRST_S if compiles == 0 else EST_COMPILE_S
                compiles += 1
                log(f"  host {shape_str(HOST_SHAPE)} float16 {HOST_COMPILED[1]}")
            for case in cases:
                cs, nc = est_case_s(case, compiles)
                compiles += nc
                skip = case.skip_reason
                cut = "" if t + s + cs <= budget_s else "  [beyond the budget in this estimate]"
                s += 0 if skip else cs
                parts = {}  # minimum bytes by what is computed
                for key in case.methods:
                    parts.setdefault(METHODS[key].group, min_bytes(key, case.shape, case.dtype))
                plan_s = plan_note(case, "ours-bwd" if "ours-bwd" in case.methods else "ours-none")
                log(
                    f"  {case.title():36s} copies={case.copies:<3d} est {cs:5.1f} s"
                    f"{'  SKIP: ' + skip if skip else ''}{cut}"
                )
                log(
                    "      min bytes: "
                    + ", ".join(f"{g} {b / 1e6:.1f} MB" for g, b in parts.items())
                    + (f" | {plan_s}" if plan_s and case.section != "compiled" else "")
                )
        t += s
        log(f"  section {name}: est {s:.0f} s (cumulative {t:.0f} s incl. {EST_STARTUP_S:.0f} s start-up)")
    log(
        f"\nestimated total {t:.0f} s on an H200 (model: {EST_BW / 1e12:.1f} TB/s x per-method factors, "
        f"compile {EST_COMPILE_FIRST_S:.0f} s first / {EST_COMPILE_S:.0f} s each after); budget {budget_s:.0f} s"
    )
    return cpu_self_check()


def cpu_self_check() -> int:
    """Every eager and drvsoftmax method on tiny CPU inputs, against its reference: same semantics?"""
    try:
        _import_torch()
        import drvsoftmax  # noqa: F401
    except Exception as e:
        log(f"\nCPU self-check skipped: {error_text(e)}")
        return 0
    shapes = ((2, 3, 5, 7), (2, 3, 6, 6), (1, 2, 3, 33), (37, 64))
    bad = 0
    n = 0
    for dt in DTYPES:
        for shape in shapes:
            methods = FWD_METHODS + BWD_METHODS if len(shape) == 4 else SWEEP_FWD_METHODS + BWD_METHODS
            case = Case("check", "fwd", dt, shape, methods)
            torch.manual_seed(0)
            (d,) = make_inputs(case, 1, "cpu")
            for key in methods:
                ref_key = REFERENCE.get(METHODS[key].group)
                try:
                    out = make_caller(key)(d)
                    if ref_key is None or ref_key == key:
                        continue
                    ref = check_rows(make_caller(ref_key)(d)).float()
                    rel, ok = compare(out, ref, dt)
                except Exception as e:
                    log(f"  FAIL {dt} {shape_str(shape)} {METHODS[key].label}: {error_text(e)}")
                    bad += 1
                    continue
                n += 1
                if not ok:
                    bad += 1
                    log(
                        f"  FAIL {dt} {shape_str(shape)} {METHODS[key].label}: max rel diff {rel:.1e} vs "
                        f"{METHODS[ref_key].label}"
                    )
    log(
        f"\nCPU self-check (drvsoftmax's CPU path against the eager functions, {len(DTYPES)} dtypes, "
        f"{len(shapes)} shapes): {n} compared, {bad} failed -> {'OK' if bad == 0 else 'FAILED'}"
    )
    return 0 if bad == 0 else 1


# ----------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="drvsoftmax against PyTorch eager and torch.compile, in GB/s over the minimum bytes "
        "and as a percentage of a device-to-device copy measured in the same run."
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the results CSV and markdown summary "
        "(default benchmarks/results); results are also copied there when it is writable",
    )
    p.add_argument("--quick", action="store_true", help="a subset that finishes in under a minute (no torch.compile)")
    p.add_argument(
        "--only",
        choices=("fwd", "bwd", "sweep", "host"),
        help="one section (plus the copy ceiling, and the torch.compile rows of that section)",
    )
    p.add_argument("--no-compile", action="store_true", help="leave out every torch.compile row")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and estimates, check every method's semantics on tiny CPU inputs; touches no CUDA",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        default=None,
        help=f"stop starting new measurements after this many seconds since start "
        f"(default {DEFAULT_BUDGET_S:.0f}, {QUICK_BUDGET_S:.0f} with --quick)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    budget_s = (
        args.time_budget if args.time_budget is not None else (QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S)
    )
    plan = build_plan(args)
    if args.dry_run:
        return dry_run(args, plan, budget_s)
    _import_torch()
    if not torch.cuda.is_available():
        log("No CUDA device is visible: this benchmark needs a GPU (use --dry-run to see the plan on a CPU machine).")
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    env = collect_env(False)
    run = Run(args, env, plan, budget_s)
    run.open_files()
    import drvsoftmax

    log(
        f"drvsoftmax {drvsoftmax.__version__} from {Path(drvsoftmax.__file__).parent} on {env['gpu']}, driver "
        f"{env['driver']}, torch {env['torch']} (CUDA {env['cuda']}), commit {env['commit']}; "
        f"budget {budget_s:.0f} s; sections: {', '.join(plan.sections)}"
    )
    log(f"writing {run.csv_paths[0]}")
    try:
        run_all(run)
    except (Terminated, KeyboardInterrupt) as e:
        run.stopped = f"interrupted ({type(e).__name__} {e}) at {run.elapsed():.0f} s"
    except Aborted as e:
        run.stopped = f"aborted: {e}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        finish(run)
    # 1 when the run broke off on errors or a drvsoftmax output disagreed with eager PyTorch.
    return 1 if run.stopped.startswith("aborted") or any(r.mismatch for r in run.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
