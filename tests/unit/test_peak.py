"""The MFU denominator: the override wins, known GPUs use their datasheet, the CPU is measured (really, at the
given shapes), cached per machine keeping the best figure, and no matmul at those shapes beats it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shardforge.planner import peak
from shardforge.planner.peak import cache_path, datasheet_peak, mfu, peak_flops

CPU = torch.device("cpu")
SHAPES = [(256, 384, 1024), (256, 384, 384)]  # tokens x hidden x intermediate, tokens x hidden x hidden


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def test_override_wins():
    assert peak_flops(CPU, torch.float32, override=3e12) == (3e12, "hardware.peak_flops")
    assert not cache_path().exists()  # nothing was measured


@pytest.mark.parametrize(
    ("name", "dtype", "tf32", "flops", "label"),
    [
        ("NVIDIA H200", torch.bfloat16, False, 989.4e12, "H200 bf16"),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4e12, "H100 SXM bf16"),
        ("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn, False, 1978.9e12, "H100 SXM fp8"),
        ("NVIDIA H100 80GB HBM3", torch.float32, True, 494.7e12, "H100 SXM tf32"),
        ("NVIDIA H100 80GB HBM3", torch.float32, False, 66.9e12, "H100 SXM fp32"),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12, "H100 PCIe bf16"),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12, "A100 bf16"),
        ("NVIDIA A100-PCIE-40GB", torch.float32, True, 156e12, "A100 tf32"),
        ("NVIDIA A100 80GB PCIe", torch.float32, False, 19.5e12, "A100 fp32"),
        ("NVIDIA L40S", torch.bfloat16, False, 362.05e12, "L40S bf16"),
        ("NVIDIA L4", torch.float16, False, 121e12, "L4 fp16"),
        ("NVIDIA A10G", torch.bfloat16, False, 125e12, "A10 bf16"),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, False, 165.2e12, "RTX 4090 bf16"),
    ],
)
def test_datasheet_table(name, dtype, tf32, flops, label):
    assert datasheet_peak(name, dtype, tf32) == (flops, f"datasheet: {label}")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("NVIDIA H100 NVL", torch.bfloat16),
        ("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn),
        ("Tesla T4", torch.bfloat16),
    ],
)
def test_unknown_devices_and_dtypes_are_not_guessed(name, dtype):
    assert datasheet_peak(name, dtype) is None


def test_cpu_peak_is_measured_and_cached():
    start = time.perf_counter()
    flops, source = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
    assert time.perf_counter() - start < 5  # bounded (1.5 s of probing, plus warm-up)
    assert 1e8 < flops < 1e13  # a plausible CPU, not a fixed number
    assert source.startswith("measured: best of ") and str(cache_path()) in source
    cache = json.loads(cache_path().read_text())
    (entry,) = cache.values()
    assert entry["flops"] == flops and entry["probes"] >= 6
    again, _ = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
    assert again >= flops  # reused: the best of both runs
    entry_now = json.loads(cache_path().read_text()).popitem()[1]
    assert entry_now["probes"] > entry["probes"] and entry_now["runs"] == 2
    while entry_now["runs"] < peak.TRUSTED_RUNS:  # the first runs on a machine keep refining the figure ...
        again, _ = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
        entry_now = json.loads(cache_path().read_text()).popitem()[1]
    start = time.perf_counter()  # ... then it is trusted: no probe, no start-up cost
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == again
    assert time.perf_counter() - start < 0.1
    assert json.loads(cache_path().read_text()).popitem()[1] == entry_now


def test_a_lower_measurement_never_replaces_a_higher_one(monkeypatch):
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (5e9, 3))
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == 5e9
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (1e9, 3))  # a busy moment
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == 5e9
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (7e9, 3))
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == 7e9
    assert peak_flops(CPU, torch.float32, gemm_shapes=[(64, 64, 64)])[0] == 7e9  # another key: measured anew


def test_low_precision_probe_stays_bounded():
    start = time.perf_counter()
    flops, _ = peak_flops(CPU, torch.bfloat16, gemm_shapes=[(2048, 2048, 2048)])
    assert flops > 0 and time.perf_counter() - start < 10


def test_matmuls_at_the_same_shapes_do_not_beat_the_peak():
    """So MFU from it cannot exceed 1 by a measurement artefact."""
    peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
    best, _ = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)  # the best of two runs, as the cache keeps
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            achieved = 2 * m * k * n / (time.perf_counter() - start)
            assert achieved <= 1.05 * best
    assert mfu(0.5 * best * 4, best, world=4) == pytest.approx(0.5)
