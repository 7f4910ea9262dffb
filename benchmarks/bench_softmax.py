#!/usr/bin/env python3
"""drvsoftmax against its peers, in GB/s over the minimum bytes and as % of a copy measured in the same run.

    python benchmarks/bench_softmax.py [--quick] [--only SECTIONS] [--out DIR]
    python benchmarks/bench_softmax.py --dry-run [--quick] [--only ...]   # the plan, on any machine
    python benchmarks/bench_softmax.py --from-csv RESULTS.csv             # markdown + PNG again

Sections: fwd, bwd, mask, causal, long, host, sweep, memory, coldstart (see softbench/cases.py).
Providers: drvsoftmax, eager, torch.compile, torch.softmax, quack, apex, Liger (softbench/peers.py);
run benchmarks/peers_setup.sh first on a machine without a package index.  benchmarks/README.md
says what is measured and how.
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the time budget counts from here, imports included

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):  # this checkout's drvsoftmax, and the benchmark's own modules
    if p not in sys.path:
        sys.path.insert(0, p)

from softbench import cases, runner  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few cases, one torch.compile: a smoke run under 90 s")
    p.add_argument("--only", metavar="SECTIONS", help=f"comma-separated subset of {','.join(cases.SECTIONS)}")
    p.add_argument("--out", metavar="DIR", help="results folder (default benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="list cases and providers with an estimate; no CUDA")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--providers", metavar="LIST", help="only these providers (drvsoftmax is always in)")
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="S",
        help=f"start nothing new after S seconds (default {runner.DEFAULT_BUDGET_S:.0f}, "
        f"{runner.QUICK_BUDGET_S:.0f} with --quick); what was measured is written",
    )
    p.add_argument("--commit", help="the commit to record (default: $DRVSOFTMAX_COMMIT, git, or the file .commit)")
    p.add_argument("--from-csv", metavar="CSV", help="write the markdown, PNG and summary again from a results CSV")
    p.add_argument(
        "--prewarm",
        metavar="LIST",
        help="compile, without timing, the first calls of quack,liger,compile for the plan (fills their caches)",
    )
    p.add_argument("--shard", metavar="K/N", help="with --prewarm: every N-th case from the K-th")
    p.add_argument("--cpu-smoke", action="store_true", help="(tests) the --quick run on the CPU, tiny shapes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.from_csv:
            return runner.redo(args)
        if args.dry_run:
            return runner.dry_run(args)
        if args.prewarm:
            return runner.prewarm(args, T0)
        return runner.run(args, T0)
    except ValueError as e:
        print(f"bench_softmax.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
