"""The optimizer a run uses (train.optimizer): AdamW, or one of the optimizers LLaMA-Factory's users pick."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class OptimizerSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: Literal["adamw"] = "adamw"
