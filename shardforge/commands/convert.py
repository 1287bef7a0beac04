"""`shardforge convert`: a LLaMA-Factory YAML as a shardforge config, or the command doing what it does."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardforge.errors import ConfigError


def _cmd_convert(args: argparse.Namespace, console: Console) -> int:
    """A LLaMA-Factory YAML as a shardforge config: printed (or written with --to), checked by the schema."""
    from pathlib import Path

    import yaml

    from shardforge.config import load_config
    from shardforge.config.lf_convert import convert_lf

    source = Path(args.source)
    if not source.is_file():
        raise ConfigError(f"{source}: no such LLaMA-Factory config file")
    lf = yaml.safe_load(source.read_text()) or {}
    if not isinstance(lf, dict):
        raise ConfigError(f"{source}: a LLaMA-Factory config is a YAML mapping of keys to values")
    out = convert_lf(lf)
    if out.unsupported and not args.allow_unsupported:
        console.print(
            f"{source}: LLaMA-Factory keys shardforge cannot honour (the run would train something else):",
            highlight=False, markup=False,
        )  # fmt: skip
        for item in out.unsupported:
            console.print(f"  {item}", highlight=False, markup=False)
        console.print(
            "remove them, or convert anyway with --allow-unsupported (they are then listed in the config)"
        )
        return 2
    if out.command is not None:  # a merge / export or inference YAML
        for item in out.unsupported:
            console.print(f"[yellow]warning:[/] not carried over: {item}", highlight=False)
        console.print(
            f"{source} is not a training run; the shardforge command doing what it does:\n{out.command}"
        )
        return 0
    load_config(None, base=out.config)  # a key or value the schema refuses is an error here, with its name
    lines = [f"# converted from {source} (LLaMA-Factory) by shardforge convert"]
    lines += [f"# note: {n}" for n in out.notes]
    lines += [f"# UNSUPPORTED (--allow-unsupported), not honoured: {k}" for k in out.unsupported]
    text = "\n".join(lines) + "\n" + yaml.safe_dump(out.config, sort_keys=False)
    if args.to:
        Path(args.to).write_text(text)
        console.print(f"wrote {args.to}", highlight=False)
    else:
        console.print(text, highlight=False, markup=False, end="")
    for item in out.unsupported:
        console.print(f"[yellow]warning:[/] not honoured: {item}", highlight=False)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge convert`: the flags, and the handler as `func`."""
    p_convert = sub.add_parser("convert", help="a LLaMA-Factory training YAML as a shardforge config")
    p_convert.add_argument("source", help="the LLaMA-Factory YAML")
    p_convert.add_argument("--to", help="write the config here (default: print it)")
    p_convert.add_argument(
        "--allow-unsupported", action="store_true",
        help="convert even where LLaMA-Factory keys have no counterpart (listed in the config)",
    )  # fmt: skip
    p_convert.set_defaults(func=_cmd_convert)
