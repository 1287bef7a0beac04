"""LLaMA Pro: `expand_blocks` against LLaMA-Factory's own scripts/llama_pro.py (run by LF's Python), the
expanded model computing what the original did (transformers), and `method.freeze.llama_pro` training the
blocks LF's own `_setup_freeze_tuning` picks."""

from __future__ import annotations

import ast
import json
import logging
import re
import subprocess
import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardforge.config import load_config
from shardforge.config.method_schema import FreezeSection
from shardforge.errors import ConfigError, ModelError
from shardforge.models.expand import expand_blocks
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_chat_model, tiny_config, write_jsonl

pytestmark = pytest.mark.slow  # LF's reference environment, and a short training run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("pro") / "base", context=128, layers=4)


def test_expansion_equals_llamafactory_s_script(base, tmp_path):
    from tests.lf.reference_env import reference

    ref = reference()
    theirs = tmp_path / "theirs"
    proc = subprocess.run(
        [str(ref.python), str(ref.src / "scripts" / "llama_pro.py"), "--model_name_or_path", str(base),
         "--output_dir", str(theirs), "--num_expand", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = expand_blocks(base, tmp_path / "ours", 2)
    mine, lf = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert mine.keys() == lf.keys()
    for key in lf:
        torch.testing.assert_close(mine[key], lf[key], rtol=0, atol=0, msg=key)
    assert json.loads((ours / "config.json").read_text())["num_hidden_layers"] == 6
    assert not mine["model.layers.2.mlp.down_proj.weight"].any()  # the new block after layer 1
    assert (ours / "tokenizer.json").is_file()


def test_the_expanded_model_computes_what_the_original_did(base, tmp_path):
    ours = expand_blocks(base, tmp_path / "ours", 4)
    ids = torch.tensor([[5, 17, 42, 99, 3, 8]])
    before = AutoModelForCausalLM.from_pretrained(base).eval()
    after = AutoModelForCausalLM.from_pretrained(ours).eval()
    assert after.config.num_hidden_layers == 8
    torch.testing.assert_close(after(ids).logits, before(ids).logits, rtol=1e-5, atol=1e-5)


def test_bad_expansions_are_refused_by_name(base, tmp_path):
    with pytest.raises(ModelError, match="--blocks 3: must be at least 1 and divide the model's 4 layers"):
        expand_blocks(base, tmp_path / "x", 3)
    with pytest.raises(ModelError, match="a folder of its own"):
        expand_blocks(base, base, 2)


def lf_trainable(names: list[str], layers: int, trainable: int) -> set[str]:
    """The parameters LF 0.9.5's `_setup_freeze_tuning` leaves trainable (use_llama_pro, modules all), its
    own source run on the names."""
    from tests.lf.reference_env import reference

    path = reference().src / "src" / "llamafactory" / "model" / "adapter.py"
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_setup_freeze_tuning"]
    namespace = {"re": re, "torch": torch, "logger": types.SimpleNamespace(info_rank0=logging.info),
                 "COMPOSITE_MODELS": {}, "get_forbidden_modules": lambda config, args: set()}  # fmt: skip
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    params = {name: torch.nn.Parameter(torch.zeros(1)) for name in names}
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(num_hidden_layers=layers, model_type="llama"),
        named_parameters=lambda: params.items(),
    )
    args = types.SimpleNamespace(
        use_llama_pro=True, freeze_trainable_layers=trainable, freeze_trainable_modules=["all"],
        freeze_extra_modules=None, freeze_multi_modal_projector=True,
    )  # fmt: skip
    namespace["_setup_freeze_tuning"](model, args, True, False)
    return {name for name, p in params.items() if p.requires_grad}


def test_llama_pro_trains_the_blocks_llamafactory_trains(base, tmp_path):
    expanded = expand_blocks(base, tmp_path / "pro", 2)
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(8))
    cfg = tiny_config(tmp_path, data, train={"steps": 2, "lr": 1e-2})
    cfg["model"] = {"path": str(expanded)}
    cfg["method"] = {"finetuning": "freeze", "freeze": {"trainable_layers": 2, "llama_pro": True}}
    trainer = Trainer(load_config(None, base=cfg))
    trainer.train()
    after = AutoModelForCausalLM.from_pretrained(trainer.run_dir / "final")
    start = dict(AutoModelForCausalLM.from_pretrained(expanded).named_parameters())
    changed = {n for n, p in after.named_parameters() if not torch.equal(p, start[n])}
    expected = lf_trainable(list(start), 6, 2)
    assert expected == {n for n in start if re.match(r"model\.layers\.[25]\.", n)}
    assert changed == expected  # the zero output projections first, the rest of the new blocks after


def test_llama_pro_needs_the_count_of_added_blocks():
    with pytest.raises(ValueError, match="give the number of blocks"):
        FreezeSection(trainable_layers=-2, llama_pro=True)
    from shardforge.adapters.apply import trainable_layers

    assert trainable_layers(6, FreezeSection(trainable_layers=2, llama_pro=True)) == {2, 5}
    assert trainable_layers(6, FreezeSection(trainable_layers=2)) == {4, 5}
    with pytest.raises(ConfigError, match="6 layers are not a multiple of trainable_layers=4"):
        trainable_layers(6, FreezeSection(trainable_layers=4, llama_pro=True))


def test_the_expand_command_writes_the_folder_and_says_how_to_train_it(base, tmp_path, capsys):
    from shardforge.cli import main

    assert main(["expand", str(base), "--blocks", "2", "--to", str(tmp_path / "pro")]) == 0
    said = capsys.readouterr().out
    assert "method.freeze.llama_pro=true" in said and "trainable_layers=2" in said
    assert json.loads((tmp_path / "pro" / "config.json").read_text())["num_hidden_layers"] == 6
    assert main(["expand", str(base), "--blocks", "3", "--to", str(tmp_path / "x")]) == 2
    assert "--blocks 3" in capsys.readouterr().err
