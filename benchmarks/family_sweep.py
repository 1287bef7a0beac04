"""Every causal-LM model_type transformers registers, tiny and random, through each path shardforge offers:
which family works for what, which is refused by name, and none gives wrong numbers.

    python benchmarks/family_sweep.py                    # all of them; writes docs/families.md
    python benchmarks/family_sweep.py --only gpt2 falcon # some (the table is not written)

For each `model_type` in transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES a tiny config is made from the
family's own defaults (`tiny_config`: the sizes shrunk by their names; the few families that need more say
so in TINY), built random by transformers and saved as an HF folder. Then, each against transformers (or
peft) on the same folder:

- load: `shardforge.load_model` (the backend `auto` picks) gives transformers' logits (fp32, 1e-4).
- packed: two documents in one row give the logits each gets alone (or packing is refused by name).
- train: two SFT steps through the one trainer on the bundled data and tokenizer; `final/` reloaded by
  transformers gives the trained model's logits (1e-4).
- lora: LoRA over `targets: all`, adapters moved off zero, saved as a PEFT folder; peft's base + adapter
  gives our logits (1e-4).
- generate: the inference engine's greedy tokens (3 prompts, continuous batching, prefill chunks) equal
  transformers' `generate`.

Each path is "works", "refused: <shardforge's message>", "WRONG: <difference>" or "error: <exception>" (a
defect: a traceback a user would see). Families run in worker processes (a crash or a hang costs one
family, not the sweep), results append to a JSON-lines file so that a rerun continues."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1024  # the bundled tokenizer's
PATHS = ("load", "packed", "train", "lora", "generate")
VERIFIED = REPO / "shardforge" / "models" / "generic" / "verified.py"
TOL = 1e-4

# Sizes by the names families give them (the first name the config's __init__ takes is set)
SIZES: list[tuple[tuple[str, ...], Any]] = [
    (("vocab_size",), VOCAB),
    (("hidden_size", "d_model", "n_embd", "n_embed", "dim"), 64),
    (("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim"), 128),
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), 4),
    (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    (("head_dim", "kv_channels"), 16),
    (("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len"), 256),
    (("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token"), 2),
    (("moe_intermediate_size", "expert_intermediate_size"), 32),
    (("shared_expert_intermediate_size",), 32),
    (("kv_lora_rank",), 16),
    (("qk_rope_head_dim",), 8),
    (("qk_nope_head_dim",), 8),
    (("v_head_dim",), 16),
    (("rotary_dim",), 8),
    (("sliding_window",), 16),
]
# Inkling 2's LM head is unpadded_vocab_size wide; its sliding layers size their heads apart
INKLING2 = {
    "unpadded_vocab_size": VOCAB,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "sliding_window_size": 16,
    "n_layers_per_attn_res_block": 1,
}
# Qwen4-exp's indexed-attention layers need their (QSA) indexer set; its linear-attention heads shrunk
QWEN4_INDEXED = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "hc_lowrank": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
# What some families need beyond the shrunk sizes (their configs validate combinations)
TINY: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "reformer": {"is_decoder": True, "axial_pos_shape": [16, 16], "axial_pos_embds_dim": [32, 32]},
    "zaya": {"num_experts_per_tok": 1},
    # hybrids: one attention layer among the two kept, state-space heads that add up
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
    },
    "nemotron_h": {"hybrid_override_pattern": "M*"},
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16},
    "nemotron": {"num_key_value_heads": 2},
    "dots1": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 16},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # grouped routing: the groups divide the four experts kept
    "axk1": {"n_group": 2, "topk_group": 1, "q_lora_rank": 32},
    # the widths the top config derives from at __post_init__ given there (the sub-configs are shrunk after);
    # the cache BLT makes at use_cache reads num_hidden_layers off the top config, which it lacks
    "blt": {
        "num_hidden_layers": 2,
        "encoder_hash_byte_group_vocab": 1000,
        "local_attention_window_len": 16,
        "encoder_config": {"hidden_size": 64, "hidden_size_global": 64},
        "decoder_config": {"hidden_size": 64, "hidden_size_global": 64},
        "global_config": {"hidden_size": 64},
    },
    # the attention sub-config as checkpoints carry it (rope_theta read by the attention, clip_qkv not None)
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # MLA with the sparse-attention indexer (and see tiny_config: the default is read at two layers)
    "dots3_note_text": {
        "q_lora_rank": 32,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "index_topk": 8,
        "shared_experts_intermediate_size": 32,
    },
    # the text config's layer schedule and rotary fraction are derived at __post_init__, before the shrinking
    "dots3_note": {
        "text_config": {
            "num_hidden_layers": 2,
            "head_dim": 8,
            "qk_rope_head_dim": 8,
            "q_lora_rank": 32,
            "index_head_dim": 16,
            "index_n_heads": 4,
            "index_topk": 8,
            "shared_experts_intermediate_size": 32,
        }
    },
    "inkling2_text": INKLING2,
    "inkling2_loop_text": {
        **INKLING2,  # n_layers_per_attn_res_block: the loop's bounds are multiples of it
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 2,
        "loop_num_passes": 2,
        "loop_gate_rank": 8,
    },
    "qwen4_exp_text": QWEN4_INDEXED,
    "qwen4_exp": {
        "text_config": {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "indexed_attention"],
            "head_dim": 16,
            **QWEN4_INDEXED,
        }
    },
    # the mLSTM's query/key width (hidden * qk_dim_factor) a multiple of 64, as its state assumes
    "xlstm": {"hidden_size": 128, "chunk_size": 8},
    # the language of the adapters used when none is passed (a config field), and a decoder
    "xmod": {"default_language": "en_XX", "is_decoder": True},
    # two hybrid layers: the shared transformer is tied from the first to the others (one alone ties nothing)
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},
    "zamba2": {
        "layers_block_type": ["hybrid", "hybrid"],
        "mamba_d_state": 16,
        "adapter_rank": 8,
        "chunk_size": 16,
    },
}
TOKENS_AT = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def tiny_config(model_type: str) -> Any:
    """The family's default config with its sizes shrunk (SIZES, TINY), sub-configs too."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    if model_type == "dots3_note_text":
        # special case: the 46-layer default's sliding layers carry per-layer sizes, which refuse being read
        # off the whole config (AmbiguousGlobalPerLayerAttributeError); its first two layers have none
        default = AutoConfig.for_model(model_type, num_hidden_layers=2)
    kwargs = {**_shrunk(default), **TINY.get(model_type, {})}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    for name in getattr(cfg, "sub_configs", None) or {}:
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            for key, value in _shrunk(sub).items():
                with contextlib.suppress(AttributeError, TypeError, ValueError):
                    setattr(sub, key, value)
    return cfg


def _shrunk(default: Any) -> dict[str, Any]:
    cls = type(default)
    params = inspect.signature(cls.__init__).parameters
    fields = getattr(default, "__dict__", {})
    out: dict[str, Any] = {}
    for names, value in SIZES:
        for name in names:
            if name in params or name in fields:
                if name in ("num_key_value_heads", "sliding_window") and getattr(default, name, None) is None:
                    break  # absent on purpose (multi-head attention, no window)
                out[name] = value
                break
    if (
        "kv_lora_rank" in out
    ):  # latent attention (MLA): keys and values per head, the rotary part its head_dim
        if "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = 4
    types = getattr(default, "layer_types", None)
    derived = isinstance(getattr(cls, "layer_types", None), property) or "layer_types" in cls.attribute_map
    if isinstance(types, (list, tuple)) and types and not derived:  # not one the config derives itself
        distinct = list(dict.fromkeys(types))
        out["layer_types"] = (distinct + list(types))[:2]
    for name in TOKENS_AT:
        v = getattr(default, name, None)
        if isinstance(v, int) and v >= VOCAB:
            out[name] = {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2)
        elif isinstance(v, list) and any(isinstance(x, int) and x >= VOCAB for x in v):
            out[name] = [2]
    return out


def build_folder(model_type: str, root: Path) -> Path:
    """The tiny random model saved by transformers (weights perturbed so that a missed bias shows)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.02)
        model(input_ids=_ids())  # transformers' own forward runs on it (else the tiny config is at fault)
    folder = root / "model"
    model.save_pretrained(folder)
    return folder


# ---- the paths ---------------------------------------------------------------------------------------------
def _ids() -> Any:
    import torch

    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _compare(got: Any, want: Any) -> str:
    import torch

    if got.shape != want.shape:
        return f"WRONG: shape {tuple(got.shape)} vs transformers' {tuple(want.shape)}"
    diff = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    ok = torch.isfinite(got).all().item() and diff <= TOL * scale
    return "works" if ok else f"WRONG: max |diff| {diff:.2e} (logits up to {scale:.1f})"


def path_load(folder: Path, work: Path) -> str:
    import torch

    from shardforge import load_model

    ours = load_model(folder).eval()
    with torch.no_grad():
        return _compare(ours(_ids()), _reference(folder)(input_ids=_ids()).logits)


def path_packed(folder: Path, work: Path) -> str:
    import torch

    from shardforge import load_model

    ours = load_model(folder).eval()
    ours.packs = True  # measured whatever verified.py says (write_verified records it)
    first, second = torch.arange(3, 8), torch.arange(20, 31)
    row = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(5), torch.arange(11)])[None]
    doc_ids = torch.cat([torch.zeros(5), torch.ones(11)]).long()[None]
    reference = _reference(folder)
    with torch.no_grad():
        packed = ours(row, position_ids=positions, doc_ids=doc_ids)  # refused by name where it cannot
        alone = torch.cat([reference(input_ids=d[None]).logits for d in (first, second)], dim=1)
    return _compare(packed, alone)


def _train(folder: Path, work: Path, finetuning: str) -> Any:
    from shardforge import load_model
    from shardforge.config import load_config
    from shardforge.train.trainer import Trainer

    packs = load_model(folder).packs
    data = REPO / "examples" / "data" / "demo_alpaca.jsonl"
    config = {
        "output_dir": str(work / f"run-{finetuning}"),
        "model": {"path": str(folder), "tokenizer": str(REPO / "examples" / "data" / "tokenizer")},
        "data": {"train": [{"path": str(data), "format": "alpaca"}], "max_length": 64, "packing": packs,
                 "cache_dir": str(work / "cache")},
        "method": {"stage": "sft", "finetuning": finetuning},
        "train": {"steps": 2, "micro_batch": 2, "lr": 1e-3, "warmup": 0, "log_every": 1, "seed": 0},
        "log": {"tensorboard": False, "plot": False, "progress": False},
    }  # fmt: skip
    trainer = Trainer(load_config(None, base=config))
    return trainer, trainer.train()


def path_train(folder: Path, work: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    trainer, result = _train(folder, work, "full")
    with torch.no_grad():
        live = trainer.model.eval()(_ids())
        exported = AutoModelForCausalLM.from_pretrained(result.final_model).eval()(input_ids=_ids()).logits
    return _compare(exported, live)


def path_lora(folder: Path, work: Path) -> str:
    import torch
    from peft import PeftModel

    from shardforge import load_model
    from shardforge.adapters.apply import add_lora
    from shardforge.adapters.peft_format import save_adapter
    from shardforge.config.method_schema import LoraSection

    ours = load_model(folder).eval()
    section = LoraSection(rank=4)
    add_lora(ours, section, seed=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    adapters = {k: v for k, v in ours.state_dict().items() if ".lora_" in k}
    out = save_adapter(work / "adapter", ours.config.family, adapters, section, str(folder))
    reference = PeftModel.from_pretrained(_reference(folder), out).eval()
    with torch.no_grad():
        return _compare(ours(_ids()), reference(input_ids=_ids()).logits)


def path_generate(folder: Path, work: Path) -> str:
    """The recompute runner (every family's fallback), then the paged one where every layer attends through
    it: "works", "works; paged: <verdict>" (write_verified records which families page)."""
    from shardforge import load_model
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.executor import Executor, LocalRunner, attends_paged
    from shardforge.infer.kv_pool import paged_pool
    from shardforge.infer.recompute import RecomputeRunner

    model = load_model(folder).eval()
    config = EngineConfig(block_size=4, num_blocks=64, max_step_tokens=16)
    recomputed = _greedy(folder, model, config, Executor(RecomputeRunner(model, 64, 4)))
    if recomputed != "works":
        return recomputed
    if not attends_paged(model):
        return "works; paged: bypasses the cache"
    return "works; paged: " + _greedy(
        folder, model, config, Executor(LocalRunner(model, paged_pool(model, config)))
    )


def _greedy(folder: Path, model: Any, config: Any, executor: Any) -> str:
    import torch
    from transformers import GenerationConfig

    from shardforge.infer.engine import Engine
    from shardforge.infer.sampling import SamplingParams

    prompts = [
        torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 9)
    ]
    got = Engine(model, config=config, executor=executor).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    reference = _reference(folder)
    # plain greedy: the family's generation config (BART's forced EOS, ...) replaced, not merged
    reference.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    for prompt, done in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=6)
        want = out[0, len(prompt) :].tolist()
        if done[0].tokens != want:
            return f"WRONG: prompt of {len(prompt)}: {done[0].tokens} vs transformers' {want}"
    return "works"


RUNNERS = {"load": path_load, "packed": path_packed, "train": path_train, "lora": path_lora,
           "generate": path_generate}  # fmt: skip


def sweep_family(model_type: str, root: Path, paths: tuple[str, ...] = PATHS) -> dict[str, str]:
    """Each path's outcome for one family (a fresh folder under `root`)."""
    from shardforge.errors import ShardforgeError

    work = root / model_type
    work.mkdir(parents=True, exist_ok=True)
    try:
        folder = build_folder(model_type, work)
    except Exception as e:  # transformers' own code: not a path of ours
        return {"tiny": f"not built: {type(e).__name__}: {_short(e)}"}
    outcome: dict[str, str] = {}
    for path in paths:
        try:
            outcome[path] = RUNNERS[path](folder, work)
        except ShardforgeError as e:
            outcome[path] = f"refused: {_short(e)}"
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            outcome[path] = (
                f"error: {type(e).__name__}: {_short(e)} ({Path(where.filename).name}:{where.lineno})"
            )
    return outcome


def _short(e: BaseException, n: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= n else text[: n - 3] + "..."


# ---- the driver --------------------------------------------------------------------------------------------
def worker(families: list[str], out: Path, root: Path) -> None:
    """Run families in this process, one JSON line each (after `started` lines, so a crash is attributed)."""
    import logging
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from shardforge.models.generic import verified

    verified.REFUSED = {}  # measured anew, not refused by the last sweep's findings
    limit = int(os.environ.get("SWEEP_TIMEOUT", "600"))

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no result within {limit} s")

    signal.signal(signal.SIGALRM, hung)
    for model_type in families:
        with out.open("a") as f:
            f.write(json.dumps({"model_type": model_type, "started": True}) + "\n")
        began = time.perf_counter()
        signal.alarm(limit)
        outcome = sweep_family(model_type, root)
        signal.alarm(0)
        row = {"model_type": model_type, "seconds": round(time.perf_counter() - began, 1), **outcome}
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{model_type:28s} {row['seconds']:6.1f}s  " + "  ".join(
            f"{k}={v.split(':')[0]}" for k, v in outcome.items()), flush=True)  # fmt: skip


def read_results(out: Path) -> dict[str, dict]:
    """Finished rows by model_type; a family started and never finished crashed its worker."""
    rows: dict[str, dict] = {}
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            if row.pop("started", False):
                rows.setdefault(
                    row["model_type"], {"model_type": row["model_type"], "tiny": "crashed the process"}
                )
            else:
                rows[row["model_type"]] = row
    return rows


def all_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# Families transformers' own code cannot build and run on token ids from their config: refused at load
NOT_BUILT = {
    "gemma3n": "its model builds a timm vision tower (timm is not a dependency); its text model is "
    "gemma3n_text",
    "gemma4_assistant": "a speculative-decoding draft head: it needs the target model's embeddings and KV "
    "states, not token ids",
    "gemma4_unified_assistant": "a speculative-decoding draft head: it needs the target model's embeddings "
    "and KV states, not token ids",
    "musicgen": "an audio model: transformers' causal-LM class cannot be built from its composite config, "
    "and its decoder reads codebook ids",
    "musicgen_melody": "an audio model: transformers' causal-LM class cannot be built from its composite "
    "config, and its decoder reads codebook ids",
}


def refused(row: dict) -> dict[str, str]:
    """The paths measured wrong (or failing with a traceback), for REFUSED: load and train refuse the
    family (both run at its load), lora and generate those paths; a family that could not be built is
    refused at load."""
    if "tiny" in row:
        built = f"transformers' own model could not be built tiny: {row['tiny']}"
        why = NOT_BUILT.get(row["model_type"], built)
        return {"load": f"not measured: {why}"}
    out = {
        p: row[p]
        for p in ("load", "train", "lora", "generate")
        if row.get(p, "").startswith(("WRONG", "error"))
    }
    return out


def shipped(row: dict) -> dict[str, str]:
    """Each path as shardforge runs it now that verified.py holds this sweep: packing measured wrong is
    turned off (said in the log; `ours(..., doc_ids)` refuses it), the engine recomputes where paging was
    wrong or bypassed, and a path measured wrong is refused by name (a family whose load or training is
    wrong, on every path)."""
    out = {}
    measured = refused(row)
    for path in PATHS:
        value = row.get(path, "not run")
        whole = measured.get("load") or measured.get("train")  # both are refused at the family's load
        if whole or path in measured:
            value = f"refused: measured wrong ({whole or measured[path]})"
        if path == "packed" and value.startswith("WRONG"):
            value = "refused: packing is not verified for this family (measured " + value + ")"
        if path == "generate" and value.startswith("works; paged: "):
            paged = value.removeprefix("works; paged: ")
            value = (
                "works (paged KV cache)" if paged == "works" else f"works (recompute runner; paged: {paged})"
            )
        out[path] = value
    return out


def write_verified(rows: dict[str, dict], target: Path) -> None:
    import transformers

    packs = sorted(m for m, r in rows.items() if r.get("packed") == "works")
    pages = sorted(m for m, r in rows.items() if r.get("generate") == "works; paged: works")
    wrong = {m: {p: _short(v, 80) for p, v in refused(r).items()} for m, r in sorted(rows.items())}
    wrong = {m: paths for m, paths in wrong.items() if paths}
    measured = sorted(m for m, r in rows.items() if "tiny" not in r)

    def listed(names: list[str]) -> str:
        body = "".join(f'        "{n}",\n' for n in names)
        return "frozenset(\n    {\n" + body + "    }\n)"

    text = target.read_text()
    head = text[: text.index('TRANSFORMERS = "')]
    target.write_text(
        f'{head}TRANSFORMERS = "{transformers.__version__}"\n'
        f"PACKS: frozenset[str] = {listed(packs)}\n"
        f"PAGED: frozenset[str] = {listed(pages)}\n"
        f"REFUSED: dict[str, dict[str, str]] = {json.dumps(wrong, indent=4)}\n"
        f"MEASURED: frozenset[str] = {listed(measured)}\n"
    )
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(target)], check=False)


def write_table(rows: dict[str, dict], doc: Path) -> None:
    import transformers

    table = {m: shipped(r) for m, r in rows.items() if "tiny" not in r}
    counts = {p: sum(1 for r in table.values() if r[p].startswith("works")) for p in PATHS}
    lines = [
        "# Model families: what works on each path",
        "",
        f"Written by `python benchmarks/family_sweep.py` ({time.strftime('%Y-%m-%d')}, transformers "
        f"{transformers.__version__}): every causal-LM model_type transformers registers ({len(rows)}), "
        "built tiny and random from its own config, through each path, each checked against transformers "
        "(peft for LoRA) on the same folder; the script's docstring says what each column checks. `works`: "
        "equal (fp32, 1e-4; generation token for token); `refused`: shardforge says why, by name; `WRONG` "
        "or `error`: a defect. Packing and the paged KV cache are used only where this sweep measured them "
        "right (`shardforge/models/generic/verified.py`, written by the same run); elsewhere packing is off "
        "and the engine recomputes. The CI runs a representative subset (tests/e2e/test_family_sweep.py).",
        "",
        "Works: " + ", ".join(f"{p} {counts[p]}" for p in PATHS) + f" of {len(table)} built tiny ("
        f"{len(rows) - len(table)} could not be, and are refused by name: transformers' own code cannot run "
        "them on token ids).",
        "",
        "| model_type | " + " | ".join(PATHS) + " |",
        "|---|" + "---|" * len(PATHS),
    ]
    notes: list[str] = []
    for model_type in sorted(rows):
        if model_type not in table:
            lines.append(f"| {model_type} | " + " | ".join(["refused"] * len(PATHS)) + " |")
            notes.append(f"- {model_type}: refused at load, {refused(rows[model_type])['load']}")
            continue
        cells = []
        for p in PATHS:
            value = table[model_type][p]
            kind = value.split(":")[0].split(" (")[0]
            cells.append(kind)
            if kind != "works" or "recompute" in value:
                notes.append(f"- {model_type}, {p}: {value}")
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    lines += ["", "## Notes (every path that is not plainly `works`)", "", *notes, ""]
    doc.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="these model_types (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per family")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results_family_sweep.jsonl")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "families.md")
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--fresh", action="store_true", help="forget earlier results")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="family-sweep-"))
    if args.worker is not None:
        worker(args.worker, args.out, root)
        return
    if args.fresh and args.out.exists():
        args.out.unlink()
    families = args.only or all_families()
    while True:
        todo = [f for f in families if f not in read_results(args.out)]
        if not todo:
            break
        chunks = [todo[i :: args.workers] for i in range(args.workers)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SWEEP_TIMEOUT": str(args.timeout)}
        procs = [
            subprocess.Popen([sys.executable, __file__, "--out", str(args.out), "--worker", *chunk], env=env)
            for chunk in chunks
            if chunk
        ]
        for proc in procs:
            try:
                proc.wait(timeout=2 * args.timeout * len(todo))
            except subprocess.TimeoutExpired:
                proc.kill()
    rows = {k: v for k, v in read_results(args.out).items() if k in families}
    if args.only is None:
        write_verified(rows, VERIFIED)
        write_table(rows, args.doc)
        print(f"wrote {VERIFIED} and {args.doc}")


if __name__ == "__main__":
    main()
