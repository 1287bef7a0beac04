"""The registry of training stages (the config's `method.stage`): each name maps to the objective that
implements it, as "module:Class" (or the class itself, for a stage registered at run time). A new stage is
one file in objectives/ and one line here; the schema validates `method.stage` against this registry and the
web form offers its names, so nothing else lists stages.

It lives in the config layer because the schema reads it, and names the objectives by import path because
objectives sit above config (they read its sections)."""

from __future__ import annotations

from typing import Any

STAGES: dict[str, Any] = {
    "pt": "shardforge.objectives.pretrain:PretrainObjective",
    "sft": "shardforge.objectives.sft:SFTObjective",
    "rm": "shardforge.objectives.reward:RewardObjective",
    "dpo": "shardforge.objectives.preference:DPOObjective",
    "kto": "shardforge.objectives.preference:KTOObjective",
    "grpo": "shardforge.objectives.rl:GRPOObjective",
    "ppo": "shardforge.objectives.rl:PPOObjective",
}


def register_stage(name: str, objective: type | str) -> None:
    """Add a stage: `objective` is its class (or "module:Class"). The config accepts it from then on."""
    STAGES[name] = objective


def known_stage(name: str) -> str:
    """`name` if it is a registered stage; else a ValueError listing the stages there are."""
    if name not in STAGES:
        raise ValueError(f"{name!r} is not one of {', '.join(STAGES)}")
    return name


class Choices:
    """Annotation metadata for a text field whose valid values are known only at run time (the web form
    offers them as a choice)."""

    def __init__(self, values: Any) -> None:
        self.values = values  # a callable returning the choices now

    def __call__(self) -> tuple:
        return tuple(self.values())
