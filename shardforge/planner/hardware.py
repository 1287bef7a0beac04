"""Device presets and the cluster a run plans for: memory, dense peaks, link bandwidths, and the few
efficiency constants the time model needs.

Figures are the vendors' datasheets (dense peaks from planner/peak.py's table; NVLink/HCCS per device
and direction; one NIC per device across nodes), except for `cpu`, whose constants were measured on the
project's 2-core CI machine with gloo (docs/planner.md, "Calibrating the CPU"); its peak is the machine's
hardware peak when a plan is made (planner/peak.py: the larger of the instruction-set figure and the best
matmul rate measured on the machine; the MFU denominator too).
Achievable compute follows a saturating curve in the GEMM size: `max_efficiency * f / (f + half_gemm_flops)`
of the peak for a matmul of f FLOPs, so small hidden sizes (or small tp shards) are penalized as measured
GEMM efficiency is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from shardforge.config.schema import HardwareSection
from shardforge.errors import ConfigError
from shardforge.planner.peak import DATASHEETS

GB = 1e9  # link bandwidths are decimal GB/s, as datasheets give them
GIB = 1 << 30  # memory sizes are binary GiB, as torch reports them


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    peak: dict[str, float]  # dtype key (fp32, bf16, fp16, fp8) -> dense FLOP/s
    intra_gbps: float  # within a node, GB/s per device per direction (NVLink, HCCS, PCIe)
    inter_gbps: float  # across nodes, GB/s per device per direction (IB / RoCE NIC)
    host_gbps: float  # device <-> host (offload), GB/s per direction
    intra_latency_us: float = 5.0  # per collective step
    inter_latency_us: float = 10.0
    max_efficiency: float = 0.75  # share of peak large GEMMs reach
    half_gemm_flops: float = 2.5e10  # a GEMM of this many FLOPs reaches half of that
    op_us: float = 5.0  # fixed cost per kernel launched (Python and dispatch, or the launch itself)
    dtensor_us: float = 100.0  # per tensor-parallel layer and pass: DTensor's sharding propagation
    memory_gbps: float = 3000.0  # what the optimizer step streams its states at
    overlap: float = 0.8  # share of the compute that data-parallel traffic can hide behind
    host_memory_gib: float = 2048.0  # per node (a DGX H100 has 2 TiB), what offload may fill
    host_adam_gbps: float = 10.0  # per device: the host's AdamW pass over offloaded states (shared DRAM)
    description: str = ""

    def achievable(self, dtype: str, gemm_flops: float) -> float:
        """FLOP/s a matmul of `gemm_flops` FLOPs runs at."""
        peak = self.peak.get(dtype, self.peak["fp32"])
        return peak * self.max_efficiency * gemm_flops / (gemm_flops + self.half_gemm_flops)


def _preset(
    name: str, sheet: str, memory: float, intra: float, inter: float, host: float, **kw: Any
) -> Device:
    return Device(name, memory, DATASHEETS[sheet], intra, inter, host, **kw)


NVLINK4, NDR = "NVLink 4", "400 Gb/s NDR per GPU"
PRESETS: dict[str, Device] = {
    d.name: d
    for d in (
        _preset("h100", "H100 SXM", 80, 450, 50, 55, description=f"H100 SXM5 80 GB, {NVLINK4}, {NDR}"),
        _preset("h200", "H200", 141, 450, 50, 55, description=f"H200 SXM 141 GB, {NVLINK4}, {NDR}"),
        _preset("a100-40", "A100", 40, 300, 25, 25, max_efficiency=0.7,
                description="A100 SXM4 40 GB, NVLink 3, 200 Gb/s HDR per GPU"),
        _preset("a100-80", "A100", 80, 300, 25, 25, max_efficiency=0.7,
                description="A100 SXM4 80 GB, NVLink 3, 200 Gb/s HDR per GPU"),
        _preset("l40s", "L40S", 48, 25, 12.5, 25, intra_latency_us=10.0, max_efficiency=0.6,
                description="L40S 48 GB, PCIe 4 only (no NVLink), 100 Gb/s per GPU"),
        _preset("h20", "H20", 96, 450, 50, 55, description=f"H20 96 GB, {NVLINK4}, {NDR}"),
        _preset("ascend-910b", "Ascend 910B", 64, 196, 25, 25, intra_latency_us=10.0,
                inter_latency_us=20.0, max_efficiency=0.6,
                description="Ascend 910B 64 GB, HCCS 392 GB/s per NPU (both ways), 200 Gb/s RoCE"),
        # This machine's constants, measured (docs/planner.md): one process per core, gloo over loopback;
        # its peak is the machine's hardware peak when a plan is made (planner/peak.py), at efficiency 1.
        Device("cpu", 0, {"fp32": 60e9, "bf16": 8e9, "fp16": 8e9}, 0.12, 0.12, 1e9,
               intra_latency_us=734.0, inter_latency_us=734.0, max_efficiency=1.0, half_gemm_flops=0.0,
               op_us=51.0, dtensor_us=24650.0, memory_gbps=2.9, overlap=0.0,
               description="this CPU: gloo over loopback, a process per core"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `devices_per_node` devices of one kind; TP and EP stay inside a node, PP may cross."""

    device: Device
    nodes: int = 1
    devices_per_node: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        return self.device.memory_gib * GIB

    @property
    def host_bytes_per_device(self) -> float:
        """The host memory offload may use per device: the node's, shared by its devices."""
        return self.device.host_memory_gib * GIB / self.devices_per_node

    def link(self, group: int, span_nodes: bool) -> tuple[float, float]:
        """(GB/s per device, latency in seconds) of a collective over `group` ranks, crossing nodes or not."""
        if group <= 1:
            return float("inf"), 0.0
        d = self.device
        if span_nodes:
            return d.inter_gbps * GB, d.inter_latency_us * 1e-6
        return d.intra_gbps * GB, d.intra_latency_us * 1e-6

    def describe(self) -> str:
        return (
            f"{self.nodes} node(s) x {self.devices_per_node} {self.device.name} "
            f"({self.device.memory_gib:.1f} GiB each)"
        )


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def detect_preset() -> str | None:
    """The preset for the devices this process sees: a known GPU by name, this CPU, or None (unknown GPU)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).upper()
        for key, token in (("h200", "H200"), ("h100", "H100"), ("h20", "H20"), ("l40s", "L40S")):
            if token in name:
                return key
        if "A100" in name:
            return "a100-80" if torch.cuda.get_device_properties(0).total_memory > 50 * GIB else "a100-40"
        return None
    return "cpu"


def cluster_for(hardware: HardwareSection, world: int, required: bool = True) -> Cluster | None:
    """The cluster a run is planned on: the preset (or the detected device), `world` processes spread over
    `hardware.nodes` nodes (or `hardware.devices_per_node` each), with the section's overrides applied.
    An unknown GPU without hardware.preset is an error when `required`, else None (nothing to check)."""
    name = hardware.preset or detect_preset()
    if name is None:
        if not required:
            return None
        import torch

        raise ConfigError(
            f"no hardware preset for {torch.cuda.get_device_name(0)!r}: set hardware.preset to the "
            f"closest of {', '.join(PRESETS)} and override its figures (hardware.memory_gib, "
            f"hardware.peak_flops, hardware.intra_node_gbps, hardware.inter_node_gbps)"
        )
    if name not in PRESETS:
        raise ConfigError(f"hardware.preset={name!r} is not a preset; valid: {', '.join(PRESETS)}")
    device = PRESETS[name]
    nodes = hardware.nodes
    per_node = hardware.devices_per_node or max(1, world // nodes)
    if per_node * nodes != world:
        raise ConfigError(
            f"hardware.nodes={nodes} x hardware.devices_per_node={per_node} = {nodes * per_node} devices, "
            f"but the run has {world} processes: make them agree (or leave devices_per_node unset)"
        )
    if name == "cpu":  # the host's memory, shared by the processes on it
        device = replace(device, memory_gib=host_memory_gib() / per_node, host_memory_gib=host_memory_gib())
    overrides = {
        "memory_gib": hardware.memory_gib,
        "intra_gbps": hardware.intra_node_gbps,
        "inter_gbps": hardware.inter_node_gbps,
    }
    device = replace(device, **{k: v for k, v in overrides.items() if v is not None})
    if hardware.peak_flops is not None:
        device = replace(device, peak={k: hardware.peak_flops for k in device.peak})
    names = {f.name for f in fields(Device)} - {"name", "peak", "description"}
    unknown = sorted(set(hardware.figures) - names)
    if unknown:
        raise ConfigError(
            f"hardware.figures: unknown figure {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(sorted(names))}"
        )
    return Cluster(replace(device, **hardware.figures), nodes, per_node)
