"""Where a profiled step's time went, read from the Chrome trace torch.profiler wrote: compute, each kind of
collective, data loading, the optimizer and idle, per step, adding up to the step's wall time.

The trainer marks its steps and phases with `record_function` ("shardforge.step", ".data", ".optimizer").
Every instant of a step is given to exactly one category, in this order:
- on the CPU (the rank's own thread runs the math; gloo runs collectives on its worker threads): data
  (waiting for the batch) > compute (an operator is running; inside the optimizer phase it counts as
  optimizer) > communication in flight with nothing else running (exposed, by kind) > optimizer phase
  overhead > idle;
- on CUDA (kernels): compute kernels > collective kernels (exposed, by kind) > data > optimizer > idle.
So communication overlapped by compute is not exposed; what is left over is idle (Python overhead, a
pipeline bubble waiting on a peer). Each kind's total in-flight time, overlapped or not, is reported too."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "other_comm")
CATEGORIES = ("compute", *COMM_KINDS, "data", "optimizer", "idle")
STEP, DATA, OPTIMIZER = "shardforge.step", "shardforge.data", "shardforge.optimizer"

# Substrings of c10d operator names (c10d::allreduce_, _c10d_functional::all_gather_into_tensor, ...), gloo
# worker events (gloo:all_gather) and NCCL kernels (ncclDevKernel_ReduceScatter_Sum_f32_RING_LL) -> kind.
_KIND_PATTERNS = (
    ("reduce_scatter", "reduce_scatter"),
    ("reducescatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
    ("sendrecv", "send_recv"),
    ("send", "send_recv"),
    ("recv", "send_recv"),
    ("broadcast", "other_comm"),
    ("barrier", "other_comm"),
    ("gather", "other_comm"),
    ("scatter", "other_comm"),
    ("reduce", "other_comm"),
)


def comm_kind(name: str) -> str | None:
    """The collective an event is part of, or None when it is not communication."""
    low = name.lower()
    if not (low.startswith(("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:")) or "nccl" in low):
        return None
    if "wrap_tensor_autograd" in low:  # functional collectives' autograd wrapper: not communication
        return None
    if "wait" in low:  # a functional collective's wait: its kind is the collective it waits for
        return "wait"
    key = low.replace("ncclkernel_", "").replace("nccldevkernel_", "")
    for pattern, kind in _KIND_PATTERNS:
        if pattern in key:
            return kind
    return "other_comm"


@dataclass
class StepBreakdown:
    """One rank's mean step, in milliseconds per category; `comm_total` counts overlapped time too."""

    rank: int
    steps: int
    step_ms: float
    categories: dict[str, float] = field(default_factory=dict)
    comm_total: dict[str, float] = field(default_factory=dict)
    wall_ms: float = 0.0  # the step as the trainer's clock measured it, for comparison with the trace

    @property
    def exposed_comm_share(self) -> float:
        return sum(self.categories[k] for k in COMM_KINDS) / self.step_ms if self.step_ms else 0.0

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "steps": self.steps,
            "step_ms": self.step_ms,
            "categories_ms": self.categories,
            "comm_in_flight_ms": self.comm_total,
            "exposed_comm_share": self.exposed_comm_share,
            "wall_ms": self.wall_ms,
        }


Interval = tuple[float, float, str]  # start, end (microseconds), label


def breakdown(events: list[dict], rank: int = 0) -> StepBreakdown:
    """The mean profiled step of one rank's Chrome trace events (`traceEvents` of export_chrome_trace)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in spans if e["name"] == STEP), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"the trace has no '{STEP}' spans: nothing was profiled")
    main = steps[0]["tid"]
    on_device = any(e.get("cat") == "kernel" for e in spans)
    intervals = _device_intervals(spans, main) if on_device else _cpu_intervals(spans, main)
    order = (
        ("compute", "comm", "data", "optimizer") if on_device else ("data", "compute", "comm", "optimizer")
    )
    totals = dict.fromkeys(CATEGORIES, 0.0)
    in_flight = dict.fromkeys(COMM_KINDS, 0.0)
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        for label, us in _classify(intervals, start, end, order).items():
            totals[label] += us
        for kind in COMM_KINDS:
            in_flight[kind] += _union([(s, e) for s, e, k in intervals if k == kind], start, end)
    n = len(steps)
    step_ms = sum(s["dur"] for s in steps) / n / 1e3
    return StepBreakdown(
        rank,
        n,
        step_ms,
        {k: v / n / 1e3 for k, v in totals.items()},
        {k: v / n / 1e3 for k, v in in_flight.items()},
    )


def _cpu_intervals(spans: list[dict], main: int) -> list[Interval]:
    """The rank's thread: annotations, and at each instant its innermost operator (compute, or a c10d call
    or wait: communication); gloo's worker threads: the collectives themselves, each of the kind of the last
    c10d call the rank issued before it started. Innermost, because a DTensor operator (a norm, say) issues
    and waits for its collective inside its own span."""
    out: list[Interval] = []
    ops: list[Interval] = []
    issued: list[tuple[float, str]] = []  # (start, kind) of the rank's c10d calls
    workers: list[dict] = []
    for e in spans:
        start, end, name = e["ts"], e["ts"] + e["dur"], e["name"]
        kind = comm_kind(name)
        if e["tid"] != main:
            if kind is not None:
                workers.append(e)
        elif name in (DATA, OPTIMIZER):
            out.append((start, end, "data" if name == DATA else "optimizer"))
        elif kind is not None:
            if kind != "wait":
                issued.append((start, kind))
            ops.append((start, end, kind))
        elif e.get("cat") == "cpu_op" and name != "record_param_comms":  # that one marks a collective
            ops.append((start, end, "compute"))
    issued.sort()
    out += _resolve_waits(_innermost(ops), issued)
    for e in workers:
        earlier = [k for s, k in issued if s <= e["ts"]]
        kind = earlier[-1] if earlier else comm_kind(e["name"])
        out.append((e["ts"], e["ts"] + e["dur"], "other_comm" if kind in (None, "wait") else kind))
    return out


def _innermost(ops: list[Interval]) -> list[Interval]:
    """Nested spans of one thread -> disjoint spans, each instant labelled by the innermost span."""
    out: list[Interval] = []
    stack: list[tuple[float, str]] = []  # (end, label), outermost first
    t = 0.0
    for start, end, label in sorted(ops, key=lambda o: (o[0], -o[1])):
        while stack and stack[-1][0] <= start:
            t = _emit(out, t, *stack.pop())
        if stack and start > t:
            out.append((t, start, stack[-1][1]))
        t = start
        stack.append((min(end, stack[-1][0]) if stack else end, label))
    while stack:
        t = _emit(out, t, *stack.pop())
    return out


def _emit(out: list[Interval], t: float, end: float, label: str) -> float:
    if end > t:
        out.append((t, end, label))
    return max(t, end)


def _device_intervals(spans: list[dict], main: int) -> list[Interval]:
    """Kernels (compute or NCCL by name), the CPU's data phase, and the GPU ranges of the optimizer phase."""
    out: list[Interval] = []
    for e in spans:
        start, end, name, cat = e["ts"], e["ts"] + e["dur"], e["name"], e.get("cat")
        if cat == "kernel":
            out.append((start, end, comm_kind(name) or "compute"))
        elif name == DATA and e["tid"] == main:
            out.append((start, end, "data"))
        elif name == OPTIMIZER and cat == "gpu_user_annotation":
            out.append((start, end, "optimizer"))
    return out


def _resolve_waits(intervals: list[Interval], issued: list[tuple[float, str]]) -> list[Interval]:
    """A wait counts as the kind of the last collective issued before it."""
    out = []
    for start, end, label in intervals:
        if label == "wait":
            earlier = [k for s, k in issued if s <= start]
            label = earlier[-1] if earlier else "other_comm"
        out.append((start, end, label))
    return out


def _classify(intervals: Iterable[Interval], start: float, end: float, order: tuple[str, ...]) -> dict:
    """Give each instant of [start, end) to one category (see the module docstring); the result's values
    add up to end - start."""
    edges: list[tuple[float, int, str]] = []
    for s, e, label in intervals:
        s, e = max(s, start), min(e, end)
        if e > s:
            edges += [(s, 1, label), (e, -1, label)]
    edges.sort(key=lambda x: (x[0], x[1]))
    active = dict.fromkeys((*COMM_KINDS, "compute", "data", "optimizer"), 0)
    out = dict.fromkeys(CATEGORIES, 0.0)
    t = start
    for when, delta, label in edges:
        if when > t:
            out[_label(active, order)] += when - t
            t = when
        active[label] += delta
    out[_label(active, order)] += end - t
    return out


def _label(active: dict[str, int], order: tuple[str, ...]) -> str:
    for what in order:
        if what == "comm":
            for kind in COMM_KINDS:
                if active[kind]:
                    return kind
        elif active[what]:
            if what == "compute" and active["optimizer"]:
                return "optimizer"  # the optimizer phase's own arithmetic
            return what
    return "idle"


def _union(spans: list[tuple[float, float]], start: float, end: float) -> float:
    total, reach = 0.0, start
    for s, e in sorted(spans):
        s, e = max(s, reach), min(e, end)
        if e > s:
            total += e - s
            reach = e
    return total


def table(rows: list[StepBreakdown]) -> str:
    """The per-rank summary as a fixed-width text table (milliseconds per step)."""
    shown = [
        c
        for c in CATEGORIES
        if c in ("compute", "data", "optimizer", "idle") or any(r.categories[c] for r in rows)
    ]
    head = ["rank", "step ms", *shown, "exposed comm"]
    lines = [head]
    for r in rows:
        cells = [str(r.rank), f"{r.step_ms:.1f}", *(f"{r.categories[c]:.1f}" for c in shown)]
        lines.append([*cells, f"{r.exposed_comm_share:.1%}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)
