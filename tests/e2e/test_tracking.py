"""log.report_to through the libraries themselves, offline: a run reports to TensorBoard, an MLflow file store
(read back with MLflow's client) and W&B in offline mode (its run file read back record by record); a resumed
run continues the same tracked runs; a tracker that cannot start stops the run before its first step, one that
fails later is dropped with a warning."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from shardforge.config import load_config
from shardforge.errors import TrainingError
from shardforge.train.tracking import Trackers
from shardforge.train.trainer import train
from tests.conftest import alpaca_records, tiny_config, write_jsonl


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def _config(tmp_path: Path, steps: int, **log) -> dict:
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(48))
    cfg = tiny_config(tmp_path, data, train={"steps": steps}, checkpoint={"every": 2})
    report_to = ["tensorboard", "mlflow", "wandb"]
    cfg["log"] = {"report_to": report_to, "run_name": "tracked", "plot": False, "progress": False, **log}
    return cfg


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a W&B run file: a 7-byte header (":W&B", magic, version), then LevelDB's log
    format (32 KiB blocks of chunks: crc32 (4), length (2, little-endian), type (1: whole, 2-4: first,
    middle, last))."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def _wandb_history(run_dir: Path) -> tuple[dict[int, float], dict, dict, set[str]]:
    """loss per step, the config, the summary and the run ids over every offline run of `run_dir`."""
    losses, config, summary, ids = {}, {}, {}, set()
    for run_file in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        ids.add(run_file.stem.removeprefix("run-"))
        for record in _wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
                }
                if "loss" in items:
                    losses[items["_step"]] = items["loss"]
            elif kind == "run":  # the run's start carries its config
                config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
            elif kind == "summary":
                summary |= {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update
                }
    return losses, config, summary, ids


def test_a_run_reports_to_tensorboard_mlflow_and_wandb_and_resumes_into_the_same_runs(tmp_path, offline):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _config(tmp_path, steps=4)
    result = train(load_config(None, base=cfg))
    run = result.run_dir
    losses = _losses(run)
    assert sorted(losses) == [1, 2, 3, 4]

    client = MlflowClient((run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("shardforge")
    (tracked,) = client.search_runs([experiment.experiment_id])
    assert (tracked.info.run_name, tracked.info.status) == ("tracked", "FINISHED")
    params = tracked.data.params
    assert params["train.lr"] == "0.001" and params["model.preset"] == "tiny-llama"
    assert json.loads(params["log.report_to"]) == ["tensorboard", "mlflow", "wandb"]
    history = {m.step: m.value for m in client.get_metric_history(tracked.info.run_id, "loss")}
    assert history == pytest.approx(losses)
    assert tracked.data.tags["artifact.final"] == str(run / "final")
    assert tracked.data.tags["artifact.metrics"] == str(run / "metrics.jsonl")
    config_copy = Path(client.download_artifacts(tracked.info.run_id, "config.yaml", str(tmp_path)))
    assert config_copy.read_text() == (run / "config.yaml").read_text()

    wandb_losses, wandb_config, summary, ids = _wandb_history(run)
    assert wandb_losses == pytest.approx(losses)
    assert wandb_config["train"]["lr"] == 0.001 and wandb_config["log"]["run_name"] == "tracked"
    assert summary["artifact/final"] == str(run / "final") and len(ids) == 1

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx(losses)

    # Two more steps from the step-4 checkpoint: the same MLflow run and the same W&B run go on.
    resumed = train(load_config(None, base={**cfg, "train": {**cfg["train"], "steps": 6}}))
    losses = _losses(resumed.run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    (tracked,) = client.search_runs([experiment.experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(tracked.info.run_id, "loss")}
    assert history == pytest.approx(losses) and tracked.info.status == "FINISHED"
    wandb_losses, _, _, resumed_ids = _wandb_history(run)
    assert wandb_losses == pytest.approx(losses) and resumed_ids == ids
    assert json.loads((run / "trackers.json").read_text())["wandb"] in ids


def test_an_unreachable_tracking_server_stops_the_run_before_training(tmp_path, offline):
    cfg = _config(tmp_path, steps=2, report_to=["mlflow"], tracking_uri="http://127.0.0.1:9")
    with pytest.raises(
        TrainingError, match=r"mlflow could not start at log.tracking_uri 'http://127.0.0.1:9'"
    ):
        train(load_config(None, base=cfg))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before the first step


class _Flaky:
    name = "flaky"

    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        if record["step"] == 2:
            raise ConnectionError("the server went away")
        self.records.append(record)

    def finish(self, artifacts: dict[str, str]) -> None:
        raise AssertionError("a dropped tracker is not finished")


class _Steady(_Flaky):
    name = "steady"

    def log(self, record: dict) -> None:
        self.records.append(record)

    def finish(self, artifacts: dict[str, str]) -> None:
        self.artifacts = artifacts


def test_a_tracker_that_fails_during_training_is_dropped_with_a_warning(logged_warnings):
    flaky, steady, warnings = _Flaky(), _Steady(), logged_warnings
    trackers = Trackers([flaky, steady])
    for step in (1, 2, 3):
        trackers.log({"step": step, "loss": 1.0})
    trackers.finish({"final": "/runs/x/final"})
    assert [r["step"] for r in flaky.records] == [1] and [r["step"] for r in steady.records] == [1, 2, 3]
    assert warnings == [
        "flaky failed to log a record (ConnectionError: the server went away); no longer reporting to it"
    ]
    assert steady.artifacts == {"final": "/runs/x/final"}


def test_an_mlflow_run_left_unfinished_is_marked_failed_at_exit(tmp_path):
    from shardforge.config.schema import LogSection
    from shardforge.train.tracking import MLflowTracker

    tracker = MLflowTracker(LogSection(report_to=["mlflow"]), tmp_path, {"a": {"b": 1}}, "a: {b: 1}\n", None)
    tracker.log({"step": 1, "loss": 2.0, "note": "text is not a metric"})
    tracker._abandoned()  # what atexit runs when training raised before finish()
    run = tracker.client.get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.params == {"a.b": "1"}
    assert run.data.metrics == {"loss": 2.0}
