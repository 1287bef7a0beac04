"""Context parallel attention on gloo ranks: for each case, every rank's output and q/k/v gradients equal the
rows it holds of a single-process attention over the whole sequence (plain causal, grouped-query, packed rows
with padding, sliding window), for the all-gather (Llama 3) and the Ulysses modes. Two launches in all (2 and
4 ranks): each rank runs every case and returns its tensors; the asserts run here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardforge.models.common.attention import sdpa
from shardforge.parallel.context_parallel import (
    allgather_kv_attention,
    check_ulysses,
    cp_mask,
    gathered_indices,
    local_indices,
    ulysses_attention,
)
from tests.dist._harness import run_ranks
from tests.oracles import shard_sequence

TOL = {"rtol": 1e-5, "atol": 1e-6}
HEAD_DIM = 8


def _doc_ids(rows: list[list[int]], seq: int) -> torch.Tensor:
    """Packed rows from document lengths; the rest of each row is padding (-1, as `collate` writes)."""
    ids = torch.full((len(rows), seq), -1, dtype=torch.long)
    for r, lengths in enumerate(rows):
        col = 0
        for d, n in enumerate(lengths):
            ids[r, col : col + n] = d
            col += n
    return ids


def _cases(seq: int) -> dict[str, dict]:
    # Documents of odd lengths cross the chunk boundaries (chunks are seq / (2 * cp) tokens long).
    packed = _doc_ids([[5, 9, 3, seq - 21], [seq - 7, 2]], seq)  # row 0: 4 docs, no pad; row 1: 5 pads
    padded = _doc_ids([[3, 7, seq - 13]], seq).expand(2, seq).clone()  # 3 pads at the end of each row
    return {
        "causal": {"heads": 4, "kv_heads": 4},
        "gqa": {"heads": 4, "kv_heads": 2},
        "gqa_8_4": {"heads": 8, "kv_heads": 4},
        "packed": {"heads": 4, "kv_heads": 2, "doc_ids": packed},
        "packed_padding": {"heads": 4, "kv_heads": 4, "doc_ids": padded},
        "window": {"heads": 4, "kv_heads": 4, "window": 5},
        "window_packed": {"heads": 4, "kv_heads": 2, "doc_ids": packed, "window": 4},
    }


def _reference_mask(seq: int, doc_ids: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
    """The single-process mask in global order, written out independently of cp_mask."""
    if doc_ids is None and window is None:
        return None  # SDPA's own causal mask
    pos = torch.arange(seq)
    allowed = (pos[None, :] <= pos[:, None])[None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    if window is not None:
        allowed = allowed & ((pos[:, None] - pos[None, :]) < window)[None]
    return allowed[:, None]


def _one_case(mode: str, case: dict, seq: int, group, cp: int, rank: int, seed: int) -> dict:
    """Reference on the whole sequence and the context-parallel result on this rank's shard; returns the
    pairs (cp result, reference rows) to compare."""
    doc_ids, window = case.get("doc_ids"), case.get("window")
    g = torch.Generator().manual_seed(seed)
    b = 2
    # Model layout [b, seq, heads, d], transposed as Attention.forward does (v stays non-contiguous).
    full = {
        name: torch.randn(b, seq, heads, HEAD_DIM, generator=g)
        for name, heads in (("q", case["heads"]), ("k", case["kv_heads"]), ("v", case["kv_heads"]))
    }
    probe = torch.randn(b, case["heads"], seq, HEAD_DIM, generator=g)

    ref = {name: t.clone().requires_grad_() for name, t in full.items()}
    ref_out = sdpa(*(ref[n].transpose(1, 2) for n in "qkv"), _reference_mask(seq, doc_ids, window))
    (ref_out * probe).sum().backward()

    idx = local_indices(seq, cp, rank)
    loc = {name: shard_sequence(t, 1, cp, rank).requires_grad_() for name, t in full.items()}
    q, k, v = (loc[n].transpose(1, 2) for n in "qkv")
    if mode == "allgather":
        out = allgather_kv_attention(q, k, v, group, cp, rank, doc_ids=doc_ids, window=window)
    else:
        out = ulysses_attention(q, k, v, group, cp, doc_ids=doc_ids, window=window)
    (out * shard_sequence(probe, 2, cp, rank)).sum().backward()

    pairs = {"out": (out.detach(), ref_out.detach().index_select(2, idx))}
    for n in "qkv":
        pairs[f"grad_{n}"] = (loc[n].grad, ref[n].grad.index_select(1, idx))
    return pairs


def _ranks_main(world: int) -> dict:
    """Every case on this rank: cp over the whole world, and (with 4 ranks) cp=2 over two subgroups."""
    rank = dist.get_rank()
    results: dict = {}
    setups = [("world", dist.group.WORLD, world, rank)]
    if world == 4:
        subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = subgroups[rank // 2]
        setups.append(("sub2", sub, 2, dist.get_rank(sub)))
    for label, group, cp, cp_rank in setups:
        seq = 12 * cp
        for seed, (name, case) in enumerate(_cases(seq).items()):
            modes = ["allgather"]
            if case["heads"] % cp == 0 and case["kv_heads"] % cp == 0:
                modes.append("ulysses")
            for mode in modes:
                key = f"{label}/cp{cp}/{mode}/{name}"
                results[key] = _one_case(mode, case, seq, group, cp, cp_rank, seed=100 + seed)
    return results


def _check(results: list[dict], world: int, expected_ulysses: set[str]) -> None:
    seen_ulysses = set()
    for rank, per_rank in enumerate(results):
        for key, pairs in per_rank.items():
            if "/ulysses/" in key:
                seen_ulysses.add(key.split("/", 1)[0] + "/" + key.rsplit("/", 1)[1])
            for what, (got, want) in pairs.items():
                assert torch.isfinite(got).all(), f"rank {rank} {key} {what}: not finite"
                torch.testing.assert_close(
                    got, want, **TOL, msg=lambda m, k=key, w=what, r=rank: f"{r} {k} {w}: {m}"
                )
    assert seen_ulysses == expected_ulysses


def test_context_parallel_two_ranks():
    results = run_ranks(_ranks_main, 2, 2, timeout=120)
    every = set(_cases(24))
    _check(results, 2, {f"world/{n}" for n in every})
    assert len(results[0]) == 2 * len(every)


def test_context_parallel_four_ranks():
    results = run_ranks(_ranks_main, 4, 4, timeout=180)
    every = set(_cases(48))
    cp4_ulysses = {n for n, c in _cases(48).items() if c["heads"] % 4 == 0 and c["kv_heads"] % 4 == 0}
    assert cp4_ulysses == {"causal", "gqa_8_4", "packed_padding", "window"}
    _check(results, 4, {f"world/{n}" for n in cp4_ulysses} | {f"sub2/{n}" for n in every})


# ---- fast checks, no ranks ----


def test_local_indices_load_balanced():
    assert local_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_indices(8, 2, 0).dtype == torch.int64
    assert local_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    gathered = gathered_indices(16, 4)
    assert sorted(gathered.tolist()) == list(range(16))
    assert gathered.index_select(0, torch.argsort(gathered)).tolist() == list(range(16))
    t = torch.arange(24).view(2, 12)
    assert torch.cat([shard_sequence(t, 1, 3, r) for r in range(3)], 1).equal(
        t.index_select(1, gathered_indices(12, 3))
    )


def test_local_indices_errors():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4"):
        local_indices(10, 2, 0)
    with pytest.raises(ValueError, match=r"rank 2 is not in 0\.\.1"):
        local_indices(8, 2, 2)


def test_check_ulysses():
    check_ulysses(8, 4, 4)
    check_ulysses(4, 2, 2)
    with pytest.raises(
        ValueError, match=r"parallel\.cp_mode: ulysses.*cp=4.*4 query heads.*2 kv heads.*Valid cp values: 2"
    ):
        check_ulysses(4, 2, 4)
    with pytest.raises(ValueError, match=r"Valid cp values: none above 1"):
        check_ulysses(9, 1, 3)


def test_cp_mask_never_leaves_a_query_blind():
    seq, cp = 16, 2
    doc_ids = _doc_ids([[5, 8]], seq)  # 3 pads at the end
    for rank in range(cp):
        mask = cp_mask(local_indices(seq, cp, rank), gathered_indices(seq, cp), doc_ids, window=3)
        assert mask.shape == (1, 1, seq // cp, seq)
        assert mask.any(-1).all()
    with pytest.raises(ValueError, match="at least 1"):
        cp_mask(torch.arange(4), torch.arange(4), window=0)
