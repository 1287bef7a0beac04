"""Any causal LM transformers provides, run by its own modules and wrapped so that the loop, the objectives,
the layouts and checkpoints treat it as one of ours.

The wrapper holds transformers' `...ForCausalLM` as `hf`; parameter names are transformers' own under `hf.`
(checkpoint keys map by that prefix alone). The forward takes the Llama family's arguments: the body runs in
transformers (causal attention over right-padded rows; packed rows attend per document through position ids
that restart, where the family builds its masks with transformers' helpers), then the head runs only where
`output_mask` says, and with `targets` as our fused head (models/head.py: no full-vocabulary logits),
unless the family changes its logits after the projection (Gemma 2's soft-capping, Granite's and Cohere's
scaling), in which case the logits are made and transformed as transformers does. In shardforge's inference
engine the family's attention runs over the paged KV cache (attention.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from shardforge.errors import ModelError
from shardforge.models.common.protocol import CausalModel
from shardforge.models.generic.config import GenericConfig
from shardforge.models.generic.verified import PACKS, PAGED, refuse_measured
from shardforge.models.head import Head, HeadInput, HeadOutput, apply_head, target_logprobs


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build with parameters on the meta device and buffers (RoPE tables, embedding scales) computed for
    real on the CPU: the buffers are derived from the config, not stored in checkpoints, and to_empty would
    leave them unset (the idea of accelerate's `init_empty_weights(include_buffers=False)`)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class HFCausalLM(CausalModel):
    """transformers' ...ForCausalLM (or ...ForSequenceClassification) of a family, wrapped: context and
    pipeline parallel are refused for this backend (planner/layout.py), so no sequence split and no stage's
    copy of a tied embedding."""

    native_names = False  # transformers' module names, read as ours through canonical_name
    shares_prefixes = False  # transformers' masks come from position ids, which a shared prefix breaks

    def __init__(self, cfg: GenericConfig, mlp: Any = None, pretrained: Any = None) -> None:
        """`pretrained`: a folder transformers loads the weights from (its own loading: the weight conversions
        of its families, e.g. per-expert checkpoint keys into fused expert tensors); None: built on the meta
        device (the loop's build_empty and the planner's inventory)."""
        super().__init__()
        if mlp is not None:
            raise ModelError("the generic backend builds the family's own MLPs")
        self.config = cfg
        # num_labels > 0: a reward model, transformers' ...ForSequenceClassification (its head: `score`)
        auto = AutoModelForSequenceClassification if cfg.num_labels else AutoModelForCausalLM
        if pretrained is not None:
            self.hf = auto.from_pretrained(pretrained, config=cfg.hf, dtype=torch.float32)
        else:
            with _parameters_on_meta():
                self.hf = auto.from_config(cfg.hf)
        # to_empty() (the meta build's) leaves buffers unset: their values, made on the CPU, are put back by
        # reset_buffers(); a model transformers loaded has them already
        buffers = self.hf.named_buffers() if pretrained is None else ()
        self._buffers_made = {name: b.detach().clone() for name, b in buffers}
        self.value_head: nn.Linear | None = None
        self.critic: nn.Module | None = None  # PPO's separate critic model (attach_critic)
        self._logit_transform = _logit_transform(cfg.hf)
        refuse_measured(cfg.model_type, "load", "train")

        self._check_structure()
        self._renames = self._canonical_prefixes()
        self.packs = packs_per_document(cfg.hf)
        self.pages = cfg.model_type in PAGED  # measured: models/generic/verified.py

    # ---- what the loop and the layouts ask of a model -----------------------------------------------------
    @property
    def lm_head(self) -> nn.Module:
        """The head: the LM head, or a reward model's score head."""
        return self.hf.score if self.config.num_labels else self.hf.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def blocks(self) -> list[nn.Module]:
        """The decoder layers, in order: the modules of the family's `_no_split_modules` classes (FSDP2's
        units, activation checkpointing's blocks)."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        found = [m for m in self.hf.modules() if type(m).__name__ in names]
        if not found:
            layers = getattr(self.hf.base_model, "layers", None)
            found = list(layers) if layers is not None else []
        if not found:
            raise ModelError(f"cannot find the decoder layers of {self.config.model_type}")
        return found

    def _check_structure(self) -> None:
        """The wrapper runs the base model, then the head alone: a family whose causal LM is not a base model
        plus one linear (BERT's and RoBERTa's prediction heads hold a dense layer and a norm; Llama 4's
        text model is its own base) would give other logits, so it is refused by name."""
        hf, family = self.hf, self.config.model_type
        if hf.base_model is hf:
            raise ModelError(
                f"model_type {family!r}: transformers' {type(hf).__name__} has no base model apart from its "
                "head, which the generic backend runs separately; not supported"
            )
        inside = {id(p) for p in hf.base_model.parameters()} | {id(p) for p in self.lm_head.parameters()}
        extra = sorted({n.rpartition(".")[0] for n, p in hf.named_parameters() if id(p) not in inside})
        if extra:
            raise ModelError(
                f"model_type {family!r}: its head is more than one linear over the base model's output "
                f"({', '.join(extra[:4])}), which the generic backend does not run; not supported"
            )

    def canonical_name(self, name: str) -> str:
        """A parameter's or module's name as the Llama family spells it (`layers.<i>...`, `embed_tokens`,
        `lm_head`; the rest without the wrapper's and the base model's prefixes): what freeze, LoRA and the
        planner's inventory select by, whatever the family calls them (GPT-2: `transformer.h.<i>`, `wte`)."""
        for prefix, ours in self._renames:
            if name == prefix or name.startswith(prefix + "."):
                return ours + name[len(prefix) :]
        return name.removeprefix(f"hf.{self.hf.base_model_prefix}.").removeprefix("hf.")

    def _canonical_prefixes(self) -> list[tuple[str, str]]:
        names = {id(m): n for n, m in self.named_modules()}
        container = names[id(self.blocks()[0])].rpartition(".")[0]  # e.g. hf.model.layers, hf.transformer.h
        renames = [
            (container, "layers"),
            (names[id(self.embed_tokens)], "embed_tokens"),
            (names[id(self.lm_head)], "lm_head"),
        ]
        # the final norm: the part with parameters after the layers in the module that holds them (the base
        # model's norm, GPT-2's ln_f, OPT's decoder.final_layer_norm)
        owner, _, layers = container.rpartition(".")
        children = [n for n, _ in self.get_submodule(owner).named_children()]
        after = children[children.index(layers) + 1 :]
        held = [n for n in after if any(True for _ in self.get_submodule(f"{owner}.{n}").parameters())]
        if len(held) == 1:
            renames.append((f"{owner}.{held[0]}", "norm"))
        return renames

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.hf.get_output_embeddings().weight = self.hf.get_input_embeddings().weight

    def reset_buffers(self) -> None:
        for name, value in self._buffers_made.items():
            owner, _, attr = name.rpartition(".")
            module = self.hf.get_submodule(owner) if owner else self.hf
            current = getattr(module, attr)
            setattr(module, attr, value.to(current.device))

    def init_weights(self, std: float = 0.02, seed: int = 0) -> None:
        raise ModelError(
            f"the generic backend ({self.config.model_type}) trains from a checkpoint folder (model.path), "
            f"not from fresh weights"
        )

    @torch.no_grad()
    def init_head(self, std: float = 0.02, seed: int = 0) -> None:
        """Fresh weights for a score head put on a pretrained body: N(0, std) from a generator of its own."""
        weight = self.lm_head.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * std)
        if getattr(self.lm_head, "bias", None) is not None:
            self.lm_head.bias.zero_()

    # ---- forward -----------------------------------------------------------------------------------------
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
        """The Llama family's forward (models/llama/model.py: Decoder.forward). With `cache` (an inference
        engine step: infer/paged.py) attention runs over the paged KV cache (attention.py); packed rows
        (`doc_ids`, `doc_layout`) are not available on this backend."""
        if not self.packs and (doc_layout is not None or (doc_ids is not None and bool((doc_ids > 0).any()))):
            raise ModelError(
                f"packed rows need per-document attention, which the generic backend is not verified to give "
                f"for {self.config.model_type} (docs/families.md): set data.packing: false"
            )
        h = self.hidden(x, position_ids, doc_ids, doc_layout, cache, images)
        return apply_head(self, h, head, HeadInput(x, position_ids, doc_ids, doc_layout, output_mask))

    def hidden(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None,
        doc_ids: torch.Tensor | None = None,
        doc_layout: Any = None,
        cache: Any = None,
        images: Any = None,
    ) -> torch.Tensor:
        """The body: transformers' base model (its final norm included), or one engine step over the paged
        KV cache. Text only: a vision-language family runs on its native one."""
        if images is not None:
            raise ModelError(f"{self.config.model_type} on the generic backend takes no images")
        if cache is not None:
            return self._paged_body(x, position_ids, cache)
        return self.hf.base_model(input_ids=x, position_ids=position_ids, use_cache=False).last_hidden_state

    def final_hidden(self, h: torch.Tensor, output_mask: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' body ends in the final norm: only the scored positions are kept here."""
        return h[output_mask] if output_mask is not None else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states, with what the family does to its logits after it (a score is
        not a logit: left as it is)."""
        logits = self.lm_head(hidden)
        transform = self._logit_transform if not self.config.num_labels else None
        return transform(logits) if transform is not None else logits

    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, summed: bool) -> torch.Tensor:
        """log p(target) per row of `hidden` [n]: fused (models/head.py) unless the family transforms its
        logits (soft-capping, scaling), whose log-softmax is then taken over whole logits."""
        if self._logit_transform is None:
            return target_logprobs(self.lm_head, hidden, targets, summed)
        logits = self.lm_head(hidden)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # TP's shards
        logits = self._logit_transform(logits.float())
        return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)

    def _paged_body(self, x: torch.Tensor, position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """One engine step through transformers' body, its attention switched to the paged one for the
        call (the family's attention modules read the implementation's name from the config each time).
        attention.py is imported here, not at the top: its transformers modules pull in quantization
        libraries (torchao) whose import prints warnings and costs a second, which every other command
        would pay."""
        from shardforge.models.generic.attention import CACHE, NAME

        config = self.hf.config
        kept = config._attn_implementation
        cache.context(self.config, position_ids)
        config._attn_implementation = NAME
        try:
            out = self.hf.base_model(
                input_ids=x, position_ids=position_ids, use_cache=False, **{CACHE: cache}
            )
        finally:
            config._attn_implementation = kept
        cache.advance(position_ids.shape[1])
        return out.last_hidden_state


def packs_per_document(hf: Any) -> bool:
    """Whether packed rows of this family attend per document with their own positions, as each document
    alone: measured family by family by benchmarks/family_sweep.py (models/generic/verified.py). Where
    transformers' mask helpers see position ids restart the masks are right, but a family that derives
    positions from the attention mask (OPT), adds ALiBi (BLOOM, MPT) or carries a recurrent state (linear
    attention, convolutions) across the row would still mix documents: a family not measured does not pack."""
    return hf.model_type in PACKS


def _logit_transform(hf: Any) -> Any:
    """What the family does to its logits after the LM head, as its ForCausalLM does (None: nothing)."""
    cap = getattr(hf, "final_logit_softcapping", None) or getattr(hf, "logits_soft_cap", None)
    scaling = getattr(hf, "logits_scaling", None)  # Granite divides
    scale = getattr(hf, "logit_scale", None)  # Cohere multiplies
    steps = []
    if scaling not in (None, 1, 1.0):
        steps.append(lambda z: z / scaling)
    if scale not in (None, 1, 1.0):
        steps.append(lambda z: z * scale)
    if cap is not None:
        steps.append(lambda z: torch.tanh(z / cap) * cap)
    if not steps:
        return None

    def transform(z: torch.Tensor) -> torch.Tensor:
        for step in steps:
            z = step(z)
        return z

    return transform
