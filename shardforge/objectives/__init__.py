"""Training objectives (the config's `method.stage`): each provides encoding, grouping, collation and the
loss; they all run in the one trainer loop."""

from __future__ import annotations

from shardforge.config.schema import MethodSection
from shardforge.objectives.base import Objective
from shardforge.objectives.preference import DPOObjective, KTOObjective
from shardforge.objectives.pretrain import PretrainObjective
from shardforge.objectives.reward import RewardObjective
from shardforge.objectives.rl import GRPOObjective, PPOObjective
from shardforge.objectives.sft import SFTObjective

OBJECTIVES: dict[str, type] = {
    "pt": PretrainObjective,
    "sft": SFTObjective,
    "rm": RewardObjective,
    "dpo": DPOObjective,
    "kto": KTOObjective,
    "grpo": GRPOObjective,
    "ppo": PPOObjective,
}


def build_objective(method: MethodSection | str) -> Objective:
    """The objective of a `method` section (or of a bare stage name); hyper-parameters such as a beta or a
    reference model come from that section as objectives gain them."""
    section = MethodSection(stage=method) if isinstance(method, str) else method
    return OBJECTIVES[section.stage](section)


def score_labels(method: MethodSection) -> int:
    """The outputs of the score head the stage's model has instead of the LM head (0: none)."""
    return getattr(OBJECTIVES[method.stage], "num_labels", 0)


__all__ = ["OBJECTIVES", "Objective", "build_objective", "score_labels"]
