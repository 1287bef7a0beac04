"""The `shardforge` command. Thin: assembles the parser from shardforge/commands/ (one module per command),
then runs the chosen command's handler with errors a user can act on."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console
from rich.text import Text

from shardforge.commands import convert, data, env, evaluate, export, generate, launch, plan, train, webui
from shardforge.commands.train import agent_mode
from shardforge.errors import ShardforgeError


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, from its own module, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(
        prog="shardforge", description="Train and fine-tune LLMs, HF checkpoints in and out."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (train, launch, plan, export, convert, data, generate, evaluate, webui, env):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Overrides may come before or after options (`train cfg.yaml --nproc 2 train.lr=1e-3`).
    args, extra = parser.parse_known_args(argv)
    args.argv = argv  # what a command relaunches as ranks
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from shardforge.launch import already_a_rank

    try:
        # Under srun with a task per rank, turn SLURM's variables into torch's before anything reads RANK (not
        # for a node's agent: srun runs one per node, and the ranks it starts get theirs from torch elastic).
        already_a_rank(translate=not agent_mode(args))
        console = Console(soft_wrap=True, quiet=os.environ.get("RANK", "0") != "0")  # one voice per job
        return args.func(args, console)
    except ShardforgeError as exc:
        if args.debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # under a launcher every rank fails alike: say it once
            Console(stderr=True, soft_wrap=True).print(Text("error: ", style="bold red") + Text(str(exc)))
        return 2
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
