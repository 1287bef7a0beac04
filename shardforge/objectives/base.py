"""What a training objective plugs into the one loop.

An objective says how records become examples (one or several sequences per record: a *group*, such as a
chosen/rejected pair, stays together on one rank and in one micro-batch), how rows are collated, what the
model is called with, and the loss as a dict of *sums* over a micro-batch. The loop divides those sums by the
objective's `normalizer` counted over the whole global batch (target tokens, sequences or groups), so a
per-token SFT loss and a per-pair preference loss share one loop and one global-batch semantics: the update
never depends on how the global batch is split over ranks and micro-steps.

`loss` receives the model's output (the log-probabilities of the scored positions' targets, from the fused
head: no full-vocabulary logits) and the micro-batch (or, under pipeline parallel, the last stage's chunk of
it: a Batch rebuilt from its per-row tensors), so it can form per-token or per-sequence quantities alike.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import MethodSection
from shardforge.config.schema import Config
from shardforge.data.batch_source import BatchSource
from shardforge.data.batching import IGNORE, Batch, collate
from shardforge.data.build import BatchSplit, Collation, build_batch_source
from shardforge.data.examples import Encoder
from shardforge.data.formats import Reader, Reading
from shardforge.data.loader import RowSet
from shardforge.models.common.images import ImageInputs
from shardforge.models.head import Head, TargetLogprobs
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.engine import Engine

Normalizer = Literal["targets", "sequences", "groups"]
# The reference model an objective compares the policy with: none, one held live during training (a frozen
# copy or the policy with its adapters disabled), or its log-probs computed once before training.
Reference = Literal["none", "live", "precomputed"]


@dataclass(frozen=True)
class Traits:
    """What the other layers read of an objective, instead of its stage name: the planner (memory, layouts),
    the layout rules, the data readers and the composition root."""

    reader: Reader = "chat"  # how the readers present records (data/formats.py)
    whole_sequences: bool = False  # scores whole sequences: context parallel may not split its rows
    reference: Reference = "none"
    score_head: int = 0  # outputs of a score head the model has instead of the LM head (0: the LM head)
    rollouts: bool = False  # its rows are sampled by the job itself (no data set is encoded)
    critic: str | None = None  # a separate critic model trained beside the policy (a folder)
    # its rollouts train one group per row, the completions packed (its loss reads sequences, not rows)
    packed_groups: bool = False
    # the method.* sub-sections whose keys it reads (the web UI shows these for the stage, the rest under
    # "advanced"); the finetuning's own section (method.lora, ...) is the finetuning's, not the stage's
    sections: tuple[str, ...] = ()


@dataclass(frozen=True)
class BindContext:
    """What an objective may take from the run before training starts (`Objective.bind`)."""

    model: nn.Module  # the rank's model, finetuning applied, before any layout
    adapter: str | None  # the adapter the run starts from (model.adapter)
    base: str | None  # the run's model folder (model.path)
    pipeline: bool  # the model runs as pipeline stages (chunks of micro-batches, never `prepare`)
    dp_sum: Callable[[torch.Tensor], torch.Tensor]  # sum over the data-parallel ranks, in place
    lay_out: Callable[[nn.Module], nn.Module]  # a frozen model laid out as the policy will be


class Sampler(Protocol):
    """Completions sampled with the training weights in place (train/sampler.py): the inference layer sits
    above objectives/, so an objective that rolls out is handed one."""

    def sample(
        self, prompts: list[list[int]], positions: list[int], images: list[ImageInputs | None]
    ) -> list[list[Any]]:
        """`group_size` completions (token ids, log-probs, finish reason) of each prompt; a prompt's global
        position seeds its completions; `images`: each prompt's, if any (a vision-language model's)."""
        ...


@dataclass(frozen=True, kw_only=True)
class SourceContext:
    """What an objective builds its batch source from (`Objective.batch_source`), after the layout."""

    config: Config
    tokenizer: Any
    reading: Reading
    rows: RowSet | None  # the cached training rows (None: streamed, or the objective samples its rows)
    split: BatchSplit
    multiple: int  # row widths are padded to a multiple of this
    engine: Engine
    dims: ParallelDims
    mesh: DeviceMesh | None
    autocast: Callable[[], contextlib.AbstractContextManager]
    sampler: Sampler


class Objective(ABC):
    """The declared interface of a training objective. The traits and the no-op hooks have defaults; an
    objective sets what differs."""

    name: ClassVar[str] = "objective"
    normalizer: Normalizer = "targets"  # the global-batch count the loss sums are divided by
    group_size: int = 1  # sequences per group (1: every sequence stands alone)
    metrics: tuple[str, ...] = ("loss",)  # the keys `loss` returns, "loss" first (the differentiated sum)
    traits: Traits = Traits()
    collate = staticmethod(collate)

    def __init__(self, method: MethodSection | None = None) -> None:
        self.method = method or MethodSection()  # where an objective's hyper-parameters come from

    @abstractmethod
    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        """Record -> its group's sequences, each (token ids, per-token target flags)."""

    @abstractmethod
    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """Keyword arguments of the model's forward besides the token ids."""

    @abstractmethod
    def loss(self, output: Any, batch: Batch) -> dict[str, torch.Tensor]:
        """Sums over the micro-batch, keyed by `metrics`; "loss" is what is differentiated."""

    def bind(self, ctx: BindContext) -> str | None:
        """Take what the objective needs from the run (a reference model, a reduction over ranks) before
        any layout is applied; returns a line for the run log, or None."""
        return None

    def batch_source(self, ctx: SourceContext) -> BatchSource:
        """Where the loop's global batches come from: by default the data set's rows in a seeded global
        order (or the stream), collated by `collate`."""
        collation = Collation(self.collate, ctx.tokenizer.pad_token_id, ctx.multiple)
        rows, how = ctx.rows, ctx.reading
        return build_batch_source(ctx.config, rows, self, how, ctx.tokenizer, ctx.split, collation)

    def prepare(self, model: nn.Module, batch: Batch) -> Batch:
        """Before the policy's forward on a micro-batch (the plain engine; e.g. a reference's log-probs)."""
        return batch

    @staticmethod
    def finish(means: dict[str, float]) -> dict[str, float]:
        """The logged means (each metric's global sum over the normalizer) -> what is logged."""
        return means


def sequence_logprob_sums(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Summed log-probability of each row's target tokens, [rows]: what per-sequence objectives (preference
    pairs, rewards of completions) compare. `logprobs` are those of the scored positions, in row order."""
    rows = (batch.targets != IGNORE).nonzero()[:, 0]
    return torch.zeros(batch.targets.shape[0], device=logprobs.device).index_add(0, rows, logprobs)


class CausalLM(Objective):
    """Next-token prediction: cross-entropy summed over target tokens, divided by the global batch's target
    count. The LM head runs only on target positions, fused with the log-probabilities: prompts and padding
    never pay for the vocabulary projection, and no full-vocabulary logits are held."""

    name = "causal_lm"
    summed = True  # the loss is a plain sum of the token log-probs (the fused head's fast gradient)

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        return self.scored_inputs(batch, self.head)

    def scored_inputs(self, batch: Batch, head: Callable[[torch.Tensor], Head]) -> dict[str, Any]:
        """The forward's inputs for `batch`, ending in `head` (made from the scored positions' targets)."""
        scored = batch.targets != IGNORE
        return {
            "position_ids": batch.position_ids,
            "doc_ids": batch.doc_ids,
            "doc_layout": batch.doc_layout,
            "output_mask": scored,
            "head": head(batch.targets[scored]),
            "images": batch.images,
        }

    def logprob_head(self, targets: torch.Tensor) -> Head:
        """The scored positions' target log-probs."""
        return TargetLogprobs(targets, self.summed)

    def head(self, targets: torch.Tensor) -> Head:
        """The head the model's forward ends in for training (the target log-probs, unless overridden)."""
        return self.logprob_head(targets)

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        raise NotImplementedError(f"{type(self).__name__} reads no records: give it an encoder")

    @staticmethod
    def loss(output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"loss": -output.sum()}
