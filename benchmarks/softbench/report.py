"""Results: rows, the CSV (long format), `ratio = best peer / ours`, the summary, markdown and the PNG.

Needs no torch; the PNG needs matplotlib (Agg backend) and is left out, with a note, without it.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .cases import Case, shape_str
from .peers import OURS, PROVIDERS

CSV_FIELDS = (
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
    "section",
    "direction",
    "mask",
    "sk",
    "bytes",
    "copy_GB/s",
    "note",
)
ENV_FIELDS = ("gpu", "driver", "torch", "commit", "date")
TIMED_SECTIONS = ("fwd", "bwd", "mask", "causal", "long", "host")
NOISE = 0.02  # run-to-run noise: "within 2%" of the best peer
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


@dataclass
class Row:
    case: str
    provider: str
    dtype: str
    shape: str
    section: str
    direction: str = ""
    mask: str = ""
    sk: int | None = None
    ms: float | None = None  # host rows: milliseconds per call (host + launch); memory rows: empty
    gbps: float | None = None
    pct: float | None = None
    nbytes: int | None = None  # the minimum bytes (memory rows: the peak beyond the inputs)
    copy_gbps: float | None = None
    note: str = ""

    def record(self, env: dict) -> dict:
        return {
            **{k: env.get(k, "") for k in ENV_FIELDS},
            "case": self.case,
            "provider": self.provider,
            "dtype": self.dtype,
            "shape": self.shape,
            "ms": _fmt(self.ms, ".6g"),
            "GB/s": _fmt(self.gbps, ".1f"),
            "pct_copy": _fmt(self.pct, ".2f"),
            "section": self.section,
            "direction": self.direction,
            "mask": self.mask,
            "sk": "" if self.sk is None else str(self.sk),
            "bytes": "" if self.nbytes is None else str(self.nbytes),
            "copy_GB/s": _fmt(self.copy_gbps, ".1f"),
            "note": self.note,
        }

    @classmethod
    def from_record(cls, r: dict) -> Row:
        sk = r.get("sk", "")
        nb = r.get("bytes", "")
        return cls(
            case=r["case"],
            provider=r["provider"],
            dtype=r["dtype"],
            shape=r["shape"],
            section=r.get("section", ""),
            direction=r.get("direction", ""),
            mask=r.get("mask", ""),
            sk=int(sk) if sk else None,
            ms=_float(r.get("ms")),
            gbps=_float(r.get("GB/s")),
            pct=_float(r.get("pct_copy")),
            nbytes=int(nb) if nb else None,
            copy_gbps=_float(r.get("copy_GB/s")),
            note=r.get("note", ""),
        )


def _fmt(v, spec: str) -> str:
    return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _float(s) -> float | None:
    try:
        v = float(s)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def timed_row(case: Case, provider: str, ms: float, copy_gbps: float | None, note: str = "") -> Row:
    """A row for a device-timed case: GB/s over the case's minimum bytes, % of the copy ceiling."""
    gbps = case.min_bytes / (ms * 1e6)
    return Row(
        case=case.name,
        provider=provider,
        dtype=case.dtype,
        shape=shape_str(case.shape),
        section=case.section,
        direction=case.direction,
        mask=case.mask,
        sk=case.sk,
        ms=ms,
        gbps=gbps,
        pct=100.0 * gbps / copy_gbps if copy_gbps else None,
        nbytes=case.min_bytes,
        copy_gbps=copy_gbps,
        note=note,
    )


def error_row(case: Case, provider: str, note: str) -> Row:
    return Row(
        case=case.name,
        provider=provider,
        dtype=case.dtype,
        shape=shape_str(case.shape),
        section=case.section,
        direction=case.direction,
        mask=case.mask,
        sk=case.sk,
        note="error: " + note,
    )


class CsvSink:
    """Appends rows to a CSV as they are measured (a run cut short still leaves its rows)."""

    def __init__(self, path: Path, env: dict):
        self.path = path
        self.env = env
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", newline="") as f:
            if new:
                csv.DictWriter(f, CSV_FIELDS).writeheader()

    def add(self, row: Row) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, CSV_FIELDS).writerow(row.record(self.env))


def read_csv(path: Path) -> tuple[dict, list[Row]]:
    """(environment of the file's last row, rows) from a results CSV."""
    with Path(path).open(newline="") as f:
        records = list(csv.DictReader(f))
    if not records:
        raise ValueError(f"{path}: no rows")
    missing = set(CSV_FIELDS) - set(records[0])
    if missing:
        raise ValueError(f"{path}: not a bench_softmax.py results file (missing columns {sorted(missing)})")
    env = {k: records[-1][k] for k in ENV_FIELDS}
    return env, [Row.from_record(r) for r in records]


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", str(s).lower()).strip("-.") or "unknown"


def file_stem(env: dict) -> str:
    """<date>-<gpu>-<driver>-<commit>: the name of the CSV, the markdown and the PNG."""
    return f"{env['date']}-{slug(env['gpu'])}-{slug(env['driver'])}-{slug(env['commit'])}"


# ----------------------------------------------------------------------------------
# Head to head.


@dataclass
class Comparison:
    case: str
    section: str
    dtype: str
    shape: str
    direction: str
    mask: str
    sk: int | None
    ours: Row | None
    peers: dict[str, Row] = field(default_factory=dict)

    @property
    def best(self) -> str | None:
        return min(self.peers, key=lambda p: self.peers[p].ms) if self.peers else None

    @property
    def ratio(self) -> float | None:
        """Best peer's time / ours: above 1 we are ahead."""
        if self.ours is None or not self.peers or not self.ours.ms:
            return None
        return self.peers[self.best].ms / self.ours.ms

    @property
    def ahead(self) -> bool:
        r = self.ratio
        return r is not None and r > 1.0

    @property
    def within_noise(self) -> bool:
        r = self.ratio
        return r is not None and r >= 1.0 - NOISE

    @property
    def unit(self) -> str:
        return "us" if self.section == "host" else "ms"


def latest(rows: Iterable[Row]) -> list[Row]:
    """The last timed row of each (case, provider), in order of first appearance."""
    by: dict[tuple[str, str], Row] = {}
    for r in rows:
        if r.ms is not None:
            by.pop((r.case, r.provider), None)
            by[(r.case, r.provider)] = r
    order: dict[str, int] = {}
    for r in rows:
        order.setdefault(r.case, len(order))
    return sorted(by.values(), key=lambda r: order[r.case])


def compare(rows: Iterable[Row]) -> list[Comparison]:
    """One Comparison per timed case, in the order the cases first appear."""
    out: dict[str, Comparison] = {}
    for r in latest(rows):
        if r.section not in TIMED_SECTIONS:
            continue
        c = out.get(r.case)
        if c is None:
            c = out[r.case] = Comparison(r.case, r.section, r.dtype, r.shape, r.direction, r.mask, r.sk, None)
        if r.provider == OURS:
            c.ours = r
        else:
            c.peers[r.provider] = r
    return list(out.values())


def tally(comps: Iterable[Comparison]) -> tuple[int, int, int]:
    """(ahead, within noise, cases with a ratio)."""
    rated = [c for c in comps if c.ratio is not None]
    return sum(c.ahead for c in rated), sum(c.within_noise for c in rated), len(rated)


def ahead_line(comps: list[Comparison], what: str = "") -> str:
    a, w, m = tally(comps)
    return f"ahead in {a} of {m}{what} (within {NOISE:.0%} of the best peer: {w} of {m})"


def _t(ms: float | None, unit: str) -> str:
    if ms is None:
        return "-"
    v = ms * 1e3 if unit == "us" else ms
    return f"{v:.2f}" if unit == "us" else f"{v:.4f}" if v < 10 else f"{v:.3f}"


def case_line(c: Comparison) -> str:
    """One printed line per case: every provider's time, our GB/s and % of copy, the ratio."""
    u = c.unit
    head = f"{c.case:24s} {c.shape:>17s}"
    if c.ours is not None:
        o = c.ours
        ours = f"ours {_t(o.ms, u)} {u}"
        if o.gbps is not None:
            ours += f" {o.gbps:5.0f} GB/s"
        if o.pct is not None:
            ours += f" {o.pct:5.1f}%"
    else:
        ours = "ours -"
    peers = " ".join(f"{p} {_t(r.ms, u)}" for p, r in sorted(c.peers.items(), key=lambda kv: _order(kv[0])))
    r = c.ratio
    verdict = "" if r is None else f" | best {c.best} ratio {r:.2f} {'ahead' if c.ahead else 'behind'}"
    return f"{head}  {ours} | {peers or 'no peer'}{verdict}"


def _order(provider: str) -> int:
    return PROVIDERS.index(provider) if provider in PROVIDERS else len(PROVIDERS)


def ceiling(rows: Iterable[Row]) -> tuple[float | None, float | None]:
    """(copy ceiling, the same copy measured at the end) in GB/s."""
    first = end = None
    for r in rows:
        if r.section == "copy" and r.gbps is not None:
            if r.case == "copy-end":
                end = r.gbps
            elif first is None:
                first = r.gbps
    return first, end


def summary_lines(env: dict, rows: list[Row], absent=(), skipped=(), stopped: str = "") -> list[str]:
    comps = compare(rows)
    out = [
        f"== drvsoftmax benchmark | {env.get('gpu')} | driver {env.get('driver')} | torch {env.get('torch')} | "
        f"commit {env.get('commit')} | {env.get('date')}"
    ]
    cop, cop_end = ceiling(rows)
    if cop:
        out.append(
            f"== copy ceiling {cop:.0f} GB/s (device-to-device copy, read + write)"
            + (f"; {cop_end:.0f} GB/s again at the end" if cop_end else "")
        )
    for sec in TIMED_SECTIONS:
        sel = [c for c in comps if c.section == sec]
        if not sel:
            continue
        pcts = [c.ours.pct for c in sel if c.ours is not None and c.ours.pct is not None]
        span = f"; ours {min(pcts):.0f}-{max(pcts):.0f}% of copy" if pcts else ""
        out.append(f"   {sec:7s} {ahead_line(sel)}{span}")
    out.append(f"== {ahead_line(comps, ' cases')}")
    behind = sorted((c for c in comps if c.ratio is not None and not c.within_noise), key=lambda c: c.ratio)
    if behind:
        out.append(
            "== behind by more than 2%, worst first: "
            + ", ".join(f"{c.case} {c.ratio:.2f} ({c.best})" for c in behind[:12])
            + (f", ... {len(behind) - 12} more" if len(behind) > 12 else "")
        )
    host = [c for c in comps if c.section == "host"]
    for c in host:
        parts = [f"{OURS} {_t(c.ours.ms, 'us')}" if c.ours else f"{OURS} -"]
        parts += [f"{p} {_t(r.ms, 'us')}" for p, r in sorted(c.peers.items(), key=lambda kv: _order(kv[0]))]
        out.append(f"== host us per eager call {c.shape} {c.dtype}: " + ", ".join(parts))
    mem = [r for r in latest_all(rows) if r.section == "memory"]
    if mem:
        out.append("== peak memory of a forward: " + "; ".join(f"{r.provider} {r.mask}: {r.note}" for r in mem))
    cold = [r for r in latest_all(rows) if r.section == "coldstart"]
    for r in cold:
        t = f"{r.ms / 1e3:.3f} s" if r.ms is not None else "-"
        out.append(f"== cold start, first call from the packaged cubin in a fresh process: {t} ({r.note})")
    errors = [r for r in rows if r.note.startswith("error")]
    if errors:
        out.append(f"== errors: {len(errors)} (see the markdown)")
    mism = [r for r in rows if "MISMATCH" in r.note]
    if mism:
        out.append("== MISMATCH against the reference: " + ", ".join(f"{r.case} {r.provider}" for r in mism))
    if absent:
        out.append(f"== absent (provider could not take the case): {len(absent)}; reasons in the log and the markdown")
    if skipped:
        out.append(f"== skipped: {len(skipped)} ({'; '.join(sorted({why for _, why in skipped}))})")
    if stopped:
        out.append(f"== STOPPED EARLY: {stopped}")
    return out


def latest_all(rows: Iterable[Row]) -> list[Row]:
    """The last row of each (case, provider), timed or not."""
    by: dict[tuple[str, str], Row] = {}
    for r in rows:
        by[(r.case, r.provider)] = r
    return list(by.values())


def markdown(env: dict, rows: list[Row], absent=(), skipped=(), stopped: str = "", extra: str = "") -> str:
    comps = compare(rows)
    md = [f"# drvsoftmax benchmark: {env.get('gpu')}, {env.get('date')}", ""]
    md.append(f"driver {env.get('driver')}, torch {env.get('torch')}, commit {env.get('commit')}.")
    if extra:
        md += ["", extra]
    md += [
        "",
        "Median of CUDA-event-timed calls. GB/s count the minimum bytes: x, the mask at its own size and y "
        "for the forward; y, dy and dx for the backward. `ratio` = best peer's time / ours (above 1: ahead). "
        "torch.softmax, quack and Liger compute softmax(x) without the scale; see benchmarks/README.md.",
        "",
        "## Summary",
        "",
        "```text",
        *summary_lines(env, rows, absent, skipped, stopped),
        "```",
        "",
    ]
    present = [p for p in PROVIDERS if any(p in c.peers or (p == OURS and c.ours) for c in comps)]
    for sec in TIMED_SECTIONS:
        sel = [c for c in comps if c.section == sec]
        if not sel:
            continue
        unit = sel[0].unit
        md += [f"## {sec} ({unit})", ""]
        md.append("| case | shape | GB/s | % of copy | best peer | ratio | " + " | ".join(present) + " |")
        md.append("|---|---|---|---|---|---|" + "---|" * len(present))
        for c in sel:
            o = c.ours
            cells = [
                c.case,
                c.shape,
                _fmt(o.gbps if o else None, ".0f"),
                _fmt(o.pct if o else None, ".1f"),
                c.best or "",
                _fmt(c.ratio, ".2f"),
            ]
            for p in present:
                r = o if p == OURS else c.peers.get(p)
                cells.append(_t(r.ms, unit) if r is not None else "")
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
    others = [r for r in latest_all(rows) if r.section in ("memory", "coldstart", "copy")]
    if others:
        md += ["## Copy ceiling, memory and cold start", "", "| case | provider | value | note |", "|---|---|---|---|"]
        for r in others:
            val = (
                f"{r.gbps:.0f} GB/s"
                if r.section == "copy" and r.gbps
                else f"{r.nbytes} B"
                if r.section == "memory" and r.nbytes is not None
                else f"{r.ms / 1e3:.3f} s"
                if r.ms is not None
                else ""
            )
            md.append(f"| {r.case} | {r.provider} | {val} | {r.note} |")
        md.append("")
    if absent:
        md += ["## Absent", "", "A provider that cannot take a case is left out of it:", ""]
        grouped: dict[tuple[str, str], list[str]] = {}
        for case, provider, why in absent:
            grouped.setdefault((provider, why), []).append(case)
        for (provider, why), cases in sorted(grouped.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1])):
            md.append(f"- {provider}: {why} ({len(cases)}: {', '.join(cases[:6])}{', ...' if len(cases) > 6 else ''})")
        md.append("")
    errors = [r for r in rows if r.note.startswith("error")]
    if errors:
        md += ["## Errors", ""] + [f"- {r.case} {r.provider}: {r.note}" for r in errors] + [""]
    if skipped:
        md += ["## Skipped", ""] + [f"- {what}: {why}" for what, why in skipped] + [""]
    return "\n".join(md)


# ----------------------------------------------------------------------------------
# The figure: GB/s against Sk per provider beside the copy ceiling.


def sweep_series(rows: Iterable[Row]) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """{(direction, dtype): {provider: {Sk: GB/s}}} for the no-mask rows of the fixed-total cases."""
    out: dict = {}
    for r in latest(rows):
        if r.section in ("fwd", "bwd", "long") and r.mask == "none" and r.gbps is not None and r.sk:
            out.setdefault((r.direction, r.dtype), {}).setdefault(r.provider, {})[r.sk] = r.gbps
    return out


COLOURS = {
    OURS: "tab:blue",
    "eager": "tab:green",
    "compile": "tab:orange",
    "torch.softmax": "tab:red",
    "quack": "tab:brown",
    "apex": "tab:olive",
    "liger": "tab:purple",
}


def _sk_label(sk: int) -> str:
    return f"{sk >> 20}M" if sk >= 1 << 20 and sk % (1 << 20) == 0 else f"{sk >> 10}K" if sk >= 16384 else str(sk)


def write_png(path: Path, env: dict, rows: list[Row]) -> str | None:
    """Draw the figure; None when written, else why not (no matplotlib, no sweep rows)."""
    series = sweep_series(rows)
    if not series:
        return "no no-mask fwd/bwd rows with GB/s"
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cop, _ = ceiling(rows)
    dirs = [d for d in ("fwd", "bwd") if any(k[0] == d for k in series)]
    dtypes = [dt for dt in ("float16", "bfloat16", "float32") if any(k[1] == dt for k in series)]
    fig, axes = plt.subplots(
        len(dirs), len(dtypes), figsize=(6.0 * len(dtypes), 4.0 * len(dirs)), squeeze=False, sharex=True
    )
    ymax = max([cop or 0.0] + [g for s in series.values() for m in s.values() for g in m.values()])
    handles: dict = {}
    for i, d in enumerate(dirs):
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            provs = series.get((d, dt), {})
            for p in sorted(provs, key=_order):
                pts = sorted(provs[p].items())
                ours = p == OURS
                ax.plot(
                    [k for k, _ in pts],
                    [v for _, v in pts],
                    color=COLOURS.get(p, "tab:gray"),
                    marker="o",
                    markersize=4 if ours else 3,
                    linewidth=2.4 if ours else 1.2,
                    label=p,
                    zorder=3 if ours else 2,
                )
            if cop:
                ax.axhline(cop, color="black", linewidth=1.2, label=f"copy {cop:.0f} GB/s")
                ax.axhline(0.95 * cop, color="grey", linewidth=0.8, linestyle=":", label="95% of copy")
            ax.set_xscale("log", base=2)
            sks = sorted({k for m in provs.values() for k in m if k & (k - 1) == 0})  # odd lengths: points only
            if sks:
                ax.set_xticks(sks)
                ax.set_xticklabels([_sk_label(s) for s in sks], rotation=60, fontsize=7)
            ax.set_ylim(0, ymax * 1.08)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{'forward' if d == 'fwd' else 'backward'}, {dt}", fontsize=10)
            if i == len(dirs) - 1:
                ax.set_xlabel("Sk (fixed total: 2^29 16-bit / 2^28 fp32 elements)")
            if j == 0:
                ax.set_ylabel("GB/s over minimum bytes")
            for h, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, h)
    fig.suptitle(
        f"softmax, GB/s against row length: {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, "
        f"commit {env.get('commit')}, {env.get('date')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.legend(handles.values(), handles.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None
