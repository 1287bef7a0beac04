"""The Llama family's pipeline-split rule: what each piece of the model costs, so the split can balance
stages. The embedding goes to the first stage, final norm + head + loss to the last, blocks in between."""

from __future__ import annotations

from shardforge.models.llama.config import DecoderConfig
from shardforge.models.spec import PipelineCosts


def pipeline_costs(cfg: DecoderConfig, seq_len: int) -> PipelineCosts:
    """Forward FLOPs per token of each piece (backward is ~2x forward for all of them alike)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    matmuls = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    attention = 2 * cfg.num_heads * d * seq_len  # QK^T and AV over a causal half of the row
    layer = 2.0 * matmuls + attention
    return PipelineCosts(
        embed=0.0,  # a table lookup
        layers=[layer] * cfg.num_layers,
        head=2.0 * h * cfg.vocab_size,  # the vocabulary projection dominates the final norm and the loss
    )
