"""Running the plan: inputs, checks against a float64 reference, the sections, the extras.

run(args)       the benchmark on a GPU (results under --out as they are measured)
dry_run(args)   the cases and providers, with an estimate; touches no CUDA, needs no torch
prewarm(args)   first calls of quack, Liger and torch.compile for a shard of the cases, so that
                their compilers' disk caches are filled before a timed run (peers_setup.sh)
redo(args)      the markdown, PNG and summary again from a results CSV
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import cases as C
from . import peers as P
from . import report as R
from . import timing as T

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-4}  # max |diff| / max |reference|
FP16_FLOOR = 2.0**-24  # fp16 outputs below 2^-14 are subnormal: absolute rounding up to 2^-25
CHECK_ELEMS = 2**21  # elements of each output compared with the reference
COMPILE_RESERVE_S = 20.0  # no new torch.compile with less budget than this left
DEFAULT_BUDGET_S = 400.0
QUICK_BUDGET_S = 85.0


class Stop(BaseException):
    """SIGTERM or Ctrl-C: stop measuring; what was measured is written."""


class Broken(BaseException):
    """The CUDA context no longer works: nothing after this can be measured."""


def _on_signal(signum, frame):
    raise Stop(f"signal {signum}")


# ----------------------------------------------------------------------------------
# Environment.


def _cmd(argv: list[str]) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def commit_id(explicit: str | None = None) -> str:
    """--commit, else $DRVSOFTMAX_COMMIT, else git, else the file .commit at the repository root."""
    if explicit:
        return explicit
    env = os.environ.get("DRVSOFTMAX_COMMIT", "").strip()
    if env:
        return env
    git = _cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    if git:
        dirty = _cmd(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
        return git + ("-dirty" if dirty else "")
    f = REPO / ".commit"
    if f.is_file():
        text = f.read_text().strip().split()
        if text:
            return text[0]
    return "unknown"


def driver_version() -> str:
    v = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"])
    if v:
        return v.splitlines()[0].strip()
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return "unknown"


def environment(torch, commit: str | None, device: str = "cuda") -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit_id(commit),
        "python": platform.python_version(),
    }
    if torch is None:
        env.update(gpu="gpu", driver="driver", torch="torch", cuda="?")
    elif device == "cpu":
        env.update(gpu="cpu", driver="none", torch=torch.__version__, cuda="none")
    else:
        env.update(
            gpu=torch.cuda.get_device_name(0),
            driver=driver_version(),
            torch=torch.__version__,
            cuda=str(torch.version.cuda or "?"),
        )
    return env


# ----------------------------------------------------------------------------------
# Inputs and the reference (work on CPU tensors too: the tests use them).


def make_inputs(torch, case: C.Case, copies: int, device: str = "cuda") -> list[dict]:
    """`copies` dicts of what the case reads: x (and mask) forward, y and dy backward."""
    dt = getattr(torch, case.dtype)
    sets = []
    for _ in range(copies):
        d = {}
        if case.direction == "bwd":
            d["y"] = torch.softmax(torch.randn(case.shape, dtype=dt, device=device), -1)
            d["dy"] = torch.randn(case.shape, dtype=dt, device=device)
        else:
            d["x"] = torch.randn(case.shape, dtype=dt, device=device)
            if case.mask in ("bool", "add"):
                hidden = torch.rand(case.mask_shape, device=device) < C.MASK_HIDDEN
                hidden[..., 0] = False  # no fully hidden row: eager gives NaN there, drvsoftmax zeros
                d["mask"] = (
                    hidden
                    if case.mask == "bool"
                    else torch.zeros(case.mask_shape, dtype=dt, device=device).masked_fill_(hidden, float("-inf"))
                )
        sets.append(d)
    return sets


def check_rows(torch, n_rows: int, sk: int, device) -> object:
    """Row indices spread over the whole output (first and last included), at most CHECK_ELEMS elements."""
    want = max(2, min(n_rows, CHECK_ELEMS // max(sk, 1)))
    spread = torch.linspace(0, n_rows - 1, want, dtype=torch.float64, device=device)
    return spread.round().long().clamp_(0, n_rows - 1).unique()  # never out of range: a device assert is fatal


def mask_rows(torch, mask, shape: tuple, rows):
    """The mask rows (broadcast over x's leading dims) that go with x's flattened rows `rows`."""
    m = mask.reshape((1,) * (len(shape) - mask.dim()) + tuple(mask.shape))
    index = torch.unravel_index(rows, tuple(shape[:-1]))
    sel = tuple(i if m.shape[k] != 1 else torch.zeros_like(i) for k, i in enumerate(index))
    return m[sel]


def reference(torch, case: C.Case, d: dict, rows, scale: float):
    """float64 softmax (or its backward) of the selected rows, with the case's mask and `scale`."""
    sk = case.sk
    if case.direction == "bwd":
        y = d["y"].reshape(-1, sk)[rows].double()
        dy = d["dy"].reshape(-1, sk)[rows].double()
        return scale * y * (dy - (dy * y).sum(-1, keepdim=True))
    z = d["x"].reshape(-1, sk)[rows].double() * scale
    if case.mask == "bool":
        z = z.masked_fill(mask_rows(torch, d["mask"], case.shape, rows), float("-inf"))
    elif case.mask == "add":
        z = z + mask_rows(torch, d["mask"], case.shape, rows).double()
    elif case.mask == "causal":
        sq = case.shape[-2]
        q = rows % sq
        j = torch.arange(sk, device=rows.device)
        z = z.masked_fill(j[None, :] > (q[:, None] + (sk - sq)), float("-inf"))
    return torch.softmax(z, -1)


def agree(out, ref, rows, case: C.Case) -> tuple[float, bool]:
    """(max |diff| / max |ref|, within the dtype's tolerance) on the selected rows."""
    got = out.reshape(-1, case.sk)[rows].double()
    err = (got - ref).abs().max().item()
    top = ref.abs().max().item()
    floor = FP16_FLOOR if case.dtype == "float16" else 0.0
    return err / max(top, 1e-30), err <= TOL[case.dtype] * top + floor  # NaN compares False


# ----------------------------------------------------------------------------------
# The run.


class Runner:
    def __init__(self, dev, peers: P.Peers, env: dict, out: Path, budget_s: float, t0: float, providers):
        self.dev = dev
        self.torch = dev.torch
        self.peers = peers
        self.env = env
        self.budget_s = budget_s
        self.t0 = t0
        self.providers = [p for p in P.PROVIDERS if p in providers]
        stem = R.file_stem(env)
        self.csv_path = out / f"{stem}.csv"
        self.md_path = out / f"{stem}.md"
        self.png_path = out / f"{stem}.png"
        self.log_path = out / f"{stem}.log"
        out.mkdir(parents=True, exist_ok=True)
        self.sink = R.CsvSink(self.csv_path, env)
        self.rows: list[R.Row] = []
        self.absent: list[tuple[str, str, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.copy_gbps: float | None = None
        self.stopped = ""
        self._said: set[tuple[str, str]] = set()

    # -- bookkeeping --
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def log(self, msg: str = "") -> None:
        line = f"[{self.elapsed():6.1f}s] {msg}"
        print(line, flush=True)
        try:
            with self.log_path.open("a") as f:
                f.write(line + "\n")
        except OSError:
            pass

    def add(self, row: R.Row) -> None:
        self.rows.append(row)
        self.sink.add(row)

    def write_summary(self, png: bool = False) -> None:
        extra = "Providers: " + "; ".join(f"{p} {v}" for p, v in self.peers.versions.items())
        if self.peers.missing:
            extra += ". Not importable here: " + "; ".join(f"{p} ({w})" for p, w in self.peers.missing.items())
        self.md_path.write_text(R.markdown(self.env, self.rows, self.absent, self.skipped, self.stopped, extra))
        if png:
            why = R.write_png(self.png_path, self.env, self.rows)
            if why:
                self.log(f"(no PNG: {why})")

    def guarded(self, what: str, fn, *args) -> None:
        """fn(*args); an unexpected error is logged and the run goes on (if CUDA still works)."""
        try:
            fn(*args)
        except Exception as e:
            self.log(f"!! {what} failed: {P.error_text(e)}")
            self.skipped.append((what, f"failed: {P.error_text(e)}"))
            self.dev.empty_cache()
            self.healthy()

    def healthy(self) -> None:
        """After a failure: does CUDA still work?  A second try clears a non-sticky launch error."""
        torch = self.torch
        for attempt in range(2):
            try:
                self.dev.sync()
                torch.ones(1, device=self.dev.name).add_(1).item()
                return
            except Exception as e:
                if attempt:
                    raise Broken(P.error_text(e)) from None

    # -- sections --
    def copy(self, case_name: str = "copy") -> None:
        nbytes = T.COPY_BYTES if self.dev.name == "cuda" else 2**24
        gbps, ms = T.copy_ceiling(self.dev, nbytes)
        if self.copy_gbps is None:
            self.copy_gbps = gbps
        row = R.Row(
            case=case_name,
            provider="copy",
            dtype="float16",
            shape=str(nbytes // 2),
            section="copy",
            ms=ms,
            gbps=gbps,
            pct=100.0 * gbps / self.copy_gbps,
            nbytes=2 * nbytes,
            copy_gbps=self.copy_gbps,
            note=f"dst.copy_(src) of {nbytes / 2**30:g} GiB, read + write counted",
        )
        self.add(row)
        self.log(f"{case_name}: {gbps:.0f} GB/s ({ms:.3f} ms)")

    def host(self) -> None:
        torch = self.torch
        x = torch.randn(C.HOST_SHAPE, dtype=torch.float16, device=self.dev.name)
        name = f"host-f16-{C.shape_str(C.HOST_SHAPE)}"
        fns = {p: fn for p, fn in P.host_calls(self.peers, x).items() if p in self.providers}
        times = T.host_times_us(self.dev, fns, *(() if self.dev.name == "cuda" else (20, 2)))
        for p, got in times.items():
            if isinstance(got, Exception):
                self.log(f"host {p}: {P.error_text(got)}")
                self.healthy()
                continue
            us, us_min = got
            self.add(
                R.Row(
                    case=name,
                    provider=p,
                    dtype="float16",
                    shape=C.shape_str(C.HOST_SHAPE),
                    section="host",
                    direction="fwd",
                    mask="none",
                    sk=C.HOST_SHAPE[-1],
                    ms=us / 1e3,
                    note=f"host + launch per eager call; min {us_min:.2f} us; median of "
                    f"{T.HOST_REPEATS} x {T.HOST_CALLS} back-to-back calls, the providers taking turns",
                )
            )
        for c in R.compare(self.rows):
            if c.case == name:
                self.log(R.case_line(c))

    def memory(self) -> None:
        if not self.peers.available(P.OURS):
            self.skipped.append(("memory", f"drvsoftmax does not import: {self.peers.missing.get(P.OURS)}"))
            return
        self._memory(self.peers.mods[P.OURS], C.MEMORY_SHAPE)
        self.dev.empty_cache()

    def _memory(self, ds, shape: tuple) -> None:
        torch = self.torch
        x = torch.randn(shape, dtype=torch.float16, device="cuda")
        hidden = torch.rand((shape[0], 1) + shape[2:], device="cuda") < C.MASK_HIDDEN
        addm = torch.zeros(hidden.shape, dtype=x.dtype, device="cuda").masked_fill_(hidden, float("-inf"))
        s = C.SCALE
        calls = {
            "none": lambda: ds.scaled_masked_softmax(x, scale=s),
            "bool": lambda: ds.scaled_masked_softmax(x, hidden, scale=s),
            "add": lambda: ds.scaled_masked_softmax(x, addm, scale=s),
            "causal": lambda: ds.scaled_masked_softmax(x, scale=s, causal=True),
        }
        todo = [(P.OURS, k, f) for k, f in calls.items() if k in C.MEMORY_MASKS]
        todo.append(("eager", "add", lambda: torch.softmax(x * s + addm, -1)))
        for provider, kind, fn in todo:
            try:
                fn()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                y = fn()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            except Exception as e:
                self.log(f"memory {provider} {kind}: {P.error_text(e)}")
                self.healthy()
                continue
            out_b = y.numel() * y.element_size()
            del y
            extra = peak - (-(-out_b // 512) * 512)  # the allocator rounds blocks to 512 bytes
            verdict = "output only" if extra <= 0 else f"{extra / 2**20:.1f} MiB beyond the output"
            note = f"peak {peak / 2**20:.1f} MiB beyond the inputs, output {out_b / 2**20:.1f} MiB: {verdict}"
            self.add(
                R.Row(
                    case=f"memory-{kind}-f16-sk{shape[-1]}",
                    provider=provider,
                    dtype="float16",
                    shape=C.shape_str(shape),
                    section="memory",
                    direction="fwd",
                    mask=kind,
                    sk=shape[-1],
                    nbytes=peak,
                    note=note,
                )
            )
            self.log(f"memory {provider} {kind} {C.shape_str(shape)}: {note}")

    def coldstart(self) -> None:
        manifest = REPO / "drvsoftmax" / "_prebuilt" / "manifest.json"
        if not manifest.is_file():
            why = "no packaged cubins in drvsoftmax/_prebuilt (build_ptx.py, or benchmarks/peers_setup.sh, makes them)"
            self.skipped.append(("coldstart", why))
            self.log(f"coldstart skipped: {why}")
            return
        try:
            res, res_src = _cold_children()
        except Exception as e:
            self.log(f"coldstart: {P.error_text(e)}")
            self.skipped.append(("coldstart", P.error_text(e)))
            return
        shape = C.COLDSTART_SHAPE
        note = (
            f"import torch {res['import_torch_s']:.2f} s (not counted); import drvsoftmax + first call "
            f"{res['first_call_s']:.3f} s with the package's bytecode compiled, as an install leaves it "
            f"({res_src['first_call_s']:.3f} s compiling it from source); "
            f"second call {res['second_call_s'] * 1e3:.2f} ms; kernels from "
            f"{', '.join(res['origins'])}; max err {res['max_err']:.1e}; target <= 0.1 s"
        )
        self.add(
            R.Row(
                case=f"coldstart-f16-sk{shape[-1]}",
                provider=P.OURS,
                dtype="float16",
                shape=C.shape_str(shape),
                section="coldstart",
                direction="fwd",
                mask="bool",
                sk=shape[-1],
                ms=res["first_call_s"] * 1e3,
                note=note,
            )
        )
        self.log(f"coldstart: {note}")

    # -- cases --
    def case(self, case: C.Case) -> None:
        if self.left() <= 0:
            self.skipped.append((case.name, "time budget"))
            return
        torch = self.torch
        todo = []
        for p in self.providers:
            why = P.why_not(p, case)
            if why is None and not self.peers.available(p):
                why = f"does not import here: {self.peers.missing[p]}"
            if why is None and p == "compile" and self.left() < COMPILE_RESERVE_S:
                why = "time budget"
            if why is None:
                todo.append(p)
            else:
                self.note_absent(case, p, why)
        copies = T.copies_for(case.min_bytes) if self.dev.name == "cuda" else 2
        try:
            sets = make_inputs(torch, case, copies, self.dev.name)
        except Exception as e:
            for p in todo:
                self.add(R.error_row(case, p, f"inputs: {P.error_text(e)}"))
            self.log(f"{case.name}: inputs failed: {P.error_text(e)}")
            self.dev.empty_cache()
            self.healthy()
            return
        rows = check_rows(torch, case.rows, case.sk, self.dev.name)
        refs: dict[float, object] = {}
        try:
            for p in todo:
                self.provider(case, p, sets, rows, refs)
        finally:
            del sets, refs
            self.dev.empty_cache()
        for c in R.compare(self.rows):
            if c.case == case.name:
                self.log(R.case_line(c))

    def note_absent(self, case: C.Case, provider: str, why: str) -> None:
        self.absent.append((case.name, provider, why))
        if (provider, why) not in self._said:
            self._said.add((provider, why))
            self.log(f"  [absent] {provider}: {why} (first: {case.name}; later cases: in the markdown)")

    def provider(self, case: C.Case, p: str, sets: list, rows, refs: dict) -> None:
        torch = self.torch
        try:
            fn = self.peers.make(p, case)
        except P.Absent as e:
            self.note_absent(case, p, str(e))
            return
        notes = []
        t = time.monotonic()
        try:
            out = fn(sets[0])
            self.dev.sync()
        except Exception as e:
            self.fail(case, p, f"first call: {P.error_text(e)}")
            return
        first = time.monotonic() - t
        if first > 0.3:
            notes.append(f"first call {first:.1f} s")
        scale = 1.0 if p in P.PLAIN else C.SCALE
        try:
            if scale not in refs:
                refs[scale] = reference(torch, case, sets[0], rows, scale)
            rel, ok = agree(out, refs[scale], rows, case)
            notes.append(f"max rel diff {rel:.1e}" + ("" if ok else " MISMATCH"))
            if not ok:
                self.log(f"  MISMATCH {case.name} {p}: max |diff| / max |reference| = {rel:.2e}")
        except Exception as e:
            notes.append(f"no check ({P.error_text(e)[:100]})")
        del out
        try:
            ms, reps = self.dev.time_ms(fn, sets)
        except Exception as e:
            self.fail(case, p, P.error_text(e))
            return
        notes.append(f"median of {reps}" + (f", {len(sets)} input sets rotated" if len(sets) > 1 else ""))
        if p == P.OURS:
            plan = plan_note(self.peers.mods[P.OURS], case, device_arch())
            if plan:
                notes.append(plan)
        self.add(R.timed_row(case, p, ms, self.copy_gbps, "; ".join(notes)))

    def fail(self, case: C.Case, p: str, msg: str) -> None:
        self.add(R.error_row(case, p, msg))
        self.log(f"  ERROR {case.name} {p}: {msg}")
        self.dev.empty_cache()
        self.healthy()


def kernel_origins() -> str:
    """Where drvsoftmax's kernels came from in this process (packaged cubin, PTX, NVRTC), with counts."""
    try:
        from drvsoftmax import _driver

        found = [o for d in _driver._devices.values() for o in d.origins.values()]
    except Exception:
        return "?"
    counts: dict[str, int] = {}
    for o in found:
        counts[o] = counts.get(o, 0) + 1
    return "; ".join(f"{o} (x{n})" for o, n in sorted(counts.items())) or "none loaded"


def plan_note(ds, case: C.Case, arch: str | None = None) -> str:
    """drvsoftmax's own account of what runs (its planner, for the GPU's architecture `arch`
    such as "sm_90": the tiers of that GPU included), first clause only."""
    try:
        if case.direction == "bwd":
            s = ds.explain(case.shape, case.dtype, backward=True, arch=arch)
        else:
            mdt = {"bool": "bool", "add": case.dtype}.get(case.mask)
            s = ds.explain(case.shape, case.dtype, mask_dtype=mdt, causal=case.mask == "causal", arch=arch)
    except Exception:
        return ""
    return "plan: " + " ".join(str(s).split())[:90]


@functools.lru_cache(maxsize=1)
def device_arch() -> str | None:
    """sm_XY of the CUDA device (asked once per run), or None."""
    try:
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    except Exception:
        return None


def _cold_children() -> tuple[dict, dict]:
    """COLD_CHILD in two fresh processes, from one copy of the package laid out as a wheel
    installs it (drvsoftmax/ with cuda_src/ and _prebuilt/ inside), run-time compiling
    forbidden, an empty kernel cache: (with the copy's modules byte-compiled, as pip does
    when it installs a wheel; compiling them from source).  The source run goes first, before
    the bytecode exists.  Neither child writes bytecode (PYTHONDONTWRITEBYTECODE=1); the
    other packages (torch, cuda.bindings) are imported as they are installed."""
    with tempfile.TemporaryDirectory(prefix="drvsoftmax-cold-") as tmp:
        site = Path(tmp) / "site"
        pkg = site / "drvsoftmax"
        shutil.copytree(REPO / "drvsoftmax", pkg, ignore=shutil.ignore_patterns("__pycache__"))
        if not (pkg / "cuda_src").is_dir():  # a source tree keeps the kernels beside the package
            shutil.copytree(REPO / "cuda_src", pkg / "cuda_src")
        env = {**os.environ, "PYTHONPATH": str(site), "DRVSOFTMAX_NO_JIT": "1", "DRVSOFTMAX_CACHE_DIR": tmp}
        env.pop("PYTHONPYCACHEPREFIX", None)
        env.pop("PYTHONDONTWRITEBYTECODE", None)

        def child() -> dict:
            r = subprocess.run(
                [sys.executable, "-c", COLD_CHILD, C.shape_str(C.COLDSTART_SHAPE)],
                capture_output=True,
                text=True,
                env={**env, "PYTHONDONTWRITEBYTECODE": "1"},
                cwd=tmp,
                timeout=180,
            )
            if r.returncode != 0:
                raise RuntimeError((r.stderr or r.stdout).strip().splitlines()[-1][:300])
            res = dict(json.loads(r.stdout.strip().splitlines()[-1]))
            if not os.path.realpath(str(res.get("from", ""))).startswith(os.path.realpath(site) + os.sep):
                raise RuntimeError(f"the child imported drvsoftmax from {res.get('from')}, not from the copy in {site}")
            return res

        from_source = child()
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(pkg)], env=env, check=True, capture_output=True, timeout=180
        )
        return child(), from_source


COLD_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
shape = tuple(int(n) for n in sys.argv[1].split("x"))
x = torch.randn(shape, device="cuda", dtype=torch.float16)
m = torch.rand((shape[0], 1) + shape[2:], device="cuda") < 0.1
m[..., 0] = False
torch.cuda.synchronize()
t1 = time.perf_counter()
import drvsoftmax
y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.125)
torch.cuda.synchronize()
t_first = time.perf_counter() - t1
t2 = time.perf_counter()
y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.125)
torch.cuda.synchronize()
t_second = time.perf_counter() - t2
ref = torch.softmax((x[:1].double() * 0.125).masked_fill(m[:1], float("-inf")), -1)
err = float((y[:1].double() - ref).abs().max())
try:
    from drvsoftmax import _driver
    origins = sorted(set(_driver.device(0).origins.values()))
except Exception:
    origins = ["?"]
print(json.dumps({"import_torch_s": t_torch, "first_call_s": t_first, "second_call_s": t_second,
                  "origins": origins, "max_err": err, "from": drvsoftmax.__file__}))
"""


def _select_providers(text: str | None) -> list[str]:
    if not text:
        return list(P.PROVIDERS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in P.PROVIDERS]
    if bad or not names:
        raise ValueError(f"--providers: expected a comma-separated subset of {', '.join(P.PROVIDERS)}; got {text!r}")
    if P.OURS not in names:
        names.insert(0, P.OURS)
    return names


def budget_of(args) -> float:
    if args.time_budget is not None:
        return args.time_budget
    return QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S


def run(args, t0: float) -> int:
    only = C.parse_only(args.only)
    providers = _select_providers(args.providers)
    smoke = bool(getattr(args, "cpu_smoke", False))
    cases = C.plan(only, args.quick or smoke, compile_on=not args.no_compile and "compile" in providers)
    import torch

    if smoke:
        dev: T.Cuda = T.Cpu(torch)
        cases = [C.shrink(c) for c in cases]
    elif torch.cuda.is_available():
        dev = T.Cuda(torch)
    else:
        print("No CUDA device is visible: this benchmark needs a GPU (--dry-run lists the plan anywhere).")
        return 2
    env = environment(torch, args.commit, dev.name)
    peers = P.Peers(torch, providers, cpu=smoke)
    out = Path(args.out) if args.out else RESULTS
    runner = Runner(dev, peers, env, out, budget_of(args), t0, providers)
    runner.log(
        f"drvsoftmax benchmark on {env['gpu']}, driver {env['driver']}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"commit {env['commit']}, {env['date']}; {len(cases)} cases; budget {runner.budget_s:.0f} s"
    )
    for p, v in peers.versions.items():
        runner.log(f"  provider {p}: {v}")
    for p, w in peers.missing.items():
        runner.log(f"  provider {p}: NOT AVAILABLE ({w})")
    runner.log(f"results: {runner.csv_path} (+ .md, .png, .log)")
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        runner.guarded("copy", runner.copy)
        for name in ("host", "memory", "coldstart"):
            if C.wants(only, name) and (dev.name == "cuda" or name == "host"):
                runner.guarded(name, getattr(runner, name))
        section = None
        for case in cases:
            if case.section != section:
                if section is not None:
                    runner.write_summary()
                section = case.section
                runner.log(f"== {section}")
            runner.guarded(case.name, runner.case, case)
        if cases:
            runner.guarded("copy-end", runner.copy, "copy-end")
    except (Stop, KeyboardInterrupt) as e:
        runner.stopped = f"interrupted ({type(e).__name__} {e}) at {runner.elapsed():.0f} s"
    except Broken as e:
        runner.stopped = f"CUDA stopped working: {e}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        origins = kernel_origins()
        runner.log(f"drvsoftmax kernels loaded from: {origins}")
        runner.peers.versions[P.OURS] = runner.peers.versions.get(P.OURS, "?") + f"; kernels from {origins}"
        runner.write_summary(png=True)
        runner.log()
        for line in R.summary_lines(env, runner.rows, runner.absent, runner.skipped, runner.stopped):
            runner.log(line)
        written = [p.name for p in (runner.md_path, runner.png_path, runner.log_path) if p.is_file()]
        runner.log(f"wrote {runner.csv_path}, {', '.join(written)}")
    mism = any("MISMATCH" in r.note for r in runner.rows if r.provider == P.OURS)
    return 1 if mism or runner.stopped.startswith("CUDA") else 0


# ----------------------------------------------------------------------------------
# Without timing: dry run, prewarm, redo.


def dry_run(args) -> int:
    only = C.parse_only(args.only)
    providers = _select_providers(args.providers)
    cases = C.plan(only, args.quick, compile_on=not args.no_compile and "compile" in providers)
    env = environment(None, args.commit)
    out = Path(args.out) if args.out else RESULTS
    print(f"DRY RUN: nothing is timed and CUDA is not touched. Commit {env['commit']}.")
    print(
        f"results would go to {out}/{R.file_stem({**env, 'gpu': '<gpu>', 'driver': '<driver>'})}.csv (+ .md .png .log)"
    )
    print(f"providers: {', '.join(providers)} (peers are assumed to import: peers_setup.sh installs them)")
    extras = [s for s in ("host", "memory", "coldstart") if C.wants(only, s)]
    if "host" in extras:
        print(f"[host] {C.shape_str(C.HOST_SHAPE)} float16: drvsoftmax, torch.softmax, apex, eager; host us per call")
    if "memory" in extras:
        print(f"[memory] {C.shape_str(C.MEMORY_SHAPE)} float16, drvsoftmax {', '.join(C.MEMORY_MASKS)}; eager add")
    if "coldstart" in extras:
        print(f"[coldstart] {C.shape_str(C.COLDSTART_SHAPE)} float16 bool mask, packaged cubin, fresh process")

    def chosen(case: C.Case) -> list[str]:
        return [p for p in P.applicable(case) if p in providers]

    section = None
    for c in cases:
        if c.section != section:
            section = c.section
            print(f"[{section}]")
        absent = [f"{p} ({P.why_not(p, c)})" for p in providers if P.why_not(p, c)]
        print(
            f"  {c.name:24s} {c.describe():52s} {c.min_bytes / 1e6:9.1f} MB  "
            f"copies {T.copies_for(c.min_bytes):<2d} providers: {', '.join(chosen(c))}"
        )
        if absent:
            print(f"      absent: {'; '.join(absent)}")
    total, per = C.estimate_s(cases, chosen, T.TIMING, extras)
    print(
        f"{len(cases)} cases, {sum(len(chosen(c)) for c in cases)} timings, "
        f"{sum('compile' in chosen(c) for c in cases)} torch.compile graphs"
    )
    print(
        "estimated run time on an H200: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in per.items())
        + f"; total {total:.0f} s (budget {budget_of(args):.0f} s)"
    )
    return 0


def prewarm(args, t0: float) -> int:
    """First calls (compiles) of the JIT-compiled peers on this shard of the cases; nothing is timed."""
    only = C.parse_only(args.only)
    wanted = [p.strip() for p in args.prewarm.split(",") if p.strip()]
    bad = [p for p in wanted if p not in ("quack", "liger", "compile")]
    if bad:
        raise ValueError(f"--prewarm: expected quack, liger and/or compile; got {args.prewarm!r}")
    try:
        k, n = (int(v) for v in (args.shard or "0/1").split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise ValueError(f"--shard: expected K/N with 0 <= K < N; got {args.shard!r}")
    smoke = bool(getattr(args, "cpu_smoke", False))
    cases = C.plan(only, args.quick or smoke, compile_on=not args.no_compile)[k::n]
    if smoke:
        cases = [C.shrink(c) for c in cases]
    device = "cpu" if smoke else "cuda"
    import torch

    peers = P.Peers(torch, wanted, cpu=smoke)
    for p, w in peers.missing.items():
        print(f"[prewarm {k}/{n}] {p} not available: {w}", flush=True)
    done = failed = 0
    for case in cases:
        for p in wanted:
            if P.why_not(p, case) or not peers.available(p):
                continue
            small = p in ("quack", "liger")  # they compile per (dtype, Sk): a few rows will do
            c = case
            if small:
                c = C.Case(case.name, case.section, case.direction, case.dtype, (C.ROW_MULTIPLE, case.sk))
            try:
                fn = peers.make(p, c)
                fn(make_inputs(torch, c, 1, device)[0])
                if device == "cuda":
                    torch.cuda.synchronize()
                done += 1
            except Exception as e:
                failed += 1
                print(f"[prewarm {k}/{n}] {case.name} {p}: {P.error_text(e)}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"[prewarm {k}/{n}] {done} first calls, {failed} failed, {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def redo(args) -> int:
    """Markdown, PNG and summary again from a results CSV (e.g. after a run was cut short)."""
    src = Path(args.from_csv)
    env, rows = R.read_csv(src)
    out = Path(args.out) if args.out else src.parent
    stem = src.stem
    (out / f"{stem}.md").write_text(R.markdown(env, rows, extra="Regenerated from the CSV."))
    why = R.write_png(out / f"{stem}.png", env, rows)
    for line in R.summary_lines(env, rows):
        print(line)
    print(f"wrote {out / (stem + '.md')}" + (f"; no PNG: {why}" if why else f" and {stem}.png"))
    return 0
