"""What the tier's trainer runs share: a few steps of a tiny preset on the bundled tokenizer and alpaca
data (tests/conftest.py), on the device under test."""

from __future__ import annotations

from pathlib import Path

import torch

from shardforge.config import load_config
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._training import logged_losses


def device_config(tmp_path: Path, name: str, device: torch.device, **sections) -> dict:
    """tests/conftest.py's `tiny_config` (tiny-llama, 4 steps of 2 rows) in fp32, on `device`."""
    data = tmp_path / "train.jsonl"
    if not data.exists():
        write_jsonl(data, alpaca_records(40, seed=3))
    cfg = tiny_config(tmp_path / name, data, **sections)
    cfg.setdefault("hardware", {})["device"] = device.type
    return cfg


def trained_losses(cfg: dict) -> tuple[list[float], Trainer]:
    """Train `cfg` to the end: the losses it logged, and the trainer."""
    trainer = Trainer(load_config(None, base=cfg))
    trainer.train()
    return logged_losses(Path(cfg["output_dir"])), trainer
