"""Tensor + sequence parallel, applied over a built model from its family's plan (data, in the ModelSpec).

The vocabulary is split over TP ranks; when tp does not divide it, the embedding and LM head are padded with
zero rows, the padded logits are masked out of the softmax, and the padding is stripped on export, so a run
computes exactly what the unpadded model computes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from shardforge.config.parallel_schema import ParallelSection
from shardforge.errors import ConfigError
from shardforge.models.spec import spec_for
from shardforge.parallel.dims import ParallelDims
from shardforge.sharding.lora_styles import ADAPTER, for_adapter
from shardforge.sharding.regather import keep_input_sharded
from shardforge.sharding.styles import GatherStream

_VOCAB_KEYS = ("embed_tokens.weight", "lm_head.weight")


def apply_tensor_parallel(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, parallel: ParallelSection
) -> nn.Module:
    """Shard `model` in place over the mesh's tp dimension (a no-op at tp=1). Shapes tp cannot split are
    ConfigErrors (the trainer checks them before the process group starts, `check_tensor_parallel`)."""
    if dims.tp == 1:
        return model
    cfg = model.config
    plan = check_tensor_parallel(cfg, parallel)
    padded = padded_vocab(cfg.vocab_size, dims.tp)
    pad_vocab(model, padded)
    # A pipeline stage holds part of the model: the plan's entries for modules it lacks do not apply.
    plan = {key: style for key, style in plan.items() if _present(model, key)}
    trained = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    parallelize_module(model, mesh["tp"], _with_adapters(model, plan))
    model.tie_weights()  # the head's style re-wraps a tied weight: share the embedding's DTensor again
    for name, param in model.named_parameters():  # torch's SequenceParallel re-creates norms trainable
        param.requires_grad_(trained[name])
    if padded != cfg.vocab_size and model.lm_head is not None and not cfg.num_labels:
        model.lm_head.register_forward_hook(_mask_padded_logits(cfg.vocab_size))
    if parallel.sequence_parallel:
        model.register_forward_pre_hook(_require_even_split(dims.tp), with_kwargs=True)
        if parallel.activation_checkpoint == "none":  # a checkpoint's hooks must see what its block saves
            for name, module in model.named_modules():
                style = next((s for k, s in plan.items() if matches_plan_key(k, name)), None)
                if isinstance(style, GatherStream):
                    keep_input_sharded(module)
    return model


def _present(model: nn.Module, key: str) -> bool:
    """Whether a plan key names modules this model holds (a pipeline stage holds some layers only)."""
    if getattr(model, key.split(".")[0]) is None:
        return False
    if "*" in key:
        return True
    try:
        model.get_submodule(key)
    except AttributeError:
        return False
    return True


def _with_adapters(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan, with each linear that carries a LoRA adapter named on its own and given the adapter-aware
    version of its style (the adapter split as its base is)."""
    adapted = {}
    for name, module in model.named_modules():
        if hasattr(module, ADAPTER):
            key = next((k for k in plan if matches_plan_key(k, name)), None)
            if key is not None:
                adapted[name] = for_adapter(plan[key])
    if not adapted:
        return plan
    rest = {}
    for key, style in plan.items():  # the pattern's other modules, by name (a pattern would take them all)
        names = [n for n, _ in model.named_modules() if matches_plan_key(key, n)]
        if any(n in adapted for n in names):
            rest.update({n: style for n in names if n not in adapted})
        else:
            rest[key] = style
    return rest | adapted


def matches_plan_key(pattern: str, name: str) -> bool:
    """parallelize_module's matching: segment by segment, `*` and globs within a segment."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch(n, p) for p, n in zip(parts, names, strict=True))


def check_tensor_parallel(model_config: Any, parallel: ParallelSection) -> dict[str, Any]:
    """The family's TP plan for this config, after its shape rules (heads, kv heads, widths) are checked;
    needs only the model's config, so the trainer calls it before any process group exists."""
    if parallel.tp == 1:
        return {}
    spec = spec_for(model_config.family)
    if spec.tp_plan is None:
        raise ConfigError(f"parallel.tp={parallel.tp}: the {model_config.family} family has no TP plan")
    return spec.tp_plan(model_config, parallel.tp, parallel.sequence_parallel)


def _require_even_split(tp: int) -> Callable[[nn.Module, tuple, dict], None]:
    """Sequence parallel splits each row evenly over the TP ranks: anything else would give ranks different
    shards and hang the next collective, so it is a clear error instead (the trainer pads rows to fit)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        if ids.shape[1] % tp:
            raise ConfigError(
                f"sequence parallel splits each row over tp={tp} ranks: a row of {ids.shape[1]} tokens must "
                f"be padded to a multiple of {tp} (collate(..., multiple={tp}))"
            )

    return hook


def padded_vocab(vocab: int, tp: int) -> int:
    return math.ceil(vocab / tp) * tp


def pad_vocab(model: nn.Module, rows: int) -> None:
    """Grow the embedding and LM head to `rows` rows (zeros); a no-op when they already have that many."""
    # A pipeline stage may hold one of them, or neither; a score head is not over the vocabulary.
    head = model.lm_head if not model.config.num_labels else None
    present = [m for m in (model.embed_tokens, head) if m is not None]
    if not present or rows <= present[0].weight.shape[0]:
        return
    vocab = present[0].weight.shape[0]
    tied = len(present) == 2 and present[0].weight is present[1].weight
    for module in present[:1] if tied else present:
        weight = module.weight.detach()
        extra = weight.new_zeros(rows - vocab, weight.shape[1])
        module.weight = nn.Parameter(torch.cat([weight, extra]), requires_grad=module.weight.requires_grad)
    if model.embed_tokens is not None:
        model.embed_tokens.num_embeddings = rows
    if head is not None:
        head.out_features = rows
    model.tie_weights()


def _mask_padded_logits(vocab: int) -> Callable[[nn.Module, tuple, DTensor], DTensor]:
    """Forward hook on the LM head: padded vocabulary columns get the lowest logit (zero probability and
    zero gradient), on whichever TP rank holds them."""

    def hook(module: nn.Module, args: tuple, out: DTensor) -> DTensor:
        assert out.device_mesh.ndim == 1 and out.placements[0].is_shard(out.ndim - 1), out.placements
        local = out.to_local()
        width = local.shape[-1]
        start = out.device_mesh.get_local_rank() * width
        columns = torch.arange(start, start + width, device=local.device)
        local = local.masked_fill(columns >= vocab, torch.finfo(local.dtype).min)
        return DTensor.from_local(
            local, out.device_mesh, out.placements, run_check=False, shape=out.shape, stride=out.stride()
        )

    return hook


def strip_vocab_padding(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Full weights as the unpadded model has them (for export)."""
    for key in state:  # the model's, and those of a submodule of the same vocabulary (PPO's critic)
        if key.endswith(_VOCAB_KEYS) and state[key].shape[0] > vocab_size:
            state[key] = state[key][:vocab_size]
    return state


@contextlib.contextmanager
def loss_context(dims: ParallelDims) -> Iterator[None]:
    """Cross-entropy over vocabulary-sharded logits needs `loss_parallel` around the loss and its backward."""
    if dims.tp == 1:
        yield
        return
    with loss_parallel():
        yield
