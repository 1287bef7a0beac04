"""The MFU denominator: the override wins, known GPUs use their datasheet, the CPU's is the larger of its
instruction-set figure and the best large-GEMM rate measured (really) on the machine, cached per machine
keeping only maxima, no matmul beats it, and a step that does raises it."""

from __future__ import annotations

import json
from types import SimpleNamespace

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


def test_cpu_peak_is_measured_and_cached(monkeypatch):
    probed = []
    probe = peak.probe_matmuls
    monkeypatch.setattr(peak, "probe_matmuls", lambda *args, **kw: probed.append(args) or probe(*args, **kw))
    flops, source = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
    assert len(probed) == 1 and probed[0][2] == peak.default_shapes(CPU, torch.float32) + SHAPES  # one probe
    assert 1e8 < flops < 1e13  # a plausible CPU, not a fixed number
    assert source.startswith("measured: best of ") and str(cache_path()) in source
    cache = json.loads(cache_path().read_text())
    (entry,) = cache.values()
    assert entry["flops"] == flops and entry["probes"] >= 6  # at least 3 timed matmuls a shape
    assert flops == max(entry["measured"], entry.get("isa", 0.0))  # the instruction-set figure is its floor
    again, _ = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
    assert again >= flops  # reused: the best of both runs
    entry_now = json.loads(cache_path().read_text()).popitem()[1]
    assert entry_now["probes"] > entry["probes"] and entry_now["runs"] == 2
    while entry_now["runs"] < peak.TRUSTED_RUNS:  # the first runs on a machine keep refining the figure ...
        again, _ = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
        entry_now = json.loads(cache_path().read_text()).popitem()[1]
    probes = len(probed)  # ... then it is trusted: no probe, no start-up cost
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == again
    assert len(probed) == probes == peak.TRUSTED_RUNS
    assert json.loads(cache_path().read_text()).popitem()[1] == entry_now


def test_a_lower_measurement_never_replaces_a_higher_one(monkeypatch):
    monkeypatch.setattr(peak, "isa_peak", lambda dtype: None)  # the measured figure alone
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (5e9, 3))
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == 5e9
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (1e9, 3))  # a busy moment
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == 5e9
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (7e9, 3))
    assert peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)[0] == 7e9
    assert peak_flops(CPU, torch.float32, gemm_shapes=[(64, 64, 64)])[0] == 7e9  # model shapes: no matter


def test_low_precision_probe_stays_bounded():
    flops, _ = peak_flops(CPU, torch.bfloat16, gemm_shapes=[(2048, 2048, 2048)])
    assert flops > 0


def test_a_slow_matmul_is_probed_on_fewer_rows(monkeypatch):
    """On a machine (simulated: 1 GFLOP/s, on its own clock) where one full matmul of a shape would take over
    a third of the shape's share of the probe, the probe never runs it: its rows are cut from a few rows'
    cost, and the probe's own time stays bounded."""
    rate, clock, ran = 1e9, [0.0], []

    def timed(a, b):
        ran.append((a.shape[0], a.shape[1]))
        seconds = 2 * a.shape[0] * a.shape[1] * b.shape[1] / rate
        clock[0] += seconds
        return seconds

    monkeypatch.setattr(peak, "_timed", timed)
    monkeypatch.setattr(peak, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    shapes = [(2048, 2048, 2048), (64, 64, 64)]  # 17 s a matmul, and 0.5 ms
    best, reps = peak.probe_matmuls(CPU, torch.float32, shapes, seconds=1.0)
    assert best == pytest.approx(rate) and reps == len(ran) - 3 * len(shapes)  # 2 estimates, 1 warm-up each
    share = 1.0 / len(shapes)
    big = [m for m, k in ran if k == 2048]
    assert big[:2] == [16, 16] and max(big) < 2048  # a few rows' cost, then never the whole matmul
    assert all(2 * m * 2048 * 2048 / rate <= share / 3 for m in big)
    assert clock[0] <= 2 * 1.0  # estimates, warm-ups and the timed runs: within twice the probe's budget


def test_matmuls_at_the_same_shapes_do_not_beat_the_peak(monkeypatch):
    """So MFU from it cannot exceed 1 by a measurement artefact: every matmul the probes timed, at the
    default shapes and the model's, ran at most at the peak they gave."""
    calls = []
    timed = peak._timed

    def recorded(a, b):
        seconds = timed(a, b)
        calls.append(((a.shape[1], b.shape[1]), 2 * a.shape[0] * a.shape[1] * b.shape[1] / seconds))
        return seconds

    def timed_runs() -> dict:
        """Each shape's timed runs (k, n -> rates): its calls after two few-row estimates and a warm-up."""
        runs = {}
        for kn, rate in calls:
            runs.setdefault(kn, []).append(rate)
        calls.clear()
        return {kn: rates[3:] for kn, rates in runs.items()}

    monkeypatch.setattr(peak, "_timed", recorded)
    peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
    runs = [timed_runs()]
    best, _ = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)  # the best of two runs, as the cache keeps
    runs.append(timed_runs())
    for run in runs:
        assert set(run) == {(k, n) for _, k, n in SHAPES + peak.default_shapes(CPU, torch.float32)}
        assert all(len(rates) >= 3 and max(rates) <= best for rates in run.values()), (best, run)
    assert mfu(0.5 * best * 4, best, world=4) == pytest.approx(0.5)


def _cpuinfo(flags: str, name: str, vendor: str = "GenuineIntel", family: int = 6, model: int = 85) -> str:
    block = (
        f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        f"model name\t: {name}\ncpu MHz\t\t: {{mhz}}\nphysical id\t: 0\ncore id\t\t: {{n}}\n"
        f"flags\t\t: fpu sse sse2 {flags}\n"
    )
    return "\n".join(block.format(n=n, mhz=mhz) for n, mhz in enumerate(["2600.000", "2596.140"]))


ZEN4 = _cpuinfo("avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni", "AMD EPYC", "AuthenticAMD", 25, 17)


@pytest.mark.parametrize(
    ("cpuinfo", "dtype", "flops"),
    [
        (ZEN4, torch.float32, 2 * 8 * 2 * 2 * 2.6e9),  # 2 cores x 8 lanes x 2 FMA pipes x 2 x 2.6 GHz
        (ZEN4, torch.bfloat16, 2 * 2 * 8 * 2 * 2 * 2.6e9),  # avx512_bf16: twice
        (ZEN4, torch.float16, 2 * 8 * 2 * 2 * 2.6e9),  # no avx512_fp16: as fp32
        (_cpuinfo("avx avx2 fma", "Intel(R) Core(TM) i7-4770 CPU @ 3.40GHz", model=60), torch.float32,
         2 * 8 * 2 * 2 * 3.4e9),  # AVX2: 8 lanes x 2 FMA pipes, the model name's clock
        (_cpuinfo("avx avx2 fma avx512f", "Intel(R) Xeon(R) Platinum 8175M CPU @ 2.50GHz"), torch.float32,
         2 * 16 * 2 * 2 * 2.5e9),  # two 512-bit FMA units
        (_cpuinfo("avx avx2 fma avx512f", "Intel(R) Xeon(R) Silver 4114 CPU @ 2.20GHz"), torch.float32,
         2 * 16 * 1 * 2 * 2.2e9),  # one
        (_cpuinfo("avx avx2 fma avx512f amx_bf16", "Intel(R) Xeon(R) Platinum 8480+", model=143),
         torch.bfloat16, 2 * 1024 * 2.6e9),  # AMX; no clock in the name: the highest cpu MHz
        (_cpuinfo("avx", "Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz", model=45), torch.float32,
         2 * 8 * 2 * 2.6e9),  # no FMA: a multiply and an add
    ],
)  # fmt: skip
def test_instruction_set_peak_from_cpuinfo(cpuinfo, dtype, flops):
    got, how = peak.isa_peak(dtype, cores=2, cpuinfo=cpuinfo)
    assert got == pytest.approx(flops) and how.startswith("2 cores x ")


def test_zen4_instruction_set_peak_on_two_cores():
    """This machine's kind: AVX-512 on 256-bit pipes at 2.6 GHz, 2 cores: ~166 GFLOP/s (large GEMMs measure up
    to ~200 with boost, which the measured figure covers)."""
    flops, how = peak.isa_peak(torch.float32, cores=2, cpuinfo=ZEN4)
    assert flops == pytest.approx(166.4e9) and "Zen 4" in how
    cpus = peak.parse_cpuinfo(ZEN4)
    assert len(cpus) == 2 and peak.cpu_cores_used(cpus) <= 2
    assert peak.isa_peak(torch.float32, cpuinfo="processor : 0\nFeatures : fp asimd sve\n") is None  # arm
    assert peak.isa_peak(torch.float32, cpuinfo="") is None


@pytest.fixture
def zen4(monkeypatch):
    """peak.py reads the Zen 4 cpuinfo above, on 2 cores, whatever this machine is."""
    monkeypatch.setattr(peak, "_read_cpuinfo", lambda: ZEN4)
    monkeypatch.setattr(peak, "cpu_cores_used", lambda cpus=None: 2)


def _machine_entry(dtype=torch.float32):
    cache = json.loads(cache_path().read_text())
    return cache[peak._cache_key(CPU, dtype, peak.default_shapes(CPU, dtype))]


def test_a_poisoned_cache_does_not_lower_the_peak(zen4, monkeypatch):
    """The issue's cache: probes taken under load (5 GFLOP/s at the demo's shapes), trusted. The peak is the
    instruction-set figure, and no probe is taken for it."""
    key = peak._cache_key(CPU, torch.float32, peak.default_shapes(CPU, torch.float32))
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(json.dumps({key: {"flops": 5e9, "probes": 9, "runs": 9}}))

    def no_probe(*args):
        raise AssertionError("a trusted entry is not probed again")

    monkeypatch.setattr(peak, "probe_matmuls", no_probe)
    flops, source = peak_flops(CPU, torch.float32, gemm_shapes=SHAPES)
    assert flops == pytest.approx(166.4e9) and source.startswith("measured: best of 9 matmul probes")
    assert "5.0 GFLOP/s" in source and "instruction set: 166.4 GFLOP/s" in source and "Zen 4" in source
    assert _machine_entry()["flops"] == flops  # and the file now says so


def test_a_probe_under_load_never_lowers_the_peak(zen4, monkeypatch):
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (2.0e11, 3))  # boost: > ISA
    assert peak_flops(CPU, torch.float32)[0] == 2.0e11
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (0.45e9, 3))  # two CPU hogs
    flops, source = peak_flops(CPU, torch.float32, gemm_shapes=[(2048, 256, 688)])
    assert flops == 2.0e11 and "200.0 GFLOP/s" in source
    assert _machine_entry() == {"flops": 2.0e11, "measured": 2.0e11, "isa": 166.4e9, "probes": 6, "runs": 2}


@pytest.fixture
def clock(monkeypatch):
    """The metrics processor's clock, moved by the test: a window's seconds are the test's, not the
    machine's."""
    import shardforge.train.metrics as metrics

    now = [1000.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def _processor(peak_and_source, world=1):
    from shardforge.objectives.base import CausalLM
    from shardforge.train.metrics import MetricsProcessor

    return MetricsProcessor(
        CausalLM, lambda t, s, p, patches=0: 1e12, peak_and_source, world, CPU, None, None, {}
    )


COUNTS = {"tokens": 100, "targets": 50, "attention_pairs": 1000}


def test_a_step_faster_than_a_measured_peak_raises_it(zen4, monkeypatch, logged_warnings, clock):
    """1e12 FLOPs in a millisecond beats the CPU's peak: MFU is logged at 1, against the achieved rate, with
    the source saying so, in every record; the machine's cache keeps the raised figure."""
    monkeypatch.setattr(peak, "probe_matmuls", lambda device, dtype, shapes: (5e9, 3))
    start = peak_flops(CPU, torch.float32)
    assert start[0] == pytest.approx(166.4e9)
    warnings = logged_warnings
    metrics = _processor(start, world=2)
    metrics.add({"loss": torch.tensor(100.0)}, COUNTS)
    clock[0] += 1e-3
    first = metrics.record(1, lambda t: t)
    assert first["mfu"] <= 1 and first["mfu"] == pytest.approx(1.0)
    assert first["peak_flops"] == start[0] and first["peak_source"] == start[1]  # the run's starting peak
    raised = first["mfu_peak_flops"]
    assert raised == pytest.approx(1e12 / 1e-3 / 2) and raised == metrics.peak  # per device: world of 2
    assert first["mfu_peak_source"] == f"raised to the achieved rate at step 1 (from {start[1]})"
    assert len(warnings) == 1 and "peak raised" in warnings[0]
    assert f"{raised / 1e9:.1f} GFLOP/s" in warnings[0]
    assert _machine_entry()["achieved"] == raised and _machine_entry()["flops"] == raised
    assert peak_flops(CPU, torch.float32)[0] == raised  # the next run starts from it
    metrics.add({"loss": torch.tensor(100.0)}, COUNTS)
    clock[0] += 4e-3
    second = metrics.record(2, lambda t: t)  # 4 times slower than the first window: below the raised peak
    assert second["mfu"] == pytest.approx(0.25) and "peak_flops" not in second
    assert second["mfu_peak_flops"] == raised and second["mfu_peak_source"] == first["mfu_peak_source"]


@pytest.mark.parametrize("source", ["hardware.peak_flops", "datasheet: H100 SXM bf16"])
def test_an_explicit_or_datasheet_peak_is_not_raised(source, zen4, logged_warnings, clock):
    """hardware.peak_flops wins over any measurement; a step beating it (or a datasheet) is reported."""
    key = peak._cache_key(CPU, torch.float32, peak.default_shapes(CPU, torch.float32))
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text(json.dumps({key: {"flops": 9e15, "probes": 9, "runs": 9}}))
    assert peak_flops(CPU, torch.float32, override=1e9) == (1e9, "hardware.peak_flops")
    warnings = logged_warnings
    metrics = _processor((1e9, source))
    metrics.add({"loss": torch.tensor(100.0)}, COUNTS)
    clock[0] += 1.0
    record = metrics.record(1, lambda t: t)
    assert record["mfu"] == pytest.approx(1e3) and record["mfu_peak_flops"] == 1e9
    assert record["mfu_peak_source"] == source
    assert "MFU" in warnings[0] and "peak raised" not in warnings[0]
    assert json.loads(cache_path().read_text())[key]["flops"] == 9e15  # untouched
