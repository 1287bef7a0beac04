"""Tensor and sequence parallel on gloo ranks: every layout reproduces the single-process run (loss per step
and final weights), each family's logits match, vocabulary padding is invisible, checkpointing modes and
sequence parallel change the activation memory as they should, and bad shapes fail before training."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from shardforge.config import load_config
from shardforge.config.parallel_schema import ParallelSection
from shardforge.errors import ConfigError
from shardforge.models import build_preset
from shardforge.models.common.config import DecoderConfig
from shardforge.models.spec import spec_for
from shardforge.parallel import activation_report, apply_activation_checkpointing
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.tensor_parallel import apply_tensor_parallel, loss_context
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, assert_tracks, parity_train, tiny_model_folder, train_runs
from tests.oracles import causal_lm_forward, causal_lm_loss_sum

STEPS = 4
ODD_VOCAB = 1027  # > the 1024-token test tokenizer and divisible by neither 2 nor 4: exercises the padding


def _cfg(tmp_path, name: str, data, model: dict, *, mb: int = 4, accum: int = 2, **parallel) -> dict:
    """`data` = (train file, eval file): the eval loss at the last step is compared too."""
    cfg = tiny_config(
        tmp_path / name,
        data[0],
        train=parity_train(STEPS, mb, accum),
        parallel=parallel,
        checkpoint={"save_final": False},
    )
    cfg["data"]["eval"] = [{"path": str(data[1]), "format": "alpaca"}]
    cfg["model"].update(model)
    return cfg


def _preset(name: str) -> dict:
    return {"preset": name}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    return (
        write_jsonl(folder / "train.jsonl", alpaca_records(120, seed=11)),
        write_jsonl(folder / "eval.jsonl", alpaca_records(12, seed=12)),
    )


def _odd_vocab_folder(folder, **shape) -> dict:
    return tiny_model_folder(folder, ODD_VOCAB, seed=3, num_layers=2, **shape)


@pytest.fixture(scope="module")
def mha_odd_vocab(tmp_path_factory) -> dict:
    """An HF folder: 4 query and 4 kv heads (so tp=4 divides them) and a vocabulary of 1027 rows."""
    return _odd_vocab_folder(tmp_path_factory.mktemp("mha"), num_kv_heads=4, family="llama")


@pytest.fixture(scope="module")
def tied_odd_vocab(tmp_path_factory) -> dict:
    """A Qwen2 folder (qkv bias, tied embeddings) with 1027 vocabulary rows: the padding is shared by the
    embedding and the head."""
    return _odd_vocab_folder(
        tmp_path_factory.mktemp("tied"), num_kv_heads=2, family="qwen2", qkv_bias=True, tie_embeddings=True
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data, mha_odd_vocab, tied_odd_vocab):
    tmp = tmp_path_factory.mktemp("tp_ref")
    models = {
        "llama": _preset("tiny-llama"),
        "qwen2": _preset("tiny-qwen2"),
        "qwen3": _preset("tiny-qwen3"),
        "mha": mha_odd_vocab,
        "tied_odd": tied_odd_vocab,
    }
    configs = [_cfg(tmp, name, data, model) for name, model in models.items()]
    for precision in ("bf16", "fp16"):  # low-precision layouts are compared with one process in the same one
        configs.append(_cfg(tmp, precision, data, _preset("tiny-llama")))
        configs[-1]["train"]["precision"] = precision
    runs = train_runs(configs)
    return dict(zip([*models, "bf16", "fp16"], runs, strict=True))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data, mha_odd_vocab):
    tmp = tmp_path_factory.mktemp("tp_two")
    layouts = {
        "tp2": ("llama", _preset("tiny-llama"), dict(tp=2, sequence_parallel=False)),
        "tp2_sp": ("llama", _preset("tiny-llama"), dict(tp=2)),
        "qwen2_sp": ("qwen2", _preset("tiny-qwen2"), dict(tp=2)),
        "qwen3_sp": ("qwen3", _preset("tiny-qwen3"), dict(tp=2)),
        "qwen3": ("qwen3", _preset("tiny-qwen3"), dict(tp=2, sequence_parallel=False)),
        "padded_vocab": ("mha", mha_odd_vocab, dict(tp=2)),
        "full_ckpt": ("llama", _preset("tiny-llama"), dict(tp=2, activation_checkpoint="full")),
        "selective_ckpt": ("llama", _preset("tiny-llama"), dict(tp=2, activation_checkpoint="selective")),
    }
    configs = [_cfg(tmp, name, data, model, **par) for name, (_, model, par) in layouts.items()]
    for precision in ("bf16", "fp16"):
        configs.append(_cfg(tmp, precision, data, _preset("tiny-llama"), tp=2))
        configs[-1]["train"]["precision"] = precision
    per_rank = run_ranks(train_runs, 2, configs)
    runs = {name: (layouts[name][0], per_rank[0][i]) for i, name in enumerate(layouts)}
    return runs | {"bf16": ("llama", per_rank[0][-2]), "fp16": ("llama", per_rank[0][-1])}


@pytest.mark.parametrize(
    "name", ["tp2", "tp2_sp", "qwen2_sp", "qwen3_sp", "qwen3", "padded_vocab", "full_ckpt", "selective_ckpt"]
)
def test_tp2_matches_single_process(two_ranks, reference, name):
    family, run = two_ranks[name]
    assert "tp=2" in run["layout"]
    assert_same(run, reference[family])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_under_tp_tracks_fp32(two_ranks, reference, precision):
    """bf16 autocast, and fp16 with the loss scaler (its overflow check over DTensor gradients)."""
    assert_tracks(two_ranks[precision][1], reference[precision])


def test_padded_vocabulary_is_stripped(two_ranks):
    state = two_ranks["padded_vocab"][1]["state"]
    assert state["embed_tokens.weight"].shape[0] == ODD_VOCAB == state["lm_head.weight"].shape[0]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, data, mha_odd_vocab, tied_odd_vocab):
    tmp = tmp_path_factory.mktemp("tp_four")
    layouts = {
        "tp4_sp": ("mha", mha_odd_vocab, dict(tp=4), 4),
        # tp 4 over 2 kv heads: the kv heads replicated (with Qwen3's q/k norms; with qkv bias, tied, padded)
        "kv_replicated_qwen3_sp": ("qwen3", _preset("tiny-qwen3"), dict(tp=4), 4),
        "kv_replicated_tied_padded": ("tied_odd", tied_odd_vocab, dict(tp=4, sequence_parallel=False), 4),
        "fsdp2x_tp2": ("llama", _preset("tiny-llama"), dict(tp=2, zero_stage=3), 2),
        "zero2x_tp2_tied_padded": (
            "tied_odd",
            tied_odd_vocab,
            dict(tp=2, zero_stage=2, sequence_parallel=False),
            2,
        ),
    }
    configs = [_cfg(tmp, name, data, model, mb=mb, **par) for name, (_, model, par, mb) in layouts.items()]
    export = _cfg(tmp, "export", data, mha_odd_vocab, mb=2, tp=2, zero_stage=3)
    export["checkpoint"]["save_final"] = True
    per_rank = run_ranks(_four_rank_jobs, 4, configs, export)
    runs = {name: (layouts[name][0], [rank[0][i] for rank in per_rank]) for i, name in enumerate(layouts)}
    return runs | {"export": per_rank[0][1]}


def _four_rank_jobs(configs: list[dict], export: dict) -> tuple[list[dict], dict]:
    """Parity runs, then a run that exports its final model, with the live model's logits to compare."""
    runs = train_runs(configs)
    trainer = Trainer(load_config(None, base=export))
    result = trainer.train()
    ids = torch.randint(0, ODD_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = trainer.model(ids).full_tensor()[..., :ODD_VOCAB]  # every rank takes part in the forward
    return runs, {"folder": result.final_model, "ids": ids, "logits": logits}


@pytest.mark.parametrize("name", ["tp4_sp", "kv_replicated_qwen3_sp", "kv_replicated_tied_padded"])
def test_tp4_matches_single_process(four_ranks, reference, name):
    """tp 4: heads split four ways, or, over 2 kv heads, the kv heads replicated (each rank keeps the one its
    query heads read; the replicas' gradients summed): the same losses and weights as one process."""
    family, runs = four_ranks[name]
    assert "tp=4" in runs[0]["layout"]
    assert_same(runs[0], reference[family])


@pytest.mark.parametrize("name", ["fsdp2x_tp2", "zero2x_tp2_tied_padded"])
def test_fsdp2_x_tp2_matches_single_process(four_ranks, reference, name):
    family, runs = four_ranks[name]
    assert "dp_shard=2 x tp=2" in runs[0]["layout"]
    assert_same(runs[0], reference[family])
    # Parameters are split four ways: over data-parallel shards and over TP ranks.
    full = sum(t.numel() for t in reference[family]["state"].values()) * 4
    assert all(r["memory"]["param_bytes"] < 0.3 * full for r in runs)


def _logits_per_family(presets: list[str]) -> dict[str, float]:
    """On each rank: a family's model before and after TP2 (+SP); the largest logit difference."""
    dims = ParallelDims.from_config(ParallelSection(tp=2), 2)
    mesh = dims.build_mesh("cpu")
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    out = {}
    for preset in presets:
        for sp in (True, False):
            model = build_preset(preset, vocab_size=251, seed=1)  # 251: padded to 252 over 2 ranks
            with torch.no_grad():
                expected = model(ids)
            apply_tensor_parallel(model, dims, mesh, ParallelSection(tp=2, sequence_parallel=sp))
            with torch.no_grad():
                got = model(ids).full_tensor()
            assert got.shape[-1] == 252 and bool((got[..., 251:] < -1e30).all())  # padding masked out
            out[f"{preset}/sp={sp}"] = (got[..., :251] - expected).abs().max().item()
    return out


def test_each_family_matches_single_process_logits_under_tp2():
    diffs = run_ranks(_logits_per_family, 2, ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])[0]
    assert len(diffs) == 8
    assert max(diffs.values()) < 1e-5, diffs


def _activation_bytes(batch, tp: int) -> dict[str, dict]:
    """Activation reports of the tiny model under TP (on `tp` ranks), with and without SP, for each
    checkpointing mode; and the loss and gradients of each mode."""
    dims = ParallelDims.from_config(ParallelSection(tp=tp), tp)
    mesh = dims.build_mesh("cpu")
    out = {}
    for sp in (False, True):
        for mode in ("none", "selective", "full"):
            parallel = ParallelSection(tp=tp, sequence_parallel=sp, activation_checkpoint=mode)
            model = build_preset("tiny-llama", vocab_size=1024, seed=1)
            apply_tensor_parallel(model, dims, mesh, parallel)
            apply_activation_checkpointing(model, mode, sp)
            with loss_context(dims):  # the forward ends in the vocabulary-parallel log-probabilities
                report = activation_report(model, partial(causal_lm_forward, model, batch))
                loss = causal_lm_loss_sum(model, batch)
                loss.backward()
            grads = [p.grad.to_local() for p in model.parameters()]
            costs = spec_for(model.config.family).costs(model.config)
            estimate = costs.activation_bytes(mode, 4, tp, sp)
            out[f"sp={sp}/{mode}"] = {
                "total": report.total_bytes,
                "estimate": estimate.total(batch.input_ids.numel(), batch.num_targets),
                "grads": grads,
                "norms": report.bytes_where(lambda t: t.module.endswith("_norm")),
                "norm_seq": {t.shape[1] for t in report.tensors if t.module.endswith("_norm")},
                "loss": loss.item(),
            }
    return out


@pytest.mark.parametrize("tp", [2, 4])  # 4: past the tiny model's 2 kv heads, which each rank then replicates
def test_activation_memory_by_checkpoint_mode_and_sequence_parallel(tp):
    from shardforge.data.batching import collate
    from shardforge.data.examples import Example

    examples = [Example(tuple(range(5 + 3 * i, 69 + 3 * i)), (True,) * 64, "test") for i in range(2)]
    batch = collate(examples, [[0], [1]], pad_id=0, multiple=tp)
    per_rank = run_ranks(_activation_bytes, tp, batch, tp)
    r = per_rank[0]
    for sp in (False, True):
        none, sel, full = (r[f"sp={sp}/{m}"] for m in ("none", "selective", "full"))
        assert full["total"] < sel["total"] < none["total"], r
        for mode, got in (("none", none), ("selective", sel), ("full", full)):  # the planner's count
            print(f"tp={tp} sp={sp} {mode}: measured {got['total']}, estimated {got['estimate']:.0f}")
            assert got["estimate"] == pytest.approx(got["total"], rel=0.02), (sp, mode)
        assert none["loss"] == pytest.approx(sel["loss"], rel=1e-6) == pytest.approx(full["loss"], rel=1e-6)
        for other in (sel, full):  # recomputation (with its TP collectives) gives the same gradients
            for grad, ref in zip(other["grads"], none["grads"], strict=True):
                torch.testing.assert_close(grad, ref, rtol=0, atol=1e-6)
    # What the blocks' norms keep is split over the sequence by SP: each tensor holds 64 / tp of the 64
    # positions (their outputs, the matmuls' inputs, are kept as those shards and gathered again in backward),
    # so the norms hold at most 1/tp of their non-SP bytes.
    no_sp, sp = r["sp=False/none"], r["sp=True/none"]
    assert no_sp["norm_seq"] == {64} and sp["norm_seq"] == {64 // tp}
    assert 0 < sp["norms"] <= no_sp["norms"] / tp, r
    assert sp["total"] < no_sp["total"]
    assert per_rank[1]["sp=True/none"]["norms"] == sp["norms"]


def _setup_error(cfg: dict) -> str:
    try:
        Trainer(load_config(None, base=cfg)).setup()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_bad_tensor_parallel_shapes_fail_before_training(tmp_path, data):
    """tiny-llama has 4 query heads: tp=3 cannot split them, checked before any training."""
    cfg = _cfg(tmp_path, "bad", data, _preset("tiny-llama"), mb=1, tp=3)
    message = run_ranks(_setup_error, 3, cfg)[0]
    assert "parallel.tp=3 does not divide the model's num_heads (query heads) = 4" in message


def test_tp_larger_than_world_and_ddp_with_tp_are_refused():
    with pytest.raises(ConfigError, match=r"parallel.tp=4 needs at least that many processes, but 2 are"):
        ParallelDims.from_config(ParallelSection(tp=4), 2)
    with pytest.raises(ConfigError, match=r"needs FSDP2: set parallel.zero_stage to 2 or 3"):
        ParallelDims.from_config(ParallelSection(tp=2, dp_replicate=2), 4)


@pytest.mark.parametrize(
    ("shape", "what"),
    [
        (dict(num_heads=6, num_kv_heads=2, head_dim=16), "num_heads"),
        (dict(intermediate_size=170), "intermediate"),
        (dict(hidden_size=66), "hidden_size"),
    ],
)
def test_shape_rules(shape, what):
    from shardforge.models.llama.plan import check_tensor_parallel

    base = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=176,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
    )
    with pytest.raises(ConfigError, match=f"parallel.tp=4 does not divide the model's {what}"):
        check_tensor_parallel(DecoderConfig(**(base | shape)), 4)
    # above the kv heads, tp must be a multiple of them (each rank's query heads read one kv head)
    gqa = DecoderConfig(**(base | dict(num_heads=12, num_kv_heads=4, hidden_size=96, intermediate_size=192)))
    check_tensor_parallel(gqa, 12)  # 3 ranks per kv head
    with pytest.raises(ConfigError, match="tp=6 is above the model's 4 kv heads and not a multiple of them"):
        check_tensor_parallel(gqa, 6)


def test_export_from_fsdp_x_tp_reloads_in_transformers_with_the_same_logits(four_ranks):
    from transformers import AutoModelForCausalLM

    export = four_ranks["export"]
    model = AutoModelForCausalLM.from_pretrained(export["folder"]).eval()
    assert model.config.vocab_size == ODD_VOCAB  # the TP padding (1028 rows) is not exported
    with torch.no_grad():
        theirs = model(export["ids"]).logits
    torch.testing.assert_close(theirs, export["logits"], rtol=1e-4, atol=1e-4)


def _odd_length_error() -> str:
    dims = ParallelDims.from_config(ParallelSection(tp=2), 2)
    model = build_preset("tiny-llama", vocab_size=64, seed=1)
    apply_tensor_parallel(model, dims, dims.build_mesh("cpu"), ParallelSection(tp=2))
    try:
        model(torch.zeros(1, 7, dtype=torch.long))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_sequence_parallel_refuses_rows_it_cannot_split_evenly():
    message = run_ranks(_odd_length_error, 2)[0]
    assert "a row of 7 tokens must be padded to a multiple of 2" in message


def test_tp_using_every_rank_leaves_nothing_for_zero3():
    with pytest.raises(ConfigError, match=r"all used by tp x pp x cp = 2, none is left to shard"):
        ParallelDims.from_config(ParallelSection(tp=2, zero_stage=3), 2)
