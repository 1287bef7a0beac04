"""Build a folder of wheels that installs shardforge with no package index, beside a torch already there.

Clusters and GPU machines often have their own CUDA build of torch and no registry. This resolves shardforge
(with the extras asked for) for the target Python and platform at the tested versions (constraints.txt),
keeps every package that shardforge needs except torch and what only torch needs (its CUDA libraries, triton,
sympy...), downloads those wheels and builds shardforge's own, and writes the pins of what it holds to
`constraints.txt` inside the folder. On the target, from the folder's parent or anywhere:

    python -m pip install --no-index --find-links WH -c WH/constraints.txt "shardforge[gpucheck]"

`--exclude` leaves out packages the target already has (e.g. numpy, pyarrow on a GPU image), to keep the
folder small; the target's own versions must then satisfy shardforge's ranges (pip says so by name if not).
Run it through scripts/wheelhouse.sh; `--help` lists the options.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# What the target's torch brings with it: never shipped. A package is shipped only if something other than
# torch needs it (the walk below does not go through torch). setuptools goes with torch too: torch pins its
# range (2.11: <82) and needs it on Python 3.12+, so wherever torch is installed, a setuptools it accepts is.
TORCH_OWNS = {"torch", "setuptools"}
MANYLINUX_X86_64 = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def _pip(python: str, *args: str) -> None:
    cmd = [python, "-m", "pip", *args, "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"wheelhouse: `pip {args[0]}` failed:\n{done.stderr[-4000:]}")


def stub_torch(folder: Path, constraints: Path) -> None:
    """A metadata-only torch wheel at the tested version, with no dependencies, so the resolution below
    never asks for torch's own (its CUDA libraries for the target platform): torch is the target's."""
    pins = [
        ln.split("==", 1)[1].strip()
        for ln in constraints.read_text().splitlines()
        if ln.startswith("torch==")
    ]
    version = f"{pins[0] if pins else '2.11.0'}+wheelhouse.stub"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr(f"{info}/RECORD", "")


def target_flags(python_version: str | None, platforms: list[str]) -> list[str]:
    """pip's options that pick wheels for another Python and platform than the running one."""
    if python_version is None and not platforms:
        return []
    flags = ["--only-binary=:all:", "--implementation", "cp"]
    if python_version:
        flags += ["--python-version", python_version]
    for platform in platforms or MANYLINUX_X86_64:
        flags += ["--platform", platform]
    return flags


def needed(report: dict, root: str, extras: list[str], python_version: str | None, exclude: set[str]) -> dict:
    """name -> version of every package reachable from root[extras] without going through torch or an
    excluded package, with environment markers evaluated for the target Python."""
    env = dict(report["environment"])
    if python_version:
        env.update(python_version=python_version, python_full_version=f"{python_version}.0")
    items = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in report["install"]}
    found: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    queue = deque([(canonicalize_name(root), tuple(extras))])
    while queue:
        name, asked = queue.popleft()
        if name in TORCH_OWNS or name in exclude or name not in items:
            continue
        meta = items[name]
        found[name] = meta["version"]
        for extra in ("", *asked):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in meta.get("requires_dist") or []:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
                    continue
                if req.marker is None and extra:
                    continue  # unconditional requirements were taken with extra ""
                queue.append((canonicalize_name(req.name), tuple(sorted(req.extras))))
    found.pop(canonicalize_name(root), None)
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (emptied first)")
    parser.add_argument("--extras", default="", help="comma-separated extras of shardforge, e.g. gpucheck")
    parser.add_argument("--python-version", help="the target's Python, e.g. 3.12 (default: this one's)")
    parser.add_argument(
        "--platform",
        action="append",
        default=[],
        help="a target wheel platform tag, repeatable (default with --python-version: manylinux x86_64)",
    )
    parser.add_argument("--exclude", default="", help="comma-separated packages the target already has")
    parser.add_argument("--constraints", type=Path, default=REPO / "constraints.txt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    extras = [e for e in args.extras.split(",") if e]
    exclude = {canonicalize_name(n) for n in args.exclude.split(",") if n}
    if not args.constraints.is_file():
        raise SystemExit(f"wheelhouse: no constraints file at {args.constraints}")
    flags = target_flags(args.python_version, args.platform)
    python = sys.executable
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)

    print(f"wheelhouse: building shardforge's wheel into {args.out}", flush=True)
    _pip(python, "wheel", "--no-deps", "-w", str(args.out), str(REPO))
    wheel = next(args.out.glob("shardforge-*.whl"))
    spec = f"shardforge[{','.join(extras)}]" if extras else "shardforge"
    print(f"wheelhouse: resolving {spec} for {args.python_version or 'this Python'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        stub_torch(Path(tmp), args.constraints)
        _pip(
            python,
            "install",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report_path),
            "--find-links",
            str(args.out),
            "--find-links",
            tmp,
            "-c",
            str(args.constraints),
            *flags,
            *(["--target", str(Path(tmp) / "target")] if flags else []),  # pip 23 wants it with --platform
            spec,
        )
        report = json.loads(report_path.read_text())
    pins = needed(report, "shardforge", extras, args.python_version, exclude)
    print(
        f"wheelhouse: downloading {len(pins)} wheels (torch and {len(exclude)} excluded left out)", flush=True
    )
    _pip(
        python,
        "download",
        "--no-deps",
        "-d",
        str(args.out),
        *(flags or ["--only-binary=:all:"]),
        *[f"{n}=={v}" for n, v in sorted(pins.items())],
    )
    lines = [
        f"# The pins of the wheels in this folder (from {args.constraints.name}); torch is the target's."
    ]
    lines += [f"{n}=={v}" for n, v in sorted(pins.items())]
    (args.out / "constraints.txt").write_text("\n".join(lines) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**20
    print(f"wheelhouse: {len(pins) + 1} wheels, {size:.0f} MiB in {args.out} ({wheel.name})")
    print(
        "install on the target (beside its torch, no index):\n"
        f'  python -m pip install --no-index --find-links {args.out} -c {args.out}/constraints.txt "{spec}"'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
