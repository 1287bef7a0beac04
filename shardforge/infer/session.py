"""An engine over what the user points at, on one process or tensor-parallel over the ranks of a launch."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardforge.errors import ConfigError
from shardforge.infer.engine import Engine, EngineConfig
from shardforge.infer.load import Loaded, load_for_inference
from shardforge.infer.packed import inference_layout
from shardforge.infer.quantized import Quantization
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
) -> Iterator[tuple[Loaded, Engine] | None]:
    """Yields (what was loaded, its engine) where the engine is driven: the only process, or rank 0 of a
    tensor-parallel launch. The other ranks follow rank 0's steps inside this call and then get None.
    `prepack`: lay the frozen weights out for the CPU's GEMM library once, and its element-wise work on the
    fused kernels (infer/packed.py: `inference_layout`). `quantize`: the linears in int8 / int4 (one
    process: the training TP plan splits plain linears only)."""
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
            yield loaded, Engine(loaded.model, loaded.tokenizer, config, loaded.defaults)
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
