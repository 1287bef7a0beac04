"""Activation memory per rank under context parallel, measured (activation_report on rank 0), for cp 1/2/4
over sequence lengths, and the longest sequence whose activations fit a fixed budget per rank.

    python benchmarks/context_parallel.py [--preset llama-10m --lengths 1024 2048 4096 8192 --budget-mib 512]

Each cp runs as that many gloo processes on this machine; one packed row of the given length (documents of
512 tokens), its split by `split_batch`, one training forward measured. Prints a table and the fits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from shardforge.data.batching import collate
from shardforge.data.examples import Example
from shardforge.models import build_preset
from shardforge.objectives.base import CausalLM
from shardforge.parallel import activation_report
from shardforge.parallel.context_parallel import apply_context_parallel, split_batch
from shardforge.parallel.dims import ParallelDims

VOCAB = 1024


def packed_row(length: int, document: int = 512):
    docs = [
        Example(tuple(range(i % 7, i % 7 + document)), (True,) * document, "t")
        for i in range(length // document)
    ]
    return collate(docs, [list(range(len(docs)))], pad_id=0)


def measure(preset: str, cp: int, length: int) -> int:
    """Bytes the forward of one row keeps on this rank (collective: every cp rank calls it)."""
    model = build_preset(preset, vocab_size=VOCAB)
    batch = packed_row(length)
    if cp > 1:
        dims = ParallelDims(1, 1, cp, 1, 1, 1, 0, cp)
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        apply_context_parallel(model, dims, mesh, "allgather")
        batch = split_batch(batch, cp, mesh.get_local_rank("cp"))
    inputs = CausalLM().model_inputs(batch)
    return activation_report(model, lambda: model(batch.input_ids, **inputs)).total_bytes


def rank_main(rank: int, cp: int, port: int, preset: str, lengths: list[int], budget: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if cp > 1:
        dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=datetime.timedelta(minutes=10))
    table = {n: measure(preset, cp, n) for n in lengths}
    low, high = lengths[0], lengths[0]  # the longest length (a multiple of 512) within the budget
    while measure(preset, cp, high) <= budget:
        low, high = high, high * 2
    while high - low > 512:
        mid = (low + high) // 1024 * 512
        low, high = (mid, high) if measure(preset, cp, mid) <= budget else (low, mid)
    if rank == 0:
        out.put((cp, table, low))
    if cp > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-10m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--out", default=None, help="also write the table here, as JSON")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for cp in args.cp:
        queue = ctx.Queue()
        budget = args.budget_mib * 2**20
        mp.start_processes(
            rank_main, (cp, free_port(), args.preset, args.lengths, budget, queue), nprocs=cp,
            start_method="spawn",
        )  # fmt: skip
        got_cp, table, fits = queue.get()
        results[got_cp] = (table, fits)
    header = " ".join(f"{n:>10}" for n in args.lengths)
    print(f"activation MiB per rank ({args.preset}, one packed row)")
    print(f"{'cp':>4} {header}  longest in {args.budget_mib} MiB")
    for cp, (table, fits) in results.items():
        row = " ".join(f"{table[n] / 2**20:10.1f}" for n in args.lengths)
        print(f"{cp:>4} {row}  {fits}")
    if args.out:
        rows = [
            {
                "cp": cp,
                "activations_mib": {str(n): table[n] / 2**20 for n in args.lengths},
                "longest_row_within_budget": fits,
            }
            for cp, (table, fits) in results.items()
        ]
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
