"""The declared interface of a model: what the layouts (parallel/), checkpoint I/O and inference call on it,
and the typed fields they read instead of probing for them. Both backends derive from `CausalModel` (ours,
models/llama/model.py: `Decoder`; transformers' modules, models/generic/model.py: `HFCausalLM`); ours is also
a `StagedModel`, which a pipeline cuts into stages (the generic backend refuses a pipeline). They are
nn.Modules, so the layouts take them as they are."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from shardforge.models.head import Head, HeadOutput


class FusedProjections:
    """A module whose linears of one input inference may run as one matmul (infer/packed.py): `FUSED` maps a
    slot (an attribute, None until inference sets it) to the linears it replaces, in output order; while the
    slot is set, the forward calls it for their outputs, and the linears' attributes are None."""

    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {}


class CausalModel(nn.Module, metaclass=ABCMeta):
    # Its parameter names are the Llama family's own; False: another spelling (the generic backend's
    # transformers names) that freeze, LoRA and NF4 read through `canonical_name`.
    native_names: ClassVar[bool] = True
    config: Any  # the family's DecoderConfig (models/common/config.py)
    embed_tokens: nn.Module | None  # None on a pipeline stage without the embedding
    lm_head: nn.Module | None  # the LM head, or a reward model's score head; None before the last stage
    value_head: nn.Module | None  # PPO's critic on the policy's final hidden states (models/head.py)
    critic: nn.Module | None  # or PPO's separate critic model, a submodule
    untied_copy: bool = False  # a pipeline stage holds its own copy of the tied embedding as its head
    sequence_split: Any = None  # context parallel's split of the rows' sequence (parallel/context_parallel)
    packs: bool = True  # attends within each document of a packed row (doc_ids / doc_layout)
    shares_prefixes: bool = True  # attends by doc_layout, whose documents may share a row's prefix
    pages: bool = True  # decodes exactly over the engine's paged KV cache (else its recompute runner)
    vision: ClassVar[bool] = False  # takes images (a vision-language family)

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        doc_layout: Any = None,
        output_mask: torch.Tensor | None = None,
        cache: Any = None,
        head: Head | None = None,
        images: Any = None,
    ) -> HeadOutput:
        """The body, then `head` over the scored positions' final hidden states (models/head.py)."""

    @abstractmethod
    def hidden(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        doc_layout: Any = None,
        cache: Any = None,
        images: Any = None,
    ) -> torch.Tensor:
        """The body: token ids (or a stage's incoming stream) -> the stream after the blocks; `images`
        (models/common/images.py) where the model is a vision-language one (`vision`)."""

    def rotary_positions(self, x: torch.Tensor, position_ids: torch.Tensor, images: Any) -> torch.Tensor:
        """The positions RoPE turns each token by: its position, unless a family's images lay out positions
        of their own (Qwen2-VL's M-RoPE [3, b, s])."""
        return position_ids

    @abstractmethod
    def blocks(self) -> list[nn.Module]:
        """The decoder blocks, in order: FSDP2's units, activation checkpointing's and compile's blocks."""

    @abstractmethod
    def canonical_name(self, name: str) -> str:
        """A parameter's name as the Llama family spells it (what freeze, LoRA and the planner select)."""

    @abstractmethod
    def final_hidden(self, h: torch.Tensor, output_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states (normed) of the positions `output_mask` keeps."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, summed: bool) -> torch.Tensor: ...

    @abstractmethod
    def tie_weights(self) -> None: ...

    @abstractmethod
    def reset_buffers(self) -> None:
        """Buffers after `to_empty` (which leaves them unset)."""

    @abstractmethod
    def init_weights(self, std: float = 0.02, seed: int = 0) -> None: ...

    @abstractmethod
    def init_head(self, std: float = 0.02, seed: int = 0) -> None: ...


class StagedModel(CausalModel):
    """A model a pipeline cuts into stages."""

    @abstractmethod
    def prune(self, layers: list[int], first: bool, last: bool) -> None:
        """Keep only what a pipeline rank holds, in place (on the meta device)."""

    @abstractmethod
    def part(self, layers: list[int], first: bool, last: bool) -> StagedModel:
        """A view of some of the model (a stage), sharing its modules."""
