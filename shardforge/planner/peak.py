"""The MFU denominator: a device's peak FLOP/s, with where the figure came from.

A single short matmul probe, taken once while a shared machine is busy, reads low and lets MFU exceed 1 (the
demo logged 1.2). So: an explicit `hardware.peak_flops` wins; a known GPU uses its datasheet's dense figure;
anything else (the CPU, an unknown GPU) is measured at the model's GEMM shapes, best of several timed
repetitions per shape, and cached per machine keeping the best figure ever seen, so a busy moment cannot
lower it and a later run's matmuls cannot beat it by a measurement artefact.
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


def model_gemm_shapes(model_config: Any, tokens: int, tp: int) -> list[Shape]:
    """(m, k, n) of the model's main matmuls for a micro-batch on one rank: where the CPU peak is measured."""
    h, i = model_config.hidden_size, model_config.intermediate_size // tp
    return [(tokens, h, i), (tokens, i, h), (tokens, h, h // tp)]


def default_shapes(device: torch.device, dtype: torch.dtype) -> list[Shape]:
    """Probe shapes when the caller has no model shapes: big enough to reach the kernel's steady state."""
    if device.type == "cuda":
        return [(8192, 8192, 8192), (4096, 4096, 16384)]
    return [(1024, 1024, 1024), (2048, 512, 2048)]


def peak_flops(
    device: torch.device,
    dtype: torch.dtype,
    override: float | None = None,
    gemm_shapes: list[Shape] | None = None,
) -> tuple[float, str]:
    """(FLOP/s per device, where the figure comes from). `gemm_shapes` are the model's matmuls (m, k, n), e.g.
    [(tokens per micro-batch, hidden, intermediate), (tokens, hidden, hidden)], for the measured peak."""
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
    shapes = gemm_shapes or default_shapes(device, dtype)
    flops, probes, path = measured_peak(device, dtype, shapes)
    at = "the model's shapes" if gemm_shapes else "default shapes"
    return flops, f"measured: best of {probes} matmul probes at {at} (cached {path}){warning}"


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


def measured_peak(device: torch.device, dtype: torch.dtype, shapes: list[Shape]) -> tuple[float, int, Path]:
    """Probe now, then keep the best of this and every earlier measurement with the same key in the cache
    file: (FLOP/s, probes behind it, cache path). Once TRUSTED_RUNS runs stand behind a figure (each at
    another moment, so one busy moment cannot decide it), it is reused without probing: a run's start-up
    pays for the probe only the first few times on a machine. An unwritable cache only loses the memory
    across runs."""
    path, key = cache_path(), _cache_key(device, dtype, shapes)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    earlier = cache.get(key, {})
    if int(earlier.get("runs", 0)) >= TRUSTED_RUNS:
        return float(earlier["flops"]), int(earlier["probes"]), path
    best, probes = probe_matmuls(device, dtype, shapes)
    probes += int(earlier.get("probes", 0))
    best = max(best, float(earlier.get("flops", 0.0)))
    cache[key] = {"flops": best, "probes": probes, "runs": int(earlier.get("runs", 0)) + 1}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent ranks never read half a file
    except OSError:
        pass
    return best, probes, path


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
