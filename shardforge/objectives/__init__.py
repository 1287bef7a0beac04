"""Training objectives (the config's `method.stage`): each provides encoding, grouping, collation and the
loss, and declares its traits; they all run in the one trainer loop. The stages are registered in
config/stages.py (one line each)."""

from __future__ import annotations

import importlib

from shardforge.config.method_schema import MethodSection
from shardforge.config.stages import STAGES
from shardforge.data.formats import Reading
from shardforge.objectives.base import BindContext, Objective, Sampler, SourceContext, Traits


def objective_class(stage: str) -> type[Objective]:
    """The class registered for `stage` (imported on first use)."""
    target = STAGES[stage]
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = getattr(importlib.import_module(module), name)
    return target


def build_objective(method: MethodSection | str) -> Objective:
    """The objective of a `method` section (or of a bare stage name); hyper-parameters such as a beta or a
    reference model come from that section."""
    section = MethodSection(stage=method) if isinstance(method, str) else method
    return objective_class(section.stage)(section)


def score_labels(method: MethodSection) -> int:
    """The outputs of the score head the stage's model has instead of the LM head (0: none)."""
    return build_objective(method).traits.score_head


def method_sections(method: MethodSection) -> tuple[str, ...]:
    """The method.* sub-sections a run of `method` reads: its stage's (the objective's declared traits) and
    its finetuning's own (method.lora, method.oft, method.freeze: each named as its finetuning)."""
    own = (method.finetuning,) if method.finetuning in MethodSection.model_fields else ()
    return objective_class(method.stage).traits.sections + own


def reading_of(objective: Objective, system: str | None = None) -> Reading:
    """How the data readers take records for `objective`, with the stages that read each kind of record
    (for messages that name the stage a data set belongs to); `system`: data.default_system."""
    serving: dict[str, list[str]] = {}
    for stage in STAGES:
        serving.setdefault(objective_class(stage).traits.reader, []).append(stage)
    stages = tuple((reader, " or ".join(sorted(names))) for reader, names in serving.items())
    return Reading(objective.traits.reader, objective.name, stages, system)


def reading_for(stage: str) -> Reading:
    """`reading_of` the stage's objective with default settings."""
    return reading_of(build_objective(stage))


__all__ = [
    "BindContext",
    "Objective",
    "Sampler",
    "SourceContext",
    "Traits",
    "build_objective",
    "method_sections",
    "objective_class",
    "reading_for",
    "reading_of",
    "score_labels",
]
