"""Training stages: each provides record encoding and a loss; they all run in the one trainer loop."""

from shardforge.stages.base import Stage
from shardforge.stages.pretrain import PretrainStage
from shardforge.stages.sft import SFTStage

STAGES: dict[str, type] = {"pt": PretrainStage, "sft": SFTStage}


def get_stage(name: str) -> Stage:
    return STAGES[name]()


__all__ = ["STAGES", "Stage", "get_stage"]
