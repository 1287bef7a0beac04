"""The same llama-family model on the native backend (our Decoder) and on the generic one (transformers'
modules, models/generic), side by side: SFT training tokens/s and the inference engine's decode tokens/s.

    python benchmarks/generic_backend.py --repeats 2
    python benchmarks/generic_backend.py --model /work/models/smollm2-135m --steps 6

Each side runs in a fresh process, alternating: `--steps` SFT steps (the bundled alpaca data, padded rows:
the generic backend has no packing, so both sides run unpacked) with full fine-tuning in fp32, then the
engine generates `--requests` completions of `--new` tokens (greedy, no eos) from the trained weights. The
default model is a random-init llama-10m with the bundled tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _sides import add_side_arguments, alternate, job_model, print_table, report, run_child

REPO = Path(__file__).resolve().parents[1]
SIDES = ("native", "hf")


def run_side(folder: Path, out: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    from shardforge.config import load_config
    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.sampling import SamplingParams
    from shardforge.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    data = REPO / "examples" / "data" / "demo_alpaca.jsonl"
    config = {
        "output_dir": str(out / "run"),
        "model": {"path": str(folder / "model"), "backend": args.side,
                  "tokenizer": str(folder / "model")},
        "data": {"train": [{"path": str(data), "format": "alpaca"}], "max_length": 256, "packing": False,
                 "cache_dir": str(out / "cache")},
        "train": {"steps": args.steps, "micro_batch": 8, "lr": 1e-4, "warmup": 0, "log_every": 1, "seed": 0},
        "checkpoint": {"save_final": False},
        "log": {"tensorboard": False, "plot": False, "progress": False},
    }  # fmt: skip
    trainer = Trainer(load_config(None, base=config))
    history = trainer.train().history[1:]  # after the first step (warm-up)
    train_tps = sum(r["tokens_per_s"] for r in history) / len(history)
    model = trainer.model.eval()
    prompts = [[5 + (i * 7 + j) % 900 for j in range(24 + i % 16)] for i in range(args.requests)]
    engine = Engine(model, config=EngineConfig(max_running=args.requests))
    began = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True))
    seconds = time.perf_counter() - began
    tokens = sum(len(c[0].tokens) for c in done)
    return {
        "train_tokens_per_s": train_tps,
        "decode_tokens_per_s": tokens / seconds,
        "loss_last": history[-1]["loss"],
        "tokens_checksum": sum((i + 1) * t for i, t in enumerate(t for c in done for t in c[0].tokens)),
    }


def _forward(args: argparse.Namespace) -> list[str]:
    keys = ("steps", "requests", "new", "threads", "seed")
    return [arg for key in keys for arg in (f"--{key}", str(getattr(args, key)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF llama-family folder (default: a random-init llama-10m)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    add_side_arguments(parser, SIDES)
    args = parser.parse_args()
    if run_child(args, {side: run_side for side in SIDES}):
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        job_model(folder, args.model)
        result = report(args, alternate(__file__, folder, args, _forward, SIDES))
        native, generic = result["median"]["native"], result["median"]["hf"]
        for key in ("train_tokens_per_s", "decode_tokens_per_s"):
            result[f"ratio_{key}"] = native[key] / generic[key]
        same = [r["tokens_checksum"] for r in result["runs"]["native"]] == [
            r["tokens_checksum"] for r in result["runs"]["hf"]
        ]
        result["same_greedy_tokens"] = same
        if args.results:
            Path(args.results).write_text(json.dumps(result, indent=2))
        keys = ("train_tokens_per_s", "decode_tokens_per_s", "loss_last", "peak_rss_mib")
        print_table({s: {k: m[k] for k in keys} for s, m in result["median"].items()}, keys)
        print(
            f"native / generic: training {result['ratio_train_tokens_per_s']:.2f}x, decoding "
            f"{result['ratio_decode_tokens_per_s']:.2f}x; the same greedy tokens: {same}"
        )


if __name__ == "__main__":
    main()
