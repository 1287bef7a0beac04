"""A layout as data: every choice the planner makes, read from a config or written back into one, and the
rules a layout must keep (`check_layout`: the launcher's, the preflight's and the search's)."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from shardforge.config.optimizers import layout_refusal
from shardforge.config.parallel_schema import ParallelSection
from shardforge.config.schema import Config, ModelSection
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.parallel.context_parallel import check_context_parallel
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.expert_parallel import check_expert_parallel
from shardforge.parallel.pipeline_plan import PipelinePlan, plan_pipeline
from shardforge.parallel.tensor_parallel import check_tensor_parallel

if TYPE_CHECKING:
    from shardforge.objectives.base import Traits

# The parallel keys a layout sets; the rest of the section (backend, timeouts, compression) is the user's.
LAYOUT_KEYS = (
    "dp_replicate",
    "dp_shard",
    "tp",
    "sequence_parallel",
    "pp",
    "pp_schedule",
    "pp_virtual",
    "pp_microbatches",
    "pp_layers",
    "cp",
    "ep",
    "zero_stage",
    "activation_checkpoint",
    "offload",
)


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero_stage: int
    sequence_parallel: bool
    activation_checkpoint: str
    offload: str
    micro_batch: int  # rows per data-parallel rank per micro-step
    grad_accum: int
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_microbatches: int | None = None
    pp_layers: str | None = None  # decoder layers per stage; None: balanced by cost at launch

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def degrees(self) -> dict[str, int]:
        """Mesh dimension -> degree, as `ParallelDims.degrees` names them."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp}  # fmt: skip

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def pipeline_microbatches(self) -> int:
        """Pipeline micro-batches per micro-step (torch's n_microbatches)."""
        return self.pp_microbatches or self.pp * self.pp_virtual

    def parallel_section(self, base: ParallelSection) -> ParallelSection:
        """`base` with this layout's keys (validated: a bad combination is a ConfigError)."""
        values = base.model_dump() | {k: getattr(self, k) for k in LAYOUT_KEYS} | {"auto": False}
        if self.pp == 1:  # pipeline keys must stay at their defaults without a pipeline
            values |= {"pp_schedule": "1f1b", "pp_virtual": 1, "pp_microbatches": None, "pp_layers": None}
        try:
            return ParallelSection(**values)
        except ValidationError as exc:  # its first message, as the config loader reports it
            raise ConfigError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None

    def apply(self, cfg: Config) -> Config:
        """The config that runs this layout: its parallel section, micro-batch and accumulation."""
        train = cfg.train.model_copy(update={"micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                                             "global_batch": None})  # fmt: skip
        return cfg.model_copy(update={"parallel": self.parallel_section(cfg.parallel), "train": train})

    def overrides(self) -> list[str]:
        """The same layout as CLI overrides (`key=value`), for the report and for relaunching."""
        keys = [k for k in LAYOUT_KEYS if self.pp > 1 or not k.startswith("pp_")]
        keys = [f"parallel.{k}={_yaml(getattr(self, k))}" for k in keys]
        return [*keys, f"train.micro_batch={self.micro_batch}", f"train.grad_accum={self.grad_accum}"]

    def describe(self) -> str:
        parts = [
            f"{k}={v}"
            for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
            if v > 1
        ]
        if self.dp > 1:
            kind = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[self.zero_stage]
            rep = f"{self.dp_replicate}x" if self.dp_replicate > 1 and self.zero_stage >= 2 else ""
            parts.insert(0, f"dp={rep}{self.dp_shard if self.zero_stage >= 2 else self.dp} {kind}")
        if self.tp > 1 and self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}" + (f" v={self.pp_virtual}" if self.pp_virtual > 1 else "")
                         + f" m={self.pipeline_microbatches}")  # fmt: skip
        if self.activation_checkpoint != "none":
            parts.append(f"ckpt={self.activation_checkpoint}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        parts.append(f"mb={self.micro_batch}x{self.grad_accum}")
        return " ".join(parts) or "single process"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def global_batch(cfg: Config) -> int:
    """The rows per optimizer step the planner keeps fixed: train.global_batch, else micro_batch x grad_accum
    (the batch one process would see)."""
    if cfg.train.global_batch is not None:
        return cfg.train.global_batch
    return cfg.train.micro_batch * cfg.train.grad_accum


def _yaml(value: Any) -> str:
    """A value as an override spells it (YAML's true, false, null)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def resolve_grad_accum(cfg: Config, dp: int) -> int:
    """grad_accum, or the one implied by train.global_batch = micro_batch x grad_accum x dp."""
    t = cfg.train
    if t.global_batch is None:
        return t.grad_accum
    per_step = t.micro_batch * dp
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch ({t.micro_batch}) x "
            f"data-parallel size ({dp}) = {per_step}"
        )
    return t.global_batch // per_step


def layout_of(cfg: Config, world: int) -> Layout:
    """The explicit layout a config asks for on `world` processes (dp_shard=-1 resolved; the degrees and
    the batch split checked as the launcher checks them)."""
    p = cfg.parallel
    dims = ParallelDims.from_config(p, world)
    grad_accum = resolve_grad_accum(cfg, dims.dp)
    return Layout(
        dims.dp_replicate, dims.dp_shard, p.tp, p.pp, p.cp, p.ep, p.zero_stage, p.sequence_parallel,
        p.activation_checkpoint, p.offload, cfg.train.micro_batch, grad_accum, p.pp_schedule, p.pp_virtual,
        p.pp_microbatches, p.pp_layers,
    )  # fmt: skip


def check_generic(cfg: Config, dims: ParallelDims, shape: Any) -> None:
    """What the generic backend (transformers' modules, models/generic) cannot run: pipeline, context and
    expert parallel and sequence parallel (tensor parallel runs transformers' own plan of the family)."""
    from shardforge.models.spec import supported  # the native families, named in the messages

    kind = f"the generic backend ({shape.model_type}: transformers' modules)"
    native = ", ".join(supported())
    for key, degree in (("pp", dims.pp), ("cp", dims.cp), ("ep", dims.ep)):
        if degree > 1:
            raise ConfigError(
                f"parallel.{key}={degree} is not available on {kind}: pipeline, context and expert parallel "
                f"need a native family ({native}); use data parallel (parallel.dp_shard with zero_stage 1-3, "
                f"or dp_replicate) and tensor parallel (parallel.tp, from transformers' plan of the family)"
            )
    if dims.tp > 1 and cfg.parallel.sequence_parallel:
        raise ConfigError(
            f"parallel.tp={dims.tp} with sequence_parallel on {kind}: transformers' modules keep the "
            f"residual stream whole; set parallel.sequence_parallel: false"
        )


def check_vision(cfg: Config, dims: ParallelDims, shape: Any) -> None:
    """A vision-language model trains data, tensor, pipeline and context parallel (its tower whole on every
    tensor- and context-parallel rank of the first stage, its decoder split); expert parallel has no family
    to split yet, and a pipeline with context parallel would have to cut each chunk's images again."""
    if not shape.takes_images:
        return
    if dims.ep > 1:
        raise ConfigError(
            f"parallel.ep={dims.ep}: a vision-language model ({shape.family}) has no experts to split; "
            f"set parallel.ep: 1"
        )
    if dims.tp > 1 and shape.family.startswith("hf:"):
        raise ConfigError(
            f"parallel.tp={dims.tp}: {shape.family} runs on the generic backend (transformers' whole model), "
            f"whose tensor-parallel plan splits no vision tower; train it with data parallel "
            f"(parallel.dp_shard / dp_replicate, ZeRO 1-3)"
        )
    if dims.cp > 1 and dims.pp > 1:
        raise ConfigError(
            f"parallel.cp={dims.cp} with parallel.pp={dims.pp}: a vision-language model ({shape.family}) "
            f"trains with context parallel or a pipeline, not both yet; set one of them to 1"
        )
    if shape.deepstack_layers and dims.tp > 1 and cfg.parallel.sequence_parallel:
        raise ConfigError(
            f"parallel.tp={dims.tp} with sequence_parallel: {shape.family} adds image features to the "
            f"outputs of its first {shape.deepstack_layers} decoder layers, which need the whole stream; "
            f"set parallel.sequence_parallel: false"
        )


@functools.lru_cache(maxsize=8)
def critic_shape(folder: str) -> Any:
    """The shape of PPO's separate critic model (method.ppo.critic a folder), with its one-output score
    head; read once per folder (the planner checks every candidate layout against it)."""
    from shardforge.models.build import check_model_source  # torch and transformers only when asked

    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"method.ppo.critic {folder!r} is not auto, head or a model folder (no config.json there): give "
            f"an rm run's final/ folder, or another HF model folder of the policy's vocabulary"
        )
    try:
        shape = check_model_source(ModelSection(path=folder))
    except ShardforgeError as exc:
        raise ConfigError(f"method.ppo.critic {folder!r}: {exc}") from None
    return shape if shape.num_labels == 1 else shape.with_score_head(1)


def check_critic(cfg: Config, dims: ParallelDims) -> None:
    """PPO's separate critic model follows the policy's data and tensor parallel layout; a pipeline (whose
    stages pass the policy's stream, not token ids), expert parallel and MoE critics are not built."""
    critic = traits_of(cfg).critic
    if critic is None:
        return
    shape = critic_shape(critic)
    for key, degree in (("pp", dims.pp), ("ep", dims.ep)):
        if degree > 1:
            raise ConfigError(
                f"parallel.{key}={degree} with a separate critic model (method.ppo.critic {critic!r}): the "
                f"critic follows data parallel (ZeRO 0-3) and tensor parallel only; use method.ppo.critic: "
                f"head (a value head on the policy), or parallel.{key}: 1"
            )
    if shape.num_experts:
        raise ConfigError(
            f"method.ppo.critic {critic!r} is a mixture-of-experts model: a separate critic must be dense "
            f"(or use method.ppo.critic: head)"
        )
    try:
        check_tensor_parallel(shape, cfg.parallel)
    except ConfigError as exc:
        raise ConfigError(f"method.ppo.critic {critic!r}: {exc}") from None


def check_layout(cfg: Config, world: int, shape: Any) -> tuple[ParallelDims, int, PipelinePlan | None]:
    """Degrees against the world size, the batch split, the model's TP shape rules (`shape`: the model's
    config, from `model_source`) and the pipeline plan. Returns (dims, grad_accum, pipeline plan). The degrees
    come first (every other rule reads them); after them every rule runs and all that break are reported in
    one ConfigError, so fixing one never uncovers the next."""
    if world < 1:
        raise ConfigError(f"--nproc {world}: a run needs at least one process")
    if world == 1 and cfg.parallel.offload != "none":
        raise ConfigError(
            f"parallel.offload={cfg.parallel.offload} offloads sharded states: it needs several processes "
            f"(--nproc N); a single process shards nothing"
        )
    dims = ParallelDims.from_config(cfg.parallel, world)
    broken: list[str] = []

    def check(rule: Any, *args: Any) -> Any:
        try:
            return rule(*args)
        except ConfigError as exc:
            broken.append(str(exc))
            return None

    grad_accum = check(resolve_grad_accum, cfg, dims.dp)
    if str(shape.family).startswith("hf:"):
        check(check_generic, cfg, dims, shape)
    check(check_vision, cfg, dims, shape)
    check(check_tensor_parallel, shape, cfg.parallel)
    check(check_expert_parallel, shape, dims)
    traits, stage = traits_of(cfg), cfg.method.stage
    check(
        check_context_parallel, shape, dims, cfg.parallel, cfg.data.max_length, traits.whole_sequences, stage
    )
    if traits.rollouts and dims.tp > 1 and cfg.parallel.sequence_parallel:
        broken.append(
            f"parallel.tp={dims.tp} with method.stage={stage}: the rollout engine's steps have any number of "
            f"tokens, which sequence parallel cannot split evenly; set parallel.sequence_parallel: false"
        )
    check(check_critic, cfg, dims)
    refused = layout_refusal(
        cfg.train.optimizer,
        world=dims.dp,
        zero_stage=cfg.parallel.zero_stage,
        tp=dims.tp,
        pp=dims.pp,
        offload=cfg.parallel.offload,
        grad_accum=grad_accum or cfg.train.grad_accum,
        clip=cfg.train.clip,
        finetuning=cfg.method.finetuning,
        lora_plus=cfg.method.finetuning == "lora" and cfg.method.lora.plus_lr_ratio is not None,
        checkpoint_every=cfg.checkpoint.every,
    )  # the optimizer menu's whole-tensor choices (config/optimizers.py)
    if refused:
        broken.append(refused)
    plan = check(plan_pipeline, shape, cfg.parallel, cfg.train.micro_batch, cfg.data.max_length)
    if len(broken) == 1:
        raise ConfigError(broken[0])
    if broken:
        raise ConfigError(
            f"the layout breaks {len(broken)} rules: "
            + "; ".join(f"({i}) {b}" for i, b in enumerate(broken, 1))
        )
    return dims, grad_accum, plan


def sequences_per_group(cfg: Config) -> int:
    """Rows per group of the config's stage, which `train.micro_batch` counts: a preference pair (or a KTO
    example and its mismatched pair) is 2, an RL prompt its group_size completions, anything else 1."""
    from shardforge.objectives import build_objective  # the objective's own figure (torch only when asked)

    return build_objective(cfg.method).group_size


def traits_of(cfg: Config) -> Traits:
    """The traits of the config's objective (what the planner asks instead of the stage's name)."""
    from shardforge.objectives import build_objective

    return build_objective(cfg.method).traits
