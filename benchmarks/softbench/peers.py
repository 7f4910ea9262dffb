"""Who runs each case: drvsoftmax and its peers, what each one can take, and how it is called.

    drvsoftmax     scaled_masked_softmax / _backward (this checkout)
    eager          the expression a user writes: softmax(x*s + mask) (bool masks through masked_fill,
                   causal through a triu mask built in the call); backward
                   torch._softmax_backward_data(dy, y) * s
    compile        torch.compile of that expression: torch._dynamo.reset() and a new compiled function
                   (dynamic=False) for every case, so each shape gets its own graph
    torch.softmax  torch.softmax(x, -1) and torch._softmax_backward_data(dy, y): no mask, no scale
    quack          quack's softmax_fwd / softmax_bwd on the [rows, Sk] view: no mask, no scale
    apex           NVIDIA apex's Megatron fused softmax extensions, built by peers_setup.sh:
                   scaled_softmax_cuda (no mask), scaled_masked_softmax_cuda (bool mask, Sk <= 4096;
                   backward), generic_scaled_masked_softmax_cuda (longer rows while 48 KB of shared
                   memory holds them), scaled_upper_triang_masked_softmax_cuda (causal, Sq == Sk);
                   fp16/bf16 only
    liger          Liger-Kernel's Triton softmax (its forward and backward ops): no mask, no scale,
                   Sk <= 65536

A peer that cannot take a case is absent from it; `why_not` says why (the run logs it).  Peers
are imported from PEERS_DIR (default /tmp/peers, where peers_setup.sh installs them), added
as a site directory so that the .pth file of nvidia-cutlass-dsl is read.
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
from collections.abc import Callable
from pathlib import Path

from .cases import SCALE, Case, next_pow2

PROVIDERS = ("drvsoftmax", "eager", "torch.softmax", "quack", "apex", "liger", "compile")
OURS = "drvsoftmax"
# Providers that take CUDA tensors only: a --cpu-smoke run leaves them out even where they
# import (a machine with a GPU and the peers installed), with this reason.
CUDA_ONLY = ("quack", "apex", "liger")
CPU_RUN = "takes CUDA tensors only (a --cpu-smoke run is on the CPU)"
PLAIN = frozenset({"torch.softmax", "quack", "liger"})  # no scale: softmax(x) and its backward
PEERS_DIR = Path(os.environ.get("DRVSOFTMAX_PEERS", "/tmp/peers"))
APEX_BUILD = "apex_build"
APEX_MODULES = (
    "scaled_softmax_cuda",
    "scaled_masked_softmax_cuda",
    "generic_scaled_masked_softmax_cuda",
    "scaled_upper_triang_masked_softmax_cuda",
)
APEX_MAX_SK = 16384  # no-mask and causal kernels
APEX_MASKED_MAX_SK = 4096  # scaled_masked_softmax_cuda: masked forward and backward
SMEM_DEFAULT = 48 * 1024  # dynamic shared memory a launch gets without opting in (apex does not)
QUACK_MAX_SK = 262144  # beyond this quack's rows no longer fit its clusters' shared memory ...
QUACK_MAX_SK_FWD16 = 1048576  # ... except the 16-bit forward, which still launches at 1M keys
LIGER_MAX_SK = 65536


class Absent(Exception):
    """The provider cannot take this case (a reason, not a failure)."""


# ----------------------------------------------------------------------------------
# What each provider can take (pure Python: the dry run uses it too).


def apex_rows_per_block(sk: int) -> int:
    """Rows one 128-thread block of apex's warp kernels handles; Sq must be a multiple of it."""
    p = next_pow2(sk)
    warp = min(p, 32)
    return (128 // warp) * (2 if p <= 128 else 1)


def _bhsq(case: Case) -> tuple[int, int, int]:
    """(batches, heads, Sq) of the [B, H, Sq, Sk] view apex gets ([1, 1, rows, Sk] for 2-D rows)."""
    s = case.shape
    return (s[0], s[1], s[2]) if len(s) == 4 else (1, 1, case.rows)


def apex_generic_fits(case: Case) -> bool:
    """The generic kernels keep a row in shared memory and never opt in to more than 48 KB."""
    warps = -(-case.sk // 32)
    if case.direction == "bwd":
        return 2 * case.itemsize * case.sk + 4 * warps <= SMEM_DEFAULT
    return 4 * (case.sk + warps) <= SMEM_DEFAULT


def apex_kernel(case: Case) -> tuple[str | None, str]:
    """(module, "") for the apex extension that computes this case, or (None, why not)."""
    if case.dtype not in ("float16", "bfloat16"):
        return None, "apex's kernels take fp16/bf16 only"
    if case.sk % 8:
        # Its warp kernels read rows in 16-byte vectors: an odd row length faults
        # (misaligned address), and the fault ends the CUDA context of the whole run.
        return None, "apex's kernels need Sk divisible by 8"
    b, h, sq = _bhsq(case)
    bpb = apex_rows_per_block(case.sk)
    if len(case.shape) not in (2, 4):
        return None, "apex takes [B, H, Sq, Sk] only"
    if case.direction == "bwd":
        if case.sk <= APEX_MASKED_MAX_SK:
            if case.rows % bpb:
                return None, f"apex's backward needs rows divisible by {bpb}"
            return "scaled_masked_softmax_cuda", ""
        if apex_generic_fits(case):
            return "generic_scaled_masked_softmax_cuda", ""
        return None, f"apex's backward: Sk <= {APEX_MASKED_MAX_SK}, or a row in 48 KB of shared memory"
    if case.mask == "add":
        return None, "apex has no additive-mask kernel"
    if case.mask == "causal":
        if sq != case.sk:
            return None, "apex's causal kernel needs Sq == Sk"
        if case.sk > APEX_MAX_SK:
            return None, f"apex's causal kernel stops at Sk {APEX_MAX_SK}"
        if (b * h) % bpb:
            return None, f"apex's causal kernel needs B*H divisible by {bpb}"
        return "scaled_upper_triang_masked_softmax_cuda", ""
    if sq < 2 or sq % bpb or h > 65535 or b > 65535:
        return None, f"apex's warp kernels need Sq > 1 divisible by {bpb} (and B, H < 65536)"
    if case.mask == "none":
        if case.sk > APEX_MAX_SK:
            return None, f"apex's scaled_softmax stops at Sk {APEX_MAX_SK}"
        return "scaled_softmax_cuda", ""
    # bool mask
    ms = case.mask_shape or ()
    if len(ms) != 4 or ms[1] != 1 or ms[2] != sq or ms[0] not in (1, b):
        return None, "apex takes masks of shape [B or 1, 1, Sq, Sk] only"
    if case.sk <= APEX_MASKED_MAX_SK:
        return "scaled_masked_softmax_cuda", ""
    if apex_generic_fits(case):
        return "generic_scaled_masked_softmax_cuda", ""
    return None, f"apex's masked kernels: Sk <= {APEX_MASKED_MAX_SK}, or a row in 48 KB of shared memory"


def why_not(provider: str, case: Case) -> str | None:
    """None when `provider` can take `case`, else the reason (static rules, no imports)."""
    if provider in (OURS, "eager"):
        return None
    if provider == "compile":
        return None if case.compile else "torch.compile is not run on this case (its time is kept for the targets)"
    if provider in PLAIN and case.mask != "none":
        return f"{provider} takes no mask"
    if provider == "torch.softmax":
        return None
    if provider == "quack":
        cap = QUACK_MAX_SK_FWD16 if case.direction == "fwd" and case.itemsize == 2 else QUACK_MAX_SK
        return None if case.sk <= cap else f"quack fails to launch beyond Sk {cap} here (shared memory)"
    if provider == "liger":
        return None if case.sk <= LIGER_MAX_SK else f"Liger refuses rows longer than {LIGER_MAX_SK}"
    if provider == "apex":
        return apex_kernel(case)[1] or None
    return f"unknown provider {provider}"


def applicable(case: Case) -> list[str]:
    return [p for p in PROVIDERS if why_not(p, case) is None]


# ----------------------------------------------------------------------------------
# Loading the peers and calling them (needs torch; imported lazily).


def add_peers_path() -> None:
    """Make PEERS_DIR importable (as a site directory: .pth files are read) and keep caches there."""
    if PEERS_DIR.is_dir() and str(PEERS_DIR) not in sys.path:
        site.addsitedir(str(PEERS_DIR))
    os.environ.setdefault("QUACK_CACHE_DIR", str(PEERS_DIR / "quack-cache"))
    os.environ.setdefault("TVM_FFI_CACHE_DIR", str(PEERS_DIR / "tvm-ffi-cache"))


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "?"


def _load_so(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


def error_text(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:240]}"


class Peers:
    """The providers that import here, with versions, and the reasons for those that do not
    (`cpu`: a run on the CPU, which leaves CUDA_ONLY out)."""

    def __init__(self, torch, names=PROVIDERS, cpu: bool = False):
        self.torch = torch
        self.mods: dict[str, object] = {}
        self.apex: dict[str, object] = {}
        self.versions: dict[str, str] = {}
        self.missing: dict[str, str] = {}
        add_peers_path()
        for name in names:
            if cpu and name in CUDA_ONLY:
                self.missing[name] = CPU_RUN
                continue
            try:
                getattr(self, "_load_" + name.replace(".", "_"))()
            except Exception as e:
                self.missing[name] = error_text(e)

    def available(self, provider: str) -> bool:
        return provider not in self.missing

    def _load_drvsoftmax(self):
        import drvsoftmax

        self.mods[OURS] = drvsoftmax
        self.versions[OURS] = f"{drvsoftmax.__version__} ({Path(drvsoftmax.__file__).parent})"

    def _load_eager(self):
        self.versions["eager"] = self.torch.__version__

    def _load_torch_softmax(self):
        self.versions["torch.softmax"] = self.torch.__version__

    def _load_compile(self):
        import torch._dynamo  # noqa: F401

        self.versions["compile"] = self.torch.__version__

    def _load_quack(self):
        from quack.softmax import softmax_bwd, softmax_fwd

        self.mods["quack"] = (softmax_fwd, softmax_bwd)
        self.versions["quack"] = (
            f"quack-kernels {_version('quack-kernels')}, cutlass-dsl {_version('nvidia-cutlass-dsl')}"
        )

    def _load_liger(self):
        from liger_kernel.ops.softmax import _softmax_backward, _softmax_forward
        from liger_kernel.ops.utils import calculate_settings

        self.mods["liger"] = (_softmax_forward, _softmax_backward, calculate_settings)
        self.versions["liger"] = f"liger-kernel {_version('liger-kernel')}"

    def _load_apex(self):
        why = []
        for name in APEX_MODULES:
            path = PEERS_DIR / APEX_BUILD / name / f"{name}.so"
            if not path.is_file():
                why.append(f"{name}: not built ({path} missing: run benchmarks/peers_setup.sh)")
                continue
            try:
                self.apex[name] = _load_so(name, path)
            except Exception as e:
                why.append(f"{name}: {error_text(e)}")
        if not self.apex:
            raise ImportError("; ".join(why))
        self.versions["apex"] = (
            "NVIDIA/apex csrc/megatron: "
            + ", ".join(sorted(self.apex))
            + (f" (missing: {'; '.join(why)})" if why else "")
        )

    # -- callables: fn(inputs) with inputs a dict of x, mask, y, dy --

    def make(self, provider: str, case: Case) -> Callable:
        """The call to time for `provider` on `case`; raises Absent when it cannot take it here."""
        why = why_not(provider, case)
        if why:
            raise Absent(why)
        if not self.available(provider):
            raise Absent(f"{provider} does not import here: {self.missing[provider]}")
        return getattr(self, "_make_" + provider.replace(".", "_"))(case)

    def _make_drvsoftmax(self, case: Case):
        ds = self.mods[OURS]
        s = SCALE
        if case.direction == "bwd":
            bwd = ds.scaled_masked_softmax_backward
            return lambda d: bwd(d["dy"], d["y"], scale=s)
        fwd = ds.scaled_masked_softmax
        if case.mask == "causal":
            return lambda d: fwd(d["x"], scale=s, causal=True)
        if case.mask == "none":
            return lambda d: fwd(d["x"], scale=s)
        return lambda d: fwd(d["x"], d["mask"], scale=s)

    def _make_eager(self, case: Case):
        return bind(expression(self.torch, case), case)

    def _make_compile(self, case: Case):
        torch = self.torch
        torch._dynamo.reset()  # a fresh graph for this shape and dtype
        return bind(torch.compile(expression(torch, case), dynamic=False), case)

    def _make_torch_softmax(self, case: Case):
        torch = self.torch
        if case.direction == "bwd":
            return lambda d: torch._softmax_backward_data(d["dy"], d["y"], -1, d["y"].dtype)
        return lambda d: torch.softmax(d["x"], -1)

    def _make_quack(self, case: Case):
        fwd, bwd = self.mods["quack"]
        sk = case.sk
        if case.direction == "bwd":
            return lambda d: bwd(d["dy"].view(-1, sk), d["y"].view(-1, sk))
        return lambda d: fwd(d["x"].view(-1, sk))

    def _make_liger(self, case: Case):
        fwd, bwd, settings = self.mods["liger"]
        sk = case.sk
        if case.direction == "bwd":
            block, warps = settings(sk)
            return lambda d: bwd(d["dy"].view(-1, sk), d["y"].view(-1, sk), block, warps, False)
        return lambda d: fwd(d["x"].view(-1, sk))[0]

    def _make_apex(self, case: Case):
        name, why = apex_kernel(case)
        if name is None:
            raise Absent(why)
        mod = self.apex.get(name)
        if mod is None:
            raise Absent(f"apex's {name} did not build or load here")
        torch, s, sk = self.torch, SCALE, case.sk
        four = len(case.shape) == 4

        def v4(t):
            return t if four else t.view(1, 1, -1, sk)

        if case.direction == "bwd":
            return lambda d: mod.backward(v4(d["dy"]), v4(d["y"]), s)
        if case.mask == "causal":
            sq = case.shape[-2]
            return lambda d: mod.forward(d["x"].view(-1, sq, sk), s)
        if case.mask == "bool":
            return lambda d: mod.forward(d["x"], d["mask"].view(torch.uint8), s)
        return lambda d: mod.forward(v4(d["x"]), s)


def expression(torch, case: Case):
    """The eager expression for the case, as a function of tensors (the same one torch.compile gets)."""
    s = SCALE
    neg_inf = float("-inf")
    if case.direction == "bwd":

        def bwd(dy, y):
            return torch._softmax_backward_data(dy, y, -1, y.dtype) * s

        return bwd
    if case.mask == "add":

        def add(x, m):
            return torch.softmax(x * s + m, -1)

        return add
    if case.mask == "bool":

        def masked(x, m):
            return torch.softmax((x * s).masked_fill(m, neg_inf), -1)

        return masked
    if case.mask == "causal":

        def causal(x):
            # bottom-right aligned like drvsoftmax: key j is hidden from query i when j > i + (Sk - Sq)
            sq, sk = x.shape[-2], x.shape[-1]
            hidden = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
            return torch.softmax((x * s).masked_fill(hidden, neg_inf), -1)

        return causal

    def plain(x):
        return torch.softmax(x * s, -1)

    return plain


def bind(fn, case: Case) -> Callable:
    """fn(tensors) -> fn(inputs dict)."""
    if case.direction == "bwd":
        return lambda d: fn(d["dy"], d["y"])
    if case.mask in ("add", "bool"):
        return lambda d: fn(d["x"], d["mask"])
    return lambda d: fn(d["x"])


def host_calls(peers: Peers, x) -> dict[str, Callable[[], object]]:
    """One eager call each on a small input, for the host-time section (no mask, scale where taken)."""
    torch, s = peers.torch, SCALE
    calls: dict[str, Callable[[], object]] = {}
    if peers.available(OURS):
        fwd = peers.mods[OURS].scaled_masked_softmax
        calls[OURS] = lambda: fwd(x, scale=s)
    calls["torch.softmax"] = lambda: torch.softmax(x, -1)
    mod = peers.apex.get("scaled_softmax_cuda")
    if mod is not None:
        calls["apex"] = lambda: mod.forward(x, s)
    calls["eager"] = lambda: torch.softmax(x * s, -1)
    return calls
