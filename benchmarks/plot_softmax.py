#!/usr/bin/env python3
"""Draw the README figure from a bench_softmax.py results CSV: GB/s against row length.

    python3 benchmarks/plot_softmax.py benchmarks/results/2026-11-30-nvidia-h200-abc1234.csv
    python3 benchmarks/plot_softmax.py RESULTS.csv --out sweep.png \\
        --baseline shared/baselines/h200-sweep-2026-11-29.csv      # peers timed elsewhere, dashed

One panel per direction (forward, backward) and dtype of the row-length sweep; one line per
method; the device-to-device copy ceiling of the same run as a black line, 90% of it dotted.
Rows measured more than once (the CSV is appended to) count with their last measurement.
Needs matplotlib (headless: the Agg backend); everything else is the standard library.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

DIRECTIONS = (("sweep-fwd", "forward"), ("sweep-bwd", "backward"))
DTYPE_ORDER = ("float16", "bfloat16", "float32")
# The baseline file's own format (shared/baselines/h200-sweep-*.csv): dir,dtype,sk,provider,ms,gbps,pct
BASELINE_DIRS = {"fwd": "sweep-fwd", "bwd": "sweep-bwd"}


def _float(s: str) -> float | None:
    try:
        v = float(s)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def read_results(path: Path, gpu: str | None) -> tuple[dict, float | None, dict]:
    """(series, copy ceiling GB/s of the latest run, facts) from a bench_softmax.py CSV.

    series: {(direction, dtype): {method: {sk: gbps}}}, last measurement wins.
    """
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    missing = {"direction", "dtype", "shape", "method", "gbps", "copy_gbps", "gpu"} - set(rows[0])
    if missing:
        raise SystemExit(f"{path}: not a bench_softmax.py results file (missing columns {sorted(missing)})")
    gpu = gpu or rows[-1]["gpu"]
    rows = [r for r in rows if r["gpu"] == gpu]
    series: dict = {}
    copy = None
    for r in rows:
        c = _float(r.get("copy_gbps", ""))
        if c:
            copy = c  # the ceiling of the latest run in the file
        if not r["direction"].startswith("sweep"):
            continue
        g = _float(r["gbps"])
        if g is None:
            continue
        sk = int(r["shape"].split("x")[-1])
        series.setdefault((r["direction"], r["dtype"]), {}).setdefault(r["method"], {})[sk] = g
    last = rows[-1]
    facts = {k: last.get(k, "?") for k in ("gpu", "date", "commit", "driver", "torch", "cuda")}
    return series, copy, facts


def read_baseline(path: Path) -> dict:
    """{(direction, dtype): {provider: {sk: gbps}}} from a baseline sweep CSV."""
    out: dict = {}
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            d = BASELINE_DIRS.get(r.get("dir", ""))
            g = _float(r.get("gbps", ""))
            if d is None or g is None:
                continue
            out.setdefault((d, r["dtype"]), {}).setdefault(r["provider"], {})[int(r["sk"])] = g
    return out


# One colour per kind of provider, the same in this run and in a baseline (dashed there).
COLOURS = (
    ("drvsoftmax", "tab:blue"),
    ("liger", "tab:purple"),
    ("compile", "tab:orange"),
    ("torch.softmax", "tab:red"),
    ("torch bwd", "tab:green"),  # the baseline's name for eager _softmax_backward_data
    ("eager", "tab:green"),
)


def colour(name: str) -> str:
    return next((c for key, c in COLOURS if key in name), "tab:gray")


def _sk_label(sk: int) -> str:
    return f"{sk >> 20}M" if sk >= 1 << 20 else f"{sk >> 10}K" if sk >= 1 << 10 else str(sk)


def draw(series: dict, copy: float | None, facts: dict, baseline: dict, baseline_name: str, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(
            "plot_softmax.py needs matplotlib, which is not installed here: `pip install matplotlib` "
            "(the results CSV itself is plain text and needs nothing)",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [(d, title) for d, title in DIRECTIONS if any(k[0] == d for k in series)]
    dtypes = [dt for dt in DTYPE_ORDER if any(k[1] == dt for k in series)]
    if not dirs or not dtypes:
        raise SystemExit("no sweep rows (direction sweep-fwd / sweep-bwd) with GB/s in this file")
    fig, axes = plt.subplots(
        len(dirs), len(dtypes), figsize=(6.4 * len(dtypes), 4.2 * len(dirs)), squeeze=False, sharex=True
    )
    ymax = max([copy or 0.0] + [g for s in series.values() for m in s.values() for g in m.values()])
    for i, (d, title) in enumerate(dirs):
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            methods = series.get((d, dt), {})
            # drvsoftmax first and bold; peers after, in a stable order
            for name in sorted(methods, key=lambda n: (not n.startswith("drvsoftmax"), n)):
                pts = sorted(methods[name].items())
                ours = name.startswith("drvsoftmax")
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=colour(name),
                    marker="o",
                    markersize=4 if ours else 3,
                    linewidth=2.4 if ours else 1.3,
                    label=name,
                    zorder=3 if ours else 2,
                )
            for name, pts_d in sorted(baseline.get((d, dt), {}).items()):
                pts = sorted(pts_d.items())
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=colour(name),
                    linestyle="--",
                    linewidth=1.0,
                    alpha=0.6,
                    label=f"{name} [{baseline_name}]",
                )
            if copy:
                ax.axhline(copy, color="black", linewidth=1.2, label=f"d2d copy {copy:.0f} GB/s")
                ax.axhline(0.9 * copy, color="grey", linewidth=0.8, linestyle=":", label="90% of copy")
            ax.set_xscale("log", base=2)
            sks = sorted({sk for m in methods.values() for sk in m})
            if sks:
                ax.set_xticks(sks)
                ax.set_xticklabels([_sk_label(s) for s in sks], rotation=45, fontsize=8)
            ax.set_ylim(0, ymax * 1.08)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{title}, {dt}", fontsize=10)
            if i == len(dirs) - 1:
                ax.set_xlabel("row length Sk (fixed total: 2^29 16-bit / 2^28 fp32 elements)")
            if j == 0:
                ax.set_ylabel("GB/s (minimum bytes)")
            if j == len(dtypes) - 1:  # one legend per direction, outside the last panel
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.suptitle(
        f"softmax over rows of Sk elements: {facts['gpu']}, driver {facts['driver']}, torch {facts['torch']}, "
        f"commit {facts['commit']}, {facts['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Draw GB/s against row length from a bench_softmax.py results CSV.")
    p.add_argument("csv", type=Path, help="results CSV written by benchmarks/bench_softmax.py")
    p.add_argument("--out", type=Path, help="PNG to write (default: the CSV's name with -sweep.png)")
    p.add_argument("--gpu", help="plot this GPU's rows (default: the GPU of the file's last row)")
    p.add_argument(
        "--baseline",
        type=Path,
        help="also draw a baseline sweep CSV (dir,dtype,sk,provider,ms,gbps,pct), dashed",
    )
    args = p.parse_args(argv)
    series, copy, facts = read_results(args.csv, args.gpu)
    baseline = read_baseline(args.baseline) if args.baseline else {}
    out = args.out or args.csv.with_name(args.csv.stem + "-sweep.png")
    draw(series, copy, facts, baseline, args.baseline.stem if args.baseline else "", out)
    n = sum(len(m) for s in series.values() for m in s.values())
    print(f"wrote {out}: {n} points in {len(series)} panels" + (f", baseline {args.baseline}" if baseline else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
