"""Prediction with generation (shardforge/eval/predict.py): the prompts are the chat template's rendering of
each conversation up to its reply, the engine's answers are transformers' greedy tokens, the files are
LLaMA-Factory's, and data is named as a training config names it (paths, or dataset_info.json entries)."""

from __future__ import annotations

import json

import jieba  # noqa: F401  (pinned in the dev extra)
import pytest
import torch

from shardforge.data.templates import resolve_template
from shardforge.data.truncate import infer_seqlen
from shardforge.errors import DataError
from shardforge.eval.predict import (
    METRICS,
    PREDICTIONS,
    dataset_specs,
    predict,
    prompt_items,
    read_records,
    write_predictions,
)
from shardforge.infer.sampling import SamplingParams
from shardforge.infer.session import inference_engine
from tests.conftest import REPO, lf_messages_entry, tiny_chat_model, write_jsonl

DEMO_EVAL = REPO / "examples" / "data" / "demo_eval.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("predict") / "tiny-chat", 256)


@pytest.fixture(scope="module")
def driven(model_dir):
    with inference_engine(str(model_dir)) as pair:
        yield pair


def test_predictions_are_transformers_greedy_tokens(driven, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    loaded, engine = driven
    records = read_records(dataset_specs([str(DEMO_EVAL)], max_samples=4))
    items = prompt_items(records, loaded.tokenizer, resolve_template(loaded.tokenizer, "auto"))
    predictions = predict(engine, items, SamplingParams(max_tokens=12, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first = json.loads(DEMO_EVAL.read_text().splitlines()[0])
    for item, record, made in zip(items, records, predictions, strict=True):
        messages = [m for m in record.messages if m["role"] != "assistant"]
        expected_prompt = loaded.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert made.prompt == expected_prompt
        with torch.no_grad():
            ids = hf.generate(torch.tensor([item.prompt_ids]), max_new_tokens=12, do_sample=False)
        assert made.tokens == ids[0, len(item.prompt_ids) :].tolist()
        assert made.predict == loaded.tokenizer.decode(made.tokens, skip_special_tokens=True)
    assert predictions[0].label == first["output"] + "\n"  # LF's label: the template's reply, decoded
    assert first["instruction"] in predictions[0].prompt and first["input"] in predictions[0].prompt

    metrics = write_predictions(predictions, tmp_path, seconds=2.0)
    lines = [json.loads(line) for line in (tmp_path / PREDICTIONS).read_text().splitlines()]
    assert lines == [{"prompt": p.prompt, "predict": p.predict, "label": p.label} for p in predictions]
    saved = json.loads((tmp_path / METRICS).read_text())
    assert saved == metrics and saved["predict_samples"] == 4
    assert {"predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l"} <= saved.keys()


def test_dataset_info_names_and_their_errors(tmp_path, tokenizer):
    write_jsonl(tmp_path / "qa.jsonl", [{"instruction": "Say hi", "input": "", "output": "hi"}] * 3)
    chats = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    write_jsonl(tmp_path / "chat.jsonl", chats)
    info = {"qa": {"file_name": "qa.jsonl"}, "chat": lf_messages_entry("chat.jsonl")}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))

    specs = dataset_specs(["qa", "chat"], tmp_path, max_samples=2)  # the folder, as LF's dataset_dir
    records = read_records(specs, system="Be brief.")
    assert len(records) == 3
    items = prompt_items(records, tokenizer, resolve_template(tokenizer, "chatml"))
    assert [i.label for i in items] == ["hi\n", "hi\n", "4\n"]  # chatml's reply ends in a newline
    assert tokenizer.decode(items[2].prompt_ids).startswith("<|im_start|>system\nBe brief.")

    with pytest.raises(DataError, match='no dataset named "qaa"'):
        read_records(dataset_specs(["qaa"], tmp_path))
    with pytest.raises(DataError, match=r"'nope.jsonl': no such file or folder.*--dataset-info"):
        dataset_specs(["nope.jsonl"])
    with pytest.raises(DataError, match="dataset_info file not found"):
        dataset_specs(["qa"], tmp_path / "missing")


def test_cutoff_len_cuts_prompt_and_label_as_llamafactory(tmp_path, tokenizer):
    long_input = " ".join(f"w{i}" for i in range(80))
    label = " ".join(f"answer{i}" for i in range(40))
    write_jsonl(tmp_path / "long.jsonl", [{"instruction": "Repeat", "input": long_input, "output": label}])
    records = read_records(dataset_specs([str(tmp_path / "long.jsonl")]))
    template = resolve_template(tokenizer, "auto")
    whole = prompt_items(records, tokenizer, template)[0]
    cut = prompt_items(records, tokenizer, template, cutoff_len=64)[0]
    # the reply as the template writes it (LF's label): its end-of-turn mark and newline counted
    label_ids = tokenizer(label + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    kept_prompt, kept_label = infer_seqlen(len(whole.prompt_ids), len(label_ids), 64)
    assert kept_label < len(label_ids)  # the case where both are cut
    assert cut.prompt_ids == whole.prompt_ids[:kept_prompt]
    assert cut.label == tokenizer.decode(label_ids[:kept_label], skip_special_tokens=True)
    assert whole.label == label + "\n"


def test_answers_end_at_the_models_context(driven):
    from shardforge.eval.predict import Item

    _, engine = driven  # a context of 256 tokens
    near_the_end = Item("a:1", list(range(5, 5 + 250)), "x")
    made = predict(engine, [near_the_end], SamplingParams(max_tokens=1024, temperature=0))
    assert len(made[0].tokens) <= 6
    with pytest.raises(DataError, match=r"b:2: the prompt has 256 tokens.*--cutoff-len"):
        predict(engine, [Item("b:2", list(range(5, 5 + 256)), "x")], SamplingParams(temperature=0))
