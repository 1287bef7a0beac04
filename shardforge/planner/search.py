"""The search: every layout of the cluster's devices that the engine can build, checked by the same rules the
launcher applies (divisibility, combinations), by topology (TP, CP and EP inside a node) and by memory, then
ranked by estimated step time for the same global batch. Offload is tried only when nothing fits without it.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from shardforge.config.schema import Config
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.models.spec import spec_for
from shardforge.parallel.pipeline_plan import PipelinePlan, balance_layers
from shardforge.planner.hardware import GIB, Cluster, Device
from shardforge.planner.layout import Layout, check_layout, global_batch, sequences_per_group, traits_of
from shardforge.planner.memory import Memory, MemoryModel
from shardforge.planner.timing import StepTime, TimeModel

MAX_MICRO_BATCH = 64
# Rows per pipeline micro-batch the search tries beyond one (Narayanan et al. 2021 sweep 1 to 8): a larger
# one runs fuller GEMMs and fewer per-micro-batch hops at the price of a longer bubble.
PIPELINE_ROWS = (2, 4, 8)
# Context parallel is searched for long sequences only: below this, chunks of a few hundred tokens per rank
# run attention kernels far below their efficiency and unbalanced, which the time model does not price
# (Megatron's guidance is the same); TP and PP split the activations of shorter rows.
MIN_CP_LENGTH = 8192


@dataclass
class Candidate:
    layout: Layout
    memory: Memory | None = None
    time: StepTime | None = None
    rejected: str | None = None  # why it cannot run
    kind: str = ""  # rules | topology | memory

    @property
    def fits(self) -> bool:
        return self.rejected is None


@dataclass
class Plan:
    """The ranked layouts that fit, and what was rejected and why."""

    cluster: Cluster
    batch: int
    ranked: list[Candidate]
    rejected: Counter = field(default_factory=Counter)  # kind -> count
    examples: dict[str, Candidate] = field(default_factory=dict)  # kind -> the rejected layout nearest to fit
    seconds: float = 0.0
    group: int = 1  # rows per group of the stage (a DPO pair: 2; an RL prompt: its completions)

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


def cpu_device(cfg: Config, shape: Any, cluster: Cluster, measure: bool) -> Device:
    """The CPU preset for this machine's processes: they share its cores (`hardware.threads` each, or cores
    / processes), so beyond one process per core memory bandwidth falls and overheads and collective
    latencies grow by processes / cores. `measure`: the matmul rate is planner/peak.py's cached probe at the
    model's shapes, shared likewise (else the preset's, or hardware.peak_flops, taken as per process)."""
    import os

    import torch

    from shardforge.dtypes import PRECISION_DTYPES
    from shardforge.planner.peak import model_gemm_shapes, peak_flops

    d, per_node = cluster.device, cluster.devices_per_node
    cores = os.cpu_count() or 1
    threads = cfg.hardware.threads or max(1, cores // per_node)
    share = min(1.0, cores / (threads * per_node))
    peak = dict(d.peak)
    if measure and cfg.hardware.peak_flops is None:
        dtype = PRECISION_DTYPES[cfg.train.precision]
        rows = cfg.train.micro_batch * sequences_per_group(cfg)
        shapes = model_gemm_shapes(shape, rows * cfg.data.max_length, cfg.parallel.tp)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rate, _ = peak_flops(torch.device("cpu"), dtype, None, shapes)
        finally:
            torch.set_num_threads(before)
        peak = dict.fromkeys(peak, rate * share)  # a figure given or assumed is per process already
    slower = {
        k: getattr(d, k) / share for k in ("op_us", "dtensor_us", "intra_latency_us", "inter_latency_us")
    }
    return replace(d, peak=peak, memory_gbps=d.memory_gbps * share, **slower)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Planner:
    """Memory, time and rules of one model, method and batch shape on one cluster."""

    def __init__(
        self, cfg: Config, shape: Any, cluster: Cluster, measure: bool = True, patches: float | None = None
    ) -> None:
        """`patches`: a vision-language run's tower patches per row, from its data once read (before, one
        image of data.image_max_pixels a row)."""
        if cluster.device.name == "cpu":
            cluster = replace(cluster, device=cpu_device(cfg, shape, cluster, measure))
        self.cfg, self.shape, self.cluster = cfg, shape, cluster
        self.costs = spec_for(shape.family).costs(shape)
        self.memory = MemoryModel(cfg, shape, self.costs, patches)
        sizes = [(math.prod(p.shape), p.trained) for p in self.memory.counter.whole_model]
        trained = sum(n for n, t in sizes if t) / sum(n for n, _ in sizes)  # as build_run counts it
        self.timing = TimeModel(cfg, shape, self.costs, cluster, trained, patches)
        self._stages: dict[int, str] = {}  # pipeline stages -> the balanced split, "3,4,4,3"

    # ---- one layout ---------------------------------------------------------------------------------------
    def rules(self, layout: Layout) -> tuple[Config, PipelinePlan | None]:
        """The config of this layout after every rule the launcher applies (a ConfigError names the first
        broken one); the pipeline split is balanced once per stage count."""
        if layout.pp > 1 and layout.pp_layers is None:
            stages = layout.pp * layout.pp_virtual
            if stages not in self._stages:
                counts = balance_layers(self.costs.pipeline(self.cfg.data.max_length), stages)
                self._stages[stages] = ",".join(map(str, counts))
            layout = replace(layout, pp_layers=self._stages[stages])
        cfg = layout.apply(self.cfg)
        return cfg, check_layout(cfg, layout.world, self.shape)[2]

    def topology(self, layout: Layout, searching: bool = False) -> str | None:
        """Placement: the collectives of every layer (TP and CP) stay inside a node. The search keeps expert
        parallel's all-to-alls inside one too; a layout given explicitly may send them across nodes (the
        time model prices the inter-node links), as Megatron lets it."""
        per_node = self.cluster.devices_per_node
        inner = layout.tp * layout.cp
        if self.cluster.nodes > 1 and (per_node % layout.tp or layout.tp > per_node):
            return f"tp={layout.tp} does not fit in a node of {per_node} devices"
        if self.cluster.nodes > 1 and inner > per_node:
            return f"tp x cp = {inner} spans nodes (a node has {per_node} devices)"
        if searching and self.cluster.nodes > 1 and layout.ep * layout.tp > per_node:
            return f"ep x tp = {layout.ep * layout.tp} spans nodes (a node has {per_node} devices)"
        return None

    def evaluate(self, layout: Layout, searching: bool = False) -> Candidate:
        try:
            cfg, plan = self.rules(layout)
        except ShardforgeError as exc:
            return Candidate(layout, rejected=str(exc), kind="rules")
        if plan is not None:
            layout = replace(layout, pp_layers=cfg.parallel.pp_layers, pp_microbatches=plan.microbatches)
        stages = plan.layers if plan is not None else None
        memory = self.memory.estimate(layout, stages, self.cluster.device.name != "cpu")
        candidate = Candidate(layout, memory)
        problems = []  # every one, so fixing the first never uncovers another
        where = self.topology(layout, searching)
        if where is not None:
            problems.append(("topology", where))
        if memory.device_bytes > self.cluster.memory_bytes:
            need, have = memory.device_bytes / GIB, self.cluster.device.memory_gib
            problems.append(("memory", f"needs {need:.1f} GiB per device of {have:.1f}"))
        if memory.states.on_host > self.cluster.host_bytes_per_device:
            need, have = memory.states.on_host / GIB, self.cluster.host_bytes_per_device / GIB
            problems.append(
                ("memory", f"offloads {need:.1f} GiB per device to a host with {have:.1f} per device")
            )
        if problems:
            candidate.kind = problems[0][0]
            candidate.rejected = "; ".join(text for _, text in problems)
        batch = layout.micro_batch * layout.grad_accum * layout.dp * self.memory.group  # rows per step
        candidate.time = self.timing.estimate(layout, memory.states, batch)
        return candidate

    # ---- the search ---------------------------------------------------------------------------------------
    def layouts(self, batch: int, offload: bool) -> list[Layout]:
        """Every layout of the cluster's world worth estimating for `batch` rows per step."""
        return [layout for group in self.layout_groups(batch, offload) for chain in group for layout in chain]

    def layout_groups(self, batch: int, offload: bool) -> list[list[list[Layout]]]:
        """The layouts to estimate for `batch` rows per step, grouped: a group is one arrangement (degrees,
        sharding, offload, checkpointing, schedule) over its micro-batch choices, as chains of one micro-batch
        size (rows per pipeline micro-batch, or per micro-step without a pipeline) from the most micro-batches
        to a micro-step to the fewest. Along a chain the step time never rises and the memory never falls
        (the time model's GEMM size and per-pass costs stay, the bubble, hops and gathers shrink; 1F1B's
        in-flight micro-batches never fall), so the search keeps the first that fits."""
        world, per_node, s = self.cluster.world, self.cluster.devices_per_node, self.shape
        seq = self.cfg.data.max_length
        out = []
        experts = s.num_experts
        kv = s.num_kv_heads  # tp divides the kv heads, or replicates them (a multiple of them)
        for tp in [d for d in divisors(world) if d <= max(per_node, 1) and (kv % d == 0 or d % kv == 0)]:
            cps = [c for c in (1, 2, 4, 8, 16) if (world // tp) % c == 0 and seq % (2 * c * tp) == 0]
            for cp in [c for c in cps if c == 1 or seq >= MIN_CP_LENGTH]:
                if cp > 1 and traits_of(self.cfg).whole_sequences:
                    continue
                for pp in [p for p in divisors(world // (tp * cp)) if p <= s.num_layers]:
                    dp = world // (tp * cp * pp)
                    if batch % dp:
                        continue
                    out += self._data_layouts(tp, cp, pp, dp, batch // dp, experts, offload)
        return out

    def _data_layouts(self, tp: int, cp: int, pp: int, dp: int, rows: int, experts: int, offload: bool):
        per_node = self.cluster.devices_per_node
        shardings = [(dp, 1, z) for z in (0, 1)] if tp == pp == cp == 1 or dp == 1 else []
        if dp * cp > 1:
            shardings += [(1, dp, z) for z in (2, 3)]
            inside = per_node // (tp * cp)  # HSDP: shard inside a node, replicate across
            if 1 < inside < dp and dp % inside == 0 and cp == 1:
                shardings += [(dp // inside, inside, z) for z in (2, 3)]
        if dp == 1 and cp == 1:
            shardings = [(1, 1, 0)]
        ckpts = ("none", "selective", "full")
        offloads = ("optimizer", "params") if offload else ("none",)
        chains = self._micro_chains(pp, rows)
        if not chains:  # fewer rows than pipeline stages
            return []
        schedules = [("1f1b", 1)]
        if pp > 1 and self.shape.num_layers >= 2 * pp:
            schedules.append(("interleaved_1f1b", 2))
            if dp == cp == 1:  # zero-bubble schedules run without data parallel (zero_bubble_refusal)
                schedules += [("zero_bubble", 2), ("zbv", 2)]
        out = []
        for rep, shard, zero in shardings:
            eps = [1]
            if experts and zero >= 2 and rep == 1:
                eps = [e for e in divisors(shard * cp) if experts % e == 0]
            for ep in eps:
                for off in offloads:
                    if off != "none" and zero < 2:
                        continue
                    for ckpt in ckpts:
                        for name, v in schedules:
                            out.append([
                                [Layout(rep, shard, tp, pp, cp, ep, zero, tp > 1, ckpt, off, mb, rows // mb,
                                        name, v, m) for mb, m in chain]
                                for chain in chains
                            ])  # fmt: skip
        return out

    @staticmethod
    def _micro_chains(pp: int, rows: int) -> list[list[tuple[int, int | None]]]:
        """(rows per micro-step, pipeline micro-batches) for `rows` per data-parallel rank and step, as chains
        of one micro-batch size, the most micro-batches per micro-step first. Without a pipeline: one chain,
        micro-steps of up to 64 rows. With one: micro-batches of 1, 2, 4 or 8 rows (Narayanan et al. sweep
        1 to 8), each any multiple of pp of them to a micro-step up to all the rows."""
        if pp == 1:
            return [[(mb, None) for mb in reversed(divisors(rows)) if mb <= MAX_MICRO_BATCH]]
        chains = []
        for size in (1, *PIPELINE_ROWS):
            counts = [m for m in divisors(rows // size) if m % pp == 0] if rows % size == 0 else []
            if counts:
                chains.append([(size * m, m) for m in reversed(counts)])
        return chains

    def search(self, batch: int | None = None, keep: int = 5) -> Plan:
        started = time.perf_counter()
        batch = batch or global_batch(self.cfg)
        plan = Plan(self.cluster, batch, [], group=self.memory.group)
        for offload in (False, True):  # offload only when nothing fits in device memory without it
            for group in self.layout_groups(batch, offload):
                # the group's least memory (the shortest chain end of the smallest micro-batches) first:
                # when that does not fit in memory, none of the group does (a rule that refuses it, as
                # layer-wise GaLore refuses accumulation, may still take another split of the group)
                least = group[0][-1]
                first = self._consider(least, plan)
                if not first.fits and first.kind == "memory":
                    continue
                for chain in group:
                    for layout in chain:
                        if layout is least:
                            if first.fits:
                                break
                        elif self._consider(layout, plan).fits:
                            break
            if plan.ranked:
                break
        plan.ranked.sort(key=lambda c: (c.time.total, _complexity(c.layout)))
        del plan.ranked[keep:]
        plan.seconds = time.perf_counter() - started
        return plan

    def _consider(self, layout: Layout, plan: Plan) -> Candidate:
        """Estimate one layout into the plan (ranked, or counted rejected)."""
        c = self.evaluate(layout, searching=True)
        if c.fits:
            plan.ranked.append(c)
            return c
        plan.rejected[c.kind] += 1
        near = plan.examples.get(c.kind)
        if near is None or _nearer(c, near):
            plan.examples[c.kind] = c
        return c


def _nearer(a: Candidate, b: Candidate) -> bool:
    """The rejected layout to show: the one needing the least memory."""
    if a.memory is None or b.memory is None:
        return b.memory is None and a.memory is not None
    return a.memory.device_bytes < b.memory.device_bytes


def _complexity(layout: Layout) -> int:
    """Among equally fast layouts, prefer fewer moving parts."""
    return sum(d > 1 for d in (layout.tp, layout.pp, layout.cp, layout.ep)) + (
        layout.activation_checkpoint != "none"
    )


def check_memory(layout: Layout, planner: Planner) -> Candidate:
    """An explicit layout against the cluster: a ConfigError naming everything that stops it (placement and
    memory together), with the memory it needs and, when that is too much, the smallest change that makes it
    fit (checkpointing, a smaller micro-batch, a higher ZeRO stage, offload)."""
    c = planner.evaluate(layout)
    if c.fits or c.memory is None:  # fits, or broke a rule check_layout reports
        return c
    cluster = planner.cluster
    hints = []
    if (
        c.memory.device_bytes > cluster.memory_bytes
        or c.memory.states.on_host > cluster.host_bytes_per_device
    ):
        tries = [("parallel.activation_checkpoint", "full", {"activation_checkpoint": "full"})]
        if layout.micro_batch > 1:
            rows = layout.grad_accum * layout.micro_batch
            tries.append(
                ("train.micro_batch", "1", {"micro_batch": 1, "grad_accum": rows, "pp_microbatches": None})
            )
        if layout.dp_shard * layout.cp > 1 and layout.zero_stage < 3:
            tries.append(("parallel.zero_stage", "3", {"zero_stage": 3}))
        if layout.zero_stage >= 2:
            tries.append(("parallel.offload", "optimizer", {"offload": "optimizer"}))
        for key, value, change in tries:
            other = planner.evaluate(replace(layout, **change))
            if other.memory is not None and other.kind != "rules":
                fits = other.memory.device_bytes <= cluster.memory_bytes
                hints.append(
                    f"with {key}={value} it needs {other.memory.device_bytes / GIB:.1f}"
                    + (" (fits)" if fits else "")
                )
        hints = hints or ["use more devices"]
    else:
        hints = [f"its memory fits ({c.memory.device_bytes / GIB:.1f} GiB per device)"]
    raise ConfigError(
        f"the layout will not run on {cluster.describe()}: {c.rejected}; "
        + "; ".join(hints)
        + ". `shardforge plan` ranks the layouts that run; `parallel: auto` picks one"
    )


def choose(cfg: Config, shape: Any, cluster: Cluster, measure: bool = True) -> tuple[Config, Plan]:
    """`parallel: auto`: the best layout that fits, applied to the config (an error when none does)."""
    planner = Planner(cfg, shape, cluster, measure)
    plan = planner.search()
    if not plan.ranked:
        if "memory" not in plan.examples and "rules" in plan.examples:  # a rule, not the device's memory
            raise ConfigError(
                f"parallel.auto: no layout of {cluster.describe()} runs this job: "
                f"{plan.examples['rules'].rejected}"
            )
        near = plan.examples.get("memory")
        detail = f"; the nearest, {near.layout.describe()}, {near.rejected}" if near else ""
        raise ConfigError(
            f"parallel.auto: no layout of {cluster.describe()} runs this job for a global batch of "
            f"{plan.batch} rows{detail}: use more devices, a shorter data.max_length or "
            f"method.finetuning=lora"
        )
    chosen, _ = planner.rules(plan.best.layout)
    return chosen, plan
