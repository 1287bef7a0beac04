"""`shardforge data prepare`: a config's data tokenized into the cache ahead of a job, with statistics."""

from __future__ import annotations

import argparse

from rich.console import Console


def _cmd_data_prepare(args: argparse.Namespace, console: Console) -> int:
    from shardforge.config import load_config
    from shardforge.data.build import prepare_data
    from shardforge.log import log_to_console
    from shardforge.objectives import build_objective, reading_of

    config = load_config(args.config, args.overrides)
    objective = build_objective(config.method)
    log_to_console(console)
    report = prepare_data(config, objective, reading_of(objective, config.data.default_system))
    for what, stats in report.items():
        histogram = stats.pop("length_histogram")
        console.print(
            f"{what}: "
            + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())
        )
        console.print(
            f"{what} sequence lengths (tokens: count): "
            + ", ".join(f"{k}: {v}" for k, v in histogram.items())
        )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge data prepare`: the flags, and the handler as `func`."""
    p_data = sub.add_parser("data", help="data utilities")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p_prepare = data_sub.add_parser(
        "prepare",
        help="tokenize a config's data into the dataset cache ahead of a job and print its statistics",
    )
    p_prepare.add_argument("config", help="path to the YAML config")
    p_prepare.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=2048")
    p_prepare.set_defaults(func=_cmd_data_prepare)
