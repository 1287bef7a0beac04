"""`parallel: auto` end to end: one config, unchanged, on one process and on two; the planner's choice is
printed, written resolved into the run folder, and its estimate logged beside the first step's measurement."""

from __future__ import annotations

import json

import yaml

from tests.e2e.test_cli import _cli

COMMON = ["train.steps=2", "train.eval_every=null", "train.log_every=2", "data.train.0.max_samples=200"]


def _run(tmp_path, name: str, *extra: str):
    out = tmp_path / name
    proc = _cli("train", "examples/demo.yaml", "parallel.auto=true", *COMMON, f"output_dir={out}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return proc.stdout, yaml.safe_load((out / "config.yaml").read_text()), first


def test_the_same_auto_config_runs_on_one_and_two_processes(tmp_path):
    for name, extra in (("one", ()), ("two", ("--nproc", "2"))):
        stdout, resolved, first = _run(tmp_path, name, *extra)
        assert "parallel: auto chose" in stdout, stdout
        parallel = resolved["parallel"]
        assert parallel["auto"] is False  # the run folder holds the layout that ran
        world = 2 if extra else 1
        dp = parallel["dp_replicate"] * max(1, parallel["dp_shard"])
        assert dp * parallel["tp"] * parallel["pp"] * parallel["cp"] == world
        # the demo's global batch (4 rows) is kept whatever the split
        assert resolved["train"]["micro_batch"] * resolved["train"]["grad_accum"] * dp == 4
        # the estimate next to the measurement: model states counted exactly, the step time's ratio logged
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert first[f"planned_{key}"] == first[key], (name, key)
        assert first["planned_step_time_s"] > 0 and first["step_time_ratio"] > 0
        assert "planner: param_bytes" in stdout and "(x1.000)" in stdout
