"""What every config section shares: unknown keys refused, and the annotated types of path and stage keys."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from shardforge.config.paths import FileRef
from shardforge.config.stages import STAGES, Choices, known_stage

# A key whose value is a file or folder (config/paths.py); the web UI keeps all of them inside its root.
FilePath = Annotated[str, FileRef()]
ModelPath = Annotated[str, FileRef(model=True)]  # a model to load, which may read other folders besides

# A registered stage name (config/stages.py); the web form offers the registry's names.
StageName = Annotated[str, AfterValidator(known_stage), Choices(lambda: STAGES)]


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
