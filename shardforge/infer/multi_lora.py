"""Many LoRA adapters served on one base, in one batch (vLLM's multi-LoRA, punica's idea): the base
weights stay as they are (plain, prepacked for oneDNN, fused q/k/v and gate/up slots, or int8 / int4), and
every linear of the decoder blocks is wrapped once by a `LoraLayer` that adds, per token of the step's one
row [1, T],

    y_t = base(x_t) + s_i B_i A_i x_t,      i = the adapter of the sequence token t belongs to

grouped by adapter (each group's rows gathered, run through its own A and B, added back with index_add), so
adapters of different ranks and target modules share a step, and tokens of base requests (slot 0) cost one
Python check a layer. The engine says each step's token -> adapter slots (`AdapterSet.begin`). Slots are never
reused: a slot's prefix-cache salt names it, so a re-loaded name never meets the old one's KV blocks.

Served: PEFT LoRA folders (peft_type LORA, rsLoRA too, PiSSA as our runs write it: a plain LoRA). Refused by
name: DoRA (its per-row magnitude rescales the whole output, not a term added per token), OFT and other
peft types, adapters on fused experts weights, modules_to_save, LoRA biases, rank / alpha patterns, modules
outside the decoder blocks (embeddings, LM head, a vision tower). Merge those with --adapter instead."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from shardforge.adapters.peft_format import read_adapter
from shardforge.errors import ConfigError, ModelError
from shardforge.infer.packed import PackedLinear
from shardforge.infer.quantized import QuantizedLinear
from shardforge.models.common.protocol import FusedProjections

log = logging.getLogger(__name__)

Factors = tuple[torch.Tensor, torch.Tensor, float]  # (A [r, in], B [out, r], scale)
_LINEARS = (nn.Linear, PackedLinear, QuantizedLinear, Conv1D)


class StepAdapters:
    """The step's tokens grouped by adapter slot: (slot, row indices, None where every token is in it)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set(self, slots: list[int], device: torch.device) -> None:
        used = set(slots)
        if used == {0} or not used:
            self.groups = []
        elif len(used) == 1:
            self.groups = [(slots[0], None)]
        else:
            where = torch.tensor(slots, device=device)
            self.groups = [(s, (where == s).nonzero().squeeze(1)) for s in sorted(used - {0})]


class LoraLayer(nn.Module):
    """A base projection (one linear, or a fused slot returning several outputs: `sizes`) plus each loaded
    adapter's A and B for it, added per token group. The factors are plain tensors, not parameters: the
    model's state dict stays the base's."""

    def __init__(self, base: nn.Module, members: list[str], sizes: list[int] | None, step: StepAdapters):
        super().__init__()
        self.base, self.members, self.sizes, self.step = base, members, sizes, step
        self.in_features = _in_features(base)
        self.out_sizes = sizes or [_out_features(base)]  # each member's outputs
        self.factors: dict[int, list[Factors | None]] = {}  # slot -> per member
        self.owner: Any = None  # the AdapterSet that wrapped it

    def forward(self, x: torch.Tensor) -> Any:
        out = self.base(x)
        if not self.factors or not self.step.groups:
            return out
        outs = list(out) if self.sizes else [out]
        flat_x = x.reshape(-1, x.shape[-1])
        for slot, rows in self.step.groups:
            per_member = self.factors.get(slot)
            if per_member is None:
                continue
            xs = flat_x if rows is None else flat_x.index_select(0, rows)
            for target, factors in zip(outs, per_member, strict=True):
                if factors is None:
                    continue
                a, b, scale = factors
                delta = nn.functional.linear(nn.functional.linear(xs, a), b) * scale
                flat = target.view(-1, target.shape[-1])
                if rows is None:
                    flat.add_(delta)
                else:
                    flat.index_add_(0, rows, delta)
        return tuple(outs) if self.sizes else outs[0]

    def extra_repr(self) -> str:
        return f"members={self.members}, adapters={len(self.factors)}"


def _in_features(module: nn.Module) -> int:
    if isinstance(module, Conv1D):
        return module.weight.shape[0]
    return module.in_features


def _out_features(module: nn.Module) -> int:
    if isinstance(module, Conv1D):
        return module.weight.shape[1]
    return module.out_features


@dataclass
class Adapter:
    """One loaded adapter: its slot (tokens' index), its prefix-cache salt, where it came from."""

    name: str
    path: Path
    slot: int
    salt: bytes
    rank: int
    modules: list[str] = field(default_factory=list)


class AdapterSet:
    """The adapters an engine serves on its base, by name. Wrapping happens once (`attach`); loading and
    unloading only put factors into the layers, so they run between steps on the engine's thread."""

    def __init__(self, model: nn.Module, base_folder: Path | None = None) -> None:
        self.model, self.base_folder = model, base_folder
        self.step = StepAdapters()
        self.device = next(model.parameters()).device
        self.layers: dict[str, tuple[LoraLayer, int]] = {}  # an adaptable linear's name -> (layer, member)
        self.adapters: dict[str, Adapter] = {}
        self.next_slot = 1
        self._wrap()

    def _wrap(self) -> None:
        """Every linear of the decoder blocks wrapped (a fused slot as one wrapper of its members)."""
        blocks = {id(b) for b in self.model.blocks()}
        block_names = [n for n, m in self.model.named_modules() if id(m) in blocks]
        swaps: list[tuple[nn.Module, str, LoraLayer]] = []
        for name, module in self.model.named_modules():
            if not any(name == b or name.startswith(f"{b}.") for b in block_names):
                continue
            if isinstance(module, FusedProjections):
                for slot, members in module.FUSED.items():
                    fused = getattr(module, slot)
                    if fused is not None:
                        full = [f"{name}.{m}" for m in members]
                        layer = LoraLayer(fused, full, list(fused.sizes), self.step)
                        swaps.append((module, slot, layer))
            for child_name, child in module.named_children():
                if isinstance(child, _LINEARS) and getattr(child, "sizes", None) is None:
                    full = f"{name}.{child_name}"
                    swaps.append((module, child_name, LoraLayer(child, [full], None, self.step)))
        for parent, attr, layer in swaps:
            layer.owner = self
            setattr(parent, attr, layer)
            for i, member in enumerate(layer.members):
                self.layers[member] = (layer, i)

    # ---- names -------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.adapters)

    def resolve(self, name: str | None) -> tuple[int, bytes]:
        """(slot, prefix-cache salt) of an adapter name; (0, b"") for None (the base)."""
        if name is None:
            return 0, b""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise KeyError(name)
        return adapter.slot, adapter.salt

    def begin(self, slots: list[int]) -> None:
        """The step's token -> adapter slot, in the step's row order."""
        self.step.set(slots, self.device)

    # ---- load / unload -----------------------------------------------------------------------------------
    def read(self, name: str, folder: Path) -> tuple[dict[str, tuple[int, Factors]], int]:
        """A PEFT LoRA folder's factors per adaptable linear (checked against this base), and its rank; reads
        only (safe off the engine's thread)."""
        where = f"--lora {name}={folder}"
        if not (folder / "adapter_config.json").is_file():
            raise ModelError(f"{where}: not a PEFT adapter folder (no adapter_config.json)")
        config, tensors = read_adapter(folder, self.model.config.family)
        _refuse_unsupported(where, config)
        self._check_base(where, config.get("base_model_name_or_path"))
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
        dtype = next(self.model.parameters()).dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, _, kind = key.rpartition(".")
            by_module.setdefault(module, {})[kind] = tensor
        out: dict[str, tuple[int, Factors]] = {}
        for module, parts in by_module.items():
            if module not in self.layers:
                raise ModelError(
                    f"{where}: it adapts {module}, which is not a linear of this model's decoder blocks "
                    "(an embedding, the LM head, a vision tower, an experts weight): merge it with --adapter"
                )
            if set(parts) != {"lora_A", "lora_B"}:
                raise ModelError(f"{where}: {module} has {sorted(parts)}; LoRA's lora_A and lora_B are read")
            layer, member = self.layers[module]
            a, b = parts["lora_A"], parts["lora_B"]
            want_in, want_out = layer.in_features, layer.out_sizes[member]
            fits = a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1]
            if not fits or a.shape[1] != want_in or b.shape[0] != want_out:
                raise ModelError(
                    f"{where}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                    f"this base's [{want_out} x {want_in}] linear: the adapter was trained on another base "
                    f"({config.get('base_model_name_or_path')!r})"
                )
            factors = (a.to(self.device, dtype), b.to(self.device, dtype), scale)
            out[module] = (member, factors)
        return out, rank

    def install(self, name: str, folder: Path, factors: dict[str, tuple[int, Factors]], rank: int) -> Adapter:
        """Put read factors into the layers under a fresh slot (on the engine's thread, between steps)."""
        if name in self.adapters:
            raise ConfigError(f"an adapter named {name!r} is loaded already")
        slot = self.next_slot
        self.next_slot += 1
        salt = hashlib.sha256(f"lora:{slot}:{name}:{folder}".encode()).digest()
        for module, (member, f) in factors.items():
            layer, _ = self.layers[module]
            layer.factors.setdefault(slot, [None] * len(layer.members))[member] = f
        adapter = Adapter(name, folder, slot, salt, rank, sorted(factors))
        self.adapters[name] = adapter
        return adapter

    def load(self, name: str, folder: Path) -> Adapter:
        return self.install(name, folder, *self.read(name, folder))

    def unload(self, name: str) -> None:
        """Take an adapter's factors out (the caller checks no running request uses it)."""
        adapter = self.adapters.pop(name)
        for layer, _ in self.layers.values():
            layer.factors.pop(adapter.slot, None)

    def _check_base(self, where: str, base: str | None) -> None:
        """A different base_model_name_or_path is a warning (the same weights may live elsewhere); shapes
        that do not fit are the error (`read`)."""
        if not base or self.base_folder is None:
            return
        named = Path(base)
        same = named.name == self.base_folder.name or (
            named.exists() and named.resolve() == self.base_folder.resolve()
        )
        if not same:
            log.warning(
                "%s: its base_model_name_or_path is %r, this base is %s", where, base, self.base_folder
            )


def _refuse_unsupported(where: str, config: dict) -> None:
    """What a per-token low-rank term cannot serve, by name."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ModelError(
            f"{where}: a {kind} adapter; many adapters on one base serve LoRA ones (merge it into the base "
            f"with --adapter instead)"
        )
    why = {
        "use_dora": "DoRA's per-row magnitude rescales the whole output, not a low-rank term per token",
        "target_parameters": "adapters on fused experts weights are not per-token linears here",
        "modules_to_save": "modules_to_save replaces whole modules for every request",
        "lora_bias": "LoRA biases are not read",
        "rank_pattern": "per-module ranks (rank_pattern) are not read",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not read",
    }
    for key, reason in why.items():
        if config.get(key):
            raise ModelError(f"{where}: {key}={config[key]!r}: {reason} (merge it with --adapter instead)")
    if config.get("bias", "none") != "none":
        raise ModelError(f"{where}: bias={config['bias']!r}: adapter biases are not read (bias='none' is)")


def attach(engine: Any, adapters: list[tuple[str, Path]], base_folder: Path | None = None) -> AdapterSet:
    """Many adapters on the engine's base: its block linears wrapped once (per model: engines over one model
    share its set), these adapters loaded, the engine told (`engine.lora`). Refused where the step is not the
    model's one forward on this process."""
    from shardforge.infer.executor import LocalRunner

    runner = engine.executor.runner
    if engine.executor.group is not None or not isinstance(runner, LocalRunner):
        raise ConfigError(
            "--lora: many adapters run in the engine's one forward on one process over the paged KV cache, "
            "not with --tp, pipeline stages or a family on the recompute runner (merge one with --adapter)"
        )
    wrapped = (m.owner for m in engine.model.modules() if isinstance(m, LoraLayer))
    lora = next(wrapped, None) or AdapterSet(engine.model, base_folder)  # another engine's on this model
    for name, folder in adapters:
        if name not in lora.adapters or lora.adapters[name].path != folder:
            lora.load(name, folder)
    engine.lora = lora
    return lora


def parse_lora_flags(values: list[str] | None) -> list[tuple[str, Path]]:
    """--lora name=FOLDER values, each name once."""
    out: list[tuple[str, Path]] = []
    for value in values or []:
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--lora {value!r}: give it as NAME=FOLDER")
        if name in {n for n, _ in out}:
            raise ConfigError(f"--lora {name}: the name is given twice")
        out.append((name, Path(folder)))
    return out
