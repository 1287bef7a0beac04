"""Stage rm on one process: a score head on the last non-padding token, trained on preference pairs with
-log sigmoid(r_c - r_r) until the reward accuracy is above 0.9; the final folder loads in transformers'
AutoModelForSequenceClassification (num_labels=1) and gives the same scores, and loads back into ours."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from shardforge.config import load_config
from shardforge.errors import ModelError
from shardforge.infer.load import load_for_inference
from shardforge.models import load_model
from shardforge.objectives.reward import RewardObjective, last_non_pad
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER, tiny_config, write_jsonl
from tests.dist._training import logged
from tests.unit.test_dpo import _pairs


def _cfg(tmp_path, data, finetuning="lora", steps=30):
    return tiny_config(
        tmp_path,
        data,
        fmt="alpaca",
        method={"stage": "rm", "finetuning": finetuning},
        train={"steps": steps, "micro_batch": 4, "lr": 3e-3, "warmup": 0},
        data={"packing": False},
    )


def test_last_non_pad_is_transformers_rule():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 6, 0, 0], [5, 6, 7, 8, 9]])
    assert last_non_pad(ids, pad_id=0).tolist() == [2, 2, 4]


def test_reward_model_learns_and_exports_for_transformers(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", _pairs(48))
    trainer = Trainer(load_config(None, base=_cfg(tmp_path, data)))
    result = trainer.train()
    records = logged(trainer.run.run_dir)
    assert math.isfinite(records[0]["loss"])
    last = records[-3:]
    assert min(r["rewards/accuracy"] for r in last) > 0.9
    assert sum(r["loss"] for r in last) / 3 < 0.3
    # The exported folder (LoRA merged: the score head trains whole) is a transformers sequence classifier.
    final = result.final_model
    hf = AutoModelForSequenceClassification.from_pretrained(final, num_labels=1).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    ours = load_model(final).eval()
    assert ours.config.num_labels == 1
    with pytest.raises(ModelError, match=r"is a reward model .* it does not generate"):
        load_for_inference(final)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    objective = RewardObjective()
    rows = trainer.run.train_rows
    batch = objective.collate(rows.examples, rows.rows_of(range(4)), tokenizer.pad_token_id)
    with torch.no_grad():
        mine = ours(batch.input_ids, **objective.model_inputs(batch)).squeeze(-1)
        attention = (batch.input_ids != tokenizer.pad_token_id).long()
        theirs = hf(input_ids=batch.input_ids, attention_mask=attention).logits.squeeze(-1)
        trained = trainer.engine.model(batch.input_ids, **objective.model_inputs(batch)).squeeze(-1)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine, trained, rtol=1e-5, atol=1e-5)
    # ... and the loss the run minimized is the pairwise one on those scores.
    pairs = theirs.view(-1, 2)
    expected = -F.logsigmoid(pairs[:, 0] - pairs[:, 1]).sum()
    assert float(objective.loss(mine[:, None], batch)["loss"]) == pytest.approx(float(expected), rel=1e-5)


def test_score_head_on_a_causal_model_is_fresh(tmp_path):
    """Starting a reward model from an LM folder drops its vocabulary head and draws a new score head."""
    from tests.dist._training import tiny_model_folder

    model = tiny_model_folder(tmp_path, vocab_size=1024, seed=1, num_layers=2, num_kv_heads=2)
    lm = load_model(model["path"])
    rm = load_model(model["path"], num_labels=1, seed=3)
    assert rm.lm_head.weight.shape == (1, 64) and not rm.config.tie_embeddings
    assert torch.equal(rm.embed_tokens.weight, lm.embed_tokens.weight)
    assert 0.01 < float(rm.lm_head.weight.std()) < 0.03  # normal(0, 0.02)
