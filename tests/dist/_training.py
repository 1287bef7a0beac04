"""Shared by the parity tests: train configs on a rank, compare a run with a reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardforge.config import load_config
from shardforge.models import save_model
from shardforge.models.common.config import DecoderConfig
from shardforge.models.llama.model import Decoder
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER


def train_runs(configs: list[dict], objective=None) -> list[dict]:
    """Train each config in turn on this rank (with `objective` instead of the config's, if given); full
    weights come back from rank 0."""
    out = []
    for cfg in configs:
        trainer = Trainer(load_config(None, base=cfg), objective=objective)
        result = trainer.train()
        state = trainer.full_state_dict()
        main = not dist.is_initialized() or dist.get_rank() == 0
        powersgd = getattr(trainer.model, "powersgd_state", None)
        reference = getattr(trainer.objective, "reference_model", None)  # a preference run's frozen copy
        local = [
            p.to_local() if hasattr(p, "to_local") else p for p in (reference or nn.Module()).parameters()
        ]
        out.append(
            {
                "losses": [r["loss"] for r in result.history],
                "grad_norms": [r["grad_norm"] for r in result.history],
                "aux_losses": [r.get("moe_aux_loss") for r in result.history],
                "eval_loss": result.eval_loss,
                "state": state if main else None,
                "memory": trainer.memory,
                "layout": trainer.dims.describe(),
                "run_dir": str(trainer.run_dir),
                "powersgd": powersgd.compression_stats() if powersgd is not None else None,
                "reference_bytes": sum(t.numel() * t.element_size() for t in local),
            }
        )
    return out


def assert_same(run: dict, ref: dict, rel: float = 1e-5, atol: float = 5e-5, loss_atol: float = 1e-9) -> None:
    """Same loss and global gradient norm at every step (relative `rel`), the same eval loss and the same
    final weights. Adam divides by the root of the squared-gradient average, so an element whose gradient is
    ~1e-9 (an embedding row of a rare token) turns last-bit differences of a reordered sum into weight
    differences of a few 1e-5 over a few steps: hence the absolute tolerance on weights. A loss that has
    fallen to ~1e-5 (a toy objective solved) is a difference of log-prob sums of ~50 in fp32, whose last
    bits move it by ~1e-10: hence 1e-9 absolute on losses (`loss_atol`: an RL loss whose advantages cancel
    is a sum of terms of both signs that ends near 0)."""
    assert len(run["losses"]) == len(ref["losses"])
    assert run["losses"] == pytest.approx(ref["losses"], rel=rel, abs=loss_atol), run["layout"]
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=rel), (
        f"{run['layout']}: {run['grad_norms']} against {ref['grad_norms']}"
    )
    assert (run["eval_loss"] is None) == (ref["eval_loss"] is None)
    if ref["eval_loss"] is not None:
        assert run["eval_loss"] == pytest.approx(ref["eval_loss"], rel=rel), run["layout"]
    assert run["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(
            run["state"][key],
            value,
            rtol=1e-4,
            atol=atol,
            msg=lambda m, key=key: f"{run['layout']}: {key}: {m}",
        )


def assert_tracks(run: dict, ref: dict) -> None:
    """A low-precision layout against one process in the same precision. The two round differently (FSDP2
    casts the weights, autocast the matmul inputs; sums run in another order), so the bound is low-precision
    noise (measured: losses within 3e-4, gradient norms within 1e-3, the loss movement within 0.04%), yet far
    below what a wrong or missing gradient does to a run whose loss moves by 0.6-1.2 over these steps."""
    assert len(run["losses"]) == len(ref["losses"]) > 1
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-3), run["layout"]
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=5e-3), run["layout"]
    moved, ref_moved = run["losses"][-1] - run["losses"][0], ref["losses"][-1] - ref["losses"][0]
    assert ref_moved < -0.3 and moved == pytest.approx(ref_moved, rel=1e-2), run["layout"]


class Interrupted(Exception):
    """Raised by a test to stop a run as if its process had died."""


def stopped_at(config: dict, step: int) -> None:
    """Train until the checkpoint of `step` is saved, then die (as a killed job would)."""
    trainer = Trainer(load_config(None, base=config))

    def stop(_trainer, saved, _folder):
        if saved == step:
            raise Interrupted

    trainer.add_hook("save", stop)
    with pytest.raises(Interrupted):
        trainer.train()


def stopped_and_resumed(config: dict, step: int) -> Trainer:
    """Run `config` until its checkpoint at `step`, stop it there, and run it again to the end (the resumed
    trainer is returned)."""
    stopped_at(config, step)
    resumed = Trainer(load_config(None, base=config))
    resumed.train()
    assert resumed.start_step == step
    return resumed


def logged(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def logged_losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in logged(run_dir)]


def tiny_model_folder(folder: Path, vocab_size: int, seed: int, **shape) -> dict:
    """An HF folder of a small Llama-family model (hidden 64, 4 query heads of 16; `shape` sets the rest),
    as the `model` section of a config."""
    cfg = DecoderConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_heads=4, head_dim=16, **shape
    )
    model = Decoder(cfg)
    model.init_weights(seed=seed)
    return {"path": str(save_model(model, folder / "model")), "preset": None, "tokenizer": str(TOKENIZER)}


def parity_train(steps: int, mb: int, accum: int = 2) -> dict:
    """The train section of the parity runs: a few steps, accumulation, a high enough rate to move weights.
    Adam's eps at 1e-6, not 1e-8: Adam moves an element by ~lr whatever its gradient's size, so an element
    whose gradient is rounding noise (~1e-9, of either sign by the order of a sum) moved the weights of two
    layouts apart by ~lr and their second step's gradient norms by up to 4e-5 (measured, with any RMSNorm
    backward); at 1e-6 such an element barely moves and the layouts stay within 5e-6."""
    return {
        "steps": steps,
        "micro_batch": mb,
        "grad_accum": accum,
        "lr": 3e-3,
        "warmup": 1,
        "log_every": 1,
        "eps": 1e-6,
    }
