"""RL rewards and prompts: the built-in reward functions on hand-made completions, a callable by import path,
a reward model folder scoring as the model itself does, clear errors for bad reward specs, and prompts read
from every format (with the reference answer from an answer column, alpaca's output or a final assistant
turn, and a dataset_info.json entry)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AutoTokenizer

from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import RewardSpec
from shardforge.data.templates import render, resolve_template
from shardforge.errors import ConfigError
from shardforge.models import save_model
from shardforge.models.common.config import DecoderConfig
from shardforge.models.llama.model import Decoder
from shardforge.objectives import reading_for
from shardforge.objectives.rewards import Completions, build_rewards, final_answer, math_answer
from shardforge.objectives.rollout import load_prompts
from tests.conftest import TOKENIZER, write_jsonl


def _batch(texts, answers=None, lengths=None):
    n = len(texts)
    return Completions(
        ["p"] * n, texts, lengths or [4] * n, answers or [None] * n, [[{"role": "user", "content": "p"}]] * n
    )


def test_final_answer_takes_the_last_boxed_or_the_last_number():
    assert final_answer("so \\boxed{1,234} is it") == "1,234"
    assert final_answer("\\boxed{\\frac{1}{2}} then \\boxed{x^{2}}") == "x^{2}"
    assert final_answer("The sum of 3 and 4 is 7.") == "7"
    assert final_answer("we get -12.5 and 1,000") == "1000"
    assert final_answer("no digits") is None


def test_math_answer_compares_numbers_and_strings():
    texts = ["The sum of 3 and 4 is 7.", "7.0", "8", "\\boxed{x^{2}}", "nothing", "12"]
    answers = ["3 + 4 = 7", "7", "7", "\\boxed{x^{2}}", "7", None]
    assert math_answer(_batch(texts, answers)) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_format_and_dapos_overlong_shaping():
    fmt, length = build_rewards(
        [RewardSpec(name="format", pattern=r"^\d+$"), RewardSpec(name="length", cache=4)],
        16,
        torch.device("cpu"),
    )
    assert fmt.fn(_batch(["12", "twelve", "1 2"])) == [1.0, 0.0, 0.0]
    # L_max = 16, L_cache = 4: 0 up to 12 tokens, then (12 - n) / 4 down to -1 at 16.
    assert length.fn(_batch(["x"] * 5, lengths=[3, 12, 13, 15, 16])) == [0.0, 0.0, -0.25, -0.75, -1.0]


def test_a_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, answers):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
        "def broken(prompts, completions, answers):\n    return [0.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (reward,) = build_rewards([RewardSpec(name="my_rewards:short", weight=2.0)], 8, torch.device("cpu"))
    assert reward.weight == 2.0 and reward.fn(_batch(["a", "abc"])) == [0.5, 0.25]
    (broken,) = build_rewards([RewardSpec(name="my_rewards:broken")], 8, torch.device("cpu"))
    with pytest.raises(ConfigError, match="returned 1 scores for 2"):
        broken.fn(_batch(["a", "b"]))
    with pytest.raises(
        ConfigError, match=r"rewards\[0\]: cannot import the reward function 'my_rewards:nope'"
    ):
        build_rewards([RewardSpec(name="my_rewards:nope")], 8, torch.device("cpu"))
    sys.modules.pop("my_rewards", None)


def test_bad_reward_specs_name_what_is_valid():
    with pytest.raises(
        ConfigError, match=r"rewards\[1\]: unknown reward 'exact'; expected one of math_answer"
    ):
        build_rewards([RewardSpec(name="math_answer"), RewardSpec(name="exact")], 8, torch.device("cpu"))
    with pytest.raises(ConfigError, match="needs a `pattern`"):
        build_rewards([RewardSpec(name="format")], 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="either name"):
        RewardSpec(name="format", model="x")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        build_rewards([RewardSpec(model="/nonexistent")], 8, torch.device("cpu"))


def test_a_reward_model_folder_scores_the_rendered_conversation(tmp_path):
    cfg = DecoderConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16).with_score_head(1)  # fmt: skip
    model = Decoder(cfg)
    model.init_weights(seed=3)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    folder = save_model(model, tmp_path / "rm", tokenizer)
    (reward,) = build_rewards([RewardSpec(model=str(folder))], 8, torch.device("cpu"))
    batch = _batch(["7", "The answer is 12."])
    got = reward.fn(batch)
    for text, score in zip(batch.texts, got, strict=True):
        turns = [{"role": "user", "content": "p"}, {"role": "assistant", "content": text}]
        rendered = render(tokenizer, resolve_template(tokenizer, "auto"), turns)
        ids = torch.tensor([tokenizer(rendered, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            expected = model(ids)[0, -1, 0]
        assert score == pytest.approx(float(expected), rel=1e-5, abs=1e-6)


def test_prompts_from_every_format_with_their_reference_answers(tmp_path):
    alpaca = write_jsonl(tmp_path / "a.jsonl", [
        {"instruction": "Add.", "input": "2 + 3", "output": "5"},
        {"instruction": "Add.", "input": "1 + 1", "answer": 2},
        {"instruction": "Say hi."},
    ])  # fmt: skip
    sharegpt = write_jsonl(tmp_path / "s.jsonl", [
        {"conversations": [{"from": "human", "value": "4 x 2?"}]},
        {"conversations": [{"from": "human", "value": "9 - 1?"}, {"from": "gpt", "value": "8"}]},
    ])  # fmt: skip
    openai = write_jsonl(tmp_path / "o.jsonl", [
        {"messages": [{"role": "user", "content": "6 / 3?"}], "answer": "2"},
    ])  # fmt: skip
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    columns = {"messages": "messages", "answer": "answer"}
    info = tmp_path / "dataset_info.json"
    info.write_text(json.dumps({"math": {"file_name": "o.jsonl", "formatting": "openai", "columns": columns,
                                         "tags": tags}}))  # fmt: skip
    data = DataSection(train=[
        {"path": str(alpaca), "format": "alpaca"}, {"path": str(sharegpt), "format": "sharegpt"},
        {"path": str(openai), "format": "openai"}, {"name": "math", "dataset_info": str(info)},
    ])  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    prompts, too_long = load_prompts(data, tokenizer, 64, reading_for("grpo"))
    assert too_long == 0
    assert [p.answer for p in prompts] == ["5", "2", None, None, "8", "2", "2"]
    assert [p.messages[-1]["content"] for p in prompts] == [
        "Add.\n2 + 3",
        "Add.\n1 + 1",
        "Say hi.",
        "4 x 2?",
        "9 - 1?",
        "6 / 3?",
        "6 / 3?",
    ]
    assert prompts[0].text.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert prompts[0].ids == tokenizer(prompts[0].text, add_special_tokens=False)["input_ids"]
    short, too_long = load_prompts(data, tokenizer, 12, reading_for("grpo"))
    assert too_long == 7 - len(short) > 0
