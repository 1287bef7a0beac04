"""LoRA through the `shardforge` command: a DoRA run over an HF base writes a PEFT adapter folder that peft
loads over the transformers base with the logits of `export --merge`'s plain folder; it resumes from
adapter-only checkpoints exactly as an uninterrupted run goes on, and a changed base is refused by name."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._training import logged_losses, tiny_model_folder
from tests.e2e.test_cli import _cli, _config


def _lora_cfg(tmp_path, name: str, model: dict, steps: int) -> dict:
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=9))
    cfg = tiny_config(
        tmp_path / name,
        data,
        method={"finetuning": "lora", "lora": {"rank": 4, "alpha": 8.0, "dora": True, "targets": "all"}},
        train={"steps": steps, "lr": 3e-3, "schedule": "constant"},  # the same rates whatever the length
        checkpoint={"every": 2},
    )
    cfg["model"] = model
    (tmp_path / name).mkdir(exist_ok=True)
    return cfg


def test_a_lora_run_exports_a_peft_adapter_resumes_and_merges(tmp_path):
    from peft import PeftModel

    model = tiny_model_folder(
        tmp_path / "base", 1024, seed=2, num_layers=2, num_kv_heads=2, family="qwen2", qkv_bias=True
    )
    straight = _lora_cfg(tmp_path, "straight", model, steps=6)
    assert _cli("train", str(_config(tmp_path / "straight", straight))).returncode == 0
    broken = _lora_cfg(tmp_path, "broken", model, steps=4)
    assert _cli("train", str(_config(tmp_path / "broken", broken))).returncode == 0
    broken["train"]["steps"] = 6
    resumed = _cli("train", str(_config(tmp_path / "broken", broken)))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    run, again = tmp_path / "straight" / "run", tmp_path / "broken" / "run"
    assert logged_losses(again) == logged_losses(run)  # bit-exact on the same layout

    final = run / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == model["path"] and config["use_dora"] is True
    merged = _cli("export", str(run), "--to", str(tmp_path / "merged"), "--merge")
    assert merged.returncode == 0 and "adapters merged" in merged.stdout, merged.stderr
    base = AutoModelForCausalLM.from_pretrained(model["path"])
    adapted = PeftModel.from_pretrained(base, final).eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (adapted(ids).logits - plain(ids).logits).abs().max().item() < 1e-4
        untrained = AutoModelForCausalLM.from_pretrained(model["path"]).eval()
        assert (untrained(ids).logits - plain(ids).logits).abs().max().item() > 1e-3  # the adapters did train

    other = tiny_model_folder(
        tmp_path / "other", 1024, seed=3, num_layers=2, num_kv_heads=2, family="qwen2", qkv_bias=True
    )
    broken["model"], broken["train"]["steps"] = other, 8
    refused = _cli("train", str(_config(tmp_path / "broken", broken)))
    assert refused.returncode != 0 and "finetuning: checkpoint" in refused.stderr + refused.stdout


def test_export_merges_a_run_without_checkpoints_and_a_peft_folder(tmp_path):
    """The README's LoRA run has no `checkpoint.every`: `export RUN --merge` and `export RUN/final --merge`
    (a plain PEFT folder) fold its final/ adapter into the base, with peft's base + adapter logits."""
    from peft import PeftModel

    model = tiny_model_folder(tmp_path / "base", 1024, seed=4, num_layers=2, num_kv_heads=2, family="llama")
    cfg = _lora_cfg(tmp_path, "quick", model, steps=2)
    cfg["checkpoint"].pop("every")
    cfg["train"]["lr"] = 3e-2
    assert _cli("train", str(_config(tmp_path / "quick", cfg))).returncode == 0
    run = tmp_path / "quick" / "run"
    assert not list((run / "checkpoints").glob("step-*"))
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(model["path"]).eval()
    with torch.no_grad():
        plain = base(ids).logits
        want = PeftModel.from_pretrained(base, run / "final").eval()(ids).logits
        assert (want - plain).abs().max().item() > 1e-3  # the adapters did train
        for source, to in ((run, "from_run"), (run / "final", "from_adapter")):
            done = _cli("export", str(source), "--to", str(tmp_path / to), "--merge")
            assert done.returncode == 0 and "adapters merged" in done.stdout, done.stdout + done.stderr
            assert ("checkpoint.every is unset" in done.stdout) == (source == run)
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / to).eval()
            assert (merged(ids).logits - want).abs().max().item() < 1e-4
    copied = _cli("export", str(run), "--to", str(tmp_path / "adapter"))
    assert copied.returncode == 0 and (tmp_path / "adapter" / "adapter_config.json").is_file()
    refused = _cli("export", str(tmp_path / "base"), "--to", str(tmp_path / "x"))
    assert refused.returncode != 0 and "not a usable checkpoint" in refused.stdout + refused.stderr
