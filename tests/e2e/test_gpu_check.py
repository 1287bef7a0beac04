"""benchmarks/gpu_check.sh, the one prepared GPU check, dry-run end to end on the CPU as its header writes it
(`--device cpu`: the same scripts and flags at tiny sizes), so that a GPU machine's scarce minutes go to
measuring, not to debugging the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

PARTS = ["install", "environment", "cuda_tests", "training", "vs_hf_trainer", "inference"]


def _check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}  # the wrapper's interpreter: this suite's
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    # the parts' limits and the budget only stop a hang here (a loaded CI machine): the verdict is the outcome
    limits = ["--budget", "3000", "--timeout-scale", "10"]
    proc = _check("--device", "cpu", "--out", str(out), *limits, timeout=3300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    parts = summary["parts"]
    assert list(parts) == PARTS and summary["ok"] and summary["device"] == "cpu"
    for i, name in enumerate(PARTS, 1):  # each part's time, printed as it finished
        assert f"[{i}/6] {name}: {parts[name]['status']} in " in proc.stdout
        assert parts[name]["seconds"] >= 0
    assert parts["install"]["status"] == "skipped" and "--wheelhouse" in parts["install"]["why"]
    for name in ("environment", "training", "vs_hf_trainer", "inference"):  # none skipped: the budget held
        assert parts[name]["status"] == "ok", (name, parts[name])

    env = parts["environment"]["figures"]
    assert env["torch"] and env["transformers"] and env["shardforge"] and env["cuda_available"] is not None

    # The CUDA tier on the CPU (SHARDFORGE_TEST_DEVICE=cpu): "no tests" only while tests/cuda has none.
    tier = parts["cuda_tests"]
    if list((REPO / "tests" / "cuda").glob("test_*.py")):
        assert tier["status"] == "ok", tier
        assert tier["figures"]["passed"] > 0 and tier["figures"]["failed"] == 0
    else:
        assert tier["status"] in ("ok", "no tests"), tier

    train = parts["training"]["figures"]
    assert train["preset"] == "tiny-llama" and train["seq"] == 64
    assert train["tokens_per_s"] > 0 and 0 < train["mfu"] <= 1  # 1: a step beat the peak, which it raised
    assert train["peak_flops"] > 0 and train["peak_source"]
    assert train["peak_is_datasheet"] is False  # a CPU has no datasheet entry: the measured figure

    hf = parts["vs_hf_trainer"]["figures"]
    assert hf["hf_target_tokens_per_s"] > 0 and hf["shardforge_target_tokens_per_s"] > 0
    assert hf["ratio_target_tokens"] > 0 and hf["ratio_process"] > 0
    assert 0 < hf["shardforge_mfu"] <= 1

    inf = parts["inference"]["figures"]
    assert inf["dtype"] == "bfloat16" and inf["engine_tokens_per_s"] > 0
    assert inf["ratio_vs_one_at_a_time"] > 0 and inf["ratio_vs_best_generate"] > 0
    assert inf["same_tokens_as_one_at_a_time"]  # the table's agreement column was read

    text = (out / "summary.txt").read_text()
    assert "all parts ok" in text and "MFU peak used:" in text
    assert all(name in text for name in PARTS)
    assert text.strip().splitlines()[0] in proc.stdout  # printed at the end
    for name in PARTS[1:]:
        assert (out / f"{name}.log").is_file()


def test_a_spent_budget_skips_the_parts_and_a_missing_wheelhouse_fails(tmp_path):
    proc = _check("--device", "cpu", "--out", str(tmp_path / "a"), "--budget", "1", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = json.loads((tmp_path / "a" / "summary.json").read_text())["parts"]
    assert {p["status"] for p in parts.values()} == {"skipped"}
    assert "budget" in parts["inference"]["why"]

    missing = ["--wheelhouse", str(tmp_path / "none"), "--budget", "21"]
    proc = _check("--device", "cpu", "--out", str(tmp_path / "b"), *missing, timeout=120)
    assert proc.returncode == 1  # a failed part fails the check; the others still ran or were skipped
    parts = json.loads((tmp_path / "b" / "summary.json").read_text())["parts"]
    assert parts["install"]["status"] == "failed" and "constraints.txt" in parts["install"]["why"]
    assert list(parts) == PARTS


def test_pytest_summary_lines_are_counted():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_check import pytest_counts
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert pytest_counts("....\n3 passed, 1 skipped, 2 deselected in 2.10s\n") == {
        "passed": 3, "failed": 0, "skipped": 1, "errors": 0, "deselected": 2,
    }  # fmt: skip
    assert pytest_counts("F.\n1 failed, 1 passed, 1 error in 0.5s") == {
        "passed": 1, "failed": 1, "skipped": 0, "errors": 1,
    }  # fmt: skip
    assert pytest_counts("\nno tests ran in 0.01s\n")["passed"] == 0
