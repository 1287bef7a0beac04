"""The Train tab's guided choices: the models and data sets found under the root (with what each is), the
starting points (the examples' configs) and the sections a stage and finetuning read. Each choice only
fills form fields: the form stays the one source of the YAML."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardforge.errors import ShardforgeError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"  # the source tree's (an installed wheel has none)
# One-click starting points: the README's demo and the examples that run on its model.
PRESETS = {
    "demo: full SFT of the demo model (README)": "demo.yaml",
    "LoRA SFT on the demo model": "demo_lora.yaml",
    "QLoRA SFT on the demo model": "demo_qlora.yaml",
    "DPO (LoRA) on the demo model": "dpo_lora.yaml",
    "GRPO on the demo model": "grpo_math.yaml",
}
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
NOT_DATA = {"dataset_info.json", "config.json", "metrics.jsonl", "tokenizer.json", "tokenizer_config.json"}
MAX_DEPTH = 5
MAX_FOUND = 200  # of each kind: a root holding a whole disk stays quick


def preset_tree(name: str) -> dict:
    """The config tree of a starting point (its YAML as written: paths relative to the root)."""
    path = EXAMPLES / PRESETS[name]
    if not path.is_file():
        raise ShardforgeError(f"preset {name!r}: {path} is not here (presets come from a source checkout)")
    return yaml.safe_load(path.read_text())


def preset_names() -> list[str]:
    return [name for name, file in PRESETS.items() if (EXAMPLES / file).is_file()]


def _walk(root: Path) -> Iterator[tuple[Path, list[str], list[str]]]:
    """Folders under the root (not hidden ones, at most MAX_DEPTH deep), sorted, with their files."""
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        depth = len(here.relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and depth < MAX_DEPTH)
        yield here, dirs, sorted(files)


# ---- models ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelChoice:
    label: str  # what the picker lists
    path: str | None  # the folder, relative to the root
    preset: str | None
    about: str  # family, parameters, backend


def _millions(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.1f} M"


def describe_model(folder: Path) -> str:
    """A model folder's family, parameter count and backend (ours or transformers' modules), or why it
    cannot train."""
    from shardforge.models.common.costs import param_counts
    from shardforge.models.io import hf_config, read_config_json
    from shardforge.models.spec import spec_for

    try:
        meta = read_config_json(folder)
        spec = spec_for(meta.get("model_type"), meta.get("architectures"))
        count = param_counts(spec.config_from_hf(hf_config(folder))).total
    except (ShardforgeError, OSError, ValueError, TypeError, KeyError) as exc:
        return f"cannot train: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    backend = "generic (transformers' modules)" if spec.name == "hf" else "native"
    return f"{meta.get('model_type')}, {_millions(count)} parameters, {backend} backend"


def model_choices(root: Path) -> list[ModelChoice]:
    """Every folder under the root with a model's config.json, then the built-in presets."""
    from shardforge.models.common.costs import param_counts
    from shardforge.models.presets import preset_config, preset_names

    out = []
    for folder, dirs, files in _walk(root):
        if "config.json" in files and _is_model(folder / "config.json"):
            rel = folder.relative_to(root).as_posix()
            out.append(ModelChoice(rel, rel, None, describe_model(folder)))
            dirs[:] = []  # a model's own sub-folders are not models
            if len(out) >= MAX_FOUND:
                break
    for name in preset_names():
        body = param_counts(preset_config(name, vocab_size=0)).total
        about = f"preset, {_millions(body)} parameters besides the embeddings, native backend"
        out.append(ModelChoice(f"preset: {name}", None, name, about))
    return out


def _is_model(config_json: Path) -> bool:
    try:
        meta = json.loads(config_json.read_text())
    except (ValueError, OSError):  # not JSON, not UTF-8, unreadable
        return False
    return isinstance(meta, dict) and "model_type" in meta


def tokenizer_folders(root: Path) -> list[str]:
    """Folders under the root holding a tokenizer (what a preset's model.tokenizer names)."""
    return [
        folder.relative_to(root).as_posix()
        for folder, _dirs, files in _walk(root)
        if "tokenizer.json" in files or "tokenizer.model" in files
    ][:MAX_FOUND]


# ---- data sets ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetChoice:
    label: str
    entry: dict  # a data.train entry


def dataset_choices(root: Path) -> list[DatasetChoice]:
    """Data files under the root (their format from their first record) and every entry of every
    dataset_info.json under it (an LF data folder lists its entries, not its files, which mean what their
    entries say); model folders and checkpoints are skipped."""
    from shardforge.data.dataset_info import load_dataset_info
    from shardforge.data.formats import detect_format

    files, entries = [], []
    for folder, dirs, names in _walk(root):
        if "config.json" in names or folder.name == "checkpoints":
            dirs[:] = []
            continue
        if "dataset_info.json" in names:  # an LF data folder: its files mean what its entries say
            names = ["dataset_info.json"]
        for name in names:
            path, rel = folder / name, (folder / name).relative_to(root).as_posix()
            if name == "dataset_info.json":
                try:
                    info = load_dataset_info(path)
                except ShardforgeError:
                    continue
                entries += [
                    DatasetChoice(f"{key} ({rel})", {"name": key, "dataset_info": rel})
                    for key, entry in info.items()
                    if isinstance(entry, dict) and "file_name" in entry
                ]
            elif name.endswith(DATA_SUFFIXES) and name not in NOT_DATA and len(files) < MAX_FOUND:
                try:
                    fmt = detect_format(path)
                except (ShardforgeError, OSError, ValueError):
                    continue
                files.append(DatasetChoice(f"{rel} ({fmt})", {"path": rel, "format": fmt}))
    return files + entries[:MAX_FOUND]


def train_entries(labels: list[str], choices: list[DatasetChoice]) -> list[dict]:
    by_label = {c.label: c.entry for c in choices}
    return [by_label[label] for label in labels if label in by_label]


# ---- which sections a run reads ----------------------------------------------------------------------------
ALWAYS = ("run", "model", "data", "method", "train", "checkpoint")
# The keys of the common sections that most runs set, shown in their section; the rest of each such section
# is under "advanced" as "<section> (more)" (an optimizer's settings, streaming, profiling, ...).
ESSENTIAL = {
    "model": ("path", "preset", "tokenizer", "dtype", "adapter", "quantize"),
    "data": ("train", "eval", "max_length", "packing", "train_on_prompt", "template", "default_system"),
    "train": ("steps", "epochs", "micro_batch", "grad_accum", "global_batch", "lr", "schedule", "warmup",
              "warmup_ratio", "weight_decay", "clip", "precision", "seed", "log_every", "eval_every",
              "optimizer.name"),
    "checkpoint": ("every", "keep", "resume", "save_final"),
}  # fmt: skip


def essential(section: str, key: str) -> bool:
    """Whether a key is shown in its section (not under "advanced")."""
    keep = ESSENTIAL.get(section)
    return keep is None or key[len(section) + 1 :] in keep


def shown_sections(stage: str, finetuning: str) -> set[str]:
    """The form sections shown for a stage and finetuning: the common ones and the method.* sub-sections
    the objective declares it reads (objectives/: Traits.sections) with the finetuning's own."""
    from shardforge.config.method_schema import MethodSection
    from shardforge.objectives import method_sections

    try:
        method = MethodSection.model_validate({"stage": stage, "finetuning": finetuning})
    except ValueError:
        return set(ALWAYS)
    return set(ALWAYS) | {f"method.{s}" for s in method_sections(method)}
