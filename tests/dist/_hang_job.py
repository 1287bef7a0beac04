"""One rank of a job in which rank 1 hangs in step 2 (run as a script by test_fault_tolerance)."""

from __future__ import annotations

import os
import sys
import time

import yaml

from shardforge.config import load_config
from shardforge.train.trainer import Trainer


def main(config_path: str) -> None:
    original = Trainer.train_step

    def step_then_hang(self):
        if self.step == 2 and os.environ["RANK"] == "1":
            time.sleep(600)  # stuck: rank 0 waits for it in the step's first collective
        return original(self)

    Trainer.train_step = step_then_hang
    with open(config_path) as f:
        config = yaml.safe_load(f)
    Trainer(load_config(None, base=config)).train()


if __name__ == "__main__":
    main(sys.argv[1])
