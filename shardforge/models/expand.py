"""LLaMA Pro's block expansion (Wu et al. 2024; LLaMA-Factory's scripts/llama_pro.py): a model folder with
`blocks` new decoder blocks, one after every (layers / blocks) original ones, each a copy of the block before
it whose output projections (attention's o_proj, the MLP's down_proj) are zero. A new block adds nothing to
the residual stream, so the expanded model computes what the original did until the new blocks train
(`method.freeze.llama_pro` trains exactly those)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from shardforge.errors import ModelError
from shardforge.models.io import INDEX_FILE, read_config_json, weight_files, write_weights

LAYER_KEY = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
ZEROED = ("o_proj", "down_proj")  # the block's writes to the residual stream (LF's rule: any key naming them)


def expanded_order(layers: int, blocks: int) -> list[tuple[int, bool]]:
    """(original layer, is a new zero-output copy) for each layer of the expanded model, in order."""
    split = layers // blocks
    order: list[tuple[int, bool]] = []
    for i in range(layers):
        order.append((i, False))
        if (i + 1) % split == 0:
            order.append((i, True))
    return order


def expand_blocks(
    source: str | Path, target: str | Path, blocks: int, max_shard_bytes: int = 5 * 1024**3
) -> Path:
    """Write the expanded copy of the HF folder `source` to `target` (its other files copied as they are)."""
    source, target = Path(source), Path(target)
    config = read_config_json(source)
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int):
        raise ModelError(
            f"{source / 'config.json'}: no top-level num_hidden_layers; block expansion reads a decoder's "
            f"config (as LLaMA-Factory's llama_pro.py)"
        )
    if blocks < 1 or layers % blocks:
        raise ModelError(f"--blocks {blocks}: must be at least 1 and divide the model's {layers} layers")
    # index rules of which layers are sparse that a copy placed between them would break
    rules = {"decoder_sparse_step": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1}
    broken = {k: config[k] for k, fine in rules.items() if config.get(k, fine) not in (fine, None)}
    if broken:
        raise ModelError(
            f"{source / 'config.json'}: {broken} places its sparse layers by index, which the copies would "
            f"shift; LLaMA Pro expands models whose layers are all alike or listed (mlp_only_layers)"
        )
    if target.resolve() == source.resolve():
        raise ModelError(f"{target}: the expanded model needs a folder of its own, not the source")
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(source):
        with safe_open(str(file), "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 (safe_open has no iter)
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        match = LAYER_KEY.match(key)
        if match is None:
            out[key] = value
        else:
            per_layer.setdefault(int(match[2]), {})[f"{match[1]}{{}}{match[3]}"] = value
    if not all(any(name in t for t in patterns) for patterns in per_layer.values() for name in ZEROED):
        raise ModelError(
            f"{source}: its decoder blocks lack an o_proj or a down_proj weight, whose zeros give a new "
            f"block its zero output (LLaMA Pro expands Llama-like models)"
        )
    order = expanded_order(layers, blocks)
    for new, (old, fresh) in enumerate(order):
        for pattern, value in per_layer[old].items():
            zeroed = fresh and any(name in pattern for name in ZEROED)  # LF's substring rule
            out[pattern.format(new)] = torch.zeros_like(value) if zeroed else value.clone()
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in (INDEX_FILE, "config.json"):
            shutil.copyfile(item, target / item.name)
    config["num_hidden_layers"] = len(order)
    if isinstance(config.get("layer_types"), list) and len(config["layer_types"]) == layers:
        config["layer_types"] = [config["layer_types"][old] for old, _ in order]
    if isinstance(config.get("mlp_only_layers"), list):  # a mixture of experts' dense layers, by index
        dense = set(config["mlp_only_layers"])
        config["mlp_only_layers"] = [new for new, (old, _) in enumerate(order) if old in dense]
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_weights(out, target, max_shard_bytes)
    return target
