"""Any training checkpoint (any layout, any world size) -> a Hugging Face folder (or, for LoRA, a PEFT adapter
folder, or with `merge` the adapters merged into the base), in one process. A run without checkpoints
(`checkpoint.every` unset) exports what it handed back (its final/), and a PEFT adapter folder merges onto its
base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.adapters.apply import apply_finetuning
from shardforge.adapters.lora import LoRALinear, is_adapter_key, pissa_converted
from shardforge.adapters.merge import merge_adapter
from shardforge.adapters.peft_format import merged_state, save_adapter
from shardforge.checkpoint.store import find_latest, resolve_checkpoint
from shardforge.checkpoint.trainer_state import load_model_weights, read_trainer_state
from shardforge.config import Config, load_config
from shardforge.config.method_schema import LoraSection, OFTSection
from shardforge.config.schema import ModelSection
from shardforge.errors import CheckpointError
from shardforge.models import load_model, save_model
from shardforge.models.build import build_model, load_tokenizer
from shardforge.models.head import attach_critic
from shardforge.models.io import copy_processor_files
from shardforge.models.spec import spec_for
from shardforge.objectives import score_labels
from shardforge.objectives.rl import critic_folder, load_critic
from shardforge.parallel.tensor_parallel import pad_vocab, strip_vocab_padding


def write_model_folder(
    model: nn.Module,
    state: dict[str, torch.Tensor] | None,
    config: Config,
    tokenizer: Any,
    to: Path,
    merge: bool = False,
) -> str:
    """Write a run's full weights (our names, unpadded) as what its method hands back: an HF folder, or for
    LoRA a PEFT adapter folder (the merged HF folder with `merge`). `state` None: the model's own weights.
    Returns what was written."""
    state = model.state_dict() if state is None else state
    # PPO's value head stays behind; its separate critic model is written beside the policy
    state = {k: v for k, v in state.items() if not k.startswith("value_head.")}
    critic = {k.removeprefix("critic."): v for k, v in state.items() if k.startswith("critic.")}
    if critic:  # an HF sequence classifier of its own, in critic/
        state = {k: v for k, v in state.items() if not k.startswith("critic.")}
        save_model(model.critic, to / "critic", tokenizer=tokenizer, state_dict=critic)
    beside = " and its critic (critic/)" if critic else ""
    merge = merge or getattr(model.config, "num_labels", 0) > 0  # a score head trains whole: not an adapter
    method = config.method
    settings: LoraSection | OFTSection = method.oft if method.finetuning == "oft" else method.lora
    if method.finetuning == "lora" and method.lora.init == "pissa":  # as the plain LoRA it amounts to
        state = pissa_converted(state)
        factor = 2**0.5 if method.lora.rslora else 2.0  # peft's: the same scale at twice the rank
        settings = method.lora.model_copy(
            update={"rank": 2 * method.lora.rank, "alpha": factor * method.lora.alpha}
        )
    if method.adapters and not merge:
        adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
        conv = any(isinstance(m, LoRALinear) and m.fan_in_fan_out for m in model.modules())  # GPT-2's Conv1D
        base = config.model.path
        others = plain_modules(model.config.family, state)
        save_adapter(to, model.config.family, adapters, settings, base, tokenizer, conv, others)
        return (
            f"{method.finetuning.upper() if method.finetuning == 'oft' else 'LoRA'} adapter (PEFT format)"
            + beside
        )
    if method.adapters:
        state = merged_state(model, state)
    save_model(
        model, to, tokenizer=tokenizer, state_dict=state, expert_layout=config.checkpoint.expert_layout
    )
    merged = ", adapters merged" if method.adapters else ""
    return f"model (HF format{merged})" + beside


def plain_modules(family: str, state: dict[str, torch.Tensor]) -> list[str]:
    """The HF names of the modules in a full state (our names) that hold a weight and carry no adapter."""
    adapted = {k.rpartition(".lora_")[0] if ".lora_" in k else k.removesuffix(".oft_R") for k in state
               if is_adapter_key(k)}  # fmt: skip
    key_to_hf = spec_for(family).key_to_hf
    return [
        key_to_hf(k).removesuffix(".weight")
        for k in state
        if k.endswith(".weight") and k.removesuffix(".weight") not in adapted
    ]


def export_checkpoint(path: Path, to: Path, merge: bool = False) -> tuple[Path, Path, str]:
    """Write the weights of a checkpoint (+ the run's tokenizer) as an HF folder; returns (the checkpoint
    used, the folder written, what it holds). A LoRA or freeze checkpoint holds only what trained: the base
    is read from the run's model.path."""
    folder = resolve_checkpoint(path)
    config = load_config(folder / "config.yaml")  # the run's resolved config, saved with its checkpoints
    tokenizer = load_tokenizer(config.model)
    num_labels = score_labels(config.method)
    model = build_model(
        config.model, tokenizer, config.train.seed, torch.device("cpu"), num_labels=num_labels
    )
    apply_finetuning(model, config.method, config.train.seed)  # the checkpoint holds the adapters
    critic = critic_folder(config.method)
    if critic is not None:  # PPO's separate critic: the checkpoint holds its trained weights
        attach_critic(model, load_critic(critic, model))
    vocab = model.config.vocab_size
    pad_vocab(model, read_trainer_state(folder)["vocab_rows"])  # as saved: padded for the run's TP degree
    load_model_weights(folder, model)
    weights = strip_vocab_padding(model.state_dict(), vocab)
    return folder, to, write_model_folder(model, weights, config, tokenizer, to, merge)


def export(path: Path, to: Path, merge: bool = False, base: Path | None = None) -> tuple[Path, Path, str]:
    """`shardforge export`: a checkpoint, a run folder (its newest complete checkpoint, else what it handed
    back in final/) or a PEFT adapter folder; returns (what was read, the folder written, what it holds)."""
    if (path / "adapter_config.json").is_file():
        return path, to, export_adapter(path, to, merge, base)
    final = path / "final"
    if final.is_dir() and find_latest(path / "checkpoints", quiet=True) is None:
        why = f"no checkpoints in {path} (checkpoint.every is unset)"
        if (final / "adapter_config.json").is_file():
            what = export_adapter(final, to, merge, base)
            return final, to, f"{why}; its final/ is a PEFT adapter: {what}"
        if (final / "config.json").is_file():
            shutil.copytree(final, to, dirs_exist_ok=True)
            return final, to, f"{why}; its final/ is an HF model folder already: copied as it is"
    if base is not None:
        raise CheckpointError(f"--base goes with a PEFT adapter folder; {path} is not one")
    return export_checkpoint(path, to, merge)


def export_adapter(adapter: Path, to: Path, merge: bool, base: Path | None = None) -> str:
    """A PEFT LoRA folder: with `merge`, folded into its base (`base`, else the adapter's
    base_model_name_or_path) and written as an HF folder in the base's dtype; without, copied as it is."""
    if not merge:
        shutil.copytree(adapter, to, dirs_exist_ok=True)
        return "LoRA adapter (PEFT format), copied as it is (--merge folds it into its base)"
    config = json.loads((adapter / "adapter_config.json").read_text())
    named = config.get("base_model_name_or_path")
    base = base or (Path(named) if named else None)
    if base is None or not (base / "config.json").is_file():
        raise CheckpointError(
            f"{adapter}: its base_model_name_or_path {named!r} is not a local model folder; give the base "
            f"folder with --base"
        )
    model = load_model(base)
    merge_adapter(model, adapter)
    own = (adapter / "tokenizer_config.json").is_file() or (adapter / "tokenizer.json").is_file()
    tokenizer = load_tokenizer(ModelSection(path=str(base), tokenizer=str(adapter if own else base)))
    saved = json.loads((base / "config.json").read_text())
    dtype = getattr(torch, str(saved.get("dtype") or saved.get("torch_dtype") or "float32"), torch.float32)
    save_model(model, to, tokenizer=tokenizer, dtype=dtype)
    copy_processor_files(base, to)  # a vision-language base's image processor, where the adapter has none
    return f"merged onto {base}: model (HF format, adapters merged)"
