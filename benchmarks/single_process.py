"""Single-process training throughput: tokens/s and MFU of the real trainer loop on this machine.

Runs `shardforge.train` (stage pt, packed rows) on the bundled demo data with a benchmark preset and reports
the median of the log windows after the first (which holds warm-up). Not a test.

    python benchmarks/single_process.py --preset llama-25m --steps 30 --micro-batch 8 --seq 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from shardforge.config import load_config
from shardforge.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def run(
    preset: str,
    steps: int,
    micro_batch: int,
    seq: int,
    threads: int,
    log_every: int,
    device: str = "auto",
    precision: str = "fp32",
    peak_flops: float | None = None,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            base={
                "output_dir": tmp,
                "model": {"preset": preset, "tokenizer": str(REPO / "examples/data/tokenizer")},
                "data": {
                    "train": [{"path": str(REPO / "examples/data/demo_alpaca.jsonl"), "format": "alpaca"}],
                    "max_length": seq,
                    "packing": True,
                },
                "method": {"stage": "pt"},
                "train": {
                    "precision": precision,
                    "steps": steps,
                    "micro_batch": micro_batch,
                    "lr": 1e-3,
                    "warmup": 2,
                    "log_every": log_every,
                },
                "log": {"tensorboard": False, "plot": False, "progress": False},
                "checkpoint": {"save_final": False},
                "hardware": {"threads": threads, "device": device, "peak_flops": peak_flops},
            },
        )
        trainer = Trainer(cfg)
        trainer.train()
        logged = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        windows = logged[1:] or logged  # the first window holds warm-up; keep it only if it is all there is
    params = sum(p.numel() for p in trainer.model.parameters())
    return {
        "preset": preset,
        "parameters": params,
        "threads": threads,
        "micro_batch": micro_batch,
        "seq": seq,
        "tokens_per_s": statistics.median(w["tokens_per_s"] for w in windows),
        "mfu": statistics.median(w["mfu"] for w in windows),
        "peak_flops": logged[0]["peak_flops"],
        "peak_source": logged[0]["peak_source"],
        "final_loss": windows[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-25m")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--peak-flops", type=float, default=None, help="MFU denominator (default: measured)")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args()
    result = run(
        args.preset,
        args.steps,
        args.micro_batch,
        args.seq,
        args.threads,
        args.log_every,
        args.device,
        args.precision,
        args.peak_flops,
    )
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{result['preset']} ({result['parameters'] / 1e6:.1f}M params), {args.threads} threads: "
        f"{result['tokens_per_s']:.0f} tokens/s, MFU {result['mfu']:.1%} of "
        f"{result['peak_flops'] / 1e9:.0f} GFLOP/s ({result['peak_source']})"
    )


if __name__ == "__main__":
    main()
