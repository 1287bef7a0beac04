"""FSDP2 (`fully_shard`, as shardforge applies it: each block a unit, then the root) over a process group of
one on the device's backend (NCCL on CUDA, gloo on the CPU): the same steps as the plain model."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardforge.config.parallel_schema import ParallelSection
from shardforge.models import build_preset
from shardforge.parallel.data_parallel import _fully_shard
from shardforge.parallel.distributed import pick_backend

VOCAB = 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one(device, monkeypatch):
    """A process group of one on the device's backend (`parallel.backend: auto`'s choice), destroyed after."""
    backend = pick_backend("auto", device)
    assert backend == ("nccl" if device.type == "cuda" else "gloo")
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    # NCCL binds the group to one GPU, named with its index ("cuda" alone is refused)
    options = {}
    if device.type == "cuda":
        options["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, rank=0, world_size=1, **options)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def _steps(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in batches:
        logits = model(ids)[:, :-1]
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fully_sharded_over_one_rank_equals_the_plain_model(device, world_of_one):
    """Reference: the same preset (same seed) unwrapped on the same device, 3 AdamW steps on the same
    batches (one batch repeated: the loss falls), fp32. A world of one makes the all-gathers and
    reduce-scatters copies (the gradient averaged over one rank), so the losses and the trained weights
    agree within 1e-5 relative (the same kernels; on CUDA a reduction may be scheduled differently, hence
    not bit equality); a missed gradient reduction, a unit that never reshards or a wrong averaging factor
    would not."""
    plain = build_preset("tiny-llama", vocab_size=VOCAB, seed=0, device=device)
    sharded = build_preset("tiny-llama", vocab_size=VOCAB, seed=0, device=device)
    mesh = init_device_mesh(device.type, (1,))
    _fully_shard(sharded, mesh, 3, ParallelSection(), "fp32", device)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    batches = [ids, ids.flip(0), ids]  # one batch again (so the loss falls), its rows swapped once
    expected = _steps(plain, batches)
    assert _steps(sharded, batches) == pytest.approx(expected, rel=1e-5)
    assert expected[-1] < expected[0]
    trained = dict(plain.named_parameters())
    for name, param in sharded.named_parameters():
        torch.testing.assert_close(param.full_tensor(), trained[name], rtol=1e-5, atol=1e-6, msg=name)
