"""Time and memory of the data pipeline before step 1: encoding in memory (no cache) against the dataset
cache, cold (tokenize once into memory-mapped arrays) and warm (map them), each in a fresh process.

    python benchmarks/data_pipeline.py --records 20000

The records are alpaca-style and LLaMA-Factory-like in length (an instruction, sometimes an input, a longer
output), encoded for SFT with the bundled tokenizer and its ChatML template. Reports seconds, records/s and
the process's peak RSS and its growth over the same process without data (bytes per token).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
]

_RUN = r"""
import json, resource, sys, time
from shardforge.config import load_config
from shardforge.models.build import load_tokenizer
from shardforge.objectives import build_objective
from shardforge.train.setup import build_data, console_for
config = load_config(sys.argv[1], sys.argv[2:])
tokenizer, objective = load_tokenizer(config.model), build_objective(config.method)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
train, _ = build_data(config, tokenizer, objective, console_for(quiet=True))
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
growth = (rss - before) / train.num_tokens
print(json.dumps({"seconds": seconds, "tokens": train.num_tokens, "records": train.stats.records,
                  "peak_rss_mib": rss / 2**20, "rss_growth_bytes_per_token": growth}))
"""


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _write_records(path: Path, count: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            record = {
                "instruction": _sentence(rng, 5, 30),
                "input": _sentence(rng, 0, 20) if rng.random() < 0.4 else "",
                "output": _sentence(rng, 20, 200),
            }
            f.write(json.dumps(record) + "\n")


def _run(config: Path, *overrides: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, str(config), *overrides], capture_output=True, text=True, cwd=REPO
    )
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _write_records(folder / "train.jsonl", args.records)
        config = folder / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "model": {"preset": "demo", "tokenizer": str(REPO / "examples/data/tokenizer")},
                    "data": {
                        "train": [{"path": str(folder / "train.jsonl"), "format": "alpaca"}],
                        "max_length": 1024,
                        "cache_dir": str(folder / "cache"),
                    },
                }
            )
        )
        results = {
            "no cache (every rank encodes)": _run(config, "data.cache=false"),
            "cache, cold (tokenize once)": _run(config),
            "cache, warm (map)": _run(config),
        }
    for name, r in results.items():
        print(
            f"{name:32s} {r['seconds']:7.2f} s  {r['records'] / r['seconds']:8.0f} records/s  "
            f"peak RSS {r['peak_rss_mib']:6.0f} MiB  +{r['rss_growth_bytes_per_token']:5.1f} B/token"
        )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
