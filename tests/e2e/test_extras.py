"""The core install runs a plain fine-tune, and every face beyond it, without its extra, says in one line
which extra to install. One process stands in for a core-only install: every module of every extra
(shardforge/extras.py, checked against pyproject.toml) is hidden from the import system before anything is
imported, then the CLI runs each face in turn, as a user of the core install would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import tomllib

from shardforge.extras import EXTRAS
from tests.conftest import REPO, alpaca_records, tiny_config, write_jsonl

# Runs in the child: blocks the extras' modules, then each command through the CLI's own main().
DRIVER = r"""
import contextlib, io, json, sys
blocked = set(json.loads(sys.argv[1]))

class Hide:  # each finder finds nothing of the blocked packages: absent, as find_spec probes see it too
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
from shardforge.cli import main
out = []
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out.append({"argv": argv, "code": code, "stderr": err.getvalue()})
print("RESULTS " + json.dumps(out))
"""


def test_extras_name_pyproject_modules():
    """EXTRAS (what the code asks for) covers each extra pyproject.toml declares for a face."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras, core = project["optional-dependencies"], project["dependencies"]
    assert set(EXTRAS) <= set(extras)
    for modules in EXTRAS.values():  # nothing an extra brings is a core dependency too
        assert not any(c.split(">")[0].split("=")[0].replace("-", "_").lower() in modules for c in core)


def test_core_install_trains_and_each_face_names_its_extra(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(16))
    cfg = tiny_config(tmp_path, data, train={"steps": 2, "micro_batch": 2, "lr": 1e-3, "log_every": 1})
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(cfg))
    parquet = tmp_path / "train.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one document", "another"]}), parquet)
    final = str(tmp_path / "run" / "final")
    blocked = sorted({m for modules in EXTRAS.values() for m in modules})
    cases = {  # argv -> (the extra, what the line names), run in this order in one process
        ("train", str(cfg_path)): None,  # the plain fine-tune: core only
        ("serve", final): ("serve", "fastapi"),
        ("webui", "--root", str(tmp_path)): ("webui", "gradio"),
        ("eval", final, "--tasks", "shardforge_tiny_mc"): ("eval", "lm-evaluation-harness"),
        ("eval", final, "--data", str(data), "--format", "alpaca"): ("eval", "jieba"),
        ("loftq", final, "--to", str(tmp_path / "loftq")): ("optimizers", "bitsandbytes"),
        ("train", str(cfg_path), "train.optimizer.name=galore", f"output_dir={tmp_path / 'g'}"): (
            "optimizers",
            "galore-torch",
        ),
        ("train", str(cfg_path), "log.report_to=[mlflow]", f"output_dir={tmp_path / 'm'}"): (
            "track",
            "mlflow",
        ),
        (
            "train",
            str(cfg_path),
            f"data.train=[{{path: {parquet}, format: text}}]",
            "method.stage=pt",
            f"output_dir={tmp_path / 'p'}",
        ): ("parquet", "pyarrow"),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(blocked), json.dumps([list(a) for a in cases])],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    for result, expected in zip(results, cases.values(), strict=True):
        if expected is None:
            assert result["code"] == 0, result
            continue
        extra, named = expected
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        assert result["code"] == 2 and len(lines) == 1, result
        assert lines[0].startswith("error: ") and named in lines[0], result
        assert f"pip install 'shardforge[{extra}]'" in lines[0], result
    assert (tmp_path / "run" / "final" / "config.json").is_file()
