"""LLaMA-Factory's training tricks against their reference implementations: the DFT loss (LF's own
`dft_loss_func`, read from its source) and NEFTune (transformers' `neftune_post_forward_hook`), each over 3
optimizer steps of our trainer against transformers' model trained on the same batches."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.neftune import neftune_post_forward_hook

from shardforge.config import load_config
from shardforge.errors import ConfigError
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.training_reference import STEPS, ce_sum, hf_steps, lf_function, train_ours


def train_theirs(folder: Path, batches: list, loss_fn: Any, noises: list | None = None) -> torch.nn.Module:
    """transformers' model on the same micro-batches (with NEFTune's hook, given the noise ours drew)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    if noises is not None:  # transformers' hook, its uniform draw replaced by the noise ours drew
        embed = model.get_input_embeddings()
        embed.neftune_noise_alpha = 5.0
        drawn = iter(noises)

        def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            noise = next(drawn)
            bound = 5.0 / math.sqrt(output.size(1) * output.size(2))
            assert noise.abs().max() <= bound and noise.abs().max() > 0.9 * bound
            original = torch.Tensor.uniform_
            torch.Tensor.uniform_ = lambda t, low, high: t.copy_(noise)  # type: ignore[method-assign]
            try:
                return neftune_post_forward_hook(module, inputs, output)
            finally:
                torch.Tensor.uniform_ = original  # type: ignore[method-assign]

        embed.register_forward_hook(hook)
    return hf_steps(model, batches, loss_fn)


def assert_same_weights(trainer: Trainer, theirs: torch.nn.Module) -> None:
    ours = AutoModelForCausalLM.from_pretrained(trainer.run_dir / "final", dtype=torch.float32)
    reference = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=1e-5, atol=1e-5, msg=name)
    assert not torch.equal(reference["model.embed_tokens.weight"], trainer_start(trainer))


def trainer_start(trainer: Trainer) -> torch.Tensor:
    base = AutoModelForCausalLM.from_pretrained(trainer.run_dir.parent / "base", dtype=torch.float32)
    return base.get_input_embeddings().weight


@pytest.mark.slow
def test_dft_loss_equals_llamafactory_s_over_three_steps(tmp_path):
    trainer, batches = train_ours(tmp_path, method={"sft": {"loss": "dft"}})
    assert len(batches) == STEPS and all(len(b.micro) == 2 for b in batches)
    theirs = train_theirs(tmp_path / "base", batches, lf_function("dft_loss_func", "_dft_cross_entropy"))
    assert_same_weights(trainer, theirs)


def test_dft_loss_is_ce_weighted_by_the_detached_probability():
    from shardforge.config.method_schema import MethodSection
    from shardforge.objectives.sft import SFTObjective

    logps = torch.tensor([-0.1, -2.0, -0.7], requires_grad=True)
    dft = SFTObjective(MethodSection(sft={"loss": "dft"}))
    loss = dft.loss(logps, None)["loss"]  # type: ignore[arg-type]
    torch.testing.assert_close(loss, -(logps * logps.exp()).sum())
    loss.backward()
    torch.testing.assert_close(logps.grad, -logps.detach().exp())  # p is a constant of the gradient
    assert dft.summed is False and SFTObjective().summed is True


@pytest.mark.slow
def test_neftune_equals_transformers_hook_over_three_steps(tmp_path, monkeypatch):
    from shardforge.train import neftune

    drawn: list[torch.Tensor] = []
    original = neftune.NEFTune.__init__

    def keep(self: Any, *args: Any) -> None:
        original(self, *args)
        self.drawn = drawn

    monkeypatch.setattr(neftune.NEFTune, "__init__", keep)
    # one row a micro-batch: transformers' width (the batch's, padding included) is the row's length, ours
    train = {"neftune_alpha": 5.0, "micro_batch": 1, "grad_accum": 4}
    trainer, batches = train_ours(tmp_path, train=train)
    assert len(drawn) == 4 * STEPS  # a draw per training forward (the evaluation draws none)
    theirs = train_theirs(tmp_path / "base", batches, ce_sum, noises=drawn)
    assert_same_weights(trainer, theirs)


def test_neftune_noise_is_keyed_by_step_and_row_not_by_layout():
    from shardforge.train.neftune import NEFTune

    noise = NEFTune(alpha=5.0, seed=3, pad_id=0)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    both = noise.noise(ids, 16)
    torch.testing.assert_close(noise.noise(ids[1:, :3], 16)[0], both[1, :3])  # alone, unpadded: the same
    assert both[0].abs().max() <= 5.0 / math.sqrt(4 * 16) and both[0].abs().max() > 0.9 * 5.0 / 8
    assert both[1].abs().max() > 5.0 / math.sqrt(4 * 16)  # 3 tokens long: the bound is the row's own
    assert not both[1, 3].any()  # padding gets none
    noise.step += 1
    assert not torch.equal(noise.noise(ids, 16), both)  # a new step, new noise


def test_neftune_refuses_layouts_that_split_a_row(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(4))
    for key in ("tp", "cp", "pp"):
        cfg = tiny_config(tmp_path, data, train={"neftune_alpha": 5.0}, parallel={key: 2})
        with pytest.raises(ConfigError, match=f"train.neftune_alpha with parallel.{key}=2"):
            load_config(None, base=cfg)
