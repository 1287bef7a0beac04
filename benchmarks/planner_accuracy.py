"""The planner's estimates against what runs measure, on CPU layouts of 1-4 gloo processes (issue 19).

Per row (a layout of one job): model-state bytes on every rank (estimate: the planner's count for that rank's
coordinates; measured: `memory_report` after the first step), activation bytes on rank 0 (estimate: the cost
model for this layout; measured: `activation_report` of one training forward, for a pipeline the first
stage's forward of one pipeline micro-batch), and the step time (estimate: the planner's; measured: the
median of steps 3..N, each rank timing its own steps between barriers). Then how often the planner orders two
layouts of the same job as the measurements do.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner_accuracy.py [--steps 8] [--rows NAME,NAME]

Each rank gets cores / processes threads (the CPU preset's assumption). Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist._harness import run_ranks  # noqa: E402

DATA = ROOT / "examples" / "data"
BASE = {
    "model": {"preset": "demo", "tokenizer": str(DATA / "tokenizer")},
    "data": {"train": [{"path": str(DATA / "demo_alpaca.jsonl"), "format": "alpaca"}], "max_length": 256},
    "train": {"lr": 1e-3, "warmup": 0, "global_batch": 8, "micro_batch": 8, "log_every": 1000},
    "checkpoint": {"save_final": False, "resume": "none"},
    "log": {"tensorboard": False, "plot": False, "progress": False},
}
MOE = {"model": {"preset": "tiny-qwen3-moe", "tokenizer": str(DATA / "tokenizer")}}
LORA = {"method": {"finetuning": "lora"}}

# (name, job, processes, config changes): rows of one job share model, method and global batch.
ROWS = [
    ("1p", "demo", 1, {}),
    ("1p ckpt=selective", "demo", 1, {"parallel": {"activation_checkpoint": "selective"}}),
    ("1p ckpt=full", "demo", 1, {"parallel": {"activation_checkpoint": "full"}}),
    ("1p mb=2x4", "demo", 1, {"train": {"micro_batch": 2}}),
    ("DDP 2", "demo", 2, {"train": {"micro_batch": 4}}),
    ("ZeRO-1 2", "demo", 2, {"train": {"micro_batch": 4}, "parallel": {"zero_stage": 1}}),
    ("ZeRO-2 2", "demo", 2, {"train": {"micro_batch": 4}, "parallel": {"zero_stage": 2}}),
    ("ZeRO-3 2", "demo", 2, {"train": {"micro_batch": 4}, "parallel": {"zero_stage": 3}}),
    ("ZeRO-3 2 ckpt=full", "demo", 2,
     {"train": {"micro_batch": 4}, "parallel": {"zero_stage": 3, "activation_checkpoint": "full"}}),
    ("TP 2 sp", "demo", 2, {"parallel": {"tp": 2}}),
    ("TP 2", "demo", 2, {"parallel": {"tp": 2, "sequence_parallel": False}}),
    ("PP 2 1f1b", "demo", 2, {"parallel": {"pp": 2, "pp_microbatches": 4}}),
    ("CP 2", "demo", 2, {"train": {"micro_batch": 8}, "parallel": {"cp": 2, "dp_replicate": 1}}),
    ("ZeRO-3 4", "demo", 4, {"train": {"micro_batch": 2}, "parallel": {"zero_stage": 3}}),
    ("TP 2 x ZeRO-3 2", "demo", 4, {"train": {"micro_batch": 4}, "parallel": {"tp": 2, "zero_stage": 3}}),
    ("1p LoRA", "lora", 1, LORA),
    ("ZeRO-3 2 LoRA", "lora", 2, {**LORA, "train": {"micro_batch": 4}, "parallel": {"zero_stage": 3}}),
    ("1p MoE", "moe", 1, MOE),
    ("EP 2 MoE", "moe", 2, {**MOE, "train": {"micro_batch": 4}, "parallel": {"zero_stage": 3, "ep": 2}}),
]  # fmt: skip


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _rank(cfg_dict: dict, steps: int, threads: int) -> dict:
    """On each rank: train `steps` steps timing each, then measure one forward's activations."""
    import torch
    import torch.distributed as dist

    from shardforge.config import load_config
    from shardforge.planner.memory import MemoryModel
    from shardforge.planner.model_states import coords_of
    from shardforge.train.trainer import Trainer

    torch.set_num_threads(threads)
    trainer = Trainer(load_config(None, base=cfg_dict))
    trainer.setup()
    rank = dist.get_rank() if dist.is_initialized() else 0
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    run, estimate = trainer.run, trainer.run.estimate
    stages = run.plan.layers if run.plan is not None else None
    counted = MemoryModel(run.config, run.model_config, run.costs).counter.count(
        estimate.layout, coords_of(estimate.layout, rank), stages
    )
    out = {
        "times": times,
        "measured_states": {
            k: trainer.memory.get(k, 0) for k in ("param_bytes", "grad_bytes", "optim_bytes")
        },
        "counted_states": {
            "param_bytes": counted.params,
            "grad_bytes": counted.grads,
            "optim_bytes": counted.optimizer,
        },
        "planned_time": estimate.time.total,
        "planned_parts": estimate.time.parts,
    }
    out.update(_activations(trainer, run, estimate))  # every rank: the forward's collectives need them all
    return out


def _activations(trainer, run, estimate) -> dict:
    """Rank 0's activations of one training forward, measured and estimated for the same piece."""
    import torch

    from shardforge.parallel import activation_report
    from shardforge.parallel.tensor_parallel import loss_context
    from shardforge.planner.memory import MemoryModel

    mb = trainer.loader.next().micro[0].to(run.device)
    model = MemoryModel(run.config, run.model_config, run.costs)
    layout = estimate.layout
    if run.plan is None:
        with loss_context(run.dims):
            report = activation_report(trainer.engine.model, functools.partial(trainer.engine._sums, mb))
        scored = mb.num_targets / mb.input_ids.numel()  # the head's share of this batch's positions
        return {"measured_act": report.total_bytes, "planned_act": model.activations(layout, None, scored)}
    # a pipeline: the first stage's forward of one pipeline micro-batch (its rows of the micro-step)
    if run.dims.pp_rank(run.mesh) != 0:
        return {}
    part = trainer.engine.inner
    rows = mb.input_ids.shape[0] // run.plan.microbatches
    ids = mb.input_ids[:rows]
    positions = getattr(mb, "position_ids", None)
    kwargs = {"position_ids": positions[:rows]} if positions is not None else {}
    with torch.enable_grad():
        report = activation_report(part, lambda: part(ids, **kwargs))
    per = run.costs.activation_bytes(layout.activation_checkpoint, model.act_dtype_bytes, layout.tp,
                                     layout.sequence_parallel)  # fmt: skip
    stage = per.stage(run.plan.layers[0], last=False)
    tokens = ids.numel()
    return {"measured_act": report.total_bytes, "planned_act": stage.total(tokens, 0), "act_note": "stage 0"}


def measure(name: str, job: str, nproc: int, change: dict, steps: int, out: Path) -> dict:
    cfg = merged(
        merged(BASE, change), {"output_dir": str(out / name.replace(" ", "_")), "train": {"steps": steps + 2}}
    )
    threads = max(1, (os.cpu_count() or 1) // nproc)
    if nproc == 1:
        per_rank = [_rank(cfg, steps, threads)]
    else:
        per_rank = run_ranks(_rank, nproc, cfg, steps, threads, timeout=900)
    first = per_rank[0]
    step = statistics.median(max(r["times"][i] for r in per_rank) for i in range(2, steps))
    exact = all(r["measured_states"] == r["counted_states"] for r in per_rank)
    return {
        "name": name,
        "job": job,
        "nproc": nproc,
        "states_exact": exact,
        "states": [(r["measured_states"], r["counted_states"]) for r in per_rank],
        "measured_act": first["measured_act"],
        "planned_act": first["planned_act"],
        "act_note": first.get("act_note", ""),
        "measured_step": step,
        "planned_step": first["planned_time"],
        "planned_parts": first["planned_parts"],
    }


def concordance(rows: list[dict]) -> tuple[int, int]:
    """Pairs of layouts of one job that the planner orders as the measurements do, out of all pairs."""
    agree = total = 0
    for a, b in itertools.combinations(rows, 2):
        if a["job"] != b["job"]:
            continue
        total += 1
        agree += (a["planned_step"] < b["planned_step"]) == (a["measured_step"] < b["measured_step"])
    return agree, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    wanted = set(args.rows.split(",")) if args.rows else None
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, job, nproc, change in ROWS:
            if wanted and name not in wanted:
                continue
            r = measure(name, job, nproc, change, args.steps, Path(tmp))
            results.append(r)
            act = r["measured_act"] / r["planned_act"]
            step = r["measured_step"] / r["planned_step"]
            print(
                f"{name:<22} states {'exact' if r['states_exact'] else 'DIFFER'}  activations "
                f"{r['measured_act'] / 2**20:7.2f} / {r['planned_act'] / 2**20:7.2f} MiB (x{act:.3f}) "
                f"{r['act_note']:<8} step {r['measured_step'] * 1e3:7.1f} / "
                f"{r['planned_step'] * 1e3:7.1f} ms "
                f"(x{step:.2f})",
                flush=True,
            )
            if not r["states_exact"]:
                print("   ", r["states"])
    agree, total = concordance(results)
    act_err = max(abs(r["measured_act"] / r["planned_act"] - 1) for r in results)
    step_err = [abs(r["measured_step"] / r["planned_step"] - 1) for r in results]
    print(
        f"model states exact on {sum(r['states_exact'] for r in results)}/{len(results)} rows; activations "
        f"within {act_err:.1%} on every row; step time within {max(step_err):.1%} "
        f"(mean {statistics.mean(step_err):.1%}); "
        f"ranking agrees on {agree}/{total} pairs ({agree / max(total, 1):.0%})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
