#!/usr/bin/env python3
"""Pack the benchmark's peers for a GPU machine without a package index (.peers/).

    python3 benchmarks/peers_pack.py                  # download, pack into .peers/c1, c2, ...
    python3 benchmarks/peers_pack.py --apex DIR       # apex's sources from a checkout of NVIDIA/apex
    python3 benchmarks/peers_pack.py --wheels DIR     # the wheels from DIR instead of downloading

Run from the repository root on a machine with a package index (and git, unless `--apex`
names a checkout).  It fills the ignored folder `.peers/` with the groups that
`benchmarks/peers_setup.sh` takes on the GPU machine, one group a call:

1. the peers' wheels (`WHEELS`, pinned) for Python 3.12 on manylinux_2_28_x86_64;
2. a wheel larger than a group (nvidia-cutlass-dsl-libs-cu13, 92 MB) rewritten with its
   members stored instead of deflated (the same files and RECORD, so pip installs it alike;
   xz then packs it to about two thirds: 61 instead of 91 MB), in an xz tarball split into
   parts with a sha256 file (`parts N`, each part's sum, the tarball's and the wheel's);
3. NVIDIA apex's `csrc/megatron` softmax sources, `csrc/type_shim.h` and its LICENSE (never
   committed here);
4. everything placed into groups `c1`, `c2`, ... of at most `--group-mb` MB each (default:
   what a call carries, 64 MiB, less the checkout's tracked files, `drvsoftmax/_prebuilt` and
   2 MiB), largest first, and a `README.txt` saying which group holds what.

It replaces `.peers/` (or `--out`) whole.  The exit status is 1 when a download or the apex
sources fail, 2 on a bad option.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = (  # what the run of the README's performance section used
    "quack-kernels==0.6.5",
    "nvidia-cutlass-dsl==4.8.1",
    "nvidia-cutlass-dsl-libs-core==4.8.1",
    "nvidia-cutlass-dsl-libs-base==4.8.1",
    "nvidia-cutlass-dsl-libs-cu13==4.8.1",
    "apache-tvm-ffi==0.1.15.post2",
    "torch-c-dlpack-ext==0.1.5",
    "liger-kernel==0.8.5",
)
PLATFORM = ("--python-version", "3.12", "--platform", "manylinux_2_28_x86_64")
APEX_URL = "https://github.com/NVIDIA/apex"
APEX_FILES = ("csrc/type_shim.h", "LICENSE")  # beside csrc/megatron/*softmax*
CARRY_BYTES = 64 * 2**20  # what one call carries, the checkout included
MARGIN_BYTES = 2 * 2**20
SLACK_BYTES = 64 * 1024
MB = 10**6


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def tree_bytes(repo: Path) -> int | None:
    """Bytes of the checkout a call carries besides a group: tracked files and the packaged
    cubins (ignored, carried by name); None without git."""
    try:
        files = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True
        ).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    total = sum((repo / f.decode()).stat().st_size for f in files if f and (repo / f.decode()).is_file())
    prebuilt = repo / "drvsoftmax" / "_prebuilt"
    if prebuilt.is_dir():
        total += sum(p.stat().st_size for p in prebuilt.rglob("*") if p.is_file())
    return total


def default_group_bytes(repo: Path) -> int:
    tree = tree_bytes(repo)
    return CARRY_BYTES - (tree if tree is not None else 24 * 2**20) - MARGIN_BYTES


def stored_wheel(src: Path, dst: Path) -> None:
    """`src` rewritten to `dst` with every member stored (no compression), in order, with
    the same names and bytes: its RECORD still holds, and xz packs it far better."""
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_STORED
            zo.writestr(out, zi.read(info))


def xz_tarball(wheel: Path, dest: Path) -> Path:
    """`wheel` in an xz tarball `dest` (its only member, at the top)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(dest, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.add(wheel, arcname=wheel.name)
    return dest


def split_file(path: Path, sizes: list[int], wheel: Path) -> list[Path]:
    """`path` (NAME.tar.xz of `wheel`) cut into parts NAME.tar.xz.part-NN of the given sizes
    (the last takes the rest) beside it, and NAME.sha256 written as peers_setup.sh checks and
    joins them: `parts N`, each part's sum, the tarball's and the wheel's.  Returns the parts."""
    name = path.name[: -len(".tar.xz")]
    parts = []
    with path.open("rb") as f:
        for k, size in enumerate(sizes):
            block = f.read(size if k < len(sizes) - 1 else -1)
            part = path.with_name(f"{path.name}.part-{k:02d}")
            part.write_bytes(block)
            parts.append(part)
    lines = [f"parts {len(parts)}"]
    lines += [f"{sha256(p)}  {p.name}" for p in parts]
    lines += [f"{sha256(path)}  {path.name}", f"{sha256(wheel)}  {wheel.name}"]
    path.with_name(f"{name}.sha256").write_text("\n".join(lines) + "\n")
    return parts


def download(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *PLATFORM, "-d", str(dest)]
    subprocess.run([*cmd, *WHEELS], check=True)
    return sorted(dest.glob("*.whl"))


def apex_sources(apex: Path | None, dest: Path, work: Path) -> None:
    """apex's megatron softmax sources, type_shim.h and LICENSE copied flat into `dest`."""
    if apex is None:
        apex = work / "apex"
        subprocess.run(["git", "clone", "-q", "--depth", "1", APEX_URL, str(apex)], check=True)
    found = sorted((apex / "csrc" / "megatron").glob("*softmax*"))
    if not found:
        raise FileNotFoundError(f"no csrc/megatron/*softmax* under {apex}")
    dest.mkdir(parents=True, exist_ok=True)
    for f in [*found, *(apex / p for p in APEX_FILES)]:
        shutil.copy2(f, dest / f.name)


def pack(wheels: list[Path], apex_dir: Path | None, out: Path, group_bytes: int, work: Path) -> dict[str, list[str]]:
    """Place the wheels and the apex sources into groups under `out` (largest first, each
    into the first group with room), then each wheel too large for a group, stored, packed
    and cut into parts that fill the room left, group by group; a group holding a part also
    holds its split's sha256 file.  Returns group -> what it holds (paths in the group)."""
    room = group_bytes - SLACK_BYTES  # the sha256 files and the file system's rounding
    items: list[tuple[int, Path, str]] = []  # (bytes, file or folder, where in its group)
    big = []
    for w in wheels:
        size = w.stat().st_size
        if size <= room:
            items.append((size, w, f"whl/{w.name}"))
        else:
            big.append(w)
    if apex_dir is not None:
        items.append((sum(p.stat().st_size for p in apex_dir.iterdir()), apex_dir, "apex_megatron"))
    groups: list[list[tuple[int, Path, str]]] = []

    def used(g: list[tuple[int, Path, str]]) -> int:
        return sum(t[0] for t in g)

    for item in sorted(items, key=lambda t: -t[0]):
        held = next((g for g in groups if used(g) + item[0] <= room), None)
        if held is None:
            groups.append([item])
        else:
            held.append(item)
    sums: dict[str, Path] = {}  # part (its place in a group) -> its split's sha256 file
    for w in big:
        name = w.name.split("-")[0]
        flat = work / "stored" / w.name
        flat.parent.mkdir(parents=True, exist_ok=True)
        print(f"packing {w.name} ({w.stat().st_size / MB:.0f} MB; xz takes minutes)", flush=True)
        stored_wheel(w, flat)
        tarball = xz_tarball(flat, work / "parts" / name / f"{name}.tar.xz")
        left, k, sizes, homes = tarball.stat().st_size, 0, [], []
        while left > 0:
            if k == len(groups):
                groups.append([])
            free = room - used(groups[k])
            if free >= min(left, room // 4):  # no sliver of a part where more remains
                sizes.append(min(free, left))
                homes.append(groups[k])
                left -= sizes[-1]
            k += 1
        for part, home in zip(split_file(tarball, sizes, flat), homes):
            home.append((part.stat().st_size, part, f"parts/{part.name}"))
            sums[f"parts/{part.name}"] = tarball.with_name(f"{name}.sha256")
    if out.exists():
        shutil.rmtree(out)
    listing: dict[str, list[str]] = {}
    for k, held in enumerate(groups, 1):
        g = out / f"c{k}"
        split_sums = sorted({sums[rel] for _, _, rel in held if rel in sums})
        files = [(src, rel) for _, src, rel in held] + [(f, f"parts/{f.name}") for f in split_sums]
        for src, rel in files:
            (g / rel).parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, g / rel)
            else:
                shutil.copy2(src, g / rel)
        listing[g.name] = sorted(rel for _, rel in files)
    return listing


def readme(listing: dict[str, list[str]], out: Path, group_bytes: int) -> str:
    lines = [
        "The benchmark's peers for a GPU machine without a package index (benchmarks/peers_pack.py).",
        f"Groups of at most {group_bytes / MB:.1f} MB; carry one a call with the checkout, e.g.",
        '  carry [".peers/c1", "drvsoftmax/_prebuilt"], command: bash benchmarks/peers_setup.sh',
        "then the next group in the next call while the machine is still warm.",
        "",
    ]
    for g, held in listing.items():
        size = sum(p.stat().st_size for p in (out / g).rglob("*") if p.is_file())
        lines.append(f"{g} ({size / MB:.1f} MB):")
        lines += [f"  {h}" for h in held]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    doc = (__doc__ or "").split("\n\n")
    ap = argparse.ArgumentParser(
        description=doc[0], epilog="\n\n".join(doc[1:3]), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=REPO / ".peers", help="the folder to fill (default .peers)")
    ap.add_argument("--wheels", type=Path, help="take the wheels from this folder instead of downloading them")
    ap.add_argument("--apex", type=Path, help="a checkout of NVIDIA/apex (default: a shallow clone)")
    ap.add_argument("--no-apex", action="store_true", help="leave apex's sources out")
    ap.add_argument("--group-mb", type=float, help="most MB (10^6 bytes) a group holds (default: as a call carries)")
    args = ap.parse_args(argv)
    group_bytes = int(args.group_mb * MB) if args.group_mb is not None else default_group_bytes(REPO)
    if group_bytes < MB:
        ap.error(f"--group-mb: expected at least 1 MB a group; got {group_bytes / MB:.2f}")
    with tempfile.TemporaryDirectory(prefix="peers_pack.") as tmp:
        work = Path(tmp)
        try:
            wheels = sorted(args.wheels.glob("*.whl")) if args.wheels else download(work / "dl")
            if not wheels:
                print(f"no wheels in {args.wheels}", file=sys.stderr)
                return 1
            apex_dir = None if args.no_apex else work / "apex_megatron"
            if apex_dir is not None:
                apex_sources(args.apex, apex_dir, work)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"peers_pack: {e}", file=sys.stderr)
            return 1
        listing = pack(wheels, apex_dir, args.out, group_bytes, work)
    text = readme(listing, args.out, group_bytes)
    (args.out / "README.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
