"""`shardforge export`, `expand` and `loftq`: commands that write an HF model folder from another."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardforge.commands.arg_types import at_least


def _cmd_export(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from shardforge.checkpoint.export import export
    from shardforge.log import log_to_console

    log_to_console(console)  # a damaged checkpoint skipped is a warning
    base = Path(args.base) if args.base else None
    checkpoint, out, what = export(Path(args.source), Path(args.to), args.merge, base)
    console.print(f"exported {checkpoint} to {out}: {what}, with the tokenizer")
    return 0


def _cmd_expand(args: argparse.Namespace, console: Console) -> int:
    """LLaMA Pro's block expansion of an HF folder (LLaMA-Factory's scripts/llama_pro.py)."""
    from pathlib import Path

    from shardforge.models.expand import expand_blocks

    folder = expand_blocks(Path(args.model), Path(args.to), args.blocks)
    console.print(
        f"expanded {args.model} by {args.blocks} blocks into {folder}; train the new blocks with "
        f"model.path={folder} method.finetuning=freeze method.freeze.llama_pro=true "
        f"method.freeze.trainable_layers={args.blocks}"
    )
    return 0


def _cmd_loftq(args: argparse.Namespace, console: Console) -> int:
    """LoftQ's base and adapter for QLoRA (LLaMA-Factory's scripts/loftq_init.py)."""
    from pathlib import Path

    from shardforge.adapters.loftq import ADAPTER, loftq_folder

    targets = tuple(t for t in args.targets.split(",") if t)
    folder = loftq_folder(Path(args.model), Path(args.to), args.rank, args.alpha, targets, args.iter)
    alpha = args.alpha or 2 * args.rank
    console.print(
        f"wrote the LoftQ base to {folder} and its adapter to {folder / ADAPTER}; train them as QLoRA with "
        f"model.path={folder} model.adapter={folder / ADAPTER} model.quantize=nf4 method.finetuning=lora "
        f"method.lora.rank={args.rank} method.lora.alpha={alpha} method.lora.targets=[{','.join(targets)}]"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge export`, `expand` and `loftq`: the flags, and the handler as `func`."""
    p_export = sub.add_parser(
        "export", help="write a training checkpoint (any layout) as a Hugging Face folder, in one process"
    )
    p_export.add_argument(
        "source",
        help="a checkpoint folder, a run folder (its newest complete checkpoint, else its final/), or a PEFT "
        "adapter folder",
    )
    p_export.add_argument("--to", required=True, help="the folder to write")
    p_export.add_argument(
        "--merge", action="store_true", help="LoRA: merge the adapters into the base (a plain HF folder)"
    )
    p_export.add_argument(
        "--base", default=None, help="a PEFT adapter's base folder (default: its base_model_name_or_path)"
    )
    p_export.set_defaults(func=_cmd_export)
    p_expand = sub.add_parser(
        "expand", help="LLaMA Pro: add zero-output copies of decoder blocks to an HF model folder"
    )
    p_expand.add_argument("model", help="the HF model folder to expand")
    p_expand.add_argument(
        "--blocks", type=at_least(1), required=True, help="blocks to add (a divisor of the layers)"
    )
    p_expand.add_argument("--to", required=True, help="the folder to write")
    p_expand.set_defaults(func=_cmd_expand)
    p_loftq = sub.add_parser("loftq", help="LoftQ: a 4-bit base and a LoRA adapter that start near the model")
    p_loftq.add_argument("model", help="the HF model folder")
    p_loftq.add_argument("--to", required=True, help="the folder to write (the base; its adapter inside)")
    p_loftq.add_argument(
        "--rank", type=at_least(1), default=16, help="LoRA rank (LLaMA-Factory's default 16)"
    )
    p_loftq.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: twice the rank)")
    p_loftq.add_argument("--targets", default="q_proj,v_proj", help="the adapted linears, comma-separated")
    p_loftq.add_argument("--iter", type=at_least(1), default=4, help="alternating rounds (LF's default 4)")
    p_loftq.set_defaults(func=_cmd_loftq)
