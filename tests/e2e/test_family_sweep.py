"""The family sweep's representative subset (benchmarks/family_sweep.py runs every causal-LM model_type and
writes docs/families.md and shardforge/models/generic/verified.py): at least one family per attention and
cache style, each through every path against transformers and peft, none giving wrong numbers or a
traceback; what the shipped lists say (packing, the paged KV cache) matches what is measured here."""

from __future__ import annotations

import re
import sys

import pytest
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardforge.models.generic.verified import PACKS, PAGED, TRANSFORMERS
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import family_sweep

SUBSET = {
    "llama": "native family: paged, packed",
    "gpt2": "learned positions, Conv1D layers (LoRA as peft's fan_in_fan_out)",
    "falcon": "attention outside transformers' interface: the recompute runner",
    "gemma2": "soft-capped scores, sliding window, scaled logits",
    "deepseek_v2": "latent attention (MLA) and a mixture of experts peft converts (LoRA on attention)",
    "bloom": "ALiBi: packing measured wrong, so refused",
    "qwen3_next": "linear-attention layers (a recurrent state): recompute runner, packing refused",
    "gpt_oss": "attention sinks: recompute runner",
    "opt": "positions from the attention mask: packing refused",
    "bert": "a head with a dense layer and a norm: refused by name",
}


@pytest.mark.parametrize("model_type", sorted(SUBSET))
def test_the_family_works_or_is_refused_by_name_and_the_shipped_lists_hold(tmp_path, model_type):
    outcome = family_sweep.sweep_family(model_type, tmp_path)
    assert "tiny" not in outcome, outcome
    for path, value in outcome.items():
        assert value.startswith(("works", "refused")) or (path == "packed" and value.startswith("WRONG")), (
            f"{model_type} {path}: {value}"
        )
    if outcome["load"].startswith("refused"):
        assert all(v.startswith("refused") for v in outcome.values())
        return
    assert (outcome["packed"] == "works") == (model_type in PACKS), outcome["packed"]
    assert (outcome["generate"] == "works; paged: works") == (model_type in PAGED), outcome["generate"]


def test_the_table_covers_every_causal_lm_transformers_registers():
    """docs/families.md has a row for each model_type of the installed transformers, which is the one the
    shipped lists were measured on (an upgrade needs a new sweep)."""
    assert transformers.__version__ == TRANSFORMERS
    table = (REPO / "docs" / "families.md").read_text()
    rows = set(re.findall(r"^\| ([\w-]+) \|", table, re.M)) - {"model_type"}
    assert rows == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert "| WRONG" not in table and "| error" not in table


def test_the_shipped_files_are_what_the_sweep_writes_from_its_results(tmp_path):
    """`python benchmarks/family_sweep.py` (docs/families.md's command) writes the table and the measured
    lists from benchmarks/results_family_sweep.jsonl: written again from those results they are the shipped
    ones (the date aside), so no list was edited by hand."""
    import importlib.util
    import shutil

    rows = family_sweep.read_results(REPO / "benchmarks" / "results_family_sweep.jsonl")
    assert set(rows) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    target = tmp_path / "verified.py"
    shutil.copy(REPO / "shardforge" / "models" / "generic" / "verified.py", target)
    family_sweep.write_verified(rows, target)
    spec = importlib.util.spec_from_file_location("rewritten", target)
    rewritten = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewritten)
    from shardforge.models.generic import verified

    for name in ("PACKS", "PAGED", "REFUSED", "MEASURED"):
        assert getattr(rewritten, name) == getattr(verified, name), name
    family_sweep.write_table(rows, tmp_path / "families.md")
    undated = [
        re.sub(r"\(\d{4}-\d\d-\d\d, ", "(", line)
        for line in (tmp_path / "families.md").read_text().splitlines()
    ]
    shipped = [
        re.sub(r"\(\d{4}-\d\d-\d\d, ", "(", line)
        for line in (REPO / "docs" / "families.md").read_text().splitlines()
    ]
    assert undated == shipped


def test_the_driver_runs_a_family_in_a_worker_process(tmp_path):
    """The script's own command form (`--only`: some families, the table left alone), in worker processes."""
    import json
    import subprocess

    out = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "family_sweep.py"), "--only", "gpt2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines() if "started" not in line]
    assert row["model_type"] == "gpt2" and row["load"] == "works" and row["lora"] == "works"
