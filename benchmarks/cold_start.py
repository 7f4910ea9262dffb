"""Cold start per loader path: time from ``import drvsoftmax`` to the first correct result.

    python benchmarks/cold_start.py [--out DIR]

Each path runs in a fresh process (torch imported first, and timed separately):
  cubin       the packaged cubin for the device, with run-time compiling forbidden
  ptx         packaged PTX only (cubins hidden), JIT-compiled by the driver
  nvrtc       no packaged artifacts: NVRTC compiles now (empty cache)
  nvrtc-warm  no packaged artifacts, the disk cache from the previous run
The child reports where the kernel came from and whether NVRTC compiled anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
x = torch.randn(8, 16, 512, 512, device="cuda", dtype=torch.float16)
m = torch.rand(8, 1, 512, 512, device="cuda") < 0.1
torch.cuda.synchronize()
t1 = time.perf_counter()
import drvsoftmax
from drvsoftmax import _compiler, _driver, _loader, _reference
from pathlib import Path
if sys.argv[1] != "-":
    _loader.ARTIFACT_DIR = Path(sys.argv[1])
compiles = []
_orig = _compiler.compile_kernels
def counting(arch, names=None):
    compiles.append(arch)
    return _orig(arch, names)
_compiler.compile_kernels = counting
y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.125)
torch.cuda.synchronize()
t_first = time.perf_counter() - t1
t2 = time.perf_counter()
y = drvsoftmax.scaled_masked_softmax(x, m, scale=0.125)
torch.cuda.synchronize()
t_second = time.perf_counter() - t2
ref = _reference.softmax_forward(x[:1].float().cpu().numpy(), m[:1].cpu().numpy(), 0.125)
err = float(abs(y[:1].float().cpu().numpy() - ref).max())
dev = _driver.device(0)
print(json.dumps({"import_torch_s": t_torch, "first_call_s": t_first, "second_call_s": t_second,
                  "origins": sorted(set(dev.origins.values())), "nvrtc_compiles": len(compiles),
                  "max_err": err}))
"""


def run_child(artifacts: str, env: dict) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, artifacts], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=900
    )
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1][:300]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    pkg = ROOT / "drvsoftmax" / "_prebuilt"
    if not (pkg / "manifest.json").is_file():
        print(f"no packaged artifacts in {pkg}: run build_ptx.py first")
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="drvsoftmax-cold-"))
    ptx_only = tmp / "ptx_only"
    ptx_only.mkdir()
    for f in pkg.iterdir():
        if f.suffix != ".cubin":
            shutil.copy2(f, ptx_only / f.name)
    empty = tmp / "empty"
    empty.mkdir()
    base = {**os.environ, "PYTHONPATH": str(ROOT), "DRVSOFTMAX_CACHE_DIR": str(tmp / "cache")}
    runs = [
        ("cubin", "-", {**base, "DRVSOFTMAX_NO_JIT": "1"}),
        ("ptx", str(ptx_only), {**base, "DRVSOFTMAX_NO_JIT": "1"}),
        ("nvrtc", str(empty), base),
        ("nvrtc-warm", str(empty), base),
    ]
    rows = []
    print(
        f"{'path':11s} {'import torch':>12s} {'import->1st result':>19s} {'2nd call':>9s} {'NVRTC':>6s}  "
        f"{'max err':>8s}  origin"
    )
    for name, art, env in runs:
        r = run_child(art, env)
        r["path"] = name
        rows.append(r)
        if "error" in r:
            print(f"{name:11s} ERROR {r['error']}")
            continue
        print(
            f"{name:11s} {r['import_torch_s']:11.2f}s {r['first_call_s']:18.3f}s {r['second_call_s'] * 1e3:7.2f}ms "
            f"{r['nvrtc_compiles']:6d}  {r['max_err']:8.1e}  {'; '.join(r['origins'])}"
        )
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "cold_start.json").write_text(json.dumps(rows, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
