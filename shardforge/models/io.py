"""Load an HF checkpoint folder into our model and write our model back as an HF folder."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig

from shardforge.errors import ModelError
from shardforge.models.quantize import QUANTIZED, quantize_model, set_nf4
from shardforge.models.spec import ModelSpec, Slot, spec_for

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_HF_KEYS = ("rotary_emb.inv_freq",)


def read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelError(f"{folder} is not a Hugging Face model folder: {path.name} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None


def hf_config(folder: Path) -> Any:
    """transformers' config of the folder; one its own code cannot read (a value its validation rejects)
    is an error naming the file."""
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, StrictDataclassError) as exc:
        raise ModelError(f"{folder / 'config.json'}: transformers cannot read this config ({exc})") from None
    quantized = config.to_dict().get("quantization_config")
    if quantized:  # AWQ, GPTQ, AQLM, fp8...: packed weights our layers do not read
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise ModelError(
            f"{folder / 'config.json'}: a pre-quantized checkpoint (quantization_config: {method}); "
            "shardforge loads full-precision weights (train over a 4-bit base with model.quantize: nf4)"
        )
    return config


def weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        try:
            names = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ModelError(f"{folder / INDEX_FILE}: not a valid safetensors index ({exc})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelError(
                f"{folder / INDEX_FILE} lists weight files that are missing: {', '.join(missing)}"
            )
        return [folder / name for name in names]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(p.name for p in folder.glob("*.bin"))
    extra = f" (found {', '.join(found)}: convert .bin checkpoints to safetensors first)" if found else ""
    raise ModelError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}{extra}")


Prune = Callable[[nn.Module], None]


def build_empty(
    spec: ModelSpec,
    cfg: Any,
    device: str | torch.device = "cpu",
    prune: Prune | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The model built on the meta device, cut down by `prune` (a pipeline stage keeps its part), then
    given uninitialized memory of `dtype` on `device`: nothing is allocated for what was pruned away, and
    nothing in a wider dtype than the weights'."""
    with torch.device("meta"):
        model = spec.build(cfg)
    if prune is not None:
        prune(model)
    model.to(dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.reset_buffers()
    return model


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    prune: Prune | None = None,
    quantize: bool = False,
    num_labels: int = 0,
    seed: int = 0,
    backend: str = "auto",
) -> nn.Module:
    """Read an HF folder (config.json + safetensors, single or sharded) into our model implementation
    (only the weights the `prune`d model keeps are read). `quantize`: the block linears in NF4, each
    quantized as it is read (models/quantize.py). `num_labels` > 0: a score head of that many outputs (a
    reward model), freshly initialized from `seed` unless the folder already has one of that shape.
    `backend`: model.backend (models/spec.py: spec_for)."""
    folder = Path(path)
    meta = read_config_json(folder)
    spec = spec_for(meta.get("model_type"), meta.get("architectures"), backend)
    cfg = spec.config_from_hf(hf_config(folder))
    if spec.load_folder is not None:  # the generic backend: transformers reads the folder
        if prune is not None:
            raise ModelError(
                f"{folder}: a pipeline part is not available on the generic backend ({cfg.family})"
            )
        fresh_head = num_labels > 0 and cfg.num_labels != num_labels
        if num_labels > 0:
            cfg = cfg.with_score_head(num_labels)
        model = spec.load_folder(folder, cfg, dtype, device)
        if fresh_head:
            model.init_head(seed=seed)
        if quantize:  # QLoRA: the block linears in NF4, once loaded
            quantize_model(model)
        return model
    fresh_head = num_labels > 0 and cfg.num_labels != num_labels
    if fresh_head:
        cfg = cfg.with_score_head(num_labels)
    model = build_empty(spec, cfg, device, prune, dtype)
    if quantize:  # no full-precision memory for what is read in NF4: placeholders until then
        for key, param in list(model.named_parameters()):
            if QUANTIZED.match(key):
                module_name, _, name = key.rpartition(".")
                meta_param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
                setattr(model.get_submodule(module_name), name, meta_param)
    files, partial = weight_files(folder), prune is not None
    load_hf_weights(model, spec, files, dtype, partial, quantize, device, ("lm_head.weight",) * fresh_head)
    if fresh_head:
        model.init_head(seed=seed)
    return model


@torch.no_grad()
def load_hf_weights(
    model: nn.Module,
    spec: ModelSpec,
    files: list[Path],
    dtype: torch.dtype,
    partial: bool = False,
    quantize: bool = False,
    device: str | torch.device = "cpu",
    fresh: tuple[str, ...] = (),
    claimed: frozenset[str] = frozenset(),
) -> None:
    """Copy safetensors weights into the model's parameters, checking that every parameter is filled
    exactly once. A `partial` model (a pipeline stage) skips the weights of the other stages; with
    `quantize`, the block linears' meta placeholders become NF4 weights on `device`. `fresh` names our
    parameters the caller initializes instead (a new head): the file's tensors of that name are skipped.
    `claimed`: HF keys the caller reads itself (a pre-quantized checkpoint's packed linears)."""
    params = dict(model.named_parameters())
    if model.untied_copy:  # a stage's copy of the tied embedding is filled from it
        params.pop("lm_head.weight")
    known = (
        set(params) if not partial else {k for k, _ in _whole_model(spec, model.config).named_parameters()}
    )
    missing = set(params) - set(fresh)
    filled: dict[str, int] = {}  # elements written per parameter (several HF tensors may fill one)
    tied = getattr(model.config, "tie_embeddings", False)
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # safetensors raises its own error type for truncated or corrupt files
            raise ModelError(
                f"{file}: cannot read safetensors weights ({exc}); the file may be truncated"
            ) from None
        with handle as f:
            for hf_key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if hf_key.endswith(_IGNORED_HF_KEYS) or (tied and hf_key == "lm_head.weight"):
                    continue
                if hf_key in claimed:
                    continue
                placed = spec.key_from_hf(hf_key)
                slot = placed if isinstance(placed, Slot) else Slot(placed)
                key = slot.key
                if key in fresh:
                    continue
                if key not in known:
                    raise ModelError(f"{file.name}: weight {hf_key!r} does not exist in this model config")
                targets = [params[key]] if key in params else []
                if key == "embed_tokens.weight" and model.untied_copy:
                    targets.append(model.lm_head.weight)
                if not targets:
                    continue  # another pipeline stage's weight
                tensor = f.get_tensor(hf_key)
                views = [slot.view(t) for t in targets]
                if tensor.shape != views[0].shape:
                    raise ModelError(
                        f"{file.name}: weight {hf_key!r} has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(views[0].shape)}"
                    )
                if quantize and QUANTIZED.match(key):
                    set_nf4(model, key, tensor.to(device=device, dtype=dtype))
                else:
                    for view in views:
                        view.copy_(tensor.to(dtype))
                filled[key] = filled.get(key, 0) + tensor.numel()
                if filled[key] > targets[0].numel():
                    raise ModelError(f"{file.name}: weight {hf_key!r} fills a part of {key!r} a second time")
                if filled[key] == targets[0].numel():
                    missing.discard(key)
    if missing:
        names = ", ".join(sorted(spec.key_to_hf(k) for k in missing)[:8])
        raise ModelError(f"checkpoint is missing {len(missing)} weight(s): {names}")


def _whole_model(spec: ModelSpec, cfg: Any) -> nn.Module:
    with torch.device("meta"):
        return spec.build(cfg)


def hf_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None, expert_layout: str = "per_expert"
) -> dict[str, torch.Tensor]:
    """Our weights under HF names (the tied head is written once, as the embedding; MoE experts per expert,
    as published checkpoints hold them, or in transformers 5's `fused` 3-D tensors). `state_dict`
    overrides the model's own (e.g. full tensors gathered from a sharded model)."""
    spec = spec_for(model.config.family)
    tied = model.config.tie_embeddings
    scores = getattr(model.config, "num_labels", 0) > 0  # a score head is HF's `score`
    head = spec.key_from_hf("lm_head.weight")  # our name of the head
    out = {}
    for key, tensor in (model.state_dict() if state_dict is None else state_dict).items():
        if tied and key == head:
            continue
        if scores and key == "lm_head.weight":
            out["score.weight"] = tensor.detach().contiguous().cpu()
            continue
        for name, part in spec.tensors_to_hf(key, tensor, expert_layout):
            out[name] = part.detach().contiguous().cpu()
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return shards


# A vision-language model's processor besides its tokenizer: what AutoProcessor / AutoImageProcessor read
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def copy_processor_files(source: Path, folder: Path) -> None:
    """The processor's files of `source` (the tokenizer's folder, or a base model's), copied into an
    exported folder beside it where it has none of its own."""
    if source.resolve() == folder.resolve():
        return
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (folder / name).is_file():
            shutil.copyfile(source / name, folder / name)


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    """An HF folder's weights: one safetensors file, or shards of at most `max_shard_bytes` and an index."""
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def save_model(
    model: nn.Module,
    path: str | Path,
    tokenizer: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: torch.dtype | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    expert_layout: str = "per_expert",
) -> Path:
    """Write an HF folder that `transformers.AutoModelForCausalLM.from_pretrained` loads as it is."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    spec = spec_for(model.config.family)
    tensors = hf_state_dict(model, state_dict, expert_layout)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    for stale in [folder / SINGLE_FILE, folder / INDEX_FILE, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if spec.save_folder is not None:
        spec.save_folder(model, folder, tensors, max_shard_bytes)
    else:
        write_weights(tensors, folder, max_shard_bytes)
    hf_config = spec.hf_config_from(model.config)
    hf_config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    if tokenizer is not None:
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(tokenizer, name)
            # a family whose config is a strict dataclass (CWM) takes no None: it keeps its own there
            with contextlib.suppress(StrictDataclassError) if value is None else contextlib.nullcontext():
                setattr(hf_config, name, value)
        tokenizer.save_pretrained(folder)
        copy_processor_files(Path(getattr(tokenizer, "name_or_path", "") or "."), folder)
    hf_config.save_pretrained(folder)
    return folder
