"""What the parity tests of LLaMA-Factory's training menu share: a few steps of our trainer on a tiny Llama
folder, the micro-batches it trained on, and transformers' (or peft's) model trained on the same batches."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Optional

import torch

from shardforge.config import load_config
from shardforge.data.batching import IGNORE
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_chat_model, tiny_config, write_jsonl

LR, STEPS = 1e-3, 3


def lf_function(name: str, *helpers: str) -> Any:
    """A function of LF 0.9.5's train/trainer_utils.py, from its own source (its module imports LF's whole
    training stack, whose pins conflict with ours): the anchor's code, not our reading of it."""
    from tests.lf.reference_env import reference

    path = reference().src / "src" / "llamafactory" / "train" / "trainer_utils.py"
    tree = ast.parse(path.read_text())
    wanted = {name, *helpers}
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace: dict[str, Any] = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def train_ours(tmp_path: Path, **sections: Any) -> tuple[Trainer, list]:
    """3 steps of 4 rows on a tiny Llama folder; the micro-batches the loop trained on, in order."""
    model = tiny_chat_model(tmp_path / "base", context=128)
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(12))
    train = {"steps": STEPS, "micro_batch": 2, "grad_accum": 2, "lr": LR, "warmup": 0, "schedule": "constant",
             "clip": None, "betas": [0.9, 0.999]}  # fmt: skip
    cfg = tiny_config(tmp_path, data, **sections)
    cfg["model"] = {"path": str(model), **sections.get("model", {})}
    cfg["train"].update(train | sections.get("train", {}))
    cfg["data"]["packing"] = False
    trainer = Trainer(load_config(None, base=cfg))
    seen: list = []
    setup = trainer.setup

    def capture() -> None:
        setup()
        draw = trainer.loader.next
        trainer.loader.next = lambda: seen.append(draw()) or seen[-1]

    trainer.setup = capture
    trainer.train()
    return trainer, seen


def hf_steps(model: torch.nn.Module, batches: list, loss_fn: Any) -> torch.nn.Module:
    """transformers' model on the same micro-batches: the loss of each (LF's labels: our targets shifted
    back by one) over the global batch's target count, AdamW as ours is set, on its trained parameters."""
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step in batches:
        count = sum(int((mb.targets != IGNORE).sum()) for mb in step.micro)
        for mb in step.micro:
            labels = torch.cat([torch.full_like(mb.targets[:, :1], -100), mb.targets[:, :-1]], dim=1)
            labels = labels.masked_fill(labels == IGNORE, -100)
            logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
            loss_fn({"logits": logits}, labels, torch.tensor(count)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def ce_sum(outputs: dict, labels: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    logits = outputs["logits"][:, :-1].flatten(0, 1)
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum") / count
