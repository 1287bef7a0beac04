"""What the engine serves, from whatever a user points at: an HF model folder, a PEFT LoRA adapter folder (on
its base), a training run (its `final/`, else its latest checkpoint), or one checkpoint of any layout. LoRA
is merged into the base weights, so inference runs plain linears. A QLoRA run serves the same way: its
adapter merges into the full-precision base it names (a checkpoint's NF4 base is dequantized by the merge).
`quantize` puts the loaded model's linears in int8 / int4 (infer/quantized.py); an HF folder that is
quantized already (AWQ, GPTQ, fp8) loads as it is (infer/prequantized.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.adapters.merge import merge_adapter, merge_lora_modules
from shardforge.data.images import ImageReader, image_processor
from shardforge.dtypes import TORCH_DTYPES
from shardforge.errors import ConfigError, DataError, ModelError
from shardforge.infer.prequantized import load_prequantized, quantization_config
from shardforge.infer.quantized import Quantization, quantize_for_inference
from shardforge.infer.sampling import GenerationDefaults
from shardforge.log import get_logger

log = get_logger(__name__)


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: Any
    defaults: GenerationDefaults
    name: str  # what the server calls it by default
    folder: Path  # where its tokenizer and generation config came from
    images: ImageReader | None = None  # a vision-language model's image processor and prompt


def load_for_inference(
    source: str | Path,
    adapter: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    quantize: Quantization | None = None,
) -> Loaded:
    """The model (frozen, in `dtype` on `device`), its tokenizer and generation defaults; with `quantize`,
    its block linears and LM head in int8 / int4, quantized once loaded."""
    loaded = _load(source, adapter, dtype, device, quantize)
    if quantize is not None:
        quantize_for_inference(loaded.model, quantize)
    return loaded


def _load(
    source: str | Path, adapter: str | Path | None, dtype: str, device: str, quantize: Quantization | None
) -> Loaded:
    path = Path(source)
    if dtype not in TORCH_DTYPES:
        raise ModelError(f"dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    if not path.exists():
        raise ModelError(f"{source}: no such model folder, adapter folder, run or checkpoint")
    torch_dtype, target = TORCH_DTYPES[dtype], torch.device(device)
    if (path / "final").is_dir():  # a run: what it handed back
        return _load(path / "final", adapter, dtype, device, quantize)
    if (path / "adapter_config.json").is_file():
        if adapter is not None:
            raise ModelError(f"{source} is an adapter folder; --adapter goes with a base model folder")
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base or not Path(base).is_dir():
            raise ModelError(
                f"{path}: the adapter's base_model_name_or_path {base!r} is not a local folder; pass the "
                f"base model folder, with the adapter as --adapter {path}"
            )
        return _load(base, path, dtype, device, quantize)
    if (path / "config.json").is_file():
        if (config := quantization_config(path)) is not None:
            return _prequantized(path, config, adapter, quantize, torch_dtype, target)
        return _hf_folder(path, adapter, torch_dtype, target)
    return _checkpoint(path, adapter, torch_dtype, target)


def sources_read(source: str | Path, seen: frozenset[Path] = frozenset()) -> list[Path]:
    """The other files and folders loading `source` reads (a caller that keeps reads inside one folder
    checks them): a run's final/ and what it reads, an adapter's base model, a checkpoint's model, tokenizer
    and adapter as its config names them."""
    path = Path(source)
    if path in seen or not path.is_dir():
        return []
    seen = seen | {path}
    if (path / "final").is_dir():
        named = [path / "final"]
    elif (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        named = [Path(base)] if base else []
    elif (path / "config.json").is_file():
        named = []
    else:
        from shardforge.checkpoint.store import resolve_checkpoint
        from shardforge.config import load_config

        model = load_config(resolve_checkpoint(path) / "config.yaml").model
        named = [Path(p) for p in (model.path, model.tokenizer, model.adapter) if p]
    return [*named, *(q for p in named for q in sources_read(p, seen))]


def _hf_folder(folder: Path, adapter: Path | None, dtype: torch.dtype, device: torch.device) -> Loaded:
    from shardforge.models import load_model

    model = load_model(folder, dtype=dtype, device=device)
    if model.config.num_labels:
        raise ModelError(
            f"{folder} is a reward model (a score head of {model.config.num_labels} output(s), not an LM "
            f"head): it scores sequences, it does not generate"
        )
    if adapter is not None:
        merge_adapter(model, Path(adapter))
    tokenizer_folder = Path(adapter) if adapter is not None and _has_tokenizer(Path(adapter)) else folder
    name = Path(adapter).name if adapter is not None else folder.name
    return _finish(model, tokenizer_folder, folder, name)


def _prequantized(
    folder: Path,
    config: dict,
    adapter: Path | None,
    quantize: Quantization | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Loaded:
    method = config.get("quant_method", "?")
    if quantize is not None:
        raise ConfigError(
            f"--quantize {quantize.scheme}: {folder} is quantized already (quantization_config.quant_method="
            f"{method!r}); it loads as it is, without --quantize"
        )
    if adapter is not None:
        raise ModelError(
            f"{folder}: a LoRA adapter cannot be merged into {method} weights; merge it into the "
            f"full-precision base, or serve that base with --quantize"
        )
    model = load_prequantized(folder, config, dtype, device)
    return _finish(model, folder, folder, folder.name)


def _checkpoint(path: Path, adapter: Path | None, dtype: torch.dtype, device: torch.device) -> Loaded:
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.checkpoint.store import resolve_checkpoint
    from shardforge.checkpoint.trainer_state import load_model_weights, read_trainer_state
    from shardforge.config import load_config
    from shardforge.models.build import build_model, load_tokenizer
    from shardforge.objectives import score_labels
    from shardforge.parallel.tensor_parallel import pad_vocab

    if adapter is not None:
        raise ModelError("--adapter goes with an HF model folder, not with a training checkpoint")
    folder = resolve_checkpoint(path)  # names what is missing when this is no checkpoint either
    config = load_config(folder / "config.yaml")
    if score_labels(config.method):
        raise ModelError(
            f"{folder} is a reward model's checkpoint (stage rm): it scores sequences, it does not generate"
        )
    tokenizer = load_tokenizer(config.model)
    model = build_model(config.model, tokenizer, config.train.seed, torch.device("cpu"))
    apply_finetuning(model, config.method, config.train.seed)
    vocab = model.config.vocab_size
    pad_vocab(model, read_trainer_state(folder)["vocab_rows"])
    load_model_weights(folder, model)
    unpad_vocab(model, vocab)
    merge_lora_modules(model)
    model = model.to(device=device, dtype=dtype)
    source = Path(config.model.tokenizer or config.model.path or folder)
    reader = image_reader(model, tokenizer, Path(config.model.path or source))
    name = folder.parent.parent.name
    return Loaded(_frozen(model), tokenizer, _defaults(source, tokenizer), name, source, reader)


def unpad_vocab(model: nn.Module, vocab: int) -> None:
    """Drop the zero rows a TP run added to the embedding and head (its checkpoint holds them)."""
    for module in (model.embed_tokens, model.lm_head):
        if module.weight.shape[0] > vocab:
            module.weight = nn.Parameter(module.weight[:vocab].detach().clone(), requires_grad=False)
    model.embed_tokens.num_embeddings = model.lm_head.out_features = vocab
    model.tie_weights()


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def _finish(model: nn.Module, tokenizer_folder: Path, folder: Path, name: str) -> Loaded:
    from shardforge.config.schema import ModelSection
    from shardforge.models.build import load_tokenizer

    tokenizer = load_tokenizer(ModelSection(path=str(folder), tokenizer=str(tokenizer_folder)))
    reader = image_reader(model, tokenizer, folder)
    return Loaded(_frozen(model), tokenizer, _defaults(folder, tokenizer), name, folder, reader)


def image_reader(model: nn.Module, tokenizer: Any, folder: Path) -> ImageReader | None:
    """A vision-language model's image processor (from its folder) and prompt; None for a text model, or
    for one that cannot read images (no image processor, a tokenizer without its image tokens): it serves
    text, and requests with images are refused."""
    if not model.config.takes_images:
        return None
    try:
        return ImageReader(image_processor(folder), model.config.image_prompt(tokenizer))
    except (DataError, ModelError) as exc:
        log.warning(f"{exc}: requests with images are refused; text is served")
        return None


def _frozen(model: nn.Module) -> nn.Module:
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def _defaults(folder: Path, tokenizer: Any) -> GenerationDefaults:
    return GenerationDefaults.from_folder(folder, getattr(tokenizer, "eos_token_id", None))
