"""Stage dpo on one process: preference data in our jsonl forms and LLaMA-Factory's ranking entries (sharegpt
and alpaca), pairs that share the prompt's tokens exactly, the reference (LoRA adapters disabled, or a frozen
copy), the first step's loss equal to log 2 (policy = reference), reward accuracy rising on a learnable task,
and bad input named clearly."""

from __future__ import annotations

import json
import math
import random

import pytest
from transformers import AutoTokenizer

from shardforge.config import load_config
from shardforge.config.data_schema import DataSection
from shardforge.data.formats import read_records
from shardforge.data.loader import read_dataset
from shardforge.errors import ConfigError, DataError
from shardforge.objectives import reading_for
from shardforge.objectives.preference import DPOObjective
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER, tiny_config, write_jsonl
from tests.dist._training import logged

WORDS = ["red", "blue", "green", "gold", "gray", "pink", "teal", "plum"]


def _pairs(n: int, seed: int = 0) -> list[dict]:
    """Learnable preferences: the chosen reply repeats the prompt's colour, the rejected one names another."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        colour, other = rng.sample(WORDS, 2)
        out.append(
            {"prompt": f"Name the colour {colour}.", "chosen": f"{colour} {colour}", "rejected": other}
        )
    return out


def _cfg(tmp_path, data, finetuning="lora", steps=30, **pref):
    return tiny_config(
        tmp_path,
        data,
        fmt="alpaca",
        method={"stage": "dpo", "finetuning": finetuning, "pref": {"beta": 0.5, **pref}},
        train={"steps": steps, "micro_batch": 4, "lr": 3e-3 if finetuning == "lora" else 1e-3, "warmup": 0},
        data={"packing": False},
        checkpoint={"save_final": False},
    )


def test_pairs_share_the_prompt_and_score_only_the_replies(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    red_pair = {"prompt": "Name the colour red.", "chosen": "red red", "rejected": "blue"}
    ours = write_jsonl(tmp_path / "ours.jsonl", [red_pair, *_pairs(2)])
    messages = [{"role": "user", "content": "Name the colour red."}]
    chat = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": messages, "chosen": "red red", "rejected": "blue"}]
    )
    # LLaMA-Factory's ranking entries: dpo_en_demo's sharegpt form, and ultrafeedback's alpaca columns.
    turn = {"from": "human", "value": "Name the colour red."}
    lf_chat = {"conversations": [turn], "chosen": {"from": "gpt", "value": "red red"}}
    lf_chat["rejected"] = {"from": "gpt", "value": "blue"}
    (tmp_path / "lf_chat.json").write_text(json.dumps([lf_chat]))
    (tmp_path / "lf_alpaca.json").write_text(
        json.dumps([{"instruction": "Name the colour red.", "chosen": "red red", "rejected": "blue"}])
    )
    info = {
        "pairs_chat": {
            "file_name": "lf_chat.json",
            "ranking": True,
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
        },
        "pairs_alpaca": {
            "file_name": "lf_alpaca.json",
            "ranking": True,
            "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"},
        },
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    specs = [
        {"path": str(ours), "format": "alpaca"},
        {"path": str(chat), "format": "openai"},
        {"name": "pairs_chat", "dataset_info": str(tmp_path / "dataset_info.json")},
        {"name": "pairs_alpaca", "dataset_info": str(tmp_path / "dataset_info.json")},
    ]
    data = DataSection(train=specs)
    records = [r for spec in data.train for r in read_dataset(spec, reading_for("dpo"))]
    encode = DPOObjective().encoder(tokenizer, data)
    groups = [encode(r) for r in records]
    red = [g for r, g in zip(records, groups, strict=True) if r.messages[-2]["content"].endswith("red.")]
    assert len(red) == 4 and all(_same(g, red[0]) for g in red)  # every form encodes alike
    for (c_ids, c_flags), (r_ids, r_flags) in groups:
        prompt = int((~c_flags).sum())
        assert prompt == int((~r_flags).sum()) and (c_ids[:prompt] == r_ids[:prompt]).all()
        assert c_flags[prompt:].all() and r_flags[prompt:].all() and not c_flags[:prompt].any()
    (c_ids, c_flags), (r_ids, _) = red[0]
    assert tokenizer.decode(c_ids[c_flags]).startswith("red red")
    assert tokenizer.decode(r_ids[int((~c_flags).sum()) :]).startswith("blue")


def _same(a, b) -> bool:
    return all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_dpo_starts_at_log2_and_learns_the_preference(tmp_path, finetuning):
    data = write_jsonl(tmp_path / "pairs.jsonl", _pairs(48))
    trainer = Trainer(load_config(None, base=_cfg(tmp_path, data, finetuning)))
    trainer.train()
    assert (trainer.objective.reference_model is None) == (finetuning == "lora")  # LoRA: no second copy
    records = logged(trainer.run.run_dir)
    # The reference is the starting policy, so every pair's margin is 0 at step 1: the loss is log 2.
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert records[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    last = records[-3:]
    assert min(r["rewards/accuracy"] for r in last) > 0.9
    assert sum(r["loss"] for r in last) / 3 < 0.5 * math.log(2)
    assert all(r["logps/chosen"] > records[0]["logps/chosen"] - 1.0 for r in last)  # no collapse of chosen
    # Model state, measured: LoRA DPO holds what LoRA SFT holds (no reference copy); full DPO adds one frozen
    # copy of the parameters and nothing else.
    sft_data = [{"instruction": p["prompt"], "output": p["chosen"]} for p in _pairs(48)]
    sft = _cfg(tmp_path / "sft", write_jsonl(tmp_path / "sft.jsonl", sft_data), finetuning, steps=1)
    sft["method"]["stage"] = "sft"
    sft_trainer = Trainer(load_config(None, base=sft))
    sft_trainer.train()
    assert trainer.memory == sft_trainer.memory
    copy = trainer.objective.reference_model
    extra = 0 if copy is None else sum(p.numel() * p.element_size() for p in copy.parameters())
    assert extra == (0 if finetuning == "lora" else trainer.memory["param_bytes"])


def test_reference_free_loss_needs_no_reference(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", _pairs(16))
    trainer = Trainer(load_config(None, base=_cfg(tmp_path, data, "full", steps=2, loss="simpo", ref="none")))
    trainer.train()
    assert trainer.objective.reference == "none" and trainer.objective.reference_model is None
    assert math.isfinite(logged(trainer.run.run_dir)[-1]["loss"])


def test_bad_preference_input_is_clear(tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", _pairs(4))
    with pytest.raises(DataError, match=r"pairs.jsonl:1: a preference record .*dpo or rm, not sft"):
        read_records(pairs, "alpaca", reading_for("sft"))
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "hi", "chosen": "a"}])
    with pytest.raises(DataError, match=r'missing.jsonl:1: preference record has no "rejected"'):
        read_records(missing, "alpaca", reading_for("dpo"))
    same = write_jsonl(
        tmp_path / "same.jsonl", [*_pairs(1), {"prompt": "hi", "chosen": "a", "rejected": "a"}]
    )
    with pytest.raises(DataError, match=r'same.jsonl:2: "chosen" and "rejected" are the same text'):
        read_records(same, "alpaca", reading_for("dpo"))
    with pytest.raises(ConfigError, match="ref=none: the 'sigmoid' loss needs a reference model"):
        load_config(None, base=_cfg(tmp_path, pairs, ref="none"))
    info = tmp_path / "dataset_info.json"
    info.write_text(json.dumps({"p": {"file_name": "pairs.jsonl", "ranking": True}}))
    sft = tiny_config(tmp_path, pairs, data={"train": [{"name": "p", "dataset_info": str(info)}]})
    with pytest.raises(DataError, match=r'dataset "p" is preference data .*method.stage: dpo'):
        Trainer(load_config(None, base=sft)).train()
