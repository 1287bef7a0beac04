"""GaLore and APOLLO: AdamW whose states for the chosen linear weights live in a low-rank projection of the
gradient, built with their packages as LLaMA-Factory 0.9.5 builds them (`_create_galore_optimizer`,
`_create_apollo_optimizer`): three groups, not decayed / decayed (LF's decay rule) / projected (decayed, with
the rank, interval, scale and projection type).

LF's `layerwise: true` steps each parameter in a post-accumulate-grad hook with an optimizer of its own, which
frees every gradient as soon as it is used. Our loop clips, guards against non-finite steps and reduces over
data parallel after the whole backward, so here `layerwise` runs the same update after the backward: the same
math where LF's applies (one process, grad_accum 1, no clipping: `config.optimizers.layout_refusal` refuses
the rest as LF does), but all gradients are held until the step (docs/optimizers.md, memory).
"""

from __future__ import annotations

import torch
from torch import nn

from shardforge.config.optimizers import ApolloSection, GaloreSection
from shardforge.train.optimizers.groups import projected_params, split_by_decay, state_tensors_of


def _groups(model: nn.Module, section: GaloreSection | ApolloSection, key: str, weight_decay: float,
            projection: dict) -> list[dict]:  # fmt: skip
    projected = projected_params(model, section.targets, f"train.optimizer.{key}.targets")
    decay, nodecay = split_by_decay(model, {id(p) for p in projected})
    groups = [
        {"params": nodecay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
        {"params": projected, "weight_decay": weight_decay, **projection},
    ]
    return [g for g in groups if g["params"]]


def galore_groups(model: nn.Module, section: GaloreSection, weight_decay: float) -> list[dict]:
    projection = {"rank": section.rank, "update_proj_gap": section.update_interval, "scale": section.scale,
                  "proj_type": section.proj_type}  # fmt: skip
    return _groups(model, section, "galore", weight_decay, projection)


def apollo_groups(model: nn.Module, section: ApolloSection, weight_decay: float) -> list[dict]:
    projection = {"rank": section.rank, "proj": section.proj, "proj_type": section.proj_type,
                  "update_proj_gap": section.update_interval, "scale": section.scale,
                  "scale_type": section.scale_type, "scale_front": section.scale_front}  # fmt: skip
    return _groups(model, section, "apollo", weight_decay, projection)


def galore_class() -> type[torch.optim.Optimizer]:
    """galore-torch's GaLoreAdamW, telling memory_report about its projectors' matrices (not in its state)."""
    from galore_torch import GaLoreAdamW

    class GaLoreAdamWCounted(GaLoreAdamW):
        def state_tensors(self) -> list[torch.Tensor]:
            return state_tensors_of(self.state)

    return GaLoreAdamWCounted


def apollo_class() -> type[torch.optim.Optimizer]:
    """apollo-torch's APOLLOAdamW, telling memory_report about its projectors' matrices."""
    from apollo_torch import APOLLOAdamW

    class APOLLOAdamWCounted(APOLLOAdamW):
        def state_tensors(self) -> list[torch.Tensor]:
            return state_tensors_of(self.state)

    return APOLLOAdamWCounted
