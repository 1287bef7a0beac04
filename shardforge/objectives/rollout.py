"""The RL batch source: each step's rollouts, sampled on the training weights in place, scored and turned
into the loop's micro-batches (`GRPOObjective.batch_source`; PPO's too).

Per step, the global batch's prompts are taken from a seeded global order (as a data set's groups are), and
each data-parallel rank takes its share, split into micro-steps exactly as `DatasetSource` splits groups.
The rank samples `group_size` completions of each of its prompts through the run's `Sampler`
(train/sampler.py: the inference engine running the training model, whatever the layout). Under FSDP2 every
unit is all-gathered once for the rollout, kept whole through sampling and scoring (no re-gather per
forward), and resharded after it: DeepSpeed's Hybrid Engine idea. That gather is the weight sync, measured
per step (`time/weight_sync_s`); the memory it needs is one unsharded model. The training forward
recomputes the log-probs the loss uses (the rollout policy's `old_logps` when a rollout trains several
steps, and the reference's), through the engine's `forward_only` whatever the layout; the sampler's own
log-probs are only compared with the training forward's (`logprob_delta`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import MoESection, RLSection
from shardforge.data.batch_source import GlobalBatch
from shardforge.data.batching import (
    IGNORE,
    Batch,
    GlobalOrder,
    collate,
    collate_groups,
    row_images,
    split_global_batch,
)
from shardforge.data.build import record_images
from shardforge.data.examples import Example, ImageArrays
from shardforge.data.formats import Reading, Record
from shardforge.data.images import ImageReader, check_image_tokens, with_images
from shardforge.data.loader import read_dataset
from shardforge.data.templates import render, resolve_template, tokenize
from shardforge.errors import ConfigError, DataError
from shardforge.log import get_logger
from shardforge.models.common.images import ImageInputs
from shardforge.models.moe import moe_layers
from shardforge.objectives.base import Sampler, SourceContext, Traits
from shardforge.objectives.rewards import Completions, Reward, build_rewards
from shardforge.parallel.data_parallel import kept_unsharded
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.engine import Engine, dp_sum
from shardforge.parallel.tensor_parallel import loss_context

log = get_logger(__name__)


class RolloutObjective(Protocol):
    """What the rollout source calls of an RL objective (objectives/rl.py: GRPO's and PPO's): its traits, its
    scores of a rollout before the update, and the advantages from the rewards."""

    traits: Traits

    def score_rollout(self, model: nn.Module, batch: Batch, forward: Callable[..., Any]) -> Batch: ...

    def assign_advantages(
        self, micro: list[Batch], scores: list[torch.Tensor], total: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[list[bool], dict[str, float]]: ...


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # each image's mark written as its image tokens
    text: str  # as the reward functions see it: the marks as they were
    messages: list[dict[str, str]]
    answer: str | None
    record: Record  # where its images are read from again, each rollout that takes it (none kept)
    image_tokens: int = 0  # how many its images made when the prompts were read


def load_prompts(
    data: DataSection,
    tokenizer: Any,
    room: int,
    how: Reading,
    reader: ImageReader | None = None,
    refusal: str = "the model reads no images",
) -> tuple[list[Prompt], int]:
    """The training prompts rendered with the chat template's generation prompt, and how many were left out
    because they leave fewer than max_new_tokens of data.max_length (`room` tokens is the most a prompt
    may have). A prompt's images (a vision-language model's `reader`) are read here for their token counts,
    and again, with only the step's prompts in memory, by each rollout that takes it."""
    template = resolve_template(tokenizer, data.template, data.enable_thinking)
    records = [r for spec in data.train for r in read_dataset(spec, how)]
    expanded, counts = [], []  # each record's marks as its image tokens, and how many (its pixels dropped)
    for record in records:
        written, arrays = with_images(record, reader, refusal)
        expanded.append(written)
        counts.append(0 if arrays is None else arrays.tokens)
    if any(counts):
        log.info(f"prompt images read: {sum(len(r.images or ()) for r in records)}")
    texts = [render(tokenizer, template, list(r.messages or ()), True, r.tools) for r in expanded]
    prompts, too_long = [], 0
    for record, count, text, (ids, _) in zip(records, counts, texts, tokenize(tokenizer, texts), strict=True):
        if len(ids) > room:
            too_long += 1
            continue
        if reader is not None:
            check_image_tokens(ids, reader.prompt.token_id, count, record.source)
        if count:
            text = render(tokenizer, template, list(record.messages or ()), True, record.tools)
        prompt = Prompt(ids.tolist(), text, list(record.messages or ()), record.answer, record, count)
        prompts.append(prompt)
    if not prompts:
        raise DataError(
            f"none of the {len(records)} prompts fits in {room} tokens (data.max_length minus "
            f"method.rl.max_new_tokens); raise data.max_length or lower max_new_tokens"
        )
    return prompts, too_long


# How a micro-batch's rollouts become rows (`rollout_packing`).
Packing = Literal["shared", "packed", "rows"]


def rollout_packing(packed_groups: bool, model: Any, dims: ParallelDims, moe: MoESection) -> Packing:
    """How a micro-batch's rollouts become rows: `shared` (one group per row, its prompt once), `packed`
    (one group per row, each sequence whole: a pipeline's chunks attend by masks, not by the layout) or
    `rows` (one sequence per row: the objective reads rows, or the model cannot keep documents apart). A
    mixture of experts balances its loads over the tokens a forward runs: its prompts are not shared (packed
    whole, its balancing sees what one sequence per row shows it), and under a capacity, which drops
    choices by the forward's token count, it keeps one sequence per row."""
    sparse = bool(moe_layers(model))
    if not (packed_groups and model.packs) or (sparse and moe.capacity_factor is not None):
        return "rows"
    return "shared" if model.shares_prefixes and dims.pp == 1 and not sparse else "packed"


def attention_pairs(lengths: list[int], completions: list[int], group_size: int, packing: Packing) -> int:
    """Query-key pairs the training forward attends over sequences of these lengths (their completions'
    lengths given, groups of `group_size` in order): each sequence's n(n+1)/2, except that with the prompt
    `shared` a group's trunk (its prompt but the last token) is attended once, not once per sequence."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    if packing == "shared":
        trunks = [lengths[i] - completions[i] - 1 for i in range(0, len(lengths), group_size)]
        pairs -= (group_size - 1) * sum(t * (t + 1) // 2 for t in trunks)
    return pairs


def build_rollout_source(ctx: SourceContext, objective: RolloutObjective) -> RolloutSource:
    """An RL stage's batch source: its prompts (with how many did not leave room for max_new_tokens) and
    its rewards."""
    cfg = ctx.config
    room = cfg.data.max_length - cfg.method.rl.max_new_tokens
    reader, refusal = record_images(cfg, ctx.tokenizer, cfg.data)
    prompts, too_long = load_prompts(cfg.data, ctx.tokenizer, room, ctx.reading, reader, refusal)
    if any(p.record.images for p in prompts):
        check_image_rollouts(objective, ctx.dims)
    if cfg.data.eval:
        log.warning(f"stage {cfg.method.stage} does not evaluate: data.eval is not read")
    log.info(
        f"train prompts: {len(prompts)}, {cfg.method.rl.group_size} completions each per rollout"
        + (f"; {too_long} left out (longer than {room} tokens)" if too_long else "")
    )
    rewards = build_rewards(cfg.method.rl.rewards, cfg.method.rl.max_new_tokens, ctx.engine.device)
    packing = rollout_packing(objective.traits.packed_groups, ctx.engine.model, ctx.dims, cfg.method.moe)
    if any(p.image_tokens for p in prompts) and not ctx.engine.inner.config.packs_images:
        packing = "rows"  # the family packs no rows with images: one sequence a row
    if (
        packing == "shared"
        and reader is not None
        and any(p.ids[-1] == reader.prompt.token_id for p in prompts)
    ):
        # a completion would start with a copy of the prompt's last token, here an image's: not shared
        log.info("a prompt ends in an image's token: each completion is packed with its whole prompt")
        packing = "packed"
    return RolloutSource(
        prompts=prompts, rl=cfg.method.rl, rewards=rewards, tokenizer=ctx.tokenizer, sampler=ctx.sampler,
        objective=objective, engine=ctx.engine, dims=ctx.dims, mesh=ctx.mesh, autocast=ctx.autocast,
        seed=cfg.train.seed, split=ctx.split.astuple(), multiple=ctx.multiple, reader=reader,
        packing=packing,
    )  # fmt: skip


def check_image_rollouts(objective: RolloutObjective, dims: ParallelDims) -> None:
    """What rolls out prompts with images: the engine places them in one process or under tensor parallel
    (a pipeline's stage runner does not yet), and a separate critic model would read the tokens alone."""
    if dims.pp > 1:
        raise ConfigError(
            f"parallel.pp={dims.pp}: the prompts have images, which the rollout engine does not place over "
            f"pipeline stages yet; use data or tensor parallel (parallel.dp_shard, parallel.tp)"
        )
    if objective.traits.critic:
        raise ConfigError(
            f"method.ppo.critic={objective.traits.critic!r}: a separate critic model reads the tokens "
            f"alone, not the prompts' images; use critic: head (a value head on the policy) with image "
            f"prompts"
        )


class RolloutSource:
    """A BatchSource (data/batch_source.py) of rollouts: never drawn ahead, since each rollout must use the
    weights of the step before it."""

    prefetch = False

    def __init__(
        self,
        *,
        prompts: list[Prompt],
        rl: RLSection,
        rewards: list[Reward],
        tokenizer: Any,
        sampler: Sampler,
        objective: RolloutObjective,
        engine: Engine,
        dims: ParallelDims,
        mesh: DeviceMesh | None,
        autocast: Callable[[], contextlib.AbstractContextManager],
        seed: int,
        split: tuple[int, int, int, int],
        multiple: int,
        packing: Packing,
        reader: ImageReader | None,
    ) -> None:
        self.prompts, self.rl, self.rewards, self.tokenizer = prompts, rl, rewards, tokenizer
        self.sampler, self.objective, self.engine = sampler, objective, engine
        self.dims, self.mesh, self.autocast, self.seed = dims, mesh, autocast, seed
        self.split, self.multiple = split, multiple
        micro_batch, grad_accum, dp, _ = split
        self.groups_per_step = micro_batch * grad_accum * dp
        self.order = GlobalOrder(len(prompts), seed)
        self.groups: float = len(prompts)  # groups in an epoch
        self.device = engine.device
        self.packing, self.reader = packing, reader
        self.cached: GlobalBatch | None = None
        self.repeats = 0  # how many more times the cached rollout trains (epochs_per_rollout)

    def identity(self) -> dict:
        """What a checkpoint's data position refers to (checked on resume)."""
        return {"prompts": len(self.prompts), "group_size": self.rl.group_size}

    def load_state_dict(self, state: dict) -> None:
        self.order.position = int(state["samples"])  # a rollout interrupted between its epochs is redone

    def close(self) -> None:
        pass

    # ---- one step --------------------------------------------------------------------------------------
    def next_batch(self) -> GlobalBatch:
        if self.cached is not None and self.repeats > 0:
            self.repeats -= 1
            return replace(self.cached, stats={"time/rollout_s": 0.0, "time/scoring_s": 0.0})
        start = self.order.position
        order = self.order.take(self.groups_per_step)
        mine = split_global_batch(np.arange(self.groups_per_step), *self.split)  # step positions per micro
        positions = [int(k) for part in mine for k in part]
        prompts = [self.prompts[int(order[k])] for k in positions]
        critic = self.engine.inner.critic  # PPO's separate critic never generates: left sharded
        skip = [critic] if critic is not None else []
        images = self._images(prompts)
        with torch.no_grad(), kept_unsharded(self.engine.fsdp_roots(), skip) as sync_s:
            began = time.perf_counter()
            completions = self.sampler.sample(
                [p.ids for p in prompts], [start + k for k in positions], [_inputs(a) for a in images]
            )
            rollout_s = time.perf_counter() - began + sync_s
            began = time.perf_counter()
            rows, stats = self._score(prompts, completions, images)
            micro = self._micro_batches(rows, [len(part) for part in mine])
            rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
            scores = list(rewards.split([len(part) * self.rl.group_size for part in mine]))  # per micro-batch
            keep, advantage_stats = self.objective.assign_advantages(micro, scores, self._sum)
            stats.update(self.engine.from_last_stage(advantage_stats))
            scoring_s = time.perf_counter() - began
        batch = GlobalBatch(
            micro, {}, {"samples": self.order.position}, self.order.position / len(self.prompts)
        )
        computed = sum(b.num_tokens for b in micro)  # a prompt shared by its group counts once
        batch.counts, batch.stats = self._reduce(rows, keep, computed, stats, (rollout_s, scoring_s, sync_s))
        self.cached, self.repeats = batch, self.rl.epochs_per_rollout - 1
        return batch

    def _images(self, prompts: list[Prompt]) -> list[ImageArrays | None]:
        """The step's prompts' images, read again (a prompt taken twice, once)."""
        read: dict[int, ImageArrays | None] = {}
        for p in prompts:
            if id(p) not in read:
                arrays = read[id(p)] = with_images(p.record, self.reader, "")[1]
                made = 0 if arrays is None else arrays.tokens
                if made != p.image_tokens:
                    raise DataError(
                        f"{p.record.source}: its images make {made} image tokens now and made "
                        f"{p.image_tokens} when the prompts were read: an image changed during the run"
                    )
        return [read[id(p)] for p in prompts]

    def _score(
        self, prompts: list[Prompt], completions: list[list[Any]], images: list[ImageArrays | None]
    ) -> tuple[list[dict], dict]:
        """Each row's example (prompt + completion, the completion trained), its prompt's images and its
        reward, the weighted sum of the reward functions' scores (each one's sum is logged)."""
        flat = [(p, c) for p, group in zip(prompts, completions, strict=True) for c in group]
        pictures = [a for a, group in zip(images, completions, strict=True) for _ in group]
        texts = [self.tokenizer.decode(c.tokens, skip_special_tokens=True) for _, c in flat]
        batch = Completions(
            [p.text for p, _ in flat], texts, [len(c.tokens) for _, c in flat], [p.answer for p, _ in flat],
            [p.messages for p, _ in flat],
        )  # fmt: skip
        parts = {r.name: torch.tensor(r.fn(batch), dtype=torch.float64) for r in self.rewards}
        total = sum(
            (r.weight * parts[r.name] for r in self.rewards), torch.zeros(len(flat), dtype=torch.float64)
        )
        rows = []
        for i, (p, c) in enumerate(flat):
            trained = (False,) * len(p.ids) + (True,) * len(c.tokens)
            rows.append({
                "example": Example((*p.ids, *c.tokens), trained, f"rollout {i}"), "reward": float(total[i]),
                "length": len(c.tokens), "truncated": c.finish_reason == "length",
                "sampled": [logp for logp, _ in c.logprobs], "images": pictures[i],
            })  # fmt: skip
        stats = {f"reward/{name}_sum": float(v.sum()) for name, v in parts.items()}
        # The sampled tokens' mean -log-prob: a Monte-Carlo estimate of the policy's entropy (temperature 1).
        stats["entropy_sum"] = -sum(sum(row["sampled"]) for row in rows)
        return rows, stats

    def _micro_batches(self, rows: list[dict], prompts_per_micro: list[int]) -> list[Batch]:
        """Each micro-batch's rows: where the objective and the model allow, one group per row with the
        prompt computed once and its completions after it (`collate_groups`), or without the pipeline's
        masks (which cannot share a prefix) the group's sequences packed whole; else one sequence per row."""
        n, out, at = self.rl.group_size, [], 0
        examples, pictures = [row["example"] for row in rows], [row["images"] for row in rows]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for count in prompts_per_micro:
            groups = [list(range(at + g * n, at + (g + 1) * n)) for g in range(count)]
            trunks = None
            if self.packing == "shared":
                shared = [self._group(rows, group) for group in groups]
                batch = collate_groups(shared, pad, self.multiple)
                layout = [group[:1] for group in groups]  # a group's images once, in its prompt
                trunks = [(p, _inputs(pictures[g[0]])) for (p, _), g in zip(shared, groups, strict=True)]
            else:
                layout = groups if self.packing == "packed" else [[i] for group in groups for i in group]
                batch = collate(examples, layout, pad, self.multiple)
            batch.images = row_images([[a for i in row if (a := pictures[i]) is not None] for row in layout])
            if batch.images is not None:
                self._place_images(batch, trunks)
            # the sampler's log-probs, sequence after sequence: the batch's targets in row-major order
            sampled = [logp for i in range(at, at + count * n) for logp in rows[i]["sampled"]]
            at += count * n
            batch.extras["sampled_logps"] = torch.zeros(batch.targets.shape)
            batch.extras["sampled_logps"][batch.targets != IGNORE] = torch.tensor(sampled)
            batch = batch.to(self.device)
            with self.autocast(), loss_context(self.dims):
                out.append(self.objective.score_rollout(self.engine.model, batch, self._forward))
        return out

    def _place_images(
        self, batch: Batch, prompts: list[tuple[tuple[int, ...], ImageInputs | None]] | None
    ) -> None:
        """Where the micro-batch's images go, as the engine placed them when it sampled (infer/media.py):
        the image tokens of the prompts only (a completion's token that happens to be the image token is a
        token), and, for a model whose images lay out rotary positions of their own (Qwen2-VL's M-RoPE),
        every token's. Rows that share their prompt (`prompts`: each row's, with its images) take the
        trunk's positions as the model lays out its prompt and each completion's after it, shifted as a text
        token after the prompt is; other rows' are the model's own, its completions' image tokens read as
        text."""
        assert batch.images is not None and batch.input_ids is not None
        model, ids = self.engine.inner, batch.input_ids
        token = model.config.image_token_id
        completion = torch.zeros_like(ids, dtype=torch.bool)
        completion[:, 1:] = batch.targets[:, :-1] != IGNORE
        batch.images.slots = (ids == token) & ~completion
        if prompts is None:
            text = ids.masked_fill(completion & (ids == token), 0 if token else 1)
            rotary = model.rotary_positions(text, batch.position_ids, batch.images)
            batch.images.positions = rotary if rotary.dim() == 3 else None
            return
        out = None
        for r, (prompt, images) in enumerate(prompts):
            if images is None:
                continue
            trunk = len(prompt) - 1
            rotary = model.rotary_positions(torch.tensor(prompt)[None], torch.arange(trunk + 1)[None], images)
            if rotary.dim() == 2:
                return
            if out is None:
                out = batch.position_ids.expand(3, -1, -1).clone()
            out[:, r, :trunk] = rotary[:, 0, :trunk]
            out[:, r, trunk:] += int(rotary.max()) - trunk
        batch.images.positions = out

    @staticmethod
    def _group(rows: list[dict], group: list[int]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
        """A group's prompt and its completions' tokens."""
        ids = rows[group[0]]["example"].input_ids
        prompt = tuple(ids[: len(ids) - rows[group[0]]["length"]])
        return prompt, [tuple(rows[i]["example"].input_ids[len(prompt) :]) for i in group]

    def _forward(self, net: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> Any:
        """A whole forward of the policy (the engine's model) or the reference, whatever the layout."""
        return self.engine.forward_only(input_ids, inputs, None if net is self.engine.model else net)

    def _sum(self, value: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """A small vector reduced over the data-parallel ranks, in float64 on the host."""
        return dp_sum(value.to(self.device, torch.float64), self.dims, self.mesh, op).cpu()

    def _reduce(
        self,
        rows: list[dict],
        keep: list[bool],
        tokens: int,
        stats: dict[str, float],
        times: tuple[float, float, float],
    ) -> tuple[dict[str, int], dict[str, float]]:
        """The global batch's counts (the loop's normalizers: the kept sequences only) and the logged
        statistics, summed (or maxed) over the data-parallel ranks."""
        kept = [r for r, k in zip(rows, keep, strict=True) if k]
        lengths = [len(r["example"].input_ids) for r in rows]
        pairs = attention_pairs(lengths, [r["length"] for r in rows], self.rl.group_size, self.packing)
        local = {
            "tokens": tokens,
            "targets": sum(r["length"] for r in kept),
            "sequences": len(kept),
            "groups": len(kept) // self.rl.group_size,
            "attention_pairs": pairs,
            "rows": len(rows),
            "reward_sum": sum(r["reward"] for r in rows),
            "reward_sq": sum(r["reward"] ** 2 for r in rows),
            "length_sum": sum(r["length"] for r in rows),
            "truncated": sum(r["truncated"] for r in rows),
            **stats,
        }
        keys = list(local)
        summed = dict(
            zip(keys, self._sum(torch.tensor([float(local[k]) for k in keys])).tolist(), strict=True)
        )
        longest, rollout_max, scoring_max, sync_max = self._sum(
            torch.tensor([max(r["length"] for r in rows), *times]), dist.ReduceOp.MAX
        ).tolist()
        counts = {k: max(1, round(summed[k])) for k in ("tokens", "targets", "sequences", "groups")}
        counts["attention_pairs"] = int(summed["attention_pairs"])
        n, n_tokens = summed["rows"], max(1.0, summed["length_sum"])
        mean = summed["reward_sum"] / n
        out = {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(0.0, summed["reward_sq"] / n - mean * mean)),
            **{k[: -len("_sum")]: v / n for k, v in summed.items() if k.startswith("reward/")},
            "response_length_mean": summed["length_sum"] / n,
            "response_length_max": longest,
            "truncated_fraction": summed["truncated"] / n,
            **({"groups_filtered": summed["groups_filtered"]} if "groups_filtered" in summed else {}),
            **({"kl_penalty": summed["kl_penalty_sum"] / n_tokens} if "kl_penalty_sum" in summed else {}),
            "entropy": summed["entropy_sum"] / n_tokens,
            "rollout_tokens_per_s": summed["length_sum"] / max(rollout_max, 1e-9),
            "time/rollout_s": rollout_max,
            "time/weight_sync_s": sync_max,
            "time/scoring_s": scoring_max,
        }
        return counts, out


def _inputs(arrays: ImageArrays | None) -> ImageInputs | None:
    """A prompt's images as a model's forward (or the engine) takes them."""
    if arrays is None:
        return None
    return ImageInputs(torch.from_numpy(arrays.pixels), torch.from_numpy(arrays.grids))
