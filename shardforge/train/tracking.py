"""Experiment trackers (`log.report_to`: tensorboard, mlflow, wandb), through the libraries themselves.

Each gets the resolved config when the run starts, every metric record, and at the end the paths of what
the run wrote. A resumed run continues the same tracked run (its id is kept in `<run>/trackers.json`).
A tracker that fails during training is warned about and dropped: a lost dashboard must not lose a run;
one that cannot start is an error before the first step."""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from shardforge.config.schema import LogSection
from shardforge.errors import ConfigError, ShardforgeError, TrainingError
from shardforge.extras import install_hint
from shardforge.log import get_logger

logger = get_logger(__name__)  # `log` is the config section here

_INSTALL = install_hint("track")


class Tracker(Protocol):
    name: str

    def log(self, record: dict[str, Any]) -> None: ...

    def finish(self, artifacts: dict[str, str]) -> None: ...


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as dotted keys (`train.lr`), the way its overrides are written; lists as JSON."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """A record's numeric fields (the step and text fields are not metrics)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step else None  # TensorBoard hides events past the resume
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def finish(self, artifacts: dict[str, str]) -> None:
        self.writer.close()


class MLflowTracker:
    """MlflowClient (no fluent global state): parameters are the flattened config, config.yaml an artifact,
    metrics per record, the artifacts' paths as tags. A folder URI is MLflow's file store, which MLflow 3
    keeps in maintenance mode behind MLFLOW_ALLOW_FILE_STORE; it is the one store that needs no server."""

    name = "mlflow"

    def __init__(self, log: LogSection, run_dir: Path, config: dict, config_text: str, run_id: str | None):
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(f"log.report_to includes mlflow, which is not installed: {_INSTALL}") from None
        self.Metric = Metric
        uri = log.tracking_uri or str(run_dir / "mlruns")
        if "://" not in uri:  # a folder: the file store
            uri = Path(uri).resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri, self.client, self.finished = uri, MlflowClient(uri), False
        atexit.register(self._abandoned)
        if run_id is not None:  # a resumed run goes on logging into the same tracked run
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        name = log.experiment or "shardforge"
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        run = self.client.create_run(experiment, run_name=log.run_name or run_dir.resolve().name)
        self.run_id = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in flatten(config).items()]  # MLflow's value limit
        for i in range(0, len(params), 100):  # log_batch takes 100 parameters at a time
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, config_text, "config.yaml")

    def log(self, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(k, v, now, record["step"]) for k, v in numbers(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, artifacts: dict[str, str]) -> None:
        for key, path in artifacts.items():
            self.client.set_tag(self.run_id, f"artifact.{key}", path)
        self.client.set_terminated(self.run_id, status="FINISHED")
        self.finished = True

    def _abandoned(self) -> None:
        """A run that ended in an error is marked FAILED when the process exits (W&B does this itself)."""
        if not self.finished and hasattr(self, "run_id"):
            self.client.set_terminated(self.run_id, status="FAILED")


class WandbTracker:
    """wandb.init with the config; WANDB_MODE=offline (or `wandb offline`) writes the run under
    `<run>/wandb` for a later `wandb sync`, as the library does for any script."""

    name = "wandb"

    def __init__(self, log: LogSection, run_dir: Path, config: dict, run_id: str | None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"log.report_to includes wandb, which is not installed: {_INSTALL}") from None
        self.run = wandb.init(
            project=log.experiment or "shardforge",
            name=log.run_name or run_dir.resolve().name,
            config=config,
            dir=str(run_dir),
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",
        )
        self.run_id = self.run.id

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(numbers(record), step=record["step"])

    def finish(self, artifacts: dict[str, str]) -> None:
        self.run.summary.update({f"artifact/{k}": v for k, v in artifacts.items()})
        self.run.finish()


class Trackers:
    """The run's trackers, one call each for a record and for the end; only built on the logging rank."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # a dashboard's failure must not end the training run
                self.trackers.remove(tracker)
                failure = f"{type(exc).__name__}: {exc}"
                logger.warning(f"{tracker.name} failed to {what} ({failure}); no longer reporting to it")

    def log(self, record: dict[str, Any]) -> None:
        self._each("log a record", lambda t: t.log(record))

    def finish(self, artifacts: dict[str, str]) -> None:
        self._each("finish", lambda t: t.finish(artifacts))


def open_trackers(log: LogSection, run_dir: Path, resume_step: int) -> Trackers:
    """Start each tracker of `log.report_to` for the run in `run_dir` (its config.yaml already written)."""
    import yaml

    config_text = (run_dir / "config.yaml").read_text()
    config = yaml.safe_load(config_text)
    ids_file = run_dir / "trackers.json"
    ids = json.loads(ids_file.read_text()) if resume_step and ids_file.is_file() else {}
    trackers: list[Tracker] = []
    starts: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoardTracker(run_dir, resume_step),
        "mlflow": lambda: MLflowTracker(log, run_dir, config, config_text, ids.get("mlflow")),
        "wandb": lambda: WandbTracker(log, run_dir, config, ids.get("wandb")),
    }
    for name in log.report_to:
        try:
            trackers.append(starts[name]())
        except ShardforgeError:
            raise
        except Exception as exc:
            where = (
                f" at log.tracking_uri {log.tracking_uri!r}" if name == "mlflow" and log.tracking_uri else ""
            )
            raise TrainingError(
                f"log.report_to: {name} could not start{where} ({type(exc).__name__}: {exc})"
            ) from exc
    ids = {t.name: t.run_id for t in trackers if hasattr(t, "run_id")}
    if ids:
        ids_file.write_text(json.dumps(ids) + "\n")
    return Trackers(trackers)
