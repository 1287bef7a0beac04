"""The Llama family's tensor-parallel plan, as data: module-name pattern -> DTensor ParallelStyle.

Megatron's layout: q/k/v and gate/up are split by output columns (attention heads, MLP channels), o and down
by input rows, so each block needs one reduction after attention and one after the MLP. The embedding and
the LM head are split over the vocabulary (cross-entropy runs on the sharded logits under `loss_parallel`).
With tp above the kv heads (grouped-query attention), the key / value projections are replicated and each rank
keeps the kv head its query heads read (Megatron's kv-head replication, `ReplicatedKVHeads`).

With sequence parallel the residual stream between those reductions is split over the sequence (Shard(1)):
the reductions become reduce-scatters, the norms run on 1/tp of the tokens, and each attention / MLP input
is all-gathered. Without it the residual stream is whole on every rank and the norms are replicated.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from shardforge.errors import ConfigError
from shardforge.models.common.config import DecoderConfig
from shardforge.sharding.styles import (
    GatherStream,
    KVColwiseParallel,
    LocalReplicate,
    ReplicatedKVHeads,
    ReplicateParallel,
    WholeSequenceParallel,
)


def check_tensor_parallel(cfg: DecoderConfig, tp: int) -> None:
    """Shapes the plan can split evenly; anything else is an error before training, never a wrong result."""
    rules = {"num_heads (query heads)": cfg.num_heads, "hidden_size": cfg.hidden_size}
    if tp <= cfg.num_kv_heads:  # kv heads split; above them replicated (each rank's query heads read one)
        rules["num_kv_heads (key/value heads)"] = cfg.num_kv_heads
    if len(cfg.moe_layers) < cfg.num_layers:  # dense MLPs are split by channels
        rules["intermediate_size (MLP width)"] = cfg.intermediate_size
    if cfg.shared_expert_intermediate_size and cfg.moe_layers:  # so is an MoE layer's shared expert
        rules["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for what, value in rules.items():
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide the model's {what} = {value}")
    if tp > cfg.num_kv_heads and tp % cfg.num_kv_heads:
        raise ConfigError(
            f"parallel.tp={tp} is above the model's {cfg.num_kv_heads} kv heads and not a multiple of them: "
            f"kv heads are replicated so that each rank's query heads read one (tp a divisor or a multiple "
            f"of {cfg.num_kv_heads})"
        )


def tensor_parallel_plan(cfg: DecoderConfig, tp: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Which module gets which sharding. Keys are `parallelize_module` paths (`*` matches one segment)."""
    check_tensor_parallel(cfg, tp)
    stream: Placement = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout

    def norm() -> ParallelStyle:
        return SequenceParallel() if sequence_parallel else ReplicateParallel()

    def kv_style() -> ParallelStyle:
        if tp > cfg.num_kv_heads:
            return ReplicatedKVHeads(cfg.num_kv_heads, cfg.head_dim)
        return KVColwiseParallel()

    def gather_input(n_args: int) -> ParallelStyle:
        """All-gather the (sequence-split) first argument; the others are not tensors of the stream."""
        rest = (None,) * (n_args - 1)
        return GatherStream(input_layouts=(stream, *rest), desired_input_layouts=(Replicate(), *rest))

    plan: dict[str, ParallelStyle] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "layers.*.input_norm": norm(),
        "layers.*.attn.q_proj": ColwiseParallel(),
        "layers.*.attn.k_proj": kv_style(),
        "layers.*.attn.v_proj": kv_style(),
        "layers.*.attn.o_proj": RowwiseParallel(output_layouts=stream),
        "layers.*.post_attn_norm": norm(),
        **_mlp_plan(cfg, stream),
        # The head scores only target positions, picked from whole rows: gather the stream before the final
        # norm (run replicated), then project to vocabulary shards for the parallel cross-entropy.
        "norm": ReplicateParallel(input_layout=stream),
        "lm_head": ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if cfg.num_labels:  # a score head (a reward model): a few outputs, run whole on every rank
        plan["lm_head"] = ReplicateParallel()
    plan["value_head"] = ReplicateParallel()  # PPO's critic (one output), where the model has one
    if sequence_parallel:
        plan["layers.*.attn"] = gather_input(5)  # (x, cos, sin, attention context, sliding)
        for layer in _dense_mlps(cfg):
            plan[f"{layer}.mlp"] = gather_input(1)
    if cfg.qk_norm:
        # Qwen3's q/k norms are shared by all heads while each rank holds some heads: as DTensors split over
        # the head dimension, their weight gradients are summed over the TP ranks.
        plan["layers.*.attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["layers.*.attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _dense_mlps(cfg: DecoderConfig) -> list[str]:
    """The blocks whose MLP is dense, as a pattern over all of them when none is an MoE layer."""
    if not cfg.moe_layers:
        return ["layers.*"]
    return [f"layers.{i}" for i in range(cfg.num_layers) if not cfg.is_moe(i)]


def _mlp_plan(cfg: DecoderConfig, stream: Placement) -> dict[str, ParallelStyle]:
    """Dense MLPs split by channels (gate/up columns, down rows). An MoE layer runs on the whole sequence
    on every rank with its router and experts replicated (`WholeSequenceParallel`); its shared expert is
    split like a dense MLP (its input is the gathered stream, its output reduced whole), its gate
    replicated. Expert parallel, not TP, is what splits the experts."""
    plan: dict[str, ParallelStyle] = {}
    for block in _dense_mlps(cfg):
        plan[f"{block}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{block}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{block}.mlp.down_proj"] = RowwiseParallel(output_layouts=stream)
    for i in cfg.moe_layers:
        plan[f"layers.{i}.mlp"] = WholeSequenceParallel(stream, ("gate", "experts"))
        if cfg.shared_expert_intermediate_size:
            shared = f"layers.{i}.mlp.shared_expert"
            plan[f"{shared}.gate_proj"] = ColwiseParallel()
            plan[f"{shared}.up_proj"] = ColwiseParallel()
            plan[f"{shared}.down_proj"] = RowwiseParallel()
            plan[f"layers.{i}.mlp.shared_expert_gate"] = ReplicateParallel()
    return plan


def vision_language_plan(
    cfg: DecoderConfig, tp: int, sequence_parallel: bool, towers: tuple[str, ...]
) -> dict[str, ParallelStyle]:
    """A vision-language model: the decoder's plan, its vision `towers` (and projector) run whole on every
    rank, and the embedding's output kept whole until the image features are placed in it (`stream_split`
    then cuts it to the sequence-parallel shard, a slice with no communication)."""
    plan = tensor_parallel_plan(cfg, tp, sequence_parallel)
    plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if sequence_parallel:
        plan["stream_split"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        )
    for tower in towers:
        plan[tower] = LocalReplicate()
    return plan
