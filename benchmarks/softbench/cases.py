"""What the benchmark runs: cases, shapes, masks and the minimum bytes each one must move.

Pure Python (no torch), so that a dry run and the tests can plan on any machine.

Sections (``--only`` takes any of them, comma-separated):

    fwd        no-mask forward at a fixed total (2^29 16-bit / 2^28 fp32 elements), rows [rows, Sk]
    bwd        the same rows, backward
    mask       forward with a bool [B,1,Sq,Sk] or an additive (x's dtype) mask, Sk 128 .. 16384
    causal     causal forward, fp16 [8,32,2048,2048]
    long       Sk 65536, 262144, 1048576 (fp16, fp32): forward without and with a bool [B,1,1,Sk]
               mask, and backward, same fixed total
    sweep      every no-mask case of fwd, bwd and long (the figure's points)
    host       host time of one eager call [1,12,128,128] fp16
    memory     peak memory of a forward (the output only)
    coldstart  first call from the packaged cubin, in a fresh process
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

SCALE = 0.125  # 1/sqrt(64): a power of two, so x*scale is exact and every provider sees the same logits
DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
TOTAL = {"float16": 2**29, "bfloat16": 2**29, "float32": 2**28}  # elements of x per call: 1 GiB either way
SWEEP_SK = (32, 64, 128, 256, 512, 1000, 1024, 2048, 4096, 4097, 8192, 16384)
LONG_SK = (65536, 262144, 1048576)
LONG_DTYPES = ("float16", "float32")
MASK_SHAPES = {  # Sk -> [B, H, Sq, Sk]; the mask is [B, 1, Sq, Sk]
    128: (256, 12, 128, 128),  # a BERT-sized batch of 128-key rows
    1000: (16, 16, 512, 1000),
    2048: (8, 32, 2048, 2048),
    4096: (2, 32, 4096, 4096),
    16384: (2, 16, 512, 16384),
}
CAUSAL_SHAPE = (8, 32, 2048, 2048)
HOST_SHAPE = (1, 12, 128, 128)
MEMORY_SHAPE = (8, 16, 1024, 1024)
MEMORY_MASKS = ("none", "bool", "add", "causal")
COLDSTART_SHAPE = (8, 16, 512, 512)
MASK_HIDDEN = 0.1  # fraction of keys a random mask hides (never key 0: no row is fully hidden)
ROW_MULTIPLE = 8  # rows of the fixed-total cases are a multiple of this (apex's rows per block)

SECTIONS = ("fwd", "bwd", "mask", "causal", "long", "host", "sweep", "memory", "coldstart")
CASE_SECTIONS = ("fwd", "bwd", "mask", "causal", "long")
# torch.compile costs about a second of compiling per shape: it runs where the targets name it
# (masks, causal, long rows) and on the sweep in fp16 and fp32 (bf16 behaves like fp16).
COMPILE_SWEEP_DTYPES = ("float16", "float32")

QUICK = (
    "fwd-f16-sk128",
    "fwd-f16-sk1000",
    "fwd-f16-sk4096",
    "fwd-f16-sk16384",
    "bwd-f16-sk1000",
    "bwd-f16-sk4096",
    "mask-bool-f16-sk128",
    "mask-bool-f16-sk2048",
    "mask-add-f16-sk2048",
    "causal-f16-sk2048",
    "long-fwd-f16-sk262144",
    "long-bool-f16-sk65536",
    "long-bwd-f16-sk65536",
)
QUICK_COMPILE = ("fwd-f16-sk1000",)


def numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


def shape_str(shape: Iterable[int]) -> str:
    return "x".join(str(n) for n in shape)


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split("x")) if text else ()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Case:
    name: str  # stable id: the CSV's `case`
    section: str  # fwd | bwd | mask | causal | long
    direction: str  # fwd | bwd
    dtype: str
    shape: tuple[int, ...]
    mask: str = "none"  # none | bool | add | causal
    mask_shape: tuple[int, ...] | None = None
    sweep: bool = False  # a point of the row-length figure
    compile: bool = False  # torch.compile runs on it

    @property
    def sk(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return numel(self.shape) // self.sk

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def min_bytes(self) -> int:
        """x read once (causal: its visible keys only), the mask read once at its own size, y
        written once; backward: y, dy read, dx written."""
        n = numel(self.shape) * self.itemsize
        if self.direction == "bwd":
            return 3 * n
        if self.mask == "causal":
            return visible_keys(self.shape) * self.itemsize + n
        b = 2 * n
        if self.mask == "bool":
            b += numel(self.mask_shape)
        elif self.mask == "add":
            b += numel(self.mask_shape) * self.itemsize
        return b

    def selected_by(self, only: set[str] | None) -> bool:
        return only is None or self.section in only or ("sweep" in only and self.sweep)

    def describe(self) -> str:
        m = f", {self.mask} mask {shape_str(self.mask_shape)}" if self.mask_shape else ""
        m += ", causal" if self.mask == "causal" else ""
        return f"{self.direction} {self.dtype} {shape_str(self.shape)}{m}"


def visible_keys(shape: tuple[int, ...]) -> int:
    """Keys a causal forward (bottom-right aligned: query i sees keys j <= i + Sk - Sq) must
    read, over every row of x of `shape`."""
    sq, sk = shape[-2], shape[-1]
    per = sum(min(sk, max(0, i + 1 + sk - sq)) for i in range(sq))
    return numel(shape) // (sq * sk) * per


def sweep_shape(dtype: str, sk: int) -> tuple[int, int]:
    rows = TOTAL[dtype] // sk // ROW_MULTIPLE * ROW_MULTIPLE
    return (rows, sk)


def long_shape(dtype: str, sk: int) -> tuple[int, int, int, int]:
    rows = TOTAL[dtype] // sk
    return (2, 8, rows // 16, sk)


def all_cases(compile_on: bool = True) -> list[Case]:
    """Every case of the full run, in the order they run."""
    out: list[Case] = []
    for direction in ("fwd", "bwd"):
        for dt in DTYPES:
            for sk in SWEEP_SK:
                out.append(
                    Case(
                        f"{direction}-{SHORT[dt]}-sk{sk}",
                        direction,
                        direction,
                        dt,
                        sweep_shape(dt, sk),
                        sweep=True,
                        compile=compile_on and dt in COMPILE_SWEEP_DTYPES,
                    )
                )
    for sk, shape in MASK_SHAPES.items():
        for dt in DTYPES:
            for kind in ("bool", "add"):
                out.append(
                    Case(
                        f"mask-{kind}-{SHORT[dt]}-sk{sk}",
                        "mask",
                        "fwd",
                        dt,
                        shape,
                        mask=kind,
                        mask_shape=(shape[0], 1, shape[2], sk),
                        compile=compile_on,
                    )
                )
    out.append(
        Case(
            f"causal-f16-sk{CAUSAL_SHAPE[-1]}",
            "causal",
            "fwd",
            "float16",
            CAUSAL_SHAPE,
            mask="causal",
            compile=compile_on,
        )
    )
    for sk in LONG_SK:
        for dt in LONG_DTYPES:
            shape = long_shape(dt, sk)
            s = SHORT[dt]
            out.append(Case(f"long-fwd-{s}-sk{sk}", "long", "fwd", dt, shape, sweep=True, compile=compile_on))
            out.append(
                Case(
                    f"long-bool-{s}-sk{sk}",
                    "long",
                    "fwd",
                    dt,
                    shape,
                    mask="bool",
                    mask_shape=(shape[0], 1, 1, sk),
                    compile=compile_on,
                )
            )
            out.append(Case(f"long-bwd-{s}-sk{sk}", "long", "bwd", dt, shape, sweep=True, compile=compile_on))
    return out


def parse_only(text: str | None) -> set[str] | None:
    """`--only fwd,mask` -> {"fwd", "mask"}; None for everything; ValueError naming a bad section."""
    if text is None:
        return None
    names = {t.strip() for t in text.split(",") if t.strip()}
    bad = sorted(names - set(SECTIONS))
    if bad or not names:
        raise ValueError(f"--only: expected a comma-separated subset of {', '.join(SECTIONS)}; got {text!r}")
    return names


def plan(only: set[str] | None = None, quick: bool = False, compile_on: bool = True) -> list[Case]:
    """The cases to run: the full plan or --quick's subset, restricted to the --only sections."""
    cases = all_cases(compile_on)
    if quick:
        by_name = {c.name: c for c in cases}
        cases = [by_name[n] for n in QUICK]
        cases = [replace(c, compile=compile_on and c.name in QUICK_COMPILE) for c in cases]
    return [c for c in cases if c.selected_by(only)]


def shrink(c: Case) -> Case:
    """The same case on a tiny shape (for the CPU smoke run): rows and lengths cut, layout kept."""
    sk = min(c.sk, 160) if c.mask != "causal" else 24
    if len(c.shape) == 2:
        shape: tuple[int, ...] = (24, sk)
    else:
        b, h, sq = c.shape[0], c.shape[1], c.shape[2]
        shape = (min(b, 2), min(h, 3), sk if c.mask == "causal" else min(sq, 8), sk)
    ms = None
    if c.mask_shape is not None:
        ms = (shape[0], 1, shape[2] if c.mask_shape[2] != 1 else 1, sk)
    return replace(c, shape=shape, mask_shape=ms)


def wants(only: set[str] | None, section: str) -> bool:
    return only is None or section in only


# ----------------------------------------------------------------------------------
# A rough run-time model of an H200, for the dry run (not a measurement).

EST_BW = 4.0e12  # bytes/s a good kernel moves
EST_FLOOR_S = 8e-6  # shortest time of one call
EST_FACTOR = {  # a provider's time relative to the minimum bytes at EST_BW
    "drvsoftmax": 1.3,
    "compile": 1.2,
    "torch.softmax": 1.4,
    "quack": 1.05,
    "apex": 1.3,
    "liger": 1.2,
    "eager": 2.5,
    "eager-mask": 6.0,
}
EST_STARTUP_S = 25.0  # import torch, the peers, CUDA context, the copy ceiling
EST_CASE_SETUP_S = 0.05  # random inputs, the reference rows
EST_JIT_S = {"quack": 0.6, "liger": 0.4, "compile": 1.2}  # per first call of a new shape
EST_COMPILE_FIRST_S = 15.0  # Inductor's worker pool starts with the first compile
EST_HOST_S = 4 * 1.0
EST_MEMORY_S = 0.5 * len(MEMORY_MASKS) + 1.0
EST_COLDSTART_S = 10.0


def est_call_s(provider: str, case: Case) -> float:
    key = "eager-mask" if provider == "eager" and case.mask != "none" else provider
    return max(case.min_bytes * EST_FACTOR.get(key, 2.0) / EST_BW, EST_FLOOR_S)


def est_timing_s(t: float, warm_ms: float, target_ms: float, min_reps: int, max_reps: int) -> float:
    warm = min(max(warm_ms / (t * 1e3), 1), 50)
    reps = min(max(target_ms / (t * 1e3), min_reps), max_reps)
    return t * (4 + warm + reps) + 20e-6 * (4 + warm + reps)


def estimate_s(
    cases: list[Case],
    providers: Callable[[Case], list[str]],
    timing: tuple[float, float, int, int],
    extras: Iterable[str] = (),
) -> tuple[float, dict[str, float]]:
    """(total seconds, seconds per section) for `cases` plus the extra sections named."""
    per: dict[str, float] = {"startup": EST_STARTUP_S}
    compiled = False
    for c in cases:
        s = EST_CASE_SETUP_S
        for p in providers(c):
            s += est_timing_s(est_call_s(p, c), *timing) + EST_JIT_S.get(p, 0.0)
            if p == "compile" and not compiled:
                s += EST_COMPILE_FIRST_S
                compiled = True
        per[c.section] = per.get(c.section, 0.0) + s
    for name, s in (("host", EST_HOST_S), ("memory", EST_MEMORY_S), ("coldstart", EST_COLDSTART_S)):
        if name in extras:
            per[name] = s
    return sum(per.values()), per
