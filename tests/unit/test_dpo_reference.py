"""The reference model's other forms, on one process: `ref: precompute` (log-probs computed once, stored in
the run folder and reused) trains exactly as the live reference does and holds no model; `ref: <HF folder>`
and `ref: <PEFT adapter>` equal the frozen copy of the same weights; a bad value is named."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shardforge.config import load_config
from shardforge.errors import ConfigError
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER, tiny_config, write_jsonl
from tests.dist._training import logged_losses, tiny_model_folder
from tests.unit.test_dpo import _pairs


def _cfg(tmp_path, name, data, model, finetuning="lora", steps=4, **pref):
    return tiny_config(
        tmp_path / name,
        data,
        fmt="alpaca",
        model=model,
        method={"stage": "dpo", "finetuning": finetuning, "pref": {"beta": 0.5, **pref}},
        train={"steps": steps, "micro_batch": 4, "lr": 3e-3, "warmup": 0, "eval_every": steps},
        data={"packing": False, "eval_fraction": 0.2},
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER))
    return (
        tmp,
        write_jsonl(tmp / "pairs.jsonl", _pairs(40)),
        tiny_model_folder(tmp, vocab, 1, num_layers=2, num_kv_heads=2),
    )


def _train(cfg: dict) -> tuple[Trainer, list[float], float]:
    trainer = Trainer(load_config(None, base=cfg))
    result = trainer.train()
    return trainer, logged_losses(trainer.run_dir), result.eval_loss


def test_precomputed_reference_trains_as_the_live_one(job, capsys):
    tmp, data, model = job
    _, live, live_eval = _train(_cfg(tmp, "live", data, model))
    trainer, pre, pre_eval = _train(_cfg(tmp, "pre", data, model, ref="precompute"))
    assert trainer.objective.reference == "precomputed" and trainer.objective.reference_model is None
    assert pre == pytest.approx(live, rel=1e-5) and pre_eval == pytest.approx(live_eval, rel=1e-5)
    (stored,) = (trainer.run.train_rows.cached_at / "reference").iterdir()  # beside the tokenized data
    assert {p.name for p in stored.iterdir()} == {"train.npy", "train.json", "eval.npy", "eval.json"}
    assert "reference log-probs: computing" in capsys.readouterr().out
    again = _cfg(tmp, "pre-again", data, model, ref="precompute")
    again["data"]["cache_dir"] = trainer.config.data.cache_dir  # another run on the same data and model
    _, losses, _ = _train(again)
    assert "reference log-probs: computing" not in capsys.readouterr().out  # read back, not recomputed
    assert losses == pytest.approx(pre, rel=1e-6)


def test_an_explicit_reference_equals_the_frozen_copy(job):
    tmp, data, model = job
    _, copied, _ = _train(_cfg(tmp, "copy", data, model, finetuning="full"))
    _, folder, _ = _train(_cfg(tmp, "folder", data, model, finetuning="full", ref=model["path"]))
    assert folder == pytest.approx(copied, rel=1e-5)
    # A run that starts from an adapter: its reference is that adapter on the base, given as a folder.
    first, _, _ = _train(_cfg(tmp, "first", data, model))
    adapter = str(first.run_dir / "final")
    start = {**model, "adapter": adapter}
    _, auto, _ = _train(_cfg(tmp, "from-adapter", data, start))
    _, explicit, _ = _train(_cfg(tmp, "from-adapter-ref", data, start, ref=adapter))
    assert explicit == pytest.approx(auto, rel=1e-5)
    with pytest.raises(
        ConfigError, match=r"method.pref.ref 'nope' is not auto, none, precompute, an HF model"
    ):
        _train(_cfg(tmp, "bad", data, model, ref="nope"))
