"""The optimizers of `train.optimizer.name` other than AdamW: each built from its reference package the way
LLaMA-Factory 0.9.5 builds it (llamafactory/train/trainer_utils.py), so a converted LF run steps the same.

`adamw_8bit` is bitsandbytes' AdamW8bit, not torchao's: it is the class LF's `optim: adamw_bnb_8bit` /
`paged_adamw_8bit` runs (through transformers' Trainer), so parity with LF is parity with the same code; it
runs on CPU in bitsandbytes 0.50 and steps eagerly (torchao's AdamW8bit compiles its step with torch.compile,
minutes on a small CPU). Its limit is the same as LF's: bitsandbytes states are of whole tensors, so the
sharded layouts (FSDP2, TP) are refused (`config.optimizers.layout_refusal`).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import torch
from torch import nn

from shardforge.config.optimizers import OptimizerSection
from shardforge.config.schema import TrainSection
from shardforge.errors import ConfigError
from shardforge.extras import install_hint
from shardforge.train.optimizers.groups import split_by_decay, state_tensors_of
from shardforge.train.optimizers.muon import MuonAdamW, muon_groups
from shardforge.train.optimizers.projected import apollo_class, apollo_groups, galore_class, galore_groups

# the package each choice is built from (the `optimizers` extra): module -> its name on the registry
PACKAGES = {"adamw_8bit": ("bitsandbytes", "bitsandbytes"), "galore": ("galore_torch", "galore-torch"),
            "apollo": ("apollo_torch", "apollo-torch"), "badam": ("badam", "badam"),
            "adam_mini": ("adam_mini", "adam-mini")}  # fmt: skip


def require(name: str) -> None:
    """A clear error, before anything is built, where the chosen optimizer's package is not installed."""
    if name not in PACKAGES:
        return
    module, package = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"train.optimizer.name={name} is built from the {package} package, which is not installed: "
            f"{install_hint('optimizers')} (or {package} alone)"
        )


def adamw_8bit_class() -> type[torch.optim.Optimizer]:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit


def keep_embeddings_32bit(model: nn.Module) -> None:
    """transformers' Trainer (so LF) keeps the states of embeddings in 32 bits under bitsandbytes' 8-bit
    optimizers: register that override before the optimizer is built. The manager is a process-wide singleton
    that keys overrides by (group, position): cleared first, so a run after another in the same process
    (tests, the Python API) does not inherit the earlier optimizer's positions."""
    import bitsandbytes as bnb

    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def projected(
    model: nn.Module, optimizer: OptimizerSection, train: TrainSection
) -> tuple[type[torch.optim.Optimizer], list[dict], dict]:
    """(class, groups, defaults) of GaLore or APOLLO: LF's optim_kwargs are lr, betas and eps."""
    hyper = {"lr": train.lr, "betas": train.betas, "eps": train.eps}
    if optimizer.name == "galore":
        return galore_class(), galore_groups(model, optimizer.galore, train.weight_decay), hyper
    return apollo_class(), apollo_groups(model, optimizer.apollo, train.weight_decay), hyper


def muon(model: nn.Module, optimizer: OptimizerSection, train: TrainSection) -> tuple[type, list[dict], dict]:
    groups = muon_groups(model, optimizer.muon, train.lr, train.weight_decay, train.betas, train.eps)
    return MuonAdamW, groups, {}


def badam(model: nn.Module, optimizer: OptimizerSection, train: TrainSection) -> torch.optim.Optimizer:
    """LF's `_create_badam_optimizer`: a torch AdamW (lr, betas, eps) under BAdam's BlockOptimizer (layer:
    one decoder block trains at a time; LF passes block_prefix_list=None, so embedding and head stay frozen)
    or BlockOptimizerRatio (ratio: a sparse share of every matrix). As in LF, the groups list the not-decayed
    parameters first; BlockOptimizer then rebuilds the active groups with AdamW's defaults, so its weight
    decay is torch's 0.01 whatever train.weight_decay says (LF's behaviour, kept for parity)."""
    section = optimizer.badam
    decay, nodecay = split_by_decay(model, set())
    groups = [{"params": nodecay, "weight_decay": 0.0}, {"params": decay, "weight_decay": train.weight_decay}]
    hyper = {"lr": train.lr, "betas": train.betas, "eps": train.eps}
    named = list(model.named_parameters())
    if section.mode == "layer":
        from badam import BlockOptimizer

        blocks = len({m[1] for n, _ in named if (m := re.match(r"(?:.*\.)?layers\.(\d+)\.", n))})
        if section.start_block is not None and section.start_block >= blocks:
            raise ConfigError(
                f"train.optimizer.badam.start_block={section.start_block}: the model has {blocks} decoder "
                f"blocks (0 to {blocks - 1})"
            )

        class CountedBlockOptimizer(BlockOptimizer):
            def state_tensors(self) -> list[torch.Tensor]:
                """The active block's AdamW states and its fp32 working copies (memory_report)."""
                return state_tensors_of(self.base_optimizer.state) + list(self.param_idx2hp.values())

        return CountedBlockOptimizer(
            base_optimizer=torch.optim.AdamW(groups, **hyper),
            named_parameters_list=named,
            block_prefix_list=None,
            switch_block_every=section.switch_interval,
            start_block=section.start_block,
            switch_mode=section.switch_mode,
            verbose=0,
        )
    from badam import BlockOptimizerRatio

    return BlockOptimizerRatio(
        param_groups=groups,
        named_parameters_list=named,
        update_ratio=section.update_ratio,
        mask_mode=section.mask_mode,
        verbose=0,
        include_embedding=False,
        **hyper,
    )


def adam_mini(model: nn.Module, train: TrainSection, model_config: Any) -> torch.optim.Optimizer:
    """LF's `_create_adam_mini_optimizer`: Adam-mini over the named parameters, its blocks (heads, neurons)
    from hidden_size, num_heads and num_kv_heads (LF reads the HF config's names of the same fields)."""
    from adam_mini import Adam_mini

    if str(model_config.family).startswith("hf:"):  # transformers' own module names (fused qkv, biases)
        raise ConfigError(
            f"train.optimizer.name=adam_mini partitions parameters by Llama-like names (q_proj, k_proj, "
            f"...); {model_config.family} runs on the generic backend with other names: use adamw or muon"
        )
    return Adam_mini(
        named_parameters=model.named_parameters(),
        lr=train.lr,
        betas=train.betas,
        eps=train.eps,
        weight_decay=train.weight_decay,
        dim=model_config.hidden_size,
        n_heads=model_config.num_heads,  # our DecoderConfig's (the generic backend is refused above)
        n_kv_heads=model_config.num_kv_heads,
        verbose=False,
    )
