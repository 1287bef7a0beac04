"""Adversarial tests of the optimizer menu (train.optimizer.name) with LoRA+ (split from the eval ones,
test_eval_adversarial.py).

Tests that document a defect fail now with a message saying what is wrong and what the reference does; the
others pin behaviour that held up under attack. Offline, tiny models, OMP_NUM_THREADS=1 friendly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardforge.config import load_config
from shardforge.errors import ConfigError, ShardforgeError
from tests.conftest import REPO, alpaca_records, tiny_config, write_jsonl
from tests.unit.test_eval_adversarial import _neox_folder

# ---- optimizers --------------------------------------------------------------------------------------------


def _cfg(optimizer: dict | None = None, method: dict | None = None, **train):
    base = tiny_config(Path("/nonexistent"), Path("/nonexistent/train.jsonl"))
    base["train"].update({"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}, **train)
    if optimizer is not None:
        base["train"]["optimizer"] = optimizer
    if method is not None:
        base["method"] = method
    return load_config(None, base=base)


def _tiny(cfg):
    from shardforge.models.build import model_source
    from shardforge.models.spec import spec_for

    shape = model_source(cfg.model)[0]
    torch.manual_seed(0)
    model = spec_for(shape.family).build(shape)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.float(), shape


def _steps(model, optimizer, n: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, 1024, (2, 16), generator=g)
        logits = model(ids)
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_badam_with_freeze_finetuning_trains_only_the_unfrozen_layers():
    """Fixed: BAdam's BlockOptimizer (layer mode) is given every named parameter (block_prefix_list=None), so
    under method.finetuning=freeze it switches requires_grad onto layers.0 — a layer freeze keeps frozen — and
    trains it, while the layer freeze trains (layers.1) never moves. A silently different run."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": "badam"}, method={"finetuning": "freeze", "freeze": {"trainable_layers": 1}})
    model, shape = _tiny(cfg)
    apply_finetuning(model, cfg.method, 0, None)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    except ConfigError:
        return  # a clear refusal is a fix too
    _steps(model, opt)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved <= trainable, (
        f"BAdam under freeze moved frozen parameters {sorted(moved - trainable)[:3]}... "
        f"(trainable were {sorted(trainable)[:2]}...): shardforge/train/optimizers/menu.py badam passes "
        "every parameter; pass the trainable blocks (block_prefix_list) or refuse badam with freeze"
    )


def test_badam_start_block_past_the_last_block_is_a_config_error():
    """Fixed: train.optimizer.badam.start_block beyond the model's blocks is an IndexError in the badam
    package, not a ConfigError naming the key."""
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": "badam", "badam": {"start_block": 99}})
    model, shape = _tiny(cfg)
    try:
        build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    except ConfigError as exc:
        assert "start_block" in str(exc)
    except Exception as exc:
        pytest.fail(
            f"start_block=99 on a 2-block model raised {type(exc).__name__}: {exc} (not a ConfigError)"
        )
    else:
        pytest.fail("start_block=99 on a 2-block model was accepted")


@pytest.mark.parametrize("betas", [[1.5, 0.9], [0.9, -0.1], [0.9, 1.0]])
def test_betas_outside_zero_one_are_a_config_error(betas):
    """Fixed: train.betas has no range: [1.5, 0.9] loads, then AdamW raises torch's ValueError at build
    (a traceback) and Muon's AdamW part accepts it silently (a diverging run)."""
    with pytest.raises(ConfigError, match=r"train\.betas"):
        _cfg(betas=betas)


def test_eps_must_be_finite():
    with pytest.raises(ConfigError, match=r"train\.eps"):
        _cfg(eps=float("inf"))


@pytest.mark.parametrize("finetuning", ["oft", "full", "freeze"])
def test_lora_plus_ratio_without_lora_is_refused_not_ignored(finetuning):
    """Fixed: method.lora.plus_lr_ratio with method.finetuning oft/full/freeze loads and is silently dropped
    (train/optim.py build_optimizer reads it only for lora); LF refuses loraplus_lr_ratio without LoRA (our
    own lf_convert does too)."""
    with pytest.raises(ConfigError, match="plus_lr_ratio"):
        _cfg(method={"finetuning": finetuning, "lora": {"plus_lr_ratio": 16.0}})


@pytest.mark.parametrize("variant", [{"dora": True}, {"init": "pissa", "pissa_iter": -1}, {"rslora": True}])
def test_lora_plus_groups_with_dora_and_pissa_follow_llamafactory(variant):
    """LF's `_create_loraplus_optimizer`: lora_B and every 1-D trained tensor (DoRA's magnitudes) at lr x
    ratio; decay by LF's rule; and the run steps with finite weights."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.train.optim import build_optimizer
    from shardforge.train.optimizers.groups import lf_decay_names

    lora = {"rank": 4, "targets": ["q_proj", "v_proj"], "plus_lr_ratio": 8.0} | variant
    cfg = _cfg(method={"finetuning": "lora", "lora": lora})
    model, shape = _tiny(cfg)
    apply_finetuning(model, cfg.method, 0, None)
    opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    decay = lf_decay_names(model)
    by_id = {id(p): g for g in opt.param_groups for p in g["params"]}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(id(p) in by_id for _, p in trained)
    if variant.get("dora"):
        assert any(p.ndim == 1 for _, p in trained), "DoRA's magnitudes are not trained"
    for name, p in trained:
        plus = "lora_B" in name or p.ndim == 1
        assert by_id[id(p)]["lr"] == pytest.approx(1e-3 * (8.0 if plus else 1.0)), name
        assert by_id[id(p)]["weight_decay"] == (0.1 if name in decay else 0.0), name
    _steps(model, opt)
    assert all(torch.isfinite(p).all() for _, p in trained)


def test_adam_mini_on_a_generic_backend_family_runs_or_is_refused(tmp_path):
    """Fixed (traceback): train.optimizer.name=adam_mini on a gpt_neox model (generic backend; fused
    query_key_value, biased MLP) builds, then its first step dies inside adam_mini with `IndexError: too many
    indices for tensor of dimension 1` (its name rules take a 1-D MLP bias for a neuron-wise matrix). LF
    builds
    it the same way, but a run should not die mid-step: refuse what adam_mini cannot partition at build time
    (a ConfigError naming train.optimizer.name), or group such tensors as adam_mini's plain ones."""
    from shardforge.train.trainer import train

    neox = _neox_folder(tmp_path / "neox")
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(8))
    cfg = tiny_config(
        tmp_path,
        data,
        train={"steps": 2, "optimizer": {"name": "adam_mini"}},
        checkpoint={"save_final": False},
    )
    cfg["model"] = {"path": str(neox)}
    try:
        train(load_config(None, base=cfg))
    except ConfigError as exc:
        assert "adam_mini" in str(exc)
    except Exception as exc:
        pytest.fail(f"adam_mini on gpt_neox: {type(exc).__name__}: {exc} (mid-run, not a ConfigError)")


@pytest.mark.parametrize("name", ["muon", "galore", "apollo", "adam_mini", "badam", "adamw_8bit"])
def test_menu_steps_a_bf16_model(name):
    """Pure bf16 parameters (model dtype bf16): every choice builds and steps to finite weights."""
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": name})
    model, shape = _tiny(cfg)
    model = model.to(torch.bfloat16)
    opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
    _steps(model, opt)
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["muon", "galore", "apollo", "adam_mini", "adamw_8bit"])
def test_menu_with_freeze_moves_only_trainable_parameters(name):
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.train.optim import build_optimizer

    cfg = _cfg({"name": name}, method={"finetuning": "freeze", "freeze": {"trainable_layers": 1}})
    model, shape = _tiny(cfg)
    apply_finetuning(model, cfg.method, 0, None)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _steps(model, build_optimizer(model, cfg.train, method=cfg.method, model_config=shape))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= trainable, sorted(moved - trainable)


@pytest.mark.parametrize("key", ["galore", "apollo"])
def test_empty_projection_targets_are_a_config_error_naming_the_key(key):
    from shardforge.train.optim import build_optimizer

    try:
        cfg = _cfg({"name": key, key: {"targets": []}})
    except ConfigError as exc:
        assert f"train.optimizer.{key}.targets" in str(exc)
        return
    model, shape = _tiny(cfg)
    with pytest.raises(ConfigError, match=f"train.optimizer.{key}.targets"):
        build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)


def test_fuzzed_optimizer_keys_are_config_errors_or_runs():
    """Random values of the menu's keys: each either loads and steps a tiny model to finite weights, or is a
    ConfigError naming the key; never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from shardforge.train.optim import build_optimizer

    num = st.one_of(
        st.integers(-3, 300),
        st.floats(allow_nan=True, allow_infinity=True),
        st.just("x"),
        st.none(),
        st.booleans(),
    )
    sections = {
        "galore": ["rank", "update_interval", "scale", "proj_type", "layerwise", "targets"],
        "apollo": ["rank", "update_interval", "scale", "proj", "proj_type", "scale_type", "scale_front"],
        "badam": ["mode", "start_block", "switch_mode", "switch_interval", "update_ratio", "mask_mode"],
        "muon": ["momentum", "nesterov", "ns_steps"],
    }
    failures: list[str] = []

    def attempt(name, option):
        try:
            cfg = _cfg(option, clip=None)
        except ConfigError as exc:
            if f"train.optimizer.{name}" not in str(exc):
                failures.append(f"{option}: ConfigError without the key: {exc}")
            return
        model, shape = _tiny(cfg)
        try:
            opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
            _steps(model, opt, 2)
        except ConfigError:
            return
        except Exception as exc:
            failures.append(f"{option}: {type(exc).__name__}: {str(exc)[:120]}")
            return
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            failures.append(f"{option}: non-finite weights after 2 steps")

    # edge values first (a tiny model: 2 blocks, hidden 64), then hypothesis' draws
    for name, key, value in [
        ("badam", "start_block", 2),
        ("badam", "start_block", 99),
        ("badam", "switch_interval", 1),
        ("badam", "switch_interval", -1),
        ("badam", "update_ratio", 1.0),
        ("galore", "rank", 1000),
        ("galore", "update_interval", 1),
        ("galore", "proj_type", "full"),
        ("apollo", "rank", 1000),
        ("apollo", "proj", "svd"),
        ("apollo", "scale_type", "tensor"),
        ("muon", "ns_steps", 99),
        ("muon", "momentum", 0.0),
        ("galore", "targets", ["lm_head"]),
        ("apollo", "targets", ["embed_tokens"]),
    ]:
        attempt(name, {"name": name, name: {key: value}})

    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(sections)), st.data())
    def check(name, data):
        key = data.draw(st.sampled_from(sections[name]))
        value = data.draw(st.one_of(num, st.sampled_from(["std", "random", "layer", "ratio", "all", []])))
        attempt(name, {"name": name, name: {key: value}})

    check()
    assert not failures, "values that escape as tracebacks:\n" + "\n".join(sorted(set(failures))[:10])


def test_planner_auto_names_badam_not_memory_when_only_badam_refuses(monkeypatch):
    """Fixed: `parallel: auto` on 2 processes with train.optimizer.name=badam (one process only) says 'no
    layout ... runs this job ... use more devices, a shorter data.max_length or method.finetuning=lora' —
    the demo fits in memory easily, and lora is refused with badam. The search never asks layout_refusal."""
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    cfg = load_config(
        REPO / "examples" / "demo.yaml",
        ["parallel.auto=true", "train.optimizer.name=badam", "checkpoint.every=null"],
    )
    shape = model_source(cfg.model)[0]
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 2, shape)
    message = str(info.value)
    assert "badam" in message and "finetuning=lora" not in message, (
        f"the refusal does not say badam needs one process: {message}"
    )


def test_planner_auto_finds_the_grad_accum_1_layout_layerwise_galore_needs(monkeypatch):
    """Fixed: one process, galore.layerwise with train.clip null: the explicit layout (micro_batch 4 x
    grad_accum 1) runs, but `parallel: auto` says 'no layout ... runs this job' — the search tries each
    group's
    least-memory layout first (micro_batch 1 x grad_accum 4), which layerwise refuses, and skips the whole
    group as if it did not fit in memory (shardforge/planner/search.py Planner.search: `if not
    self._consider(least, plan): continue` does not tell a broken rule from memory)."""
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    overrides = ["train.optimizer.name=galore", "train.optimizer.galore.layerwise=true", "train.clip=null"]
    explicit = load_config(REPO / "examples" / "demo.yaml", overrides)
    shape = model_source(explicit.model)[0]
    preflight(explicit, 1, shape)  # runs as written
    auto = load_config(REPO / "examples" / "demo.yaml", [*overrides, "parallel.auto=true"])
    try:
        _, _, grad_accum, _, _ = preflight(auto, 1, shape)
    except ConfigError as exc:
        pytest.fail(f"parallel.auto refused a job whose explicit layout runs: {exc}")
    assert grad_accum == 1


def test_planner_auto_names_the_lora_plus_rule_not_memory(monkeypatch):
    """Fixed: LoRA+ with muon under `parallel: auto` is refused as 'no layout ... runs this job ... use more
    devices, a shorter data.max_length or method.finetuning=lora' (it IS lora); the explicit layout gets the
    rule's own message (method.lora.plus_lr_ratio ... use adamw or adamw_8bit)."""
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    cfg = load_config(
        REPO / "examples" / "demo.yaml",
        [
            "parallel.auto=true",
            "method.finetuning=lora",
            "method.lora.plus_lr_ratio=16",
            "train.optimizer.name=muon",
        ],
    )
    with pytest.raises(ConfigError) as info:
        preflight(cfg, 1, model_source(cfg.model)[0])
    assert "plus_lr_ratio" in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["muon", "galore", "adam_mini", "adamw_8bit"])
def test_planner_auto_resolves_a_layout_each_whole_tensor_optimizer_accepts(monkeypatch, name):
    from shardforge.config.optimizers import layout_refusal
    from shardforge.models.build import model_source
    from shardforge.planner.preflight import preflight

    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "examples" / "demo.yaml", ["parallel.auto=true", f"train.optimizer.name={name}"])
    shape = model_source(cfg.model)[0]
    resolved, dims, grad_accum, _, _ = preflight(cfg, 2, shape)
    p = resolved.parallel
    assert (
        layout_refusal(
            resolved.train.optimizer,
            world=dims.dp,
            zero_stage=p.zero_stage,
            tp=dims.tp,
            pp=dims.pp,
            offload=p.offload,
            grad_accum=grad_accum,
            clip=resolved.train.clip,
            finetuning="full",
            lora_plus=False,
        )
        is None
    )


def test_resuming_with_another_optimizer_is_a_clear_error(tmp_path):
    """Fixed: a run checkpointed with AdamW and resumed (same output_dir) with train.optimizer.name=muon dies
    in torch.distributed.checkpoint with CheckpointException ('Missing key ... momentum_buffer'), a
    BaseException that even escapes `except Exception` and the CLI's handler: a traceback. It should be a
    ConfigError naming train.optimizer.name (the checkpoint's optimizer and the config's)."""
    from shardforge.train.trainer import Trainer
    from tests.dist._training import stopped_at

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(24))
    ckpt = {"save_final": False, "every": 2}
    stopped_at(tiny_config(tmp_path, data, train={"steps": 4}, checkpoint=ckpt), 2)
    cfg = tiny_config(tmp_path, data, train={"steps": 4, "optimizer": {"name": "muon"}}, checkpoint=ckpt)
    try:
        Trainer(load_config(None, base=cfg)).train()
    except ShardforgeError as exc:
        assert "optimizer" in str(exc)
    except BaseException as exc:
        pytest.fail(f"resuming an AdamW checkpoint with muon raised {type(exc).__name__}: {str(exc)[-200:]}")


@pytest.mark.parametrize("name", ["muon", "galore", "adam_mini"])
def test_grad_accum_and_clip_equal_one_big_batch(tmp_path, name):
    """grad_accum 2 x micro_batch 1 and micro_batch 2 x grad_accum 1 with train.clip: the same losses (the
    menu's optimizers see the accumulated, clipped gradient once per step)."""
    from shardforge.train.trainer import train

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(24))
    losses = []
    for mb, accum in ((2, 1), (1, 2)):
        run = tmp_path / f"r{mb}"
        cfg = tiny_config(
            run,
            data,
            train={
                "steps": 3,
                "micro_batch": mb,
                "grad_accum": accum,
                "clip": 0.5,
                "optimizer": {"name": name},
            },
            checkpoint={"save_final": False},
        )
        train(load_config(None, base=cfg))
        losses.append(
            [json.loads(x)["loss"] for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
        )
    assert losses[0] == pytest.approx(losses[1], rel=1e-4), losses


def test_tied_embeddings_are_one_parameter_in_each_optimizer():
    """A tied embedding/head is one parameter: no optimizer holds it twice (a double step), and each steps."""
    from dataclasses import replace

    from shardforge.models.build import model_source
    from shardforge.models.spec import spec_for
    from shardforge.train.optim import build_optimizer

    for name in ("muon", "galore", "adam_mini", "adamw", "adamw_8bit"):
        cfg = _cfg({"name": name})
        shape = replace(model_source(cfg.model)[0], tie_embeddings=True)
        torch.manual_seed(0)
        model = spec_for(shape.family).build(shape).float()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        opt = build_optimizer(model, cfg.train, method=cfg.method, model_config=shape)
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        assert len(ids) == len(set(ids)), name
        _steps(model, opt)
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
