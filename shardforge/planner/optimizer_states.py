"""The bytes each choice of train.optimizer.name keeps for a rank's trained tensors, after its first step."""

from __future__ import annotations

import math

from shardforge.config.optimizers import OptimizerSection
from shardforge.planner.inventory import FP32_BYTES, STEP_BYTES, ParamSpec

BNB_MIN_8BIT = 4096  # bitsandbytes keeps 32-bit states for smaller tensors (its min_8bit_size)
BNB_BLOCK = 256  # elements per absmax scale of its blockwise 8-bit states
BNB_QMAPS = 2 * 256 * FP32_BYTES  # the two 256-entry code books, one tensor each shared by every parameter


def optimizer_state_bytes(
    optimizer: OptimizerSection, trained: list[tuple[int, ParamSpec]], model_shape: object, offload: str
) -> int:
    """The bytes of a rank's optimizer states for its `trained` (local numel, parameter) pairs: what each
    choice of train.optimizer.name keeps after its first step (tests/unit/test_optimizers.py measures them).
    AdamW: two moments and a 4-byte step per tensor (offload: fp32 masters and moments on the host). The
    whole-tensor choices only run on unsharded layouts, so local numel is the whole tensor."""
    name = optimizer.name
    if name == "adamw":
        if offload == "optimizer":  # fp32 masters and both moments on the host
            return sum(12 * n + STEP_BYTES for n, _ in trained)
        return int(sum(2 * n * p.itemsize + STEP_BYTES for n, p in trained))
    if name == "adamw_8bit":
        return _bnb_8bit(trained)
    if name == "muon":  # one momentum for the hidden matrices, AdamW's two moments and step for the rest
        hidden = [(n, p) for n, p in trained if _muon_matrix(p)]
        rest = [(n, p) for n, p in trained if not _muon_matrix(p)]
        return int(
            sum(n * p.itemsize for n, p in hidden) + sum(2 * n * p.itemsize + STEP_BYTES for n, p in rest)
        )
    if name in ("galore", "apollo"):
        return _projected(getattr(optimizer, name), name, trained)
    if name == "badam":
        return _badam(optimizer, trained)
    return _adam_mini(trained, model_shape)


def _bnb_8bit(trained: list[tuple[int, ParamSpec]]) -> int:
    """Two uint8 moments plus an fp32 scale per 256 elements each; fp32 moments for small tensors and the
    embedding (transformers' override); the step is a Python int."""
    total, eight = 0, False
    for n, p in trained:
        if n >= BNB_MIN_8BIT and not (p.first and p.vocab):
            total += 2 * n + 2 * math.ceil(n / BNB_BLOCK) * FP32_BYTES
            eight = True
        else:
            total += 2 * n * FP32_BYTES
    return total + BNB_QMAPS * eight


def _muon_matrix(p: ParamSpec) -> bool:
    return len(p.shape) == 2 and "embed" not in p.name and "lm_head" not in p.name


def _projected(section: object, name: str, trained: list[tuple[int, ParamSpec]]) -> int:
    """GaLore / APOLLO: the projected weights keep both moments of a rank x side projection and the projector
    (rank x the other side; `full`: both); APOLLO adds a scalar scale; the rest keep AdamW's moments."""
    total = 0
    for n, p in trained:
        if not _projected_target(p, section.targets):
            total += int(2 * n * p.itemsize)
            continue
        rows, cols = p.shape
        k = min(section.rank, rows, cols)
        kind = section.proj_type
        if kind in ("std", "reverse_std"):
            right = (rows >= cols) == (kind == "std")
            kind = "right" if right else "left"
        states, projector = {
            "right": (rows * k, k * cols),
            "left": (k * cols, rows * k),
            "full": (k * k, rows * k + k * cols),
        }[kind]
        total += int((2 * states + projector) * p.itemsize) + int(p.itemsize) * (name == "apollo")
    return total


def _projected_target(p: ParamSpec, targets: str | list[str]) -> bool:
    """LF's selection over the parameter list: the 2-D weights of the decoder's linears ("all": any but the
    embedding and the head), or of the modules whose name holds a target."""
    if len(p.shape) != 2 or not p.name.endswith(".weight"):
        return False
    if targets == "all":
        return not p.vocab
    module = p.name.rsplit(".", 1)[0]
    return any(t in module for t in targets)


def _badam(optimizer: OptimizerSection, trained: list[tuple[int, ParamSpec]]) -> int:
    """layer: the active block's fp32 working copies, both fp32 moments and a step each, for the largest
    decoder block (the embedding and head never train); ratio: both moments of each tensor's trained share."""
    section = optimizer.badam
    if section.mode == "ratio":
        return int(sum(2 * int(n * section.update_ratio) * p.itemsize for n, p in trained if not p.vocab))
    blocks: dict[int, int] = {}
    for n, p in trained:
        if p.layer is not None:
            blocks[p.layer] = blocks.get(p.layer, 0) + 3 * n * FP32_BYTES + STEP_BYTES
    return max(blocks.values(), default=0)


def badam_block_grads(numel: list[int], held: list[ParamSpec]) -> int:
    """BAdam's layer mode: only the active decoder block has requires_grad (the largest block's gradients)."""
    blocks: dict[int, int] = {}
    for n, p in zip(numel, held, strict=True):
        if p.trained and p.layer is not None:
            blocks[p.layer] = blocks.get(p.layer, 0) + n * p.itemsize
    return max(blocks.values(), default=0)


def _adam_mini(trained: list[tuple[int, ParamSpec]], shape: object) -> int:
    """Adam-mini: the first moment whole, one second moment per block: per head of the query and key
    projections (hidden_size^2 / heads elements each, as LF passes it), per row of the embedding, head,
    value, output and MLP matrices, one per other tensor (norms); biases keep Adam's."""
    head_numel = shape.hidden_size * shape.hidden_size // shape.num_heads
    total = 0
    for n, p in trained:
        name = p.name.lower()
        if "bias" in name:
            second = n
        elif any(k in name for k in ("k_proj", "q_proj", "wq", "wk", "query", "key")):
            second = n // head_numel
        elif any(
            k in name
            for k in (
                "embed",
                "embd",
                "wte",
                "lm_head",
                "output",
                "final_layer",
                "v_proj",
                "wv",
                "value",
                "feed_forward",
                "linear",
                "mlp",
                "o_proj",
                "wo",
                "attn.proj",
            )
        ):
            second = p.shape[0]  # fmt: skip
        else:
            second = 1
        total += int((n + second) * p.itemsize)
    return total
