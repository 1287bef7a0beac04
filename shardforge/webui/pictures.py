"""What the web UI draws, as data first (tables the tests check and screen readers read) and then as
pictures: the planner's layouts (memory per device by part against the device's memory, step time by
part), a run's curves (several runs overlaid) and the data preview's length histogram."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from shardforge.planner.hardware import GIB
from shardforge.planner.report import DEVICE_PARTS
from shardforge.planner.search import Plan

# The curves of the Runs tab: one plot each (drawn where it has points), every chosen run a line in it.
CURVES = {
    "loss": ("loss", "eval_loss"),
    "reward": ("reward_mean",),
    "learning rate": ("lr",),
    "tokens/s": ("tokens_per_s",),
    "MFU": ("mfu",),
}


def layout_names(plan: Plan) -> list[str]:
    """The ranked layouts as the planner's table numbers them."""
    return [f"#{i} {c.layout.describe()}" for i, c in enumerate(plan.ranked, 1)]


def plan_rows(plan: Plan) -> list[dict[str, Any]]:
    """Per ranked layout and part: GiB per device and seconds per step (what the chart draws)."""
    rows = []
    for name, c in zip(layout_names(plan), plan.ranked, strict=True):
        assert c.memory is not None and c.time is not None  # ranked layouts were evaluated
        breakdown = c.memory.breakdown()
        rows += [
            {"layout": name, "what": "memory GiB", "part": k, "value": round(breakdown[k] / GIB, 4)}
            for k in DEVICE_PARTS
            if breakdown[k]
        ]
        rows += [
            {"layout": name, "what": "step s", "part": k, "value": round(v, 6)}
            for k, v in sorted(c.time.parts.items())
            if v
        ]
    return rows


def plan_figure(plan: Plan) -> Any:
    """Stacked bars per layout: memory per device by part with the device's memory as a line, and the
    estimated step time by part."""
    rows = plan_rows(plan)
    layouts = layout_names(plan)
    fig, (mem_ax, time_ax) = _figure(2, width=11)
    for ax, what, unit in ((mem_ax, "memory GiB", "GiB per device"), (time_ax, "step s", "seconds per step")):
        parts = list(dict.fromkeys(r["part"] for r in rows if r["what"] == what))
        bottom = [0.0] * len(layouts)
        for part in parts:
            value = {r["layout"]: r["value"] for r in rows if r["what"] == what and r["part"] == part}
            heights = [value.get(name, 0.0) for name in layouts]
            ax.bar(range(len(layouts)), heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(range(len(layouts)), [name.split(" ")[0] for name in layouts])
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    have = plan.cluster.device.memory_gib
    mem_ax.axhline(have, color="black", linestyle="--", linewidth=1)
    mem_ax.annotate(
        f"device {have:.1f} GiB", (0, have), xytext=(0, 3), textcoords="offset points", fontsize=8
    )
    mem_ax.set_title("memory per device by part")
    time_ax.set_title("estimated step time by part")
    fig.tight_layout()
    return fig


def _figure(columns: int, lines: int = 1, width: float = 10, height: float = 3.6) -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure becomes an image
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(lines, columns, figsize=(width, height))
    plt.close(fig)  # the UI holds it; pyplot need not
    return fig, axes


def curve_rows(runs: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """Per plot of CURVES: (step, series, value) rows of each named run's metrics.jsonl; with more than one
    run, a series is named by its run too."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in CURVES}
    for label, run_dir in runs.items():
        for record in _records(run_dir / "metrics.jsonl"):
            for plot, keys in CURVES.items():
                for key in keys:
                    if isinstance(record.get(key), int | float) and "step" in record:
                        series = key if len(runs) == 1 else f"{label}: {key}"
                        out[plot].append({"step": record["step"], "series": series, "value": record[key]})
    return out


def curves_figure(rows: dict[str, list[dict[str, Any]]]) -> Any:
    """One plot per curve that has points (the loss always), every series a line in it."""
    plots = [name for name, points in rows.items() if points or name == "loss"]
    columns = min(3, len(plots))
    lines = -(-len(plots) // columns)
    fig, _axes = _figure(columns, lines, width=12 if columns == 3 else 4.2 * columns, height=3.2 * lines)
    for ax in fig.axes[len(plots) :]:
        ax.set_visible(False)
    for ax, name in zip(fig.axes, plots, strict=False):
        for series in dict.fromkeys(r["series"] for r in rows[name]):
            points = [(r["step"], r["value"]) for r in rows[name] if r["series"] == series]
            ax.plot(*zip(*points, strict=True), marker="." if len(points) < 3 else None, label=series)
        ax.set_title(name)
        ax.set_xlabel("step")
        if rows[name]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def latest(rows: dict[str, list[dict[str, Any]]]) -> str:
    """Each series' last point in words: the curves' text (for screen readers, and what tests read)."""
    last = {r["series"]: r for points in rows.values() for r in points}
    return "; ".join(f"{name} {r['value']:.4g} at step {r['step']}" for name, r in last.items())


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def length_bins(lengths: list[int], bins: int = 20) -> list[dict[str, Any]]:
    """Histogram rows (from, to, records) of token lengths, up to the longest."""
    top = max([*lengths, 1])
    width = max(1, -(-top // bins))
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n // width] = counts.get(n // width, 0) + 1
    return [
        {"from": b * width, "to": (b + 1) * width - 1, "records": counts.get(b, 0)}
        for b in range(top // width + 1)
    ]


def length_figure(lengths: list[int], max_length: int) -> Any:
    """Records by token length, with data.max_length marked (longer records are cut there)."""
    fig, ax = _figure(1, width=8, height=3)
    rows = length_bins(lengths)
    ax.bar([r["from"] for r in rows], [r["records"] for r in rows], width=rows[0]["to"] - rows[0]["from"] + 1,
           align="edge", color="#1f77b4")  # fmt: skip
    ax.axvline(max_length, color="black", linestyle="--", linewidth=1)
    ax.annotate(f"max_length {max_length}", (max_length, 0), xytext=(-4, 4), textcoords="offset points",
                fontsize=8, ha="right", rotation=90)  # fmt: skip
    ax.set_xlabel("tokens per record (its first sequence)")
    ax.set_ylabel("records")
    ax.set_title(f"lengths of {len(lengths)} records")
    fig.tight_layout()
    return fig


def table_html(rows: list[dict[str, Any]], caption: str) -> str:
    """Rows as a plain HTML table: a chart's figures for screen readers (and for the tests)."""
    if not rows:
        return ""
    head = "".join(f"<th scope='col'>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows
    )
    table = f"<caption>{html.escape(caption)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody>"
    return f"<table class='sf-figures'>{table}</table>"
