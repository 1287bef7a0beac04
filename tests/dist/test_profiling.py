"""train.profile on 2 gloo ranks: every rank writes a Chrome trace, rank 0 gathers where each rank's step time
went, and the categories add up to the step time, which is the step time the trainer's clock measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from shardforge.config import load_config
from shardforge.train.profile_summary import CATEGORIES, COMM_KINDS
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks


def _profiled_runs(configs: list[dict]) -> list[dict]:
    out = []
    for cfg in configs:
        trainer = Trainer(load_config(None, base=cfg))
        trainer.train()
        folder = Path(cfg["output_dir"]) / "profile"
        summary = json.loads((folder / "summary.json").read_text()) if dist.get_rank() == 0 else None
        out.append({"summary": summary, "trace": (folder / f"rank{dist.get_rank()}.trace.json").is_file()})
    return out


def test_profiled_steps_break_down_into_compute_collectives_data_optimizer_and_idle(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(64))
    common = {"steps": 5, "profile": {"start": 2, "steps": 3}}
    zero3 = tiny_config(tmp_path / "zero3", data, train=common, parallel={"zero_stage": 3})
    pp = tiny_config(tmp_path / "pp", data, train={**common, "grad_accum": 2}, parallel={"pp": 2})
    per_rank = run_ranks(_profiled_runs, 2, [zero3, pp])
    assert all(run["trace"] for runs in per_rank for run in runs)  # every rank wrote its trace
    for runs_of_rank in per_rank[1:]:
        assert all(run["summary"] is None for run in runs_of_rank)  # the summary is rank 0's to write
    zero3_summary, pp_summary = (run["summary"] for run in per_rank[0])
    for summary in (zero3_summary, pp_summary):
        assert [r["rank"] for r in summary] == [0, 1]
        for r in summary:
            parts = r["categories_ms"]
            assert set(parts) == set(CATEGORIES) and r["steps"] == 3
            assert sum(parts.values()) == pytest.approx(r["step_ms"], rel=1e-6)
            # the trace's step spans are the steps the trainer timed: each opens after the trainer's clock
            # starts and closes before it stops (an order, whatever the machine's load; 50 us for the two
            # clocks' resolution)
            assert 0 < r["step_ms"] <= r["wall_ms"] + 0.05, (r["step_ms"], r["wall_ms"])
            assert parts["compute"] > 0 and parts["optimizer"] > 0 and parts["data"] > 0
            exposed = sum(parts[k] for k in COMM_KINDS)
            assert r["exposed_comm_share"] == pytest.approx(exposed / r["step_ms"])
            for kind in COMM_KINDS:  # exposed is the part of the in-flight time not hidden behind compute
                assert parts[kind] <= r["comm_in_flight_ms"][kind] + 1e-6
    for (
        r
    ) in zero3_summary:  # FSDP2: parameters all-gathered, gradients reduce-scattered, the norm all-reduced
        assert min(r["comm_in_flight_ms"][k] for k in ("all_gather", "reduce_scatter", "all_reduce")) > 0
        assert r["comm_in_flight_ms"]["send_recv"] == 0
    for r in pp_summary:  # the pipeline: activations and gradients sent between the stages
        assert r["categories_ms"]["send_recv"] > 0
        assert r["comm_in_flight_ms"]["all_gather"] == r["comm_in_flight_ms"]["reduce_scatter"] == 0
