"""The bundled tasks' data sets, read from the JSONL files beside their YAML: no hub and no download, from
any working folder (lm-eval's `dataset_path: json` would resolve `data_files` against the working folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(data_files: dict[str, str] | None = None, **_metadata: Any) -> Any:
    """A `custom_dataset` for lm-eval: {split: file name in this folder} -> a DatasetDict of those splits."""
    import datasets

    splits = {}
    for split, name in (data_files or {}).items():
        lines = (HERE / name).read_text(encoding="utf-8").splitlines()
        splits[split] = datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])
    return datasets.DatasetDict(splits)
