"""The Evaluate tab: `shardforge eval` as a terminal would run it (answers generated for data sets and scored
with BLEU/ROUGE, or lm-evaluation-harness tasks), started as a subprocess in the root and streamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from shardforge.errors import ConfigError
from shardforge.eval.predict import METRICS

RESULTS = "lm_eval_results.json"


def eval_command(
    model: str, entries: list[dict], tasks: str, out: str, max_samples: int | None, max_new_tokens: int | None
) -> list[str]:
    """The `shardforge eval` arguments for data set entries (files, or names of one dataset_info.json) or
    lm-eval tasks (A,B); a choice the command cannot take is a ConfigError saying what would do."""
    for what, value in (("records at most", max_samples), ("new tokens at most", max_new_tokens)):
        if value is not None and value < 0:
            raise ConfigError(f"evaluate: {what} is {value}; give a whole number >= 1 (0 or empty: no limit)")
    args = ["eval", model, "--out", out]
    tasks = tasks.strip()
    if bool(entries) == bool(tasks):
        raise ConfigError("evaluate: pick data sets or name lm-eval tasks (one of the two)")
    if tasks:
        args += ["--tasks", tasks] + (["--limit", str(max_samples)] if max_samples else [])
    else:
        infos = {e["dataset_info"] for e in entries if "dataset_info" in e}
        if len(infos) > 1:
            raise ConfigError(f"evaluate: the data sets name {len(infos)} dataset_info files; pick from one")
        names = [e.get("path") or e["name"] for e in entries]
        args += ["--data", ",".join(names)] + (["--dataset-info", infos.pop()] if infos else [])
        args += ["--max-samples", str(max_samples)] if max_samples else []
    return args + (["--max-new-tokens", str(max_new_tokens)] if max_new_tokens else [])


def run_eval(args: list[str], root: Path, log: Path) -> Iterator[tuple[str, bool]]:
    """Run `python -m shardforge <args>` in the root, yielding its output so far about once a second, and
    (the output, True) when it has ended; the process is stopped if the caller stops listening."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardforge", *args], cwd=root, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"},
        )  # fmt: skip
    try:
        while process.poll() is None:
            time.sleep(1.0)
            yield log.read_text(errors="replace")[-20_000:], False
        yield log.read_text(errors="replace")[-20_000:], True
    finally:
        if process.poll() is None:  # the page went away: no orphan keeps generating
            process.terminate()
            process.wait(30)


def results_of(out: Path) -> dict:
    """The metrics an evaluation wrote (LF's predict_results.json, or lm-eval's results), {} if none."""
    for name in (METRICS, RESULTS):
        path = out / name
        if path.is_file():
            data = json.loads(path.read_text())
            return data.get("results", data) if name == RESULTS else data
    return {}
