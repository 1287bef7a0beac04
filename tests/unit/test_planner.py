"""The layout planner (issue 19) on shapes alone: searches for public models on H100 clusters of 8 to 1024
devices (config.json only, no weights), `shardforge plan`, `parallel: auto` and the preflight's memory check,
and the model-state counter against torch.chunk and hand-counted parameters (the papers' formulas:
test_planner_papers.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch
import yaml

from shardforge.cli import main
from shardforge.config import load_config
from shardforge.config.schema import Config
from shardforge.errors import ConfigError
from shardforge.models.build import check_model_source, model_source
from shardforge.models.spec import spec_for
from shardforge.planner.hardware import GIB, PRESETS
from shardforge.planner.inventory import inventory
from shardforge.planner.layout import Layout, layout_of
from shardforge.planner.memory import MemoryModel
from shardforge.planner.model_states import StateCounter, coords_of
from shardforge.planner.preflight import preflight
from shardforge.planner.search import Planner, choose
from tests.conftest import REPO
from tests.oracles import zero_model_states
from tests.unit.large_models import H100_PER_NODE, PUBLISHED, config_for, h100s

DEMO = REPO / "examples" / "demo.yaml"


# ---- 1. public models by shape on H100 clusters -----------------------------------------------------------
def test_shapes_read_from_config_json(model_dirs):
    for name, path in model_dirs.items():
        cfg = config_for(path)
        shape = check_model_source(cfg.model, weights=False)
        total = sum(math.prod(p.shape) for p in inventory(shape, cfg))
        assert total == pytest.approx(PUBLISHED[name], rel=5e-3), name
    moe = check_model_source(config_for(model_dirs["qwen3-235b-a22b"]).model, weights=False)
    assert (moe.num_experts, moe.experts_per_token, moe.moe_intermediate_size) == (128, 8, 1536)
    assert (moe.head_dim, moe.num_kv_heads, len(moe.moe_layers)) == (128, 4, 94)


@pytest.mark.parametrize("devices", [8, 64, 512, 1024])
@pytest.mark.parametrize("name", ["llama3-70b", "llama3.1-405b", "qwen3-235b-a22b"])
def test_public_models_on_h100_clusters(model_dirs, name, devices):
    # 1024 rows of 4096 tokens (4M tokens) a step; 2048 on 1024 devices, so each data-parallel rank has rows
    cfg = config_for(model_dirs[name], global_batch=2048 if devices == 1024 else 1024)
    shape = check_model_source(cfg.model, weights=False)
    cluster = h100s(devices)
    planner = Planner(cfg, shape, cluster)
    estimated = []
    evaluate = planner.evaluate
    planner.evaluate = lambda layout, searching=False: estimated.append(layout) or evaluate(layout, searching)
    plan = planner.search()
    del planner.evaluate
    # the search is bounded by its pruning, not by a clock: each layout estimated at most once, and far
    # fewer than the layouts there are (a chain stops at its first fit; a group whose least memory does not
    # fit is left after that one)
    offloaded = any(layout.offload != "none" for layout in estimated)  # the second pass ran
    every = planner.layouts(plan.batch, False) + (planner.layouts(plan.batch, True) if offloaded else [])
    assert len(set(estimated)) == len(estimated) < len(every), (len(estimated), len(every))
    # ZeRO-3 over every device, 16 bytes a parameter (fp32 weights and gradients, two fp32 moments)
    states = zero_model_states(PUBLISHED[name], 3, devices, 4, 4, 8)
    if states > 80 * GIB + cluster.host_bytes_per_device:
        # more than the devices and their share of the nodes' 2 TiB of host memory hold (405B and 235B on one
        # node): nothing fits, and the nearest layout says which memory ran out
        assert not plan.ranked, plan.best.layout.describe()
        assert "offloads" in plan.examples["memory"].rejected, plan.examples["memory"].rejected
        no_offload = planner.layouts(plan.batch, offload=False)
        assert no_offload and not any(planner.evaluate(layout).fits for layout in no_offload)
        print(f"\n{name} on {cluster.describe()}: nothing fits ({plan.examples['memory'].rejected})")
        return
    assert plan.ranked, f"{name} on {devices} H100s: nothing fits: {dict(plan.rejected)} {plan.examples}"
    best = plan.best
    lay = best.layout
    print(
        f"\n{name} on {cluster.describe()}: searched in {plan.seconds:.2f} s "
        f"({len(estimated)} of {len(every)} layouts estimated); "
        f"best {lay.describe()}; {best.memory.device_bytes / GIB:.1f} GiB/device; "
        f"step {best.time.total:.3g} s, MFU {best.time.mfu:.1%}; rejected {dict(plan.rejected)}"
    )
    for i, c in enumerate(plan.ranked[1:3], 2):
        print(f"    #{i} {c.layout.describe()}: {c.memory.device_bytes / GIB:.1f} GiB, {c.time.total:.3g} s")
    assert lay.world == devices
    assert lay.micro_batch * lay.grad_accum * lay.dp == plan.batch  # the global batch is kept
    for c in plan.ranked:
        assert c.fits and c.memory.device_bytes <= 80 * GIB
        tp, cp = c.layout.tp, c.layout.cp
        assert tp <= H100_PER_NODE and H100_PER_NODE % tp == 0, c.layout.describe()  # TP inside a node
        assert tp * cp <= H100_PER_NODE, c.layout.describe()
        assert c.layout.ep * tp <= H100_PER_NODE, c.layout.describe()
    if states > 80 * GIB:  # more than the device holds: only offload can fit
        assert lay.offload != "none", lay.describe()
        host = best.memory.states.on_host
        print(
            f"    ZeRO-3 states {states / GIB:.0f} GiB/device:",
            f"offload={lay.offload}, {host / 1e9:.0f} GB host",
        )
    elif states < 0.75 * 80 * GIB:  # room to spare: offload only costs time
        assert lay.offload == "none", lay.describe()
    if lay.offload != "none":  # parallel: auto takes the same choice
        chosen, _ = choose(cfg, shape, cluster)
        assert not chosen.parallel.auto and chosen.parallel.offload == lay.offload


@pytest.mark.parametrize(("name", "devices"), [("llama3-70b", 64), ("qwen3-235b-a22b", 64)])
def test_search_finds_the_fastest_layout_that_fits_every_one_estimated(model_dirs, name, devices):
    """The search stops along each chain of micro-batch choices at the first that fits; estimating every
    layout instead finds the same fastest one (the time model's monotony the search relies on), and the
    pipeline's micro-batches go past 64 up to the rows per data-parallel rank, in sizes 1 to 8 rows."""
    cfg = config_for(model_dirs[name], global_batch=1024)
    planner = Planner(cfg, check_model_source(cfg.model, weights=False), h100s(devices))
    plan = planner.search(keep=10**9)
    every = [planner.evaluate(layout, searching=True) for layout in planner.layouts(plan.batch, False)]
    fits = [c for c in every if c.fits]
    assert plan.ranked and fits
    assert plan.best.time.total == min(c.time.total for c in fits)
    assert len(plan.ranked) < len(fits)  # the dominated ones were never estimated
    assert len({c.layout for c in plan.ranked}) == len(plan.ranked)  # each estimated once
    piped = [c.layout for c in every if c.layout.pp > 1]
    rows = {layout.micro_batch // layout.pipeline_microbatches for layout in piped}
    assert rows == {1, 2, 4, 8}
    assert max(layout.pipeline_microbatches * layout.grad_accum for layout in piped) > 64


def test_choose_names_what_is_needed_when_nothing_fits(model_dirs):
    cfg = config_for(model_dirs["llama3.1-405b"])
    shape = check_model_source(cfg.model, weights=False)
    with pytest.raises(ConfigError) as err:
        choose(cfg, shape, h100s(1))
    message = str(err.value)
    print(f"\nchoose, 405B on one H100: {message}")
    assert "no layout of 1 node(s) x 1 h100" in message and "global batch of 1024 rows" in message
    need = re.search(r"the nearest, (.+?), needs ([\d.]+) GiB per device of 80\.0", message)
    assert need, message
    # at least its model states: fp32 weights and gradients, and AdamW's two moments (16 bytes a parameter)
    assert float(need.group(2)) > zero_model_states(405.8e9, 0, 1, 4, 4, 8) / GIB
    assert "use more devices" in message and "method.finetuning=lora" in message


# ---- 2. `shardforge plan` ---------------------------------------------------------------------------------
def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", str(DEMO), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_on_this_machine(monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the demo's tokenizer path is relative to the repository
    out = _plan_json(capsys)
    assert (
        out["cluster"]["preset"] == "cpu"
        and out["cluster"]["nodes"] * out["cluster"]["devices_per_node"] == 1
    )
    assert out["global_batch"] == 4  # the demo's micro_batch 4 x grad_accum 1
    ranked = out["ranked"]
    assert 1 <= len(ranked) <= 5
    steps = [c["step_seconds"]["total"] for c in ranked]
    assert steps == sorted(steps)  # ranked by estimated step time
    assert ranked[0]["describe"] in out["reason"] and "shortest estimated step" in out["reason"]
    assert out["overrides"] and all("=" in o for o in out["overrides"])


def test_plan_for_two_nodes_of_h100(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = _plan_json(capsys, "--hardware", "h100", "--nodes", "2", "--devices-per-node", "8")
    assert out["cluster"] == {"preset": "h100", "nodes": 2, "devices_per_node": 8, "memory_gib": 80}
    assert out["ranked"] and out["reason"]
    for c in out["ranked"]:
        lay = c["layout"]
        assert lay["dp_replicate"] * lay["dp_shard"] * lay["cp"] * lay["tp"] * lay["pp"] == 16, c["describe"]
        assert lay["micro_batch"] * lay["grad_accum"] * lay["dp_replicate"] * lay["dp_shard"] == 4
        assert c["memory_bytes"]["total"] <= 80 * GIB


def test_plan_list_hardware(capsys):
    assert main(["plan", "--list-hardware"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(PRESETS)
    h100 = next(line for line in lines if line.startswith("h100"))
    assert "80 GB" in h100 and "bf16 989.4" in h100


def test_plan_unknown_preset_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["plan", str(DEMO), "--hardware", "tpu9"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "hardware.preset='tpu9' is not a preset; valid: " in captured.err
    assert all(name in captured.err for name in PRESETS)


# ---- 3. `parallel: auto` ----------------------------------------------------------------------------------
def test_parallel_auto_shorthand(tmp_path):
    text = DEMO.read_text()
    short, long = tmp_path / "short.yaml", tmp_path / "long.yaml"
    short.write_text(text + "parallel: auto\n")
    long.write_text(text + "parallel: {auto: true}\n")
    a, b = load_config(short), load_config(long)
    assert a.parallel.auto is True
    assert a == b
    assert load_config(DEMO).parallel.auto is False


def test_preflight_resolves_auto_on_two_processes(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(DEMO, ["parallel.auto=true"])
    shape = model_source(cfg.model)[0]
    resolved, dims, grad_accum, _, estimate = preflight(cfg, 2, shape)
    p = resolved.parallel
    print(f"\ndemo, parallel: auto on 2 processes: {estimate.layout.describe()}")
    assert p.auto is False
    assert p.dp_replicate * p.dp_shard * p.tp * p.pp * p.cp == 2 == dims.world_size
    assert resolved.train.micro_batch * grad_accum * dims.dp == 4  # the demo's global batch
    assert estimate.fits
    # what it resolved to is an explicit layout the preflight accepts as it is
    again, dims2, _, _, _ = preflight(resolved, 2, shape)
    assert again.parallel == p and dims2 == dims


# ---- 4. the preflight's memory check ----------------------------------------------------------------------
def test_preflight_explicit_layout_that_cannot_fit(model_dirs):
    cfg = config_for(
        model_dirs["llama3-70b"], global_batch=None, train={"micro_batch": 8}, hardware={"preset": "h100"}
    )
    shape = check_model_source(cfg.model, weights=False)
    with pytest.raises(ConfigError) as err:
        preflight(cfg, 1, shape)
    message = str(err.value)
    print(f"\n70B on one H100, micro_batch 8: {message}")
    pattern = r"will not run on 1 node\(s\) x 1 h100 .*: needs ([\d.]+) GiB per device of 80\.0;"
    need = re.search(pattern, message)
    assert need, message
    full = re.search(r"with parallel\.activation_checkpoint=full it needs ([\d.]+)", message)
    assert full, message
    assert float(full.group(1)) < float(need.group(1))
    # the planner's own estimate of that layout, and at least 16 bytes of states per parameter
    estimate = Planner(cfg, shape, h100s(1)).evaluate(layout_of(cfg, 1))
    assert need.group(1) == f"{estimate.memory.device_bytes / GIB:.1f}"
    assert float(need.group(1)) > 16 * 70.5e9 / GIB


# ---- 5. counting model states on shapes alone -------------------------------------------------------------
def _demo(vocab: int | None = None):
    cfg = load_config(DEMO)
    shape = check_model_source(cfg.model, weights=False)
    shape = replace(shape, vocab_size=vocab or 1024)  # 1024: the bundled tokenizer's vocabulary
    return cfg, shape


def _by_hand(shape, vocab: int) -> tuple[int, int]:
    """(elements TP splits, elements it replicates) of a Llama decoder with a tied head, counted by hand."""
    h, i, n = shape.hidden_size, shape.intermediate_size, shape.num_layers
    kv = shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    split = vocab * h + n * (h * q + 2 * h * kv + q * h + 3 * h * i)  # embedding, q k v o, gate up down
    replicated = n * 2 * h + h  # two norms a layer and the final one
    return split, replicated


@pytest.mark.parametrize("vocab", [1024, 1023])
def test_zero3_shards_sum_to_the_whole(vocab):
    cfg, shape = _demo(vocab)
    assert shape.tie_embeddings and cfg.model.dtype == "float32"
    params = inventory(shape, cfg)
    counter = StateCounter(params, True)
    layout = Layout(1, 4, 1, 1, 1, 1, 3, False, "none", "none", 1, 1)
    split, replicated = _by_hand(shape, vocab)
    whole = 4 * (split + replicated)
    per_rank = [counter.count(layout, coords_of(layout, r), None).params for r in range(4)]
    assert sum(per_rank) == whole
    # each rank holds FSDP2's dimension-0 chunk of every tensor (the tied head is the embedding)
    for r in range(4):
        expected = 0
        for p in params:
            if p.name == "lm_head.weight":
                continue
            chunks = torch.chunk(torch.empty(p.shape, device="meta"), 4, dim=0)
            expected += 4 * (chunks[r].numel() if r < len(chunks) else 0)
        assert per_rank[r] == expected, r
    if vocab % 4:  # uneven: the last rank's embedding chunk is shorter
        assert per_rank[3] < per_rank[0]


@pytest.mark.parametrize("vocab", [1024, 1023])
def test_tensor_parallel_halves_split_tensors(vocab):
    cfg, shape = _demo(vocab)
    full = inventory(shape, cfg)
    assert full[-1].name == "lm_head.weight"  # the tied head's copy, held apart only by a pipeline
    params = full[:-1]
    splits = {p.name.split(".")[-2] for p in params if p.tp_dim is not None}
    assert splits == {
        "embed_tokens",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert all("norm" in p.name for p in params if p.tp_dim is None)
    counter = StateCounter(full, True)
    layout = Layout(1, 1, 2, 1, 1, 1, 0, True, "none", "none", 1, 1)
    padded = math.ceil(vocab / 2) * 2  # the vocabulary padded to a multiple of tp
    split, replicated = _by_hand(shape, padded)
    for r in range(2):
        states = counter.count(layout, coords_of(layout, r), None)
        assert states.params == 4 * (split // 2 + replicated), r
        assert states.grads == states.params and states.frozen == 0


def test_rl_rollout_memory_counted_by_hand():
    """GRPO's rollout phase: the KV cache of every completion of the rank's prompts in a step (max_length
    tokens each, in 16-token blocks, plus the engine's spare block), the sampled rows' logits and their copy,
    and under ZeRO-3 the whole model gathered in fp32; a step's peak is the fuller of rollout and training."""
    cfg = load_config(DEMO, ["method.stage=grpo", "method.rl.group_size=4", "data.max_length=70"])
    shape = check_model_source(cfg.model, weights=False)
    shape = replace(shape, vocab_size=1024)
    memory = MemoryModel(cfg, shape, spec_for(shape.family).costs(shape))
    layout = Layout(1, 2, 1, 1, 1, 1, 3, False, "none", "none", 2, 3)  # dp_shard 2, ZeRO-3, mb 2 x 3
    sequences = 2 * 3 * 4
    slots = sequences * 80 + 16  # 70 tokens take 5 blocks of 16
    kv = 2 * shape.num_layers * slots * shape.num_kv_heads * shape.head_dim * 4
    split, replicated = _by_hand(shape, 1024)
    expected = kv + 4 * (split + replicated) + 2 * sequences * 1024 * 4
    assert memory.rollout(layout, None) == expected
    plan = memory.estimate(layout, None, on_gpu=False)
    assert plan.rollout == expected
    held = sum(plan.states.on_device.values())
    assert plan.device_bytes == held + plan.reference + max(plan.activations + plan.buffers, expected)
    sft = load_config(DEMO, ["data.max_length=70"])
    assert MemoryModel(sft, shape, spec_for(shape.family).costs(shape)).rollout(layout, None) == 0


# ---- offload costs host traffic ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "held"),
    [
        (["method.stage=dpo"], True),
        (["method.stage=dpo", "method.pref.loss=orpo"], False),
        (["method.stage=dpo", "method.pref.loss=simpo"], False),
        (["method.stage=kto"], True),
        (["method.stage=grpo", "method.rl.kl_beta=0.05"], True),
        (["method.stage=grpo"], False),
        (["method.stage=dpo", "method.finetuning=lora"], False),  # the adapters disabled are the reference
    ],
)
def test_the_planner_counts_a_reference_copy_exactly_when_the_run_holds_one(overrides, held):
    """A frozen copy of the starting weights, as large as the policy's parameters, where the objective holds
    one (ORPO and SimPO need no reference: the run holds none, and the planner counts none)."""
    cfg = load_config(DEMO, overrides)
    shape = check_model_source(cfg.model, weights=False)
    plan = MemoryModel(cfg, shape, spec_for(shape.family).costs(shape)).estimate(
        Layout(1, 1, 1, 1, 1, 1, 0, False, "none", "none", 1, 1), None, on_gpu=False
    )
    assert plan.reference == (plan.states.params if held else 0.0)


@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_pays_for_the_host_link(model_dirs, offload):
    cfg = config_for(model_dirs["llama3-70b"])
    shape = check_model_source(cfg.model, weights=False)
    cluster = h100s(8)
    planner = Planner(cfg, shape, cluster)
    on_device = planner.evaluate(Layout(1, 8, 1, 1, 1, 1, 3, False, "selective", "none", 1, 128))
    moved = planner.evaluate(Layout(1, 8, 1, 1, 1, 1, 3, False, "selective", offload, 1, 128))
    # at the least, each step's gradients go to the host and the updated parameters come back
    states = moved.memory.states
    floor = (states.grads + states.params) / (cluster.device.host_gbps * 1e9)
    assert moved.time.total >= on_device.time.total + floor


def test_any_preset_figure_can_be_overridden_by_name():
    from shardforge.config.schema import HardwareSection
    from shardforge.planner.hardware import cluster_for

    hw = HardwareSection(
        preset="h100", nodes=2, devices_per_node=8, figures={"host_gbps": 25, "overlap": 0.5}
    )
    cluster = cluster_for(hw, 16)
    assert (cluster.device.host_gbps, cluster.device.overlap, cluster.device.memory_gib) == (25, 0.5, 80)
    with pytest.raises(ConfigError, match=r"hardware.figures: unknown figure 'nvlink'; valid: .*host_gbps"):
        cluster_for(HardwareSection(preset="h100", figures={"nvlink": 1.0}), 8)
    with pytest.raises(ConfigError, match=r"hardware.nodes=2 x hardware.devices_per_node=8 = 16 devices"):
        cluster_for(HardwareSection(preset="h100", nodes=2, devices_per_node=8), 8)


def test_plan_estimate_gives_the_config_s_own_layout_and_its_rank(model_dirs, tmp_path, capsys):
    """`shardforge plan --estimate`: the explicit layout's memory and time by part (the planner's own figures
    for it), where it ranks among the searched layouts, and a layout that cannot run said so (exit 1)."""
    config = {
        "model": {"path": str(model_dirs["llama3-70b"])},
        "data": {"train": [{"path": "x.jsonl", "format": "alpaca"}], "max_length": 4096},
        "train": {"precision": "bf16", "global_batch": 512, "micro_batch": 8},
        "parallel": {"tp": 8, "pp": 4, "zero_stage": 2, "dp_shard": -1},
        "hardware": {"preset": "h100", "nodes": 8, "devices_per_node": 8},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", str(path), "--estimate", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    cfg = Config(**config)
    ours = Planner(cfg, check_model_source(cfg.model, weights=False), h100s(64)).evaluate(layout_of(cfg, 64))
    assert answer["estimate"]["memory_bytes"]["total"] == ours.memory.device_bytes
    assert answer["estimate"]["step_seconds"]["total"] == pytest.approx(ours.time.total)
    assert re.match(r"it ranks #\d+ among the \d+ searched layouts that fit; the best, ", answer["standing"])
    assert answer["best"]["step_seconds"]["total"] <= ours.time.total
    replicas = ["parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=1"]  # a 70B copy on every device
    assert main(["plan", str(path), "--estimate", *replicas]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "will not run: needs" in out and "it does not fit, so it is not among the searched layouts" in out


def test_qwen3_235b_at_tp8_over_4_kv_heads_is_judged_on_memory_only(model_dirs):
    """The seed document's Qwen3-235B-A22B layout, TP8 x PP8 x EP8 on 1024 A100s: tp 8 over its 4 kv heads
    replicates them (each rank keeps the one its query heads read), so the layout is accepted or refused for
    memory alone, with the figure; the replicated k/v projections are counted whole on every rank."""
    cfg = config_for(
        model_dirs["qwen3-235b-a22b"], global_batch=1024, train={"micro_batch": 8},
        parallel={"tp": 8, "pp": 8, "ep": 8, "zero_stage": 3, "dp_shard": -1},
        hardware={"preset": "a100-80", "nodes": 128, "devices_per_node": 8},
    )  # fmt: skip
    shape = check_model_source(cfg.model, weights=False)
    try:
        _, dims, _, _, estimate = preflight(cfg, 1024, shape, measure=False)
        verdict = f"accepted: {estimate.memory.device_bytes / GIB:.1f} GiB per device"
        assert (dims.tp, dims.pp, dims.ep) == (8, 8, 8)
    except ConfigError as exc:
        verdict = str(exc)
        assert "GiB per device of 80.0" in verdict and "kv heads" not in verdict, verdict
    print(f"\nQwen3-235B-A22B TP8 x PP8 x EP8 on 1024 A100-80: {verdict}")
    k = next(p for p in inventory(shape, cfg) if p.name == "layers.0.attn.k_proj.weight")
    layout = layout_of(cfg, 1024)
    # whole over tp (the kv heads replicated), then a ZeRO-3 shard over dp_shard = 1024 / (tp 8 x pp 8) = 16
    assert (
        k.kv_heads == 4 and StateCounter.local_numel(k, layout, coords_of(layout, 0)) == 4 * 128 * 4096 // 16
    )


def test_preflight_reports_every_broken_rule_and_the_memory_together(model_dirs):
    """Every rule runs after the degrees and all that break are listed in one error, with the memory the
    layout would need: fixing the first never uncovers the second."""
    cfg = config_for(
        model_dirs["llama3-70b"], global_batch=96, train={"micro_batch": 6},
        parallel={"tp": 3, "pp": 4, "zero_stage": 2, "dp_shard": -1},
        hardware={"preset": "h100", "nodes": 12, "devices_per_node": 8},
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        preflight(cfg, 96, check_model_source(cfg.model, weights=False), measure=False)
    message = str(err.value)
    assert message.startswith(
        "the layout breaks 2 rules: (1) parallel.tp=3 does not divide the model's num_heads"
    )
    assert (
        "(2) parallel.pp_microbatches=4 (the default: pp x pp_virtual) must divide train.micro_batch=6"
        in message
    )
    assert re.search(r"\(and its memory: it would need [\d.]+ GiB per device of 80\.0\)$", message), message


def test_zero_bubble_schedules_are_searched_where_they_compose(model_dirs):
    """Zero-bubble schedules run without data parallel (their weight-gradient pass misses FSDP2's gathered
    parameters): the search offers them for pp x tp layouts only, each one the launcher's rules accept."""
    cfg = config_for(model_dirs["llama3-70b"], global_batch=64)
    planner = Planner(cfg, check_model_source(cfg.model, weights=False), h100s(8))
    layouts = planner.layouts(64, False)
    zero_bubble = [lay for lay in layouts if lay.pp_schedule in ("zero_bubble", "zbv")]
    assert {lay.pp_schedule for lay in zero_bubble} == {"zero_bubble", "zbv"}
    assert {lay.dp for lay in zero_bubble} == {1} and any(lay.dp > 1 and lay.pp > 1 for lay in layouts)
    assert all(planner.evaluate(lay, searching=True).kind != "rules" for lay in zero_bubble)
