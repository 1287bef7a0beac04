"""The planner's answer for people (a table and the reason for the choice) and for machines (JSON)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from shardforge.planner.hardware import GIB
from shardforge.planner.search import Candidate, Plan

# The parts of a layout's memory on each device, in the order people read them ("host": what offload keeps
# off the device, shown after them).
DEVICE_PARTS = ("params", "grads", "optimizer", "activations", "reference", "buffers", "rollout", "margin")


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def reason(plan: Plan) -> str:
    """Why the first layout: what it needs, how much faster it is than the next, what the others lacked."""
    best = plan.best
    mem, time, have = best.memory, best.time, plan.cluster.device.memory_gib
    parts = [
        f"{best.layout.describe()} fits in {_gib(mem.device_bytes)} of {have:.1f} GiB per device and has the "
        f"shortest estimated step, {time.total:.3g} s ({time.tokens_per_s:,.0f} tokens/s, MFU {time.mfu:.1%})"
    ]
    if len(plan.ranked) > 1:
        other = plan.ranked[1]
        diffs = {
            k: time.parts.get(k, 0) - other.time.parts.get(k, 0)
            for k in set(time.parts) | set(other.time.parts)
        }
        key = min(diffs, key=diffs.get)
        if other.time.total <= time.total * 1.0005:
            parts.append(f"{other.layout.describe()} is as fast; the one with fewer moving parts comes first")
        else:
            parts.append(
                f"the next best, {other.layout.describe()}, takes {other.time.total / time.total:.3f}x as "
                f"long, mostly in {key} ({other.time.parts.get(key, 0):.3g} s against "
                f"{time.parts.get(key, 0):.3g} s)"
            )
    for kind, example in plan.examples.items():
        what = f"{plan.rejected[kind]} layout(s) rejected by {kind}"
        parts.append(f"{what}, e.g. {example.layout.describe()}: {example.rejected}")
    return "; ".join(parts)


def _heading(plan: Plan) -> str:
    unit = f"groups ({plan.batch * plan.group} rows)" if plan.group > 1 else "rows"
    return f"planning for {plan.cluster.describe()}, global batch {plan.batch} {unit}"


def _parts(candidates: list[Candidate], names: list[str]) -> Table:
    """One column per layout: memory and time by part."""
    t = Table(title="per device (GiB) and per step (seconds)", title_justify="left")
    t.add_column("")
    for name in names:
        t.add_column(name, justify="right")
    breakdowns = [c.memory.breakdown() for c in candidates]
    t.add_row("memory GiB", *[_gib(c.memory.device_bytes) for c in candidates], style="bold")
    for k in (*DEVICE_PARTS, "host"):
        if any(b[k] for b in breakdowns):
            t.add_row(f"  {k}", *[_gib(b[k]) for b in breakdowns])
    t.add_row("step s", *[f"{c.time.total:.3g}" for c in candidates], style="bold")
    for k in sorted({k for c in candidates for k in c.time.parts}):
        t.add_row(f"  {k}", *[f"{c.time.parts.get(k, 0):.3g}" for c in candidates])
    t.add_row("tokens/s", *[f"{c.time.tokens_per_s:,.0f}" for c in candidates])
    t.add_row("MFU", *[f"{c.time.mfu:.1%}" for c in candidates])
    return t


def table(plan: Plan, console: Console) -> None:
    """The ranked layouts as numbered lines, then one column per layout: memory and time by part."""
    console.print(f"{_heading(plan)}; searched in {plan.seconds:.2f} s", highlight=False)
    for i, c in enumerate(plan.ranked, 1):
        console.print(f"  #{i}  {c.layout.describe()}", highlight=False)
    console.print(_parts(plan.ranked, [f"#{i + 1}" for i in range(len(plan.ranked))]))
    console.print(f"chosen: {reason(plan)}", highlight=False)
    console.print("run it with: " + " ".join(plan.best.layout.overrides()), highlight=False)


def standing(estimate: Candidate, plan: Plan) -> str:
    """Where a given layout ranks among the searched ones that fit."""
    if not plan.ranked:
        return "no searched layout fits"
    faster = sum(c.time.total < estimate.time.total for c in plan.ranked)
    where = (
        f"it ranks #{faster + 1} among the {len(plan.ranked)} searched layouts that fit"
        if estimate.fits
        else "it does not fit, so it is not among the searched layouts"
    )
    best = plan.best
    return (
        f"{where}; the best, {best.layout.describe()}, takes {best.time.total:.3g} s a step against its "
        f"{estimate.time.total:.3g} s ({estimate.time.total / best.time.total:.3f}x)"
    )


def estimate_table(estimate: Candidate, plan: Plan, console: Console) -> None:
    """`plan --estimate`: the config's own layout, memory and time by part, and where it ranks."""
    console.print(_heading(plan), highlight=False)
    console.print(f"the config's layout: {estimate.layout.describe()}", highlight=False)
    console.print(_parts([estimate], ["estimate"]))
    if estimate.rejected:
        console.print(f"[red]will not run[/]: {estimate.rejected}", highlight=False)
    console.print(standing(estimate, plan), highlight=False)


def candidate_json(c: Candidate) -> dict[str, Any]:
    out: dict[str, Any] = {"layout": c.layout.as_dict(), "describe": c.layout.describe()}
    if c.memory is not None:
        out["memory_bytes"] = {"total": c.memory.device_bytes, **c.memory.breakdown()}
    if c.time is not None:
        out["step_seconds"] = {"total": c.time.total, **c.time.parts}
        out["tokens_per_s"], out["mfu"] = c.time.tokens_per_s, c.time.mfu
    if c.rejected:
        out["rejected"], out["kind"] = c.rejected, c.kind
    return out


def as_json(plan: Plan) -> dict[str, Any]:
    return {
        "cluster": {
            "preset": plan.cluster.device.name,
            "nodes": plan.cluster.nodes,
            "devices_per_node": plan.cluster.devices_per_node,
            "memory_gib": plan.cluster.device.memory_gib,
        },
        "global_batch": plan.batch,
        "ranked": [candidate_json(c) for c in plan.ranked],
        "rejected": dict(plan.rejected),
        "rejected_examples": {k: candidate_json(c) for k, c in plan.examples.items()},
        "reason": reason(plan) if plan.ranked else None,
        "overrides": plan.best.layout.overrides() if plan.ranked else None,
        "seconds": plan.seconds,
    }
