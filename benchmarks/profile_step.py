"""Where the time of a training step goes, by operator kind and by model part, on a real model.

    python benchmarks/profile_step.py --model MODEL_FOLDER --data alpaca_en_demo.json [--rows 4 --seq 256]
    python benchmarks/profile_step.py --model MODEL_FOLDER --data ... --set train.compile=true

Builds the real trainer (stage sft, the model's chat template, packed rows of --seq tokens, AdamW, fp32) over
the first records of an alpaca-format file, runs --warmup steps, then profiles --steps steps with
torch.profiler. Prints: the step time and its split into matmuls, attention, the LM head's log-softmax and
loss, element-wise passes, copies and layout, the optimizer and the rest (each operator's self time); the
forward time of each model part (embedding, norms, attention, MLP, head), from module hooks; and the top
operators. `--json` writes the same figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# operator (self time) -> kind: the first kind with a pattern (space-separated) that the name contains
KINDS = (
    ("matmul", "aten::mm aten::addmm aten::bmm aten::baddbmm aten::addmv"),
    ("attention", "scaled_dot_product _flash_attention _efficient_attention"),
    ("head log-softmax / loss", "log_softmax nll_loss cross_entropy logsumexp"),
    ("optimizer", "adam _foreach lerp"),
    (
        "copies and layout",
        "copy_ aten::cat index gather scatter clone contiguous aten::to fill_ zero_ empty stack aten::where "
        "masked embedding",
    ),
    (
        "element-wise",
        "aten::mul aten::add aten::sub aten::div aten::neg aten::pow rsqrt aten::mean silu aten::sum "
        "aten::exp "
        "sigmoid aten::sqrt aten::norm threshold aten::max aten::abs clamp",
    ),
)
PARTS = ("embed_tokens", "input_norm", "attn", "post_attn_norm", "mlp", "norm", "lm_head")


def kind_of(name: str) -> str:
    for kind, patterns in KINDS:
        if any(p in name for p in patterns.split()):
            return kind
    return "other"


def build_trainer(args: argparse.Namespace):
    from shardforge.config import load_config
    from shardforge.train.trainer import Trainer

    base = {
        "output_dir": str(Path(args.out_dir)),
        "model": {"path": args.model},
        "data": {
            "train": [{"path": args.data, "format": "alpaca", "max_samples": args.records}],
            "max_length": args.seq,
            "cache": False,
        },
        "train": {
            "steps": args.warmup + args.steps,
            "micro_batch": args.rows,
            "lr": 1e-5,
            "log_every": 10**6,
        },
        "log": {"tensorboard": False, "plot": False, "progress": False},
        "checkpoint": {"save_final": False, "every": 10**6},
        "hardware": {"threads": args.threads},
    }
    trainer = Trainer(load_config(None, args.set, base=base))
    trainer.setup()
    return trainer


def part_hooks(model, times: dict[str, float]) -> None:
    """Forward wall time per model part (summed over the blocks), from pre/post hooks."""
    import torch

    def attach(module, part: str) -> None:
        starts: list[float] = []
        module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

        def done(*_):
            times[part] += time.perf_counter() - starts.pop()

        module.register_forward_hook(done)

    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in PARTS and isinstance(module, torch.nn.Module):
            attach(module, last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF model folder")
    parser.add_argument("--data", required=True, help="an alpaca-format .json/.jsonl file")
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out-dir", default="/tmp/shardforge_profile")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from torch.profiler import ProfilerActivity, profile

    trainer = build_trainer(args)
    for _ in range(args.warmup):
        trainer.train_step()
    parts: dict[str, float] = defaultdict(float)
    part_hooks(trainer.model, parts)
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            _, _, counts = trainer.train_step()
            walls.append(time.perf_counter() - start)
    step = sum(walls) / len(walls)
    ops = defaultdict(float)
    for event in prof.key_averages():
        ops[event.key] += event.self_cpu_time_total / 1e6 / args.steps
    kinds = defaultdict(float)
    for name, seconds in ops.items():
        kinds[kind_of(name)] += seconds
    profiled = sum(kinds.values())
    tokens = counts["tokens"]
    print(
        f"step: {step:.3f} s for {tokens} tokens ({tokens / step:.0f} tokens/s); operator self time "
        f"{profiled:.3f} s (profiler overhead included)"
    )
    print("\n| kind | s / step | share |\n|---|---|---|")
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {seconds:.3f} | {seconds / profiled:.1%} |")
    forward = {k: v / args.steps for k, v in parts.items()}
    print("\n| forward part | s / step |\n|---|---|")
    for part in PARTS:
        if part in forward:
            print(f"| {part} | {forward[part]:.3f} |")
    print("\n| operator | kind | s / step |\n|---|---|---|")
    for name, seconds in sorted(ops.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {name} | {kind_of(name)} | {seconds:.4f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"step_s": step, "tokens": tokens, "kinds": kinds, "forward": forward, "ops": ops})
        )
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main()
