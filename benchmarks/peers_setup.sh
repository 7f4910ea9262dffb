#!/usr/bin/env bash
# Prepare the benchmark's peers on a GPU machine that has no package index.
#
#   bash benchmarks/peers_setup.sh          (repository root; run once per carried group)
#
# What it takes: the folder .peers/ of the repository root (benchmarks/peers_pack.py packs it
# where a package index is), carried in groups .peers/c1, .peers/c2, ... (one group per call
# is fine: everything is staged under $PEERS and every step runs as soon as its pieces are
# there).  A group may hold
#   whl/*.whl             wheels (quack-kernels, nvidia-cutlass-dsl*, apache-tvm-ffi,
#                         torch-c-dlpack-ext, liger-kernel)
#   parts/NAME.part-NN    pieces of NAME (an xz tarball of one wheel too big for one group),
#   parts/NAME.sha256     with their count and sha256 sums, and those of the joined file and wheel
#   apex_megatron/        NVIDIA apex's csrc/megatron softmax sources (and type_shim.h)
#
# What it does, each step skipped when already done (files under /tmp survive between calls
# while the machine stays warm):
#   1. stage what was carried into $PEERS/stage;
#   2. join and check the parts, unpack the wheel;
#   3. pip install --no-index --no-deps --target $PEERS: Liger on its own, quack with
#      cutlass-dsl (all its wheels in one call: they share a top-level folder);
#   4. in parallel: build apex's four softmax extensions with torch.utils.cpp_extension into
#      $PEERS/apex_build/<name>/<name>.so (-O3 --use_fast_math and apex's half-operator flags);
#      build drvsoftmax's packaged cubin for this GPU into drvsoftmax/_prebuilt when it is missing
#      or stale (the cold-start section times the first call from it, and the run then loads
#      every kernel from it as an installed wheel would; BUILD_CUBIN=0 skips); fill the caches of
#      quack, Liger and torch.compile for the benchmark's shapes (PREWARM=0 leaves that out);
#   5. print which providers import.
# The benchmark finds everything in $PEERS by itself (softbench/peers.py).
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
PEERS=${DRVSOFTMAX_PEERS:-/tmp/peers}
STAGE=$PEERS/stage
LOGS=$PEERS/logs
PY=${PYTHON:-python3}
JOBS=${PREWARM_SHARDS:-4}
mkdir -p "$STAGE/whl" "$STAGE/parts" "$STAGE/apex_megatron" "$LOGS"
T0=$(date +%s)
say() { echo "[peers_setup $(($(date +%s) - T0))s] $*"; }

# 1. stage
n=0
for g in "$REPO"/.peers/c*/; do
    [ -d "$g" ] || continue
    for sub in whl parts apex_megatron; do
        [ -d "$g$sub" ] && cp -n "$g$sub"/* "$STAGE/$sub/" 2>/dev/null
    done
    n=$((n + 1))
    say "staged $(basename "$g")"
done
[ "$n" = 0 ] && say "no .peers/c* group carried in this call"

# 2. join the parts of each split file once all are there
for sums in "$STAGE"/parts/*.sha256; do
    [ -f "$sums" ] || continue
    name=$(basename "$sums" .sha256)
    want=$(awk '$1 == "parts" {print $2}' "$sums")
    have=$(ls "$STAGE/parts/$name.tar.xz.part-"* 2>/dev/null | wc -l)
    wheel=$(awk '$2 ~ /\.whl$/ {print $2}' "$sums")
    if [ -n "$wheel" ] && [ -f "$STAGE/whl/$wheel" ]; then
        continue
    fi
    if [ "$have" != "$want" ]; then
        say "$name: $have of $want parts here; carry the other groups"
        continue
    fi
    if ! (cd "$STAGE/parts" && grep -E '^[0-9a-f]{64} ' "$sums" | grep -v '\.whl$' | grep -v " $name.tar.xz\$" | sha256sum -c --quiet); then
        say "$name: a part is corrupt (sha256); carry it again"
        exit 1
    fi
    cat "$STAGE/parts/$name.tar.xz.part-"* >"$STAGE/parts/$name.tar.xz"
    (cd "$STAGE/parts" && grep " $name.tar.xz\$" "$sums" | sha256sum -c --quiet) || { say "$name.tar.xz: bad sha256"; exit 1; }
    $PY -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2], filter="data")' \
        "$STAGE/parts/$name.tar.xz" "$STAGE/whl" && rm -f "$STAGE/parts/$name.tar.xz"
    (cd "$STAGE/whl" && grep " $wheel\$" "$sums" | sha256sum -c --quiet) || { say "$wheel: bad sha256"; exit 1; }
    say "joined $name -> $wheel"
done

# 3. install
install_group() { # name, then wheel globs; installs only when every glob matches
    local group=$1 files=() f m
    shift
    [ -f "$PEERS/.installed-$group" ] && return 0
    for f in "$@"; do
        # shellcheck disable=SC2206  # $f is a glob
        m=("$STAGE"/whl/$f)
        [ -f "${m[0]}" ] || { say "$group: waiting for $f"; return 0; }
        files+=("${m[0]}")
    done
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$PEERS" "${files[@]}" \
        >"$LOGS/pip-$group.log" 2>&1; then
        touch "$PEERS/.installed-$group"
        say "installed $group (${#files[@]} wheels)"
    else
        say "pip failed for $group:"
        tail -n 20 "$LOGS/pip-$group.log"
    fi
}
install_group liger 'liger_kernel-*.whl'
install_group quack 'quack_kernels-*.whl' 'apache_tvm_ffi-*.whl' 'torch_c_dlpack_ext-*.whl' \
    'nvidia_cutlass_dsl-[0-9]*.whl' 'nvidia_cutlass_dsl_libs_core-*.whl' 'nvidia_cutlass_dsl_libs_base-*.whl' \
    'nvidia_cutlass_dsl_libs_cu13-*.whl'

# 4. builds and caches, in parallel
ARCH=$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
if [ -z "$ARCH" ]; then
    say "torch sees no GPU: nothing to build"
    exit 1
fi
pids=()
if ls "$STAGE/apex_megatron/"*.cu >/dev/null 2>&1; then
    for mod in scaled_softmax_cuda scaled_masked_softmax_cuda generic_scaled_masked_softmax_cuda \
        scaled_upper_triang_masked_softmax_cuda; do
        [ -f "$PEERS/apex_build/$mod/$mod.so" ] && continue
        mkdir -p "$PEERS/apex_build/$mod"
        rm -f "$PEERS/apex_build/$mod/lock" # left by a build that was killed: load() would wait for it
        TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=4 $PY - "$mod" "$STAGE/apex_megatron" "$PEERS/apex_build/$mod" \
            >"$LOGS/apex-$mod.log" 2>&1 <<'EOF' &
import sys, time
from torch.utils.cpp_extension import load
name, src, build = sys.argv[1:4]
stem = name[: -len("_cuda")]
t = time.time()
load(
    name=name,
    sources=[f"{src}/{stem}.cpp", f"{src}/{stem}_cuda.cu"],
    extra_include_paths=[src],
    extra_cflags=["-O3"],
    extra_cuda_cflags=[
        "-O3",
        "--use_fast_math",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
    ],
    build_directory=build,
    verbose=True,
)
print(f"built {name} in {time.time() - t:.0f} s")
EOF
        pids+=("$!:apex-$mod")
    done
else
    say "apex sources not staged yet (group c1)"
fi
SM="sm_${ARCH/./}"
cubin=$($PY - "$SM" 2>/dev/null <<'EOF'
import json, sys
sys.path.insert(0, ".")
from drvsoftmax import _compiler
m = json.load(open("drvsoftmax/_prebuilt/manifest.json"))
fresh = m.get("source_hash") == _compiler.source_hash() and any(sys.argv[1] in f for f in m.get("files", {}))
print("fresh" if fresh else "stale")
EOF
)
if [ "${BUILD_CUBIN:-1}" != 0 ] && [ "$cubin" != fresh ]; then
    say "drvsoftmax/_prebuilt: ${cubin:-missing}; building the $SM cubin into it (BUILD_CUBIN=0 skips)"
    $PY build_ptx.py --arch "$SM" --ptx >"$LOGS/build_ptx.log" 2>&1 &
    pids+=("$!:build_ptx-$SM")
fi
todo=()
if [ "${PREWARM:-1}" != 0 ]; then
    for p in quack liger compile; do
        [ -f "$PEERS/.prewarmed-$p" ] && continue
        case $p in
        quack) [ -f "$PEERS/.installed-quack" ] || continue ;;
        liger) [ -f "$PEERS/.installed-liger" ] || continue ;;
        esac
        todo+=("$p")
    done
    if [ ${#todo[@]} -gt 0 ]; then
        list=$(IFS=,; echo "${todo[*]}")
        for k in $(seq 0 $((JOBS - 1))); do
            TORCHINDUCTOR_COMPILE_THREADS=4 $PY benchmarks/bench_softmax.py --prewarm "$list" --shard "$k/$JOBS" \
                >"$LOGS/prewarm-$k.log" 2>&1 &
            pids+=("$!:prewarm-$k")
        done
        say "prewarming $list in $JOBS processes"
    fi
fi
[ ${#pids[@]} -gt 0 ] && say "waiting for: ${pids[*]#*:}"
prewarm_failed=0
for e in "${pids[@]}"; do
    pid=${e%%:*} what=${e#*:}
    if wait "$pid"; then
        say "done: $what"
    else
        case $what in prewarm-*) prewarm_failed=1 ;; esac
        say "FAILED: $what (log $LOGS/${what%-sm_*}.log):"
        tail -n 25 "$LOGS/${what%-sm_*}.log"
    fi
done
if [ ${#todo[@]} -gt 0 ] && [ "$prewarm_failed" = 0 ]; then
    for p in "${todo[@]}"; do touch "$PEERS/.prewarmed-$p"; done
fi
grep -h "first calls" "$LOGS"/prewarm-*.log 2>/dev/null

# 5. what imports
$PY - <<'EOF'
import sys
sys.path[:0] = ["benchmarks", "."]
import torch
from softbench import peers
p = peers.Peers(torch)
for name in peers.PROVIDERS:
    print(f"  {name:14s} " + (f"OK   {p.versions[name]}" if p.available(name) else f"MISSING  {p.missing[name]}"))
EOF
say "finished"
