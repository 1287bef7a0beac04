"""The offline install (README "Offline install"): scripts/wheelhouse.sh builds a folder of wheels for every
dependency but torch; a fresh venv that already has torch installs shardforge from it with no index and no pip
configuration (so no other folder of wheels), keeps its torch, and runs the demo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import REPO

TIMEOUT = 900


def _run(argv: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=TIMEOUT, **kw)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheelhouse_installs_beside_an_existing_torch_with_no_index_and_runs_the_demo(tmp_path: Path):
    wheelhouse, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    _run(
        ["bash", REPO / "scripts" / "wheelhouse.sh", wheelhouse], env={**os.environ, "PYTHON": sys.executable}
    )
    names = {p.name.split("-")[0].lower() for p in wheelhouse.glob("*.whl")}
    assert "shardforge" in names and "transformers" in names and "torch" not in names
    assert not any(n.startswith(("nvidia", "triton")) for n in names), names

    # The "site" torch: this suite's own version, installed the way the machine installs it.
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    tested = torch.__version__.split("+")[0]
    _run([python, "-m", "pip", "install", "-q", f"torch=={tested}"])

    # No pip configuration at all: this machine's (pip.conf, PIP_FIND_LINKS) names other folders of wheels
    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    _run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheelhouse,
         "-c", wheelhouse / "constraints.txt", "shardforge"],
        env=offline, cwd=tmp_path,
    )  # fmt: skip
    kept = _run([python, "-c", "import torch, shardforge; print(torch.__version__, shardforge.__file__)"],
                cwd=tmp_path)  # fmt: skip
    version, where = kept.stdout.split()
    assert version.split("+")[0] == tested
    assert str(venv) in where  # the installed wheel, not this checkout

    run_dir = tmp_path / "demo"
    _run(
        [venv / "bin" / "shardforge", "train", REPO / "examples" / "demo.yaml", f"output_dir={run_dir}",
         "train.steps=4", "train.eval_every=null"],
        cwd=REPO, env={**offline, "HF_HUB_OFFLINE": "1"},  # the demo's relative data paths
    )  # fmt: skip
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "metrics.jsonl").read_text().strip()
