"""The MFU denominator: a device's peak FLOP/s, with where the figure came from.

The peak is a property of the hardware, not of a moment: probes taken while a shared machine is busy (two
CPU-bound processes read 5 GFLOP/s at the demo's GEMM shapes on a CPU whose own best is ~200) let MFU exceed
1 (the demo logged 11-16). So: an explicit `hardware.peak_flops` wins; a known GPU uses its datasheet's dense
figure; on the CPU it is the larger of the instruction-set figure (cores x FLOP per cycle x clock, from
/proc/cpuinfo) and the best large-GEMM rate ever measured on this machine (a probe at big default shapes, best
of several timed repetitions, cached per machine keeping only the maximum, so a busy moment cannot lower it);
an unknown GPU has only the measured figure. A training step that runs faster than the peak raises it (the
metrics processor, train/metrics.py, which also stores the achieved rate in the cache on the CPU), so MFU
stays at most 1. The planner's CPU preset takes its matmul rate from the same figure (planner/search.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

# Dense (no 2:4 sparsity) tensor-core peaks per GPU, FLOP/s, from NVIDIA's datasheets and architecture
# whitepapers (H100/H200: Hopper datasheet; A100: A100 datasheet; L40S, L4, A10: their datasheets; RTX 4090:
# Ada whitepaper, FP32 accumulate). fp32 is the non-tensor rate; "tf32" applies when fp32 matmuls may use
# TF32.
_HOPPER_SXM = {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12}
_DATASHEET: list[tuple[str, str, dict[str, float]]] = [
    # (regex over torch.cuda.get_device_name(), label, dtype -> FLOP/s); the first match wins.
    (r"\bH200\b", "H200", _HOPPER_SXM),
    (r"\bGH200\b", "GH200", _HOPPER_SXM),
    (
        r"\bH100\b.*\bPCIe\b",
        "H100 PCIe",
        {"bf16": 756e12, "fp16": 756e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51.2e12},
    ),
    (r"\bH100\b.*\b(SXM|HBM3)\b", "H100 SXM", _HOPPER_SXM),
    (r"\bA100\b", "A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (
        r"\bL40S\b",
        "L40S",
        {"bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12, "tf32": 183e12, "fp32": 91.6e12},
    ),
    (r"\bH20\b", "H20", {"bf16": 148e12, "fp16": 148e12, "fp8": 296e12, "tf32": 74e12, "fp32": 44e12}),
    # Huawei's published FP16 figure for the 910B series (bins differ by ~10%); fp32 (not published as a
    # matrix rate) taken as half of it. torch_npu names the device e.g. "Ascend910B3".
    (r"Ascend ?910B", "Ascend 910B", {"bf16": 320e12, "fp16": 320e12, "fp32": 160e12}),
    (r"\bL4\b", "L4", {"bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12, "tf32": 60e12, "fp32": 30.3e12}),
    # AWS's A10G has no NVIDIA datasheet; it is the A10's chip (GA102), whose figures are used.
    (r"\bA10G?\b", "A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (
        r"\bRTX 4090\b",
        "RTX 4090",
        {"bf16": 165.2e12, "fp16": 165.2e12, "fp8": 330.3e12, "tf32": 82.6e12, "fp32": 82.6e12},
    ),
]

DATASHEETS = {label: table for _, label, table in _DATASHEET}  # the planner's device presets read these

_DTYPE_KEYS = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}

Shape = tuple[int, int, int]  # (m, k, n): an [m, k] @ [k, n] matmul
PROBE_SECONDS = 1.5  # the whole measurement, all shapes together


def datasheet_peak(name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float, str] | None:
    """The datasheet's dense peak for a CUDA device name and dtype (fp32 as TF32 when `tf32`), or None."""
    key = _DTYPE_KEYS.get(dtype)
    if key == "fp32" and tf32:
        key = "tf32"
    for pattern, label, table in _DATASHEET:
        if re.search(pattern, name) and key in table:
            return table[key], f"datasheet: {label} {key}"
    return None


# The CPU's instruction-set peak: cores x fp32 FLOP per cycle and core x clock. FLOP per cycle = SIMD fp32
# lanes x FMA pipes x 2 (a fused multiply-add is two FLOPs), or lanes x 2 without FMA (one multiply and one
# add pipe). /proc/cpuinfo tells the instruction sets (flags), the vendor, family, model and model name, and a
# clock; it does not tell how many FMA pipes a core has or how wide they are, so those come from this table,
# keyed by what cpuinfo does tell, erring low where unsure (the measured figure, the larger, corrects a low
# one; a high one would hide a real MFU):
# - AVX-512, AMD family 0x19 (Zen 4): 512-bit ops run on 256-bit datapaths, 2 FMA pipes x 8 lanes (AMD's
#   Software Optimization Guide for Zen 4, pub. 57647, "Floating-point unit"). 2.6 GHz x 2 cores: 166 GFLOP/s.
# - AVX-512, AMD family 0x1A (Zen 5) "EPYC": full 512-bit datapath, 2 FMA pipes x 16 lanes (AMD's Zen 5
#   guide, pub. 58455; mobile Zen 5 keeps 256-bit datapaths, hence 8 lanes when not EPYC).
# - AVX-512, Intel Xeon: 2 x 512-bit FMA units, 16 lanes each (Intel's optimization reference manual, Skylake
#   Server microarchitecture; ark.intel.com "# of AVX-512 FMA Units"), except the Skylake/Cascade Lake (model
#   85) Bronze, Silver and Gold 5xxx parts (but the 5122), which have one; other AVX-512 parts (client cores:
#   one 512-bit FMA from fused ports 0+1) or vendors: 1 x 16 lanes.
# - AVX2 with FMA3 and no AVX-512: 2 FMA pipes x 8 lanes (Intel Haswell and later, AMD Zen 2/3), but AMD
#   family 0x17 before model 0x30 and Hygon family 0x18 (Zen 1/Zen+: 128-bit datapaths): 2 x 4 lanes.
# - AVX without FMA (Sandy/Ivy Bridge): one 8-lane multiply and one add per cycle; SSE2 only: 4 lanes.
# - bf16: AMX (amx_bf16, Sapphire Rapids on): 1024 FLOP per cycle and core (Intel, Architecture Day 2021:
#   "1024 BF16 ops/cycle"); avx512_bf16 (VDPBF16PS: two bf16 products per fp32 lane): twice the fp32 figure;
#   else bf16 runs as fp32. fp16 likewise with amx_fp16 / avx512_fp16. Other dtypes: the fp32 figure.
# The clock is the model name's "@ x.xxGHz" (Intel's nominal) or else the highest "cpu MHz" (a VM's nominal
# clock; on bare metal with frequency scaling, the momentary one, which reads low at idle): turbo is not
# known, so large GEMMs may beat this figure (up to ~200 GFLOP/s measured here against 166), which the
# measured figure covers. Cores: the threads torch uses, at most the physical cores (distinct physical/core
# ids) this process may run on; a VM's vCPUs that are really one core's SMT siblings cannot be told apart.
def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """One dict per processor block of a /proc/cpuinfo text."""
    blocks = []
    for chunk in re.split(r"\n\s*\n", text.strip()):
        fields = (line.split(":", 1) for line in chunk.splitlines() if ":" in line)
        blocks.append({k.strip(): v.strip() for k, v in fields})
    return [b for b in blocks if b]


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _fp32_per_cycle(cpu: dict[str, str]) -> tuple[int, str] | None:
    """fp32 FLOP per cycle and core, and what it assumes (the table above), or None (no x86 SIMD flags)."""
    flags = set(cpu.get("flags", "").split())
    vendor, name = cpu.get("vendor_id", ""), cpu.get("model name", "")
    family, model = int(cpu.get("cpu family", "0") or 0), int(cpu.get("model", "0") or 0)
    amd = vendor in ("AuthenticAMD", "HygonGenuine")
    if "avx512f" in flags:
        if amd and family == 0x19:
            return 8 * 2 * 2, "AVX-512 on 2 x 256-bit FMA pipes (AMD Zen 4)"
        if amd and family >= 0x1A and "EPYC" in name:
            return 16 * 2 * 2, "AVX-512, 2 x 512-bit FMA pipes (AMD Zen 5 EPYC)"
        one_fma = model == 85 and re.search(r"\b(Bronze|Silver)\b|\bGold 5(?!122)\d{3}", name)
        if vendor == "GenuineIntel" and "Xeon" in name and not one_fma:
            return 16 * 2 * 2, "AVX-512, 2 x 512-bit FMA units (Intel Xeon)"
        return 16 * 1 * 2, "AVX-512, one 512-bit FMA unit assumed"
    if "avx2" in flags and "fma" in flags:
        if (vendor == "AuthenticAMD" and family == 0x17 and model < 0x30) or vendor == "HygonGenuine":
            return 4 * 2 * 2, "AVX2 on 2 x 128-bit FMA pipes (AMD Zen 1)"
        return 8 * 2 * 2, "AVX2, 2 x 256-bit FMA pipes"
    if "avx" in flags:
        return 8 * 2, "AVX without FMA: a 256-bit multiply and add per cycle"
    if "sse2" in flags:
        return 4 * 2, "SSE2: a 128-bit multiply and add per cycle"
    return None


def _clock_hz(cpus: list[dict[str, str]]) -> float | None:
    nominal = re.search(r"@\s*(\d+(?:\.\d+)?)\s*GHz", cpus[0].get("model name", ""))
    if nominal:
        return float(nominal.group(1)) * 1e9
    mhz = [float(c["cpu MHz"]) for c in cpus if re.fullmatch(r"\d+(\.\d+)?", c.get("cpu MHz", ""))]
    return max(mhz) * 1e6 if mhz else None


def cpu_cores_used(cpus: list[dict[str, str]] | None = None) -> int:
    """The cores torch's threads run on: its thread count, at most the physical cores this process may use."""
    cpus = parse_cpuinfo(_read_cpuinfo()) if cpus is None else cpus
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    cores = {
        (c.get("physical id"), c.get("core id"))
        for c in cpus
        if c.get("processor", "").isdigit() and int(c["processor"]) in allowed
    }
    physical = len(cores) if cores and (None, None) not in cores else len(allowed)
    return max(1, min(torch.get_num_threads(), physical))


def isa_peak(
    dtype: torch.dtype, cores: int | None = None, cpuinfo: str | None = None
) -> tuple[float, str] | None:
    """(FLOP/s, how it was computed) of this CPU for `dtype` from its instruction sets and clock (the table
    above), on `cores` cores (default: those torch's threads use); None when cpuinfo cannot tell."""
    cpus = parse_cpuinfo(_read_cpuinfo() if cpuinfo is None else cpuinfo)
    if not cpus:
        return None
    per_cycle, clock = _fp32_per_cycle(cpus[0]), _clock_hz(cpus)
    if per_cycle is None or clock is None:
        return None
    flops, label = per_cycle
    flags, key = set(cpus[0].get("flags", "").split()), _DTYPE_KEYS.get(dtype, "fp32")
    key = key if key in ("bf16", "fp16") else "fp32"
    if key in ("bf16", "fp16") and f"amx_{key}" in flags:
        flops, label = 1024, f"AMX {key}: 1024 FLOP per cycle"
    elif key in ("bf16", "fp16") and f"avx512_{key}" in flags:
        flops, label = 2 * flops, f"{label}, avx512_{key} at twice the fp32 rate"
    cores = cpu_cores_used(cpus) if cores is None else cores
    return (
        cores * flops * clock,
        f"{cores} cores x {flops} {key} FLOP/cycle ({label}) x {clock / 1e9:.3g} GHz",
    )


def model_gemm_shapes(model_config: Any, tokens: int, tp: int) -> list[Shape]:
    """(m, k, n) of the model's main matmuls for a micro-batch on one rank. No longer where the peak is
    measured (a small shape's rate is its kernel's, or a busy moment's, not the hardware's)."""
    h, i = model_config.hidden_size, model_config.intermediate_size // tp
    return [(tokens, h, i), (tokens, i, h), (tokens, h, h // tp)]


def default_shapes(device: torch.device, dtype: torch.dtype) -> list[Shape]:
    """The probe's shapes: big enough to reach the kernel's steady state, whatever the model's are."""
    if device.type == "cuda":
        return [(8192, 8192, 8192), (4096, 4096, 16384)]
    return [(1024, 1024, 1024), (2048, 512, 2048)]


def peak_flops(
    device: torch.device,
    dtype: torch.dtype,
    override: float | None = None,
    gemm_shapes: list[Shape] | None = None,
) -> tuple[float, str]:
    """(FLOP/s per device, where the figure comes from). The CPU (and an unknown GPU) is probed at big
    default shapes and at `gemm_shapes`, the model's matmuls (m, k, n) if given: any matmul's rate is at
    most the peak, so each can only raise the figure, which is kept per machine (not per model shape), with
    the CPU's instruction-set figure as its floor."""
    if override:
        return float(override), "hardware.peak_flops"
    warning = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
        known = datasheet_peak(name, dtype, tf32)
        if known is not None:
            return known
        warning = f"; WARNING: {name} {dtype} is not in the datasheet table, MFU is relative to this probe"
    isa = isa_peak(dtype) if device.type == "cpu" else None
    shapes = default_shapes(device, dtype)
    also = [s for s in gemm_shapes or [] if s not in shapes]
    entry, path = measured_peak(device, dtype, shapes, isa[0] if isa else 0.0, also)
    at = "default shapes and the model's" if also else "default shapes"
    source = (
        f"measured: best of {entry['probes']} matmul probes at {at}, "
        f"{entry['measured'] / 1e9:.1f} GFLOP/s (cached {path})"
    )
    if isa:
        source += f"; instruction set: {isa[0] / 1e9:.1f} GFLOP/s ({isa[1]})"
    if entry.get("achieved"):
        source += f"; achieved by a training step: {entry['achieved'] / 1e9:.1f} GFLOP/s"
    if isa or entry.get("achieved"):
        source += "; the peak is the largest"
    if device.type == "cpu":
        _CACHED[source] = (path, _cache_key(device, dtype, shapes))
    return float(entry["flops"]), source + warning


_CACHED: dict[str, tuple[Path, str]] = {}  # a CPU peak's source -> its cache file and key, for raise_peak


def raisable(source: str) -> bool:
    """Whether a peak with this source is an estimate that an achieved rate may raise: the measured ones
    (the CPU's, an unknown GPU's), not an explicit hardware.peak_flops or a datasheet figure (a step beating
    those means the FLOP count or the figure is wrong: reported, not hidden)."""
    return source.startswith("measured:")


def raise_peak(source: str, flops: float) -> bool:
    """Keep a rate a training step achieved above the CPU peak that `peak_flops` returned with `source` (in
    this process) in the machine cache, so later runs start from it; False when there is none to raise."""
    if source not in _CACHED:
        return False
    path, key = _CACHED[source]
    cache = _load_cache(path)
    entry = cache.setdefault(key, {})
    entry["achieved"] = max(float(flops), float(entry.get("achieved", 0.0)))
    entry["flops"] = max(entry["achieved"], float(entry.get("flops", 0.0)))
    _store_cache(path, cache)
    return True


def mfu(flops_per_s: float, peak: float, world: int) -> float:
    """Model FLOPs utilization: the job's achieved FLOP/s over the peak of all its devices."""
    return flops_per_s / (peak * world)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardforge" / "peak.json"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def _cache_key(device: torch.device, dtype: torch.dtype, shapes: list[Shape]) -> str:
    threads = f"threads={torch.get_num_threads()}" if device.type == "cpu" else device.type
    dims = ",".join("x".join(map(str, s)) for s in shapes)
    return f"{_device_name(device)}|{threads}|{str(dtype).removeprefix('torch.')}|{dims}"


TRUSTED_RUNS = 3  # probing runs behind a cached figure before it is reused without probing again


def measured_peak(
    device: torch.device,
    dtype: torch.dtype,
    shapes: list[Shape],
    floor: float = 0.0,
    also: list[Shape] | None = None,
) -> tuple[dict[str, Any], Path]:
    """Probe now, then keep the best of this and every earlier measurement with the same key in the cache
    file; returns (the entry, the cache path). `shapes` name the entry and are probed, and so are `also`
    (the model's: their rates count, but a run of another model shares the entry). The entry: "measured",
    the best rate ever seen; "flops", the peak: the largest of it, `floor` (the instruction-set figure), a
    rate a training step achieved ("achieved", see raise_peak) and the earlier peak; "probes" and "runs"
    behind it. Only maxima
    are kept: a probe on a busy machine, or a small figure written into the file, cannot lower the peak.
    Once TRUSTED_RUNS runs stand behind a figure it is reused without probing: a run's start-up pays for
    the probe only the first few times on a machine. An unwritable cache only loses the memory across runs."""
    path, key = cache_path(), _cache_key(device, dtype, shapes)
    cache = _load_cache(path)
    earlier = cache.get(key, {})
    entry = dict(earlier)
    measured = float(earlier.get("measured", earlier.get("flops", 0.0)))
    entry.setdefault("probes", 0)
    if int(earlier.get("runs", 0)) < TRUSTED_RUNS:
        best, probes = probe_matmuls(device, dtype, shapes + (also or []))
        measured = max(best, measured)
        entry.update(probes=probes + int(earlier.get("probes", 0)), runs=int(earlier.get("runs", 0)) + 1)
    peak = max(measured, floor, float(earlier.get("achieved", 0.0)), float(earlier.get("flops", 0.0)))
    entry.update(measured=measured, flops=peak)
    if floor:
        entry["isa"] = floor
    if entry != earlier:
        cache[key] = entry
        _store_cache(path, cache)
    return entry, path


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _store_cache(path: Path, cache: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent ranks never read half a file
    except OSError:
        pass


def probe_matmuls(
    device: torch.device, dtype: torch.dtype, shapes: list[Shape], seconds: float = PROBE_SECONDS
) -> tuple[float, int]:
    """(best FLOP/s over all shapes, timed repetitions), each shape given an equal share of `seconds`. A
    shape whose single matmul would take over a third of its share (low precision on a CPU without fast
    units runs ~100-1000x slower) has its m (the token count) cut so that the probe stays bounded; the cost
    is estimated from a few rows first, so not even the warm-up runs the full, slow matmul."""
    share = seconds / len(shapes)
    best, reps = 0.0, 0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        rows = min(m, 16)
        _timed(a[:rows], b)  # warm-up
        estimate = _timed(a[:rows], b) * m / rows
        if estimate > share / 3:
            m = max(1, int(m * share / 3 / estimate))
            a = a[:m].contiguous()
        _timed(a, b)
        deadline = time.perf_counter() + share
        done = 0
        while done < 3 or time.perf_counter() < deadline:
            best = max(best, 2 * m * k * n / _timed(a, b))
            done += 1
        reps += done
    return best, reps


def _timed(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    start = time.perf_counter()
    a @ b
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    return max(time.perf_counter() - start, 1e-9)
