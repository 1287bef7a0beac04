"""Measured activation memory of one training forward per checkpointing mode (and, under torchrun with 2+
ranks, per tensor/sequence-parallel setting): what the planner's activation estimate is checked against.

    python benchmarks/activation_memory.py --preset llama-10m --batch 4 --seq 512
    torchrun --nproc-per-node 2 benchmarks/activation_memory.py --preset llama-10m --tp 2

Prints MiB kept for backward on rank 0 (`shardforge.parallel.activation_report`) and the recompute cost:
the time of forward + backward relative to no checkpointing. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from shardforge.config.parallel_schema import ParallelSection
from shardforge.data.batching import collate
from shardforge.data.examples import Example
from shardforge.models import build_preset
from shardforge.objectives.base import CausalLM
from shardforge.parallel import activation_report, apply_activation_checkpointing
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.tensor_parallel import apply_tensor_parallel, loss_context

VOCAB = 1024


def _forward(model: torch.nn.Module, batch) -> torch.Tensor:
    """The training forward: log-probabilities of the target positions' next tokens."""
    return model(batch.input_ids, **CausalLM().model_inputs(batch))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-10m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the rows here (rank 0), as JSON")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    examples = [
        Example(tuple(torch.randint(0, VOCAB, (args.seq,), generator=gen).tolist()), (True,) * args.seq, "b")
        for _ in range(args.batch)
    ]
    batch = collate(examples, [[i] for i in range(args.batch)], pad_id=0, multiple=max(1, args.tp))
    settings = [(False, "none")] if args.tp == 1 else [(False, "none"), (True, "none")]
    settings += [(settings[-1][0], mode) for mode in ("selective", "full")]
    base_time = None
    rows = []
    for sp, mode in settings:
        model = build_preset(args.preset, vocab_size=VOCAB, seed=0)
        dims = ParallelDims.from_config(ParallelSection(tp=args.tp, sequence_parallel=sp), world)
        apply_tensor_parallel(
            model, dims, dims.build_mesh("cpu"), ParallelSection(tp=args.tp, sequence_parallel=sp)
        )
        apply_activation_checkpointing(model, mode)
        report = activation_report(model, partial(_forward, model, batch))
        times = []
        for _ in range(3):  # the fastest of three: the first one also warms up
            start = time.perf_counter()
            with loss_context(dims):
                CausalLM.loss(_forward(model, batch), batch)["loss"].backward()
            times.append(time.perf_counter() - start)
        elapsed = min(times)
        base_time = base_time or elapsed
        norms = report.bytes_where(lambda t: t.module.endswith("_norm"))
        if not dist.is_initialized() or dist.get_rank() == 0:
            label = f"{args.preset} b={args.batch} s={args.seq} tp={args.tp} sp={'on ' if sp else 'off'}"
            print(
                f"{label} checkpoint={mode:<9} activations {report.total_bytes / 2**20:8.2f} MiB "
                f"(block norms {norms / 2**20:6.2f} MiB), forward+backward {elapsed / base_time:.2f}x"
            )
            rows.append(
                {
                    "preset": args.preset,
                    "batch": args.batch,
                    "seq": args.seq,
                    "tp": args.tp,
                    "sequence_parallel": sp,
                    "checkpoint": mode,
                    "activations_mib": report.total_bytes / 2**20,
                    "block_norms_mib": norms / 2**20,
                    "forward_backward_s": elapsed,
                    "forward_backward_relative": elapsed / base_time,
                }
            )
    if args.out and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
