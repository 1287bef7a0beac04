"""The engine core's execute seam: the scheduler's output for one step in, the logits of the positions to
sample out, whatever the layout (as vLLM v1 draws it: one model-runner interface, executors around it).

- `LocalRunner`: the whole model's forward over the paged pool (one process, or one rank of a
  tensor-parallel model: its own heads' keys and values, the plan's reductions, the vocabulary shards
  gathered into whole logits).
- `StageRunner` (infer/pp.py): the rank's pipeline stages, the stream passed on point to point.
- `Executor`: a runner on one process, or on a group of ranks that hold parts of one model copy. Only the
  group's first rank (the leader) schedules and samples; every step it broadcasts the step's input, all
  ranks run it together, and the others (`follow`) wait for the next until the leader says stop. No rank
  but the leader holds request state, so nothing relies on identical random draws in lockstep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardforge.errors import ModelError
from shardforge.infer.paged import Chunk, PagedKV, PagedStep
from shardforge.models.common.images import ImageInputs
from shardforge.models.common.protocol import CausalModel


@dataclass(frozen=True)
class StepInput:
    """One step as the scheduler made it: the step's token ids (prefill chunks and decodes in one row),
    each sequence's part (its block table, cached length, new tokens), and the row indices whose next token
    is sampled."""

    ids: list[int]
    chunks: list[Chunk]
    last: list[int]
    images: ImageInputs | None = None  # the step's image embeddings and rotary positions (infer/media.py)


class ModelRunner(Protocol):
    def run(self, step: StepInput) -> torch.Tensor:
        """The logits [len(step.last), vocab] (fp32, the real vocabulary) on every rank that runs it."""
        ...


class LocalRunner:
    """The model's own forward (one module runs the whole model on this rank)."""

    def __init__(self, model: CausalModel, kv: PagedKV) -> None:
        self.model, self.kv = model, kv
        self.device = next(model.parameters()).device
        self.layers = len(model.blocks())

    def run(self, step: StepInput) -> torch.Tensor:
        paged = PagedStep(self.kv, step.chunks, self.device)
        mask = sampled_positions(len(step.ids), step.last, self.device)
        ids = torch.tensor(step.ids, device=self.device)[None]
        images = None if step.images is None else step.images.to(self.device)
        logits = self.model(ids, paged.positions, output_mask=mask, cache=paged, images=images)
        if not paged.through_every_layer(self.layers):
            raise ModelError(
                f"{self.model.config.family}: {len(paged.attended)} attention calls through the inference "
                f"engine's paged KV cache in a step of its {self.layers} layers (one each is right), so its "
                "tokens would be wrong (a family that does not attend through it runs on the recompute "
                "runner: engine.py's local_runner)"
            )
        return whole_vocabulary(logits, self.model.config.vocab_size).float()


@torch.no_grad()
def attends_paged(model: CausalModel) -> bool:
    """Whether every layer of `model` attends through the paged cache: one token through a scratch pool of
    one slot, before the engine takes requests (engine.py serves a family that does not on the recompute
    runner, infer/recompute.py)."""
    device = next(model.parameters()).device
    paged = PagedStep(PagedKV(1, 1), [Chunk([0], 0, 1)], device)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    model(ids, paged.positions, output_mask=sampled_positions(1, [0], device), cache=paged)
    return paged.through_every_layer(len(model.blocks()))


_STOP = None


class Executor:
    """A runner on this process (`group` None) or on a group of ranks led by the group's first."""

    def __init__(self, runner: ModelRunner, group: dist.ProcessGroup | None = None) -> None:
        self.runner, self.group = runner, group

    @property
    def leads(self) -> bool:
        """Whether this rank schedules (the only process, or the group's first rank)."""
        return self.group is None or dist.get_group_rank(self.group, dist.get_rank()) == 0

    @torch.no_grad()
    def execute(self, step: StepInput) -> torch.Tensor:
        """On the leader: the step's logits, every rank of the group having run it."""
        if self.group is not None:
            dist.broadcast_object_list([step], group=self.group, group_src=0)
        return self.runner.run(step)

    @torch.no_grad()
    def follow(self) -> None:
        """On the other ranks: run every step the leader announces, until it says stop (`close`)."""
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, group=self.group, group_src=0)
            if message[0] is _STOP:
                return
            self.runner.run(message[0])

    def close(self) -> None:
        """On the leader: release the followers from `follow`."""
        if self.group is not None:
            dist.broadcast_object_list([_STOP], group=self.group, group_src=0)

    def share(self, value: Any) -> Any:
        """The leader's `value` on every rank of the group (a rollout's completions, after `close`)."""
        if self.group is None:
            return value
        message = [value]
        dist.broadcast_object_list(message, group=self.group, group_src=0)
        return message[0]


def sampled_positions(tokens: int, last: list[int], device: torch.device) -> torch.Tensor:
    """The step's output mask [1, tokens]: the head runs only where a next token is sampled."""
    mask = torch.zeros(1, tokens, dtype=torch.bool, device=device)
    mask[0, last] = True
    return mask


def whole_vocabulary(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the real vocabulary: TP's vocabulary shards gathered, and the rows a training layout padded
    the vocabulary with (never tokens) cut off."""
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return logits[..., :vocab_size]
