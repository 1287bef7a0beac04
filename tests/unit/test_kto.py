"""Stage kto on one process: our {messages|prompt, completion, label} forms and LLaMA-Factory's kto_tag
entries encode alike; each example is paired with the next one's completion for the KL estimate; the loss on
a batch equals KTO's formula written here over log-probs from plain logits; the first step's loss is 0.5
(policy = reference, KL = 0); a learnable task separates the rewards; bad input is named clearly."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch
from transformers import AutoTokenizer

from shardforge.config import load_config
from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import MethodSection
from shardforge.data.batching import IGNORE
from shardforge.data.formats import read_records
from shardforge.data.loader import kto_examples, read_dataset
from shardforge.data.store import ExampleStore
from shardforge.errors import ConfigError, DataError
from shardforge.models.common.config import DecoderConfig
from shardforge.models.llama.model import Decoder
from shardforge.objectives import reading_for
from shardforge.objectives.preference import KTOObjective
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER, tiny_config, write_jsonl
from tests.dist._training import logged

WORDS = ["red", "blue", "green", "gold", "gray", "pink", "teal", "plum"]


def _examples(n: int, seed: int = 0) -> list[dict]:
    """Learnable labels: a completion that repeats the prompt's colour is desirable, another colour is not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        colour, other = rng.sample(WORDS, 2)
        good = i % 2 == 0
        completion = f"{colour} {colour}" if good else other
        out.append({"prompt": f"Name the colour {colour}.", "completion": completion, "label": good})
    return out


def _cfg(tmp_path, data, steps=40, **kto):
    return tiny_config(
        tmp_path,
        data,
        fmt="alpaca",
        method={"stage": "kto", "finetuning": "lora", "kto": {"beta": 1.0, **kto}},
        train={"steps": steps, "micro_batch": 8, "lr": 3e-3, "warmup": 0},
        data={"packing": False},
        checkpoint={"save_final": False},
    )


def test_kto_forms_encode_alike_and_pair_each_example_with_the_next_completion(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    rows = [
        {"prompt": "Name the colour red.", "completion": "red red", "label": True},
        {"prompt": "Name the colour blue.", "completion": "green", "label": False},
    ]
    ours = write_jsonl(tmp_path / "ours.jsonl", rows)
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": r["prompt"]}], **r} for r in rows],
    )
    # LLaMA-Factory's kto_tag entries: kto_en_demo's sharegpt form (the completion is the last turn), and
    # alpaca columns.
    lf_chat = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["completion"]},
            ],
            "label": r["label"],
        }
        for r in rows
    ]
    (tmp_path / "lf_chat.json").write_text(json.dumps(lf_chat))
    lf_alpaca = [{"q": r["prompt"], "a": r["completion"], "tag": r["label"]} for r in rows]
    (tmp_path / "lf_alpaca.json").write_text(json.dumps(lf_alpaca))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    info = {
        "kto_chat": {
            "file_name": "lf_chat.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "kto_tag": "label"},
            "tags": tags,
        },
        "kto_alpaca": {
            "file_name": "lf_alpaca.json",
            "columns": {"prompt": "q", "response": "a", "kto_tag": "tag"},
        },
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    where = str(tmp_path / "dataset_info.json")
    specs = [
        {"path": str(ours), "format": "alpaca"},
        {"path": str(chat), "format": "openai"},
        {"name": "kto_chat", "dataset_info": where},
        {"name": "kto_alpaca", "dataset_info": where},
    ]
    data = DataSection(train=specs)
    encode = KTOObjective().encoder(tokenizer, data)
    encoded = []
    for spec in data.train:
        records = kto_examples(read_dataset(spec, reading_for("kto")), "test")
        assert [r.label for r in records] == [True, False]
        assert [r.mismatched for r in records] == ["green", "red red"]  # the previous one's completion
        encoded.append([encode(r) for r in records])
    for other in encoded[1:]:
        assert all(_same(a, b) for a, b in zip(encoded[0], other, strict=True))
    (ids, flags), (kl_ids, kl_flags) = encoded[0][0]
    prompt = int((~flags).sum())
    assert prompt == int((~kl_flags).sum()) and (ids[:prompt] == kl_ids[:prompt]).all()
    assert tokenizer.decode(ids[flags]).startswith("red red")
    assert tokenizer.decode(kl_ids[kl_flags]).startswith("green")


def _same(a, b) -> bool:
    return all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a, b, strict=True))


def test_kto_loss_is_the_formula_over_plain_logits():
    """The objective's sums on a batch (two desirable, two undesirable examples, their mismatched rows)
    against KTO's loss computed here from full logits: KL = max(0, mean over the mismatched rows of
    log pi - log ref), loss = w_d (1 - s(b (r - KL))) or w_u (1 - s(b (KL - r))), r = log pi - log ref."""
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    policy, reference = Decoder(cfg), Decoder(cfg)
    policy.init_weights(seed=1)
    reference.init_weights(seed=2)
    rng = torch.Generator().manual_seed(3)
    seqs, labels = [], [True, False, True, False]
    for _ in labels:
        for length in (
            int(torch.randint(6, 12, (1,), generator=rng)),
            int(torch.randint(6, 12, (1,), generator=rng)),
        ):
            ids = torch.randint(0, 64, (length,), generator=rng)
            flags = torch.arange(length) >= 4  # a 4-token prompt
            seqs.append((ids.numpy(), flags.numpy()))
    store = ExampleStore.from_arrays(
        [s[0] for s in seqs], [s[1] for s in seqs], [len(s[0]) for s in seqs],
        [int(s[1][1:].sum()) for s in seqs], [int(label) for label in labels for _ in (0, 1)],
    )  # fmt: skip
    objective = KTOObjective(
        MethodSection(stage="kto", kto={"beta": 0.3, "desirable_weight": 1.5, "undesirable_weight": 0.7})
    )
    objective.reference, objective.reference_model = "copy", reference
    batch = objective.collate(store, [[i] for i in range(len(seqs))], pad_id=0)
    batch = objective.prepare(policy, batch)
    sums = objective.loss(policy(batch.input_ids, **objective.model_inputs(batch)), batch)

    def row_logps(model):
        logits = model(batch.input_ids, position_ids=batch.position_ids).float()
        picked = torch.log_softmax(logits, -1).gather(2, batch.targets.clamp(min=0)[..., None])[..., 0]
        return (picked * (batch.targets != IGNORE)).sum(1).view(-1, 2)

    with torch.no_grad():
        pi, ref = row_logps(policy), row_logps(reference)
    kl = max(0.0, float((pi[:, 1] - ref[:, 1]).mean()))
    expected = 0.0
    for ratio, label in zip((pi[:, 0] - ref[:, 0]).tolist(), labels, strict=True):
        if label:
            expected += 1.5 * (1 - torch.sigmoid(torch.tensor(0.3 * (ratio - kl))).item())
        else:
            expected += 0.7 * (1 - torch.sigmoid(torch.tensor(0.3 * (kl - ratio))).item())
    assert float(sums["loss"].detach()) == pytest.approx(expected, rel=1e-5)
    assert float(sums["kl"]) == pytest.approx(kl * 4, rel=1e-5, abs=1e-7)
    assert float(sums["share/desirable"]) == 2


def test_kto_starts_at_one_half_and_separates_the_rewards(tmp_path):
    data = write_jsonl(tmp_path / "kto.jsonl", _examples(48))
    cfg = _cfg(tmp_path, data)
    cfg["data"]["eval_fraction"] = 0.125
    trainer = Trainer(load_config(None, base=cfg))
    trainer.train()
    assert trainer.objective.reference == "adapters" and trainer.objective.reference_model is None
    records = logged(trainer.run.run_dir)
    # Policy = reference at step 1: every log-ratio and the KL estimate are 0, so each loss is 1 - s(0).
    assert records[0]["loss"] == pytest.approx(0.5, rel=1e-5)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert sum(r["share/desirable"] for r in records) / len(records) == pytest.approx(0.5, abs=0.1)
    last = records[-5:]
    # A step whose sample holds one label only has no mean for the other (NaN): averaged over the rest.
    keys = ("loss", "rewards/margin", "rewards/chosen", "rewards/rejected", "logps/chosen")
    mean = {key: statistics.fmean(r[key] for r in last if math.isfinite(r[key])) for key in keys}
    assert mean["loss"] < 0.3
    assert mean["rewards/margin"] > 1.5  # desirable rewards well above the undesirable ones
    assert mean["rewards/chosen"] > 0 > mean["rewards/rejected"]
    assert mean["logps/chosen"] > records[0]["logps/chosen"] - 3.0  # no collapse (it falls tens of nats)
    final = records[-1]  # evaluation reports the same metrics, over the held-out examples
    assert {"eval_loss", "eval_kl", "eval_rewards/margin", "eval_logps/chosen"} <= final.keys()
    assert final["eval_rewards/chosen"] > final["eval_rewards/rejected"]


def test_bad_kto_input_is_clear(tmp_path):
    one_label = write_jsonl(tmp_path / "one.jsonl", [{**e, "label": True} for e in _examples(6)])
    with pytest.raises(DataError, match=r"training data: all 6 KTO examples are desirable .*one.jsonl:1"):
        Trainer(load_config(None, base=_cfg(tmp_path, one_label, steps=1))).train()
    unlabelled = write_jsonl(tmp_path / "unlabelled.jsonl", [{"prompt": "hi", "completion": "a"}])
    with pytest.raises(DataError, match=r'unlabelled.jsonl:1: KTO record has no "label"'):
        read_records(unlabelled, "alpaca", reading_for("kto"))
    numeric = write_jsonl(tmp_path / "numeric.jsonl", [{"prompt": "hi", "completion": "a", "label": 1}])
    with pytest.raises(DataError, match=r'numeric.jsonl:1: KTO record "label" is 1; expected true'):
        read_records(numeric, "alpaca", reading_for("kto"))
    kto = write_jsonl(tmp_path / "kto.jsonl", _examples(4))
    with pytest.raises(DataError, match=r"kto.jsonl:1: a KTO record .*method.stage: kto, not sft"):
        read_records(kto, "alpaca", reading_for("sft"))
    with pytest.raises(ConfigError, match="ref=none: stage kto compares the policy with a reference"):
        load_config(None, base=_cfg(tmp_path, kto) | {"method": {"stage": "kto", "pref": {"ref": "none"}}})
    info = tmp_path / "dataset_info.json"
    info.write_text(json.dumps({"k": {"file_name": "kto.jsonl", "columns": {"kto_tag": "label"}}}))
    dpo = tiny_config(
        tmp_path, kto, method={"stage": "dpo"}, data={"train": [{"name": "k", "dataset_info": str(info)}]}
    )
    with pytest.raises(DataError, match=r'dataset "k" is KTO data .*method.stage: kto'):
        Trainer(load_config(None, base=dpo)).train()
