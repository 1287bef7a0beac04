"""README's demo command as a newcomer meets it: a fresh clone, an empty pip cache, the install timed, then
the demo timed. The command is read from README.md (the block under "Two commands"), so what is timed is
what the README says; the figures go to --out as JSON with the host's instruction set and load.

    python benchmarks/fresh_install.py --out benchmarks/results_fresh_install.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def demo_command() -> str:
    """README's demo line: the one that installs and then runs `shardforge train examples/demo.yaml`."""
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("python3 -m venv") and line.endswith("shardforge train examples/demo.yaml"):
            return line
    raise SystemExit("README.md has no demo command line")


def timed(command: str, cwd: Path, env: dict[str, str]) -> float:
    began = time.perf_counter()
    proc = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{command!r} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - began


def instruction_set() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" if "avx512_bf16" in flags else "avx512" if "avx512f" in flags else "avx2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    command = demo_command()
    install, demo = (part.strip() for part in command.rsplit("&&", 1))
    with tempfile.TemporaryDirectory() as tmp:
        clone, cache = Path(tmp) / "clone", Path(tmp) / "pip-cache"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        env = {**os.environ, "PIP_CACHE_DIR": str(cache)}  # empty: every package fetched as on a new machine
        load = os.getloadavg()[0]
        install_s = timed(install, clone, env)
        demo_s = timed(demo, clone, env)
        packages = subprocess.run([".venv/bin/pip", "list"], cwd=clone, capture_output=True, text=True)
    result = {
        "date": date.today().isoformat(),
        "command": command,
        "install_s": round(install_s, 1),
        "demo_s": round(demo_s, 1),
        "packages": len(packages.stdout.splitlines()) - 2,
        "host": {"cpus": os.cpu_count(), "instruction_set": instruction_set(), "machine": platform.machine()},
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
