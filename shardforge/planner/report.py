"""The planner's answer for people (a table and the reason for the choice) and for machines (JSON)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from shardforge.planner.hardware import GIB
from shardforge.planner.search import Candidate, Plan


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


def table(plan: Plan, console: Console) -> None:
    """The ranked layouts as numbered lines, then one column per layout: memory and time by part."""
    cluster = plan.cluster
    unit = f"groups ({plan.batch * plan.group} rows)" if plan.group > 1 else "rows"
    what = f"planning for {cluster.describe()}, global batch {plan.batch} {unit}"
    console.print(f"{what}; searched in {plan.seconds:.2f} s", highlight=False)
    for i, c in enumerate(plan.ranked, 1):
        console.print(f"  #{i}  {c.layout.describe()}", highlight=False)
    t = Table(title="per device (GiB) and per step (seconds)", title_justify="left")
    t.add_column("")
    for i in range(len(plan.ranked)):
        t.add_column(f"#{i + 1}", justify="right")
    memory_keys = ["params", "grads", "optimizer", "activations", "reference", "buffers", "rollout", "margin",
                   "host"]  # fmt: skip
    breakdowns = [c.memory.breakdown() for c in plan.ranked]
    t.add_row("memory GiB", *[_gib(c.memory.device_bytes) for c in plan.ranked], style="bold")
    for k in memory_keys:
        if any(b[k] for b in breakdowns):
            t.add_row(f"  {k}", *[_gib(b[k]) for b in breakdowns])
    t.add_row("step s", *[f"{c.time.total:.3g}" for c in plan.ranked], style="bold")
    for k in sorted({k for c in plan.ranked for k in c.time.parts}):
        t.add_row(f"  {k}", *[f"{c.time.parts.get(k, 0):.3g}" for c in plan.ranked])
    t.add_row("tokens/s", *[f"{c.time.tokens_per_s:,.0f}" for c in plan.ranked])
    t.add_row("MFU", *[f"{c.time.mfu:.1%}" for c in plan.ranked])
    console.print(t)
    console.print(f"chosen: {reason(plan)}", highlight=False)
    console.print("run it with: " + " ".join(plan.best.layout.overrides()), highlight=False)


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
