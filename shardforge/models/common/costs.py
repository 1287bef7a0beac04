"""The Llama family's cost model: parameters by group, forward FLOPs per piece, activation bytes per token.

Activation bytes follow what this code's autograd graph keeps (measured by `activation_report`, one process),
in the spirit of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", adapted
to these modules: RMSNorm computed in fp32 but keeping its input in its own dtype and an fp32 rsqrt per row,
SwiGLU (gate, SiLU, up and product outputs), RoPE (q and k after rotation), grouped-query K/V kept at their
own head count (SDPA's enable_gqa), no dropout, and flash-style SDPA, which keeps the output and a fp32
logsumexp per (token, head), never the s x s scores: so the sequence length does not enter. Under tensor
parallel, heads and MLP channels are split; the residual stream and the norms only with sequence parallel,
whose all-gathered attention / MLP inputs are kept as their 1/tp shard and gathered again in backward
(sharding/regather.py, Megatron's way; selective recomputes them and the row-parallel partial sums).
Not modelled: packed rows' per-document gather copies (attention_per_document), K/V repeated per query head
(CUDA with a mask: models/common/attention.py `sdpa`), masks or score matrices of non-flash kernels, the TP
embedding's masking temporaries, and transient peaks (only what is kept for backward).
"""

from __future__ import annotations

from functools import cache, partial
from typing import TYPE_CHECKING

from shardforge.models.spec import ActivationBytes, CheckpointMode, CostModel, ParamCounts

if TYPE_CHECKING:  # config.py counts its parameters here
    from shardforge.models.common.config import DecoderConfig

FP32 = 4  # bytes; RMSNorm, the logsumexp and the loss work in fp32


def _moe_mlp(cfg: DecoderConfig, experts: int) -> int:
    """Parameters (or, with `experts` = the top k, multiply-adds per token) of an MoE layer's MLP: the
    router over all experts, `experts` SwiGLU experts, the shared expert and its gate."""
    h, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
    return (
        h * cfg.num_experts
        + experts * 3 * h * cfg.moe_intermediate_size
        + (3 * h * shared + h) * (shared > 0)
    )


def param_counts(cfg: DecoderConfig) -> ParamCounts:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn = h * (q + 2 * kv) + q * h
    attn += (q + 2 * kv) * cfg.qkv_bias + h * cfg.o_bias + 2 * d * cfg.qk_norm
    dense = 3 * h * i + (2 * i + h) * cfg.mlp_bias
    n = cfg.num_layers
    embedding = cfg.vocab_size * h
    return ParamCounts(
        embedding=embedding,
        attention=(attn,) * n,
        mlp=tuple(_moe_mlp(cfg, cfg.num_experts) if cfg.is_moe(layer) else dense for layer in range(n)),
        norms=(2 * h,) * n,
        final_norm=h,
        head=0 if cfg.tie_embeddings else embedding,
    )


def activation_bytes(
    cfg: DecoderConfig, mode: CheckpointMode, b: int, tp: int, sequence_parallel: bool
) -> ActivationBytes:
    """Bytes kept per token (and per scored token) on one rank; `b` is the activation dtype's size."""
    h, d, vocab = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    heads, kv_heads = cfg.num_heads / tp, cfg.kv_heads_per_rank(tp)
    q, kv, inner = heads * d, kv_heads * d, cfg.intermediate_size / tp
    kv_out = cfg.num_kv_heads * d if tp > cfg.num_kv_heads else kv  # replicated kv: projected whole
    split = tp if sequence_parallel else 1
    stream = h / split  # the residual stream's elements per token on this rank

    def norm(width: float, rows: float) -> float:
        """An RMSNorm's own saved tensors: its input, in its own dtype, and the fp32 rsqrt per row
        (models/common/elementwise.py)."""
        return b * width + FP32 * rows

    k, experts, width = cfg.experts_per_token, cfg.num_experts, cfg.moe_intermediate_size
    shared = cfg.shared_expert_intermediate_size / tp

    def mlp_kept(moe: bool) -> float:
        """What the MLP keeps per token with no checkpointing. An MoE layer runs whole on every TP rank:
        the router's logits, its fp32 probabilities, the top-k weights (fp32) and ids (int64) and, when
        renormalized, their sum and the quotient; the sorted rows' token ids and order (int64) and weights;
        per choice the gathered input, the gate/up output, SiLU, product, down output and weighted output;
        the shared expert's SwiGLU, its output and gate."""
        if not moe:
            return 4 * b * inner  # SwiGLU: gate, SiLU, up and product
        router = b * experts + FP32 * experts + FP32 * k + 8 * k + cfg.norm_topk_prob * (FP32 + FP32 * k)
        dispatch = 2 * 8 * k + b * k
        chosen = b * k * (3 * h + 4 * width)
        return router + dispatch + chosen + (4 * b * shared + b * h + b) * (shared > 0)

    def mlp_selective(moe: bool) -> float:
        """Matmul outputs (grouped matmuls are recomputed): the router's logits, the shared expert's."""
        if not moe:
            return 2 * b * inner + b * h
        return b * experts + (2 * b * shared + b * h) * (shared > 0)

    def layer_bytes(moe: bool) -> float:
        if mode == "full":  # each block keeps only its input, the stream
            return b * stream
        if mode == "selective":  # matmul and collective outputs, and the block input
            matmuls = b * (q + 2 * kv_out) + b * h + mlp_selective(moe)  # o/down outputs: whole partial sums
            if sequence_parallel:  # less the whole partial sums and the all-gathered inputs (recomputed)
                matmuls -= b * h * (1 + (not moe or shared > 0))
                return matmuls + 2 * b * stream + b * stream  # the reduce-scatters' outputs, the block input
            collectives = 2 * b * h * (tp > 1)  # the all-reduces' outputs
            return matmuls + collectives + b * stream
        attention = b * (2 * q + 2 * kv) + FP32 * heads  # q, k after RoPE, v, the output; logsumexp
        if cfg.qk_norm:  # the q/k norms over head_dim (their inputs: the q/k projections' outputs)
            attention += norm(q, heads) + norm(kv, kv_heads)
        # Both norms take the stream (the block input, the residual after attention); the matmuls after
        # them keep their output: under SP the sequence-split one, gathered again in backward.
        norms = 2 * (norm(stream, 1 / split) + b * stream)
        return norms + attention + mlp_kept(moe)

    rope = 2 * b * d  # cos and sin, shared by all layers
    final = norm(h, 1)  # on the whole (gathered) stream; its input is the last block's output
    output_mask = 1  # bool, kept by the head's indexing
    # The embedding output is the first block's input, counted there.
    layers = tuple(layer_bytes(cfg.is_moe(i)) for i in range(cfg.num_layers))
    per_token = sum(layers) + rope + final + output_mask
    detail = {"layers": layers, "tail": final + output_mask}
    if tp == 1:  # the fused head keeps its input and its input's gradient (a row per scored position), the
        # targets (int64); its fp32 weight gradient is made in the forward (counted when the head trains)
        return ActivationBytes(per_token, per_scored=2 * b * h + 8, fixed=FP32 * vocab * h, **detail)
    # a vocabulary-sharded head: its input, the targets and the log-softmax of its logit shards
    return ActivationBytes(per_token, per_scored=b * h + 8 + FP32 * vocab / tp, **detail)


def costs(cfg: DecoderConfig) -> CostModel:
    """FLOPs count the matmuls (2 per multiply-add); norms, RoPE and SiLU are a rounding error."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attention = h * (q + 2 * kv) + q * h
    dense, sparse = (
        3 * h * cfg.intermediate_size,
        _moe_mlp(cfg, cfg.experts_per_token) if cfg.num_experts else 0,
    )
    # An MoE layer counts its active experts only (the top k of each token), the router and shared expert.
    layers = tuple(2.0 * (attention + (sparse if cfg.is_moe(i) else dense)) for i in range(cfg.num_layers))
    return CostModel(
        params=param_counts(cfg),
        embed_flops=0.0,  # a table lookup
        layer_flops=layers,
        pair_flops=(4.0 * cfg.num_heads * d,) * cfg.num_layers,  # QK^T and AV: 2 x 2 x head_dim per head
        head_flops=2.0 * h * cfg.vocab_size,  # the vocabulary projection dominates the norm and the loss
        # memoized: the planner asks for a few (mode, tp, SP) thousands of times, each a pass over the layers
        activations=cache(partial(activation_bytes, cfg)),
    )
