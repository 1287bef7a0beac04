"""Data-parallel scaling on one machine: tokens/s of the demo model on 1 process (all threads) vs N processes
(one thread each) for ZeRO stages 0-3, same global batch. Not a test.

    python benchmarks/data_parallel.py --steps 30 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(out: Path, nproc: int, threads: int, micro_batch: int, steps: int, extra: list[str]) -> dict:
    log_every = max(1, steps // 3)
    cmd = [
        sys.executable,
        "-m",
        "shardforge",
        "train",
        "examples/demo.yaml",
        "--nproc",
        str(nproc),
        f"output_dir={out}",
        f"train.steps={steps}",
        f"train.log_every={log_every}",
        "train.eval_every=null",
        f"train.micro_batch={micro_batch}",
        f"hardware.threads={threads}",
        "checkpoint.save_final=false",
        "log.tensorboard=false",
        "log.plot=false",
        "data.eval=[]",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    windows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    windows = windows[1:] or windows  # the first window holds warm-up
    return {
        "tokens_per_s": statistics.median(w["tokens_per_s"] for w in windows),
        "loss": windows[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--out", default=None, help="also write the JSON results here")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = run(Path(tmp) / "single", 1, args.nproc, args.global_batch, args.steps, [])
        results["1 process"] = base
        for stage in range(4):
            name = f"{args.nproc} processes, zero_stage={stage}"
            results[name] = run(
                Path(tmp) / f"z{stage}",
                args.nproc,
                1,
                args.global_batch // args.nproc,
                args.steps,
                [f"parallel.zero_stage={stage}"],
            )
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    print("\n| layout | tokens/s | vs 1 process |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
