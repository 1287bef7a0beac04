"""Build what a run needs from the config: tokenizer and model (HF folder or preset)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.config.schema import ModelSection
from shardforge.dtypes import TORCH_DTYPES
from shardforge.errors import ModelError
from shardforge.models import build_preset, load_model
from shardforge.models.io import Prune, hf_config, read_config_json, weight_files
from shardforge.models.presets import preset_config
from shardforge.models.quantize import quantize_model
from shardforge.models.spec import spec_for

# What AutoTokenizer builds a tokenizer from; without any of them it quietly makes an empty one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model_source(model: ModelSection, weights: bool = True) -> Any:
    """Fail fast (before the data is read) on a missing folder, a missing config.json, an unsupported family
    or an unknown preset. Returns the model's shape (our config; a preset's vocabulary is not known yet).
    `weights=False`: the shape is all that is needed (planning), config.json alone will do."""
    if model.preset is not None:
        return preset_config(model.preset, vocab_size=1)
    folder = Path(model.path)
    if not folder.is_dir():
        raise ModelError(f"model.path {model.path!r} is not a folder (expected a Hugging Face model folder)")
    meta = read_config_json(folder)
    spec = spec_for(meta.get("model_type"), meta.get("architectures"), model.backend)
    try:  # a folder with config.json alone is a clear error here, not a surprise later
        if weights:
            weight_files(folder)
    except ModelError as exc:
        raise ModelError(
            f"model.path: {exc} (a model folder needs its weights besides config.json)"
        ) from None
    return spec.config_from_hf(hf_config(folder))


def load_tokenizer(model: ModelSection) -> Any:
    from transformers import AutoTokenizer

    folder = model.tokenizer or model.path
    if folder is None or not Path(folder).is_dir():
        raise ModelError(f"tokenizer folder {folder!r} does not exist (set model.tokenizer to a folder)")
    if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        key = "model.tokenizer" if model.tokenizer else "model.path"
        raise ModelError(
            f"{key} {folder!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); set model.tokenizer "
            f"to a folder that has one"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load a tokenizer from {folder}: {first}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def planning_shape(model: ModelSection) -> Any:
    """The model's shape where no weights are needed (planning, dry runs): config.json alone for a folder; a
    preset with its tokenizer's vocabulary."""
    shape = check_model_source(model, weights=False)
    if model.preset is not None:
        shape = dataclasses.replace(shape, vocab_size=len(load_tokenizer(model)))
    return shape


def model_source(model: ModelSection) -> tuple[Any, Any]:
    """(the model's shape, its tokenizer), each checked in that order: a bad folder is reported as such
    before the tokenizer is looked for in it. A preset's vocabulary is its tokenizer's."""
    shape = check_model_source(model)
    tokenizer = load_tokenizer(model)
    if model.preset is not None:
        shape = dataclasses.replace(shape, vocab_size=len(tokenizer))
    return shape, tokenizer


def build_model(
    model: ModelSection,
    tokenizer: Any,
    seed: int,
    device: torch.device,
    prune: Prune | None = None,
    num_labels: int = 0,
) -> nn.Module:
    """The model of a run, built directly on `device`; `prune` (a pipeline split) drops what this rank does
    not hold before any memory is allocated. `num_labels` > 0: a score head instead of the LM head."""
    dtype, nf4 = TORCH_DTYPES[model.dtype], model.quantize == "nf4"
    if model.preset is not None:
        net = build_preset(
            model.preset, len(tokenizer), dtype, seed, device, prune=prune, num_labels=num_labels
        )
        if nf4:
            quantize_model(net)
        return net
    net = load_model(model.path, dtype, device, prune, nf4, num_labels, seed, model.backend)
    if len(tokenizer) > net.config.vocab_size:
        raise ModelError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {net.config.vocab_size}"
        )
    return net
