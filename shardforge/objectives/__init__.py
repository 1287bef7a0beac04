"""Training stages: each provides record encoding and a loss; they all run in the one trainer loop."""

from shardforge.objectives.base import Stage
from shardforge.objectives.pretrain import PretrainStage
from shardforge.objectives.sft import SFTStage

STAGES: dict[str, type] = {"pt": PretrainStage, "sft": SFTStage}


def get_stage(name: str) -> Stage:
    return STAGES[name]()


__all__ = ["STAGES", "Stage", "get_stage"]
