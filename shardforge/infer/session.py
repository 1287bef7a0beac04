"""An engine over what the user points at, on one process or tensor-parallel over the ranks of a launch."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from shardforge.errors import ConfigError
from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.load import Loaded, load_for_inference
from shardforge.infer.multi_lora import attach
from shardforge.infer.packed import inference_layout
from shardforge.infer.quantized import Quantization
from shardforge.models.common.protocol import CausalModel
from shardforge.parallel.distributed import (
    init_distributed,
    local_rank_from_env,
    pick_backend,
    pick_device,
    world_size_from_env,
)


@contextlib.contextmanager
def inference_engine(
    source: str,
    adapter: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    config: EngineConfig | None = None,
    tp: int = 1,
    prepack: bool = True,
    quantize: Quantization | None = None,
    loras: list[tuple[str, Path]] | None = None,
    draft: str | None = None,
) -> Iterator[tuple[Loaded, Engine] | None]:
    """Yields (what was loaded, its engine) where the engine is driven: the only process, or rank 0 of a
    tensor-parallel launch. The other ranks follow rank 0's steps inside this call and then get None.
    `prepack`: lay the frozen weights out for the CPU's GEMM library once, and its element-wise work on the
    fused kernels (infer/packed.py: `inference_layout`). `quantize`: the linears in int8 / int4 (one
    process: the training TP plan splits plain linears only). `loras`: (name, PEFT LoRA folder) pairs served
    on the base unmerged, each request choosing one (infer/multi_lora.py; []: none yet, loaded later)."""
    # `draft`: the draft model folder of `config.speculative` (infer/draft.py), loaded as the target is
    if config is not None and config.speculative is not None and (tp > 1 or loras is not None):
        flag = "--draft" if config.speculative.method == "draft" else "--speculative"
        raise ConfigError(f"{flag} runs on one process without --lora adapters (not with --tp / --lora)")
    if loras is not None and tp > 1:
        raise ConfigError(f"--lora with --tp {tp}: many adapters on one base run on one process")
    if quantize is not None and tp > 1:
        raise ConfigError(
            f"--quantize {quantize.scheme} with --tp {tp}: quantized weights run on one process"
        )
    if tp > 1 and world_size_from_env() != tp:
        raise ConfigError(f"--tp {tp} runs on {tp} processes, but {world_size_from_env()} were started")
    place = pick_device(device, local_rank_from_env()) if tp > 1 else torch.device(device)
    owns = tp > 1 and init_distributed(pick_backend("auto", place), timeout_minutes=60)
    try:
        loaded = load_for_inference(source, adapter, dtype, str(place), quantize)
        if tp == 1:
            if prepack:
                inference_layout(loaded.model)
            drafter = _draft(draft, loaded, prepack)
            engine = Engine(loaded.model, loaded.tokenizer, config, loaded.defaults, draft=drafter)
            if loras is not None:
                attach(engine, loras, loaded.folder)
            yield loaded, engine
            return
        from shardforge.infer.tp import shard_for_inference, tp_executor

        shard_for_inference(loaded.model, tp)
        executor = tp_executor(loaded.model, config or EngineConfig())
        if not executor.leads:
            # torch's agent passes SIGTERM / SIGINT to every rank; the leader ends the job (its close() ends
            # the following), so a follower that died of it first would break the leader's graceful stop
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            executor.follow()
            yield None
            return
        try:
            yield loaded, Engine(loaded.model, loaded.tokenizer, config, loaded.defaults, executor)
        finally:
            executor.close()
    finally:
        if owns:
            dist.barrier()  # every rank is done with the last broadcast before any tears the group down
            dist.destroy_process_group()


def _draft(source: str | None, target: Loaded, prepack: bool) -> CausalModel | None:
    """The draft model (`--draft`), in the target's precision on its device, its tokenizer checked."""
    if source is None:
        return None
    from shardforge.infer.speculative import same_vocabulary

    param = next(target.model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    loaded = load_for_inference(source, None, dtype, str(param.device))
    same_vocabulary(target.tokenizer, loaded.tokenizer, source)
    if prepack:
        inference_layout(loaded.model)
    return loaded.model
