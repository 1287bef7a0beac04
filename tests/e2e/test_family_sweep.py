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
