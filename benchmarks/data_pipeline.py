"""Time and memory of the data pipeline until the first global batch is ready, each case in a fresh process.

    python benchmarks/data_pipeline.py --records 200000             # SFT: alpaca-style records
    python benchmarks/data_pipeline.py --records 0 --text-mb 100,1024  # pretraining: plain text corpora

SFT: alpaca-style records, LLaMA-Factory-like in length (an instruction, sometimes an input, a longer output),
encoded with the bundled tokenizer and its ChatML template: in memory (no cache), then the dataset cache cold
(tokenize once into memory-mapped arrays) and warm (map them).

Pretraining: a plain .txt corpus (a document per line, Zipf-distributed pseudo-words) of each size: in memory,
cache cold and warm as above, and streamed (`data.streaming`), where the process then draws `--stream-batches`
more global batches so its peak RSS covers several windows. Reports seconds to the first batch, records/s, the
process's peak RSS and its growth over the same process without data (per token of the data set, or of the
stream's consumed batches).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

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
from shardforge.data.batch_source import DatasetSource
from shardforge.data.stream import StreamSource
from shardforge.models.build import load_tokenizer
from shardforge.objectives import build_objective
from shardforge.data.build import build_data
from shardforge.objectives import reading_of
from shardforge.train.runtime import console_for
more = int(sys.argv[2])
config = load_config(sys.argv[1], sys.argv[3:])
tokenizer, objective = load_tokenizer(config.model), build_objective(config.method)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
train, _ = build_data(config, tokenizer, objective, reading_of(objective))
split, collate = (config.train.micro_batch, 1, 1, 0), (objective.collate, tokenizer.pad_token_id)
if train is None:
    source = StreamSource(config.data, "pt", objective.encoder(tokenizer, config.data), 0, split, *collate)
else:
    source = DatasetSource(train, 0, *split, *collate)
batch = source.next_batch()
seconds = time.perf_counter() - start
tokens, records = batch.counts["tokens"], batch.counts["sequences"]
for _ in range(more if train is None else 0):
    batch = source.next_batch()
    tokens += batch.counts["tokens"]
if train is not None:
    tokens, records = train.num_tokens, train.stats.records
source.close()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "tokens": tokens, "records": records, "peak_rss_mib": rss / 2**20,
                  "rss_growth_bytes_per_token": (rss - before) / tokens, "streamed": train is None}))
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


def _write_text(path: Path, megabytes: int) -> None:
    """A corpus of `megabytes` MiB: documents of 20-300 Zipf-distributed pseudo-words, a document per line
    (drawn from a pool of 20,000 so writing a gigabyte takes seconds, not minutes)."""
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(30000)]
    pool = []
    for _ in range(20000):
        ids = np.minimum(rng.zipf(1.3, size=rng.integers(20, 300)) - 1, len(vocab) - 1)
        pool.append(" ".join(vocab[i] for i in ids) + "\n")
    target, written = megabytes * 2**20, 0
    with path.open("w") as f:
        while written < target:
            chunk = "".join(pool[i] for i in rng.integers(0, len(pool), size=2000))
            f.write(chunk)
            written += len(chunk)


def _run(config: Path, *overrides: str, more: int = 0) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, str(config), str(more), *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _config(folder: Path, train: dict, stage: str, cache: Path) -> Path:
    config = folder / f"config-{stage}.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"preset": "demo", "tokenizer": str(REPO / "examples/data/tokenizer")},
                "data": {"train": [train], "max_length": 1024, "cache_dir": str(cache)},
                "method": {"stage": stage},
                "train": {"micro_batch": 8},
            }
        )
    )
    return config


def _show(name: str, r: dict) -> None:
    if r["streamed"]:  # memory is bounded by the windows: growth in MiB, not per token
        rate = f"{r['tokens'] / 1e6:6.1f}M tokens drawn"
        growth = f"+{r['rss_growth_bytes_per_token'] * r['tokens'] / 2**20:5.0f} MiB"
    else:
        rate = f"{r['records'] / r['seconds']:8.0f} records/s ({r['tokens'] / 1e6:.1f}M tokens)"
        growth = f"+{r['rss_growth_bytes_per_token']:5.1f} B/token"
    first, peak = f"{r['seconds']:7.2f} s", f"{r['peak_rss_mib']:6.0f} MiB"
    print(f"{name:44s} first batch {first}  peak RSS {peak}  {growth}  {rate}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000, help="alpaca records (0: skip)")
    parser.add_argument("--text-mb", default="", help="plain text corpus sizes in MiB, e.g. 100,1024")
    parser.add_argument("--stream-batches", type=int, default=100, help="batches drawn after the first")
    parser.add_argument("--out", default=None, help="also write the JSON results here")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.records:
            _write_records(folder / "train.jsonl", args.records)
            train = {"path": str(folder / "train.jsonl"), "format": "alpaca"}
            config = _config(folder, train, "sft", folder / "cache")
            for name, overrides in [
                ("no cache (every rank encodes)", ["data.cache=false"]),
                ("cache, cold (tokenize once)", []),
                ("cache, warm (map)", []),
            ]:
                results[f"sft {args.records} records: {name}"] = r = _run(config, *overrides)
                _show(f"sft {args.records}: {name}", r)
        for megabytes in [int(m) for m in args.text_mb.split(",") if m]:
            corpus = folder / f"corpus-{megabytes}.txt"
            _write_text(corpus, megabytes)
            config = _config(folder, {"path": str(corpus), "format": "text"}, "pt", folder / "cache")
            cases = [
                ("streamed", ["data.streaming=true"]),
                ("no cache (every rank encodes)", ["data.cache=false"]),
                ("cache, cold (tokenize once)", []),
                ("cache, warm (map)", []),
            ]
            for name, overrides in cases:
                r = _run(config, *overrides, more=args.stream_batches)
                results[f"text {megabytes} MiB: {name}"] = r
                _show(f"text {megabytes} MiB: {name}", r)
            corpus.unlink()
            shutil.rmtree(folder / "cache", ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
