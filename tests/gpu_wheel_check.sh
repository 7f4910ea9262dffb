#!/usr/bin/env bash
# On a GPU machine: install a built wheel into a folder of its own and check that the first
# call loads the packaged cubin of the device's architecture, with no NVRTC at all.
#
#   bash tests/gpu_wheel_check.sh dist/drvsoftmax-*.whl
#
# The Python running it (PYTHON, default python3) needs the wheel's dependencies and torch
# with CUDA.  Exits non-zero, saying why, unless
#  1. every kernel of the first call came from "packaged cubin drvsoftmax_sm_XY_..." for the
#     device's own sm_XY, and NVRTC was never imported;
#  2. with the cubins hidden (the wheel's PTX only, the driver's JIT cache off), the first
#     call JIT-compiles its kernel from the per-kernel PTX in at most 2 s.
set -euo pipefail
WHEEL=${1:?usage: tests/gpu_wheel_check.sh path/to/drvsoftmax-*.whl}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/drvsoftmax-wheel-check.XXXXXX)
"$PY" -m pip install -q --no-deps --target "$WORK/site" "$WHEEL"
cd "$WORK"   # away from any source tree
PYTHONPATH="$WORK/site" DRVSOFTMAX_NO_JIT=1 DRVSOFTMAX_CACHE_DIR="$WORK/empty-cache" "$PY" - <<'PYEOF'
import logging
import sys
import time

records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())


logging.getLogger("drvsoftmax").addHandler(Keep())
logging.getLogger("drvsoftmax").setLevel(logging.DEBUG)

t0 = time.perf_counter()
import drvsoftmax  # noqa: E402
import torch  # noqa: E402

from drvsoftmax import _driver  # noqa: E402

assert "/site/drvsoftmax/" in drvsoftmax.__file__, f"not the wheel: {drvsoftmax.__file__}"
x = torch.randn(4, 8, 128, 128, device="cuda", dtype=torch.float16)
mask = torch.rand(4, 1, 128, 128, device="cuda") < 0.1
torch.cuda.synchronize()
t = time.perf_counter()
y = drvsoftmax.scaled_masked_softmax(x, mask, scale=0.125, causal=True)
torch.cuda.synchronize()
first = time.perf_counter() - t
y.float().sum().item()
ref = torch.softmax((x.float() * 0.125).masked_fill(mask | torch.ones(128, 128, dtype=torch.bool, device="cuda").triu(1), float("-inf")), -1)
err = (y.float() - ref).abs().max().item()
dev = _driver.device(torch.cuda.current_device())
want = f"packaged cubin drvsoftmax_{dev.arch}_"
print(f"wheel: {drvsoftmax.__file__}")
print(f"device: {dev.name} {dev.arch}; first call {first * 1e3:.1f} ms; max |error| {err:.2e}")
for name, origin in dev.origins.items():
    print(f"  {name}: {origin}")
for line in records:
    print(f"  log: {line}")
bad = [o for o in dev.origins.values() if not o.startswith(want)]
problems = []
if not dev.origins:
    problems.append("no kernel was loaded")
if bad:
    problems.append(f"kernels not from {want}...: {bad}")
if "cuda.bindings.nvrtc" in sys.modules:
    problems.append("NVRTC was imported")
if any("compiled" in r and "NVRTC" in r for r in records):
    problems.append("the log shows an NVRTC compile")
if err > 2e-3:
    problems.append(f"wrong result: max error {err}")
if problems:
    sys.exit("FAILED: " + "; ".join(problems))
print(f"OK: first call loaded {want}... with no NVRTC")
PYEOF

echo "== the wheel's PTX alone: first call through the driver's JIT"
mkdir -p "$WORK/ptx-only"
cp "$WORK"/site/drvsoftmax/_prebuilt/*.ptx "$WORK"/site/drvsoftmax/_prebuilt/manifest.json "$WORK/ptx-only/"
PYTHONPATH="$WORK/site" DRVSOFTMAX_NO_JIT=1 CUDA_CACHE_DISABLE=1 DRVSOFTMAX_CACHE_DIR="$WORK/empty-cache" \
    PTX_ONLY="$WORK/ptx-only" "$PY" - <<'PYEOF'
import json
import os
import sys
import time
from pathlib import Path

from drvsoftmax import _loader

folder = Path(os.environ["PTX_ONLY"])
m = json.loads((folder / "manifest.json").read_text())
m["files"] = {f: e for f, e in m["files"].items() if e["kind"] == "ptx"}
(folder / "manifest.json").write_text(json.dumps(m))
_loader.ARTIFACT_DIR = folder

import drvsoftmax  # noqa: E402
import torch  # noqa: E402

from drvsoftmax import _driver  # noqa: E402

x = torch.randn(4, 8, 128, 128, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
t = time.perf_counter()
y = drvsoftmax.scaled_masked_softmax(x, scale=0.125)
torch.cuda.synchronize()
first = time.perf_counter() - t
err = (y.float() - torch.softmax(x.float() * 0.125, -1)).abs().max().item()
dev = _driver.device(torch.cuda.current_device())
print(f"first call {first:.2f} s, max |error| {err:.2e}")
for name, origin in dev.origins.items():
    print(f"  {name}: {origin}")
if not all(o.startswith("packaged PTX drvsoftmax_compute_") for o in dev.origins.values()):
    sys.exit("FAILED: not loaded from the packaged PTX")
if first > 2.0 or err > 2e-3:
    sys.exit(f"FAILED: first call {first:.2f} s (limit 2 s), max error {err}")
print("OK: per-kernel PTX, first call within 2 s")
PYEOF
