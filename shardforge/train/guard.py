"""The NaN guard: a non-finite global gradient norm (the same on every rank, so every rank decides alike)
skips the update; too many in a row halt the run with advice instead of training on garbage."""

from __future__ import annotations

from shardforge.errors import TrainingError
from shardforge.log import get_logger

log = get_logger(__name__)


class NonFiniteGuard:
    def __init__(self, limit: int, checkpoints: str, bad_steps: int = 0) -> None:
        self.limit, self.checkpoints = limit, checkpoints
        self.bad_steps, self.in_a_row = bad_steps, 0  # bad_steps: over the whole run (checkpointed)

    def allow(self, finite: bool) -> bool:
        """Whether this step's update may be applied."""
        if finite:
            self.in_a_row = 0
            return True
        self.bad_steps += 1
        self.in_a_row += 1
        log.warning(f"non-finite loss or gradient norm: update skipped ({self.in_a_row} in a row)")
        if self.in_a_row >= self.limit:
            raise TrainingError(
                f"training diverged: {self.limit} steps in a row had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={self.limit}); lower train.lr, set train.clip, check the data, or "
                f"prefer bf16 to fp16; the latest checkpoint (if any) is in {self.checkpoints}"
            )
        return False
