"""Where the time from launch to the end of step 1 goes, for a config (default: the demo).

    python benchmarks/startup.py [CONFIG] [--repeats 3]

Prints, per phase, seconds since the process started (imports, tokenizer, data, model build and layout,
peak probe, step 1), the median over fresh processes; and the wall time of `shardforge --help` and of a
config error, which must answer in well under a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
marks = {}
def timed(module, name, label):
    inner = getattr(module, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        marks[label] = marks.get(label, 0.0) + time.perf_counter() - start
        return out
    setattr(module, name, wrapper)
from shardforge.config import load_config
from shardforge.train.trainer import Trainer
import shardforge.data.build as data_build
import shardforge.train.policy as policy
import shardforge.train.runtime as runtime
import shardforge.train.setup as setup
marks["imports"] = time.perf_counter() - t0
timed(setup, "model_source", "tokenizer and model source")
timed(data_build, "build_datasets", "data (read, tokenize, pack)")
timed(policy, "build_model", "model build")
timed(setup, "parallelize", "layout (parallelize)")
timed(runtime, "peak_flops", "peak probe")
overrides = ["train.steps=1", "train.eval_every=null", "checkpoint.save_final=false", "log.tensorboard=false",
             "log.plot=false", f"output_dir={sys.argv[2]}"]
trainer = Trainer(load_config(sys.argv[1], overrides))
trainer.setup()
marks["setup total"] = time.perf_counter() - t0
trainer.train_step()
marks["launch to end of step 1"] = time.perf_counter() - t0
print(json.dumps(marks))
"""


def _wall(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, capture_output=True, cwd=REPO, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="examples/demo.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(
                [sys.executable, "-c", _PHASES, args.config, out], capture_output=True, text=True, cwd=REPO
            )
            if proc.returncode:
                raise SystemExit(proc.stderr)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    phases = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    cli = [sys.executable, "-m", "shardforge"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as bad:
        bad.write(
            "model: {preset: demo, tokenizer: examples/data/tokenizer}\ndata: {train: []}\ntrain: {lr: -1}\n"
        )
        bad.flush()
        walls = {
            "shardforge --help": statistics.median(_wall([*cli, "--help"]) for _ in range(args.repeats)),
            "config error": statistics.median(_wall([*cli, "train", bad.name]) for _ in range(args.repeats)),
        }
    result = {"config": args.config, "repeats": args.repeats, "phases_s": phases, "wall_s": walls}
    print(json.dumps({"phases_s": phases, "wall_s": walls}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
