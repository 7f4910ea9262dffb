#!/usr/bin/env bash
# Runs tests/sanitize_slice.py (every kernel tier, every dtype, forward and backward, each
# mask family) under compute-sanitizer's memcheck, racecheck, synccheck and initcheck, and
# fails on any report.  On a GPU machine, from the repository root:
#
#     PYTHONPATH=$PWD bash tests/sanitize.sh
#
# COMPUTE_SANITIZER (default /usr/local/cuda/bin/compute-sanitizer) and PYTHON (default
# python3) may point elsewhere.  Logs are kept in $SANITIZE_LOGS (default a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
SANITIZER=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD}
LOGS=${SANITIZE_LOGS:-$(mktemp -d /tmp/drvsoftmax-sanitize.XXXXXX)}
mkdir -p "$LOGS"

if [ ! -x "$SANITIZER" ]; then
    echo "compute-sanitizer not found at $SANITIZER (set COMPUTE_SANITIZER)" >&2
    exit 2
fi

# First without the sanitizer: the slice must pass on its own, and every kernel it needs
# gets compiled (or found) and cached, so that the sanitized runs time kernels, not NVRTC.
echo "== plain run"
if ! "$PY" tests/sanitize_slice.py --quiet; then
    echo "FAILED: the slice fails without the sanitizer" >&2
    exit 1
fi

failed=0
for tool in memcheck racecheck synccheck initcheck; do
    args=(--tool "$tool" --error-exitcode 86 --print-limit 50 --log-file "$LOGS/$tool.log")
    if [ "$tool" = memcheck ]; then
        args+=(--report-api-errors no)
    fi
    echo "== $tool"
    "$SANITIZER" "${args[@]}" "$PY" tests/sanitize_slice.py --quiet
    rc=$?
    # A clean run ends with summary lines that count nothing: "ERROR SUMMARY: 0 errors",
    # and for racecheck "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)".
    summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$LOGS/$tool.log" || true)
    echo "$summary"
    bad=0
    [ "$rc" -ne 0 ] && bad=1
    [ -z "$summary" ] && bad=1
    if echo "$summary" | grep -qE "[1-9][0-9]* (error|warning|hazard)"; then
        bad=1
    fi
    if [ "$bad" -ne 0 ]; then
        echo "FAILED: $tool (exit status $rc); report in $LOGS/$tool.log:" >&2
        head -n 200 "$LOGS/$tool.log" >&2
        failed=1
    fi
done

if [ "$failed" -ne 0 ]; then
    echo "== compute-sanitizer found problems (logs: $LOGS)" >&2
    exit 1
fi
echo "== compute-sanitizer: memcheck, racecheck, synccheck, initcheck clean (logs: $LOGS)"
