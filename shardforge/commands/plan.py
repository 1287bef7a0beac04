"""`shardforge plan`: the layout planner's search, or one config's layout estimated and ranked."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from shardforge.commands.arg_types import at_least
from shardforge.errors import ConfigError


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    import json

    from shardforge.config import load_config
    from shardforge.planner.hardware import PRESETS

    if args.list_hardware:
        for name, d in PRESETS.items():
            peaks = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in d.peak.items())
            console.print(f"{name:<12} {d.description}; TFLOP/s {peaks}", highlight=False)
        return 0
    if args.config is None:
        raise SystemExit("shardforge plan: give a config (or --list-hardware)")
    from shardforge.models.build import planning_shape
    from shardforge.planner.hardware import cluster_for
    from shardforge.planner.report import as_json, table
    from shardforge.planner.search import Planner

    overrides = [*args.overrides]
    flags = {"preset": args.hardware, "nodes": args.nodes, "devices_per_node": args.devices_per_node}
    overrides += [f"hardware.{k}={v}" for k, v in flags.items() if v is not None]
    config = load_config(args.config, overrides)
    shape = planning_shape(config.model)  # no weights needed
    hardware = config.hardware
    world = hardware.nodes * (hardware.devices_per_node or args.nproc)
    planner = Planner(config, shape, cluster_for(hardware, world))
    if args.estimate:
        return _estimate(planner, world, args.json, console)
    plan = planner.search(keep=args.top)
    if args.json:
        print(json.dumps(as_json(plan), indent=1))
    elif not plan.ranked:
        console.print(f"[red]no layout fits[/]: {plan.rejected}")
        for kind, c in plan.examples.items():
            console.print(f"  {kind}: {c.layout.describe()}: {c.rejected}", highlight=False)
        return 1
    else:
        table(plan, console)
    return 0 if plan.ranked else 1


def _estimate(planner: Any, world: int, as_json: bool, console: Console) -> int:
    """`plan --estimate`: the config's explicit layout on the planned cluster (its rules first), and where
    it ranks among the searched layouts."""
    import json

    from shardforge.planner.layout import layout_of
    from shardforge.planner.report import candidate_json, estimate_table, standing

    if planner.cfg.parallel.auto:
        raise ConfigError("plan --estimate: the config says parallel: auto; give it a layout to estimate")
    estimate = planner.evaluate(layout_of(planner.cfg, world))
    if estimate.kind == "rules":
        raise ConfigError(f"the config's layout breaks a rule: {estimate.rejected}")
    plan = planner.search(keep=10**9)  # every layout that fits, to rank this one among
    if as_json:
        answer = {"estimate": candidate_json(estimate), "standing": standing(estimate, plan),
                  "best": candidate_json(plan.best) if plan.ranked else None}  # fmt: skip
        print(json.dumps(answer, indent=1))
    else:
        estimate_table(estimate, plan, console)
    return 0 if estimate.fits else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge plan`: the flags, and the handler as `func`."""
    p_plan = sub.add_parser(
        "plan",
        help="choose a parallel layout: memory and step time of the best ones, and why (docs/planner.md)",
    )
    p_plan.add_argument("config", nargs="?", help="path to the YAML config")
    p_plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=8192")
    p_plan.add_argument("--hardware", help="a device preset (see --list-hardware); default: this machine's")
    p_plan.add_argument("--nodes", type=at_least(1), help="nodes of the cluster planned for")
    p_plan.add_argument("--devices-per-node", type=at_least(1), help="devices per node")
    p_plan.add_argument("--nproc", type=at_least(1), default=1, help="processes here, without --nodes")
    p_plan.add_argument("--top", type=at_least(1), default=5, help="layouts shown")
    p_plan.add_argument("--json", action="store_true", help="machine-readable output")
    p_plan.add_argument(
        "--estimate",
        action="store_true",
        help="estimate the config's own parallel layout (memory and time by part) and rank it among the rest",
    )
    p_plan.add_argument("--list-hardware", action="store_true", help="the device presets and their figures")
    p_plan.set_defaults(func=_cmd_plan)
