"""LLaMA-Factory's YAMLs that are not training runs (predict, merge / export, inference) as the shardforge
command doing what they do."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from shardforge.config.lf_tables import GENERIC_TEMPLATES
from shardforge.config.lf_values import Converted, cast, names_of
from shardforge.errors import ConfigError

# LF's generating arguments' defaults (hparams/generating_args.py): it samples unless do_sample is false
GENERATION = {"do_sample": True, "temperature": 0.95, "top_p": 0.7, "top_k": 50, "max_new_tokens": 1024,
              "repetition_penalty": 1.0}  # fmt: skip
PREDICT_KEYS = {"model_name_or_path", "adapter_name_or_path", "stage", "do_predict", "predict_with_generate",
                "finetuning_type", "eval_dataset", "dataset_dir", "template", "cutoff_len", "max_samples",
                "default_system", "output_dir", "seed", *GENERATION}  # fmt: skip


def predict_command(lf: dict[str, Any]) -> Converted:
    """LF's do_predict YAML (predict_with_generate, BLEU / ROUGE) as the equivalent `shardforge eval`."""
    out = Converted({})
    model = lf.get("model_name_or_path")
    if not model:
        raise ConfigError("model_name_or_path: missing (the model to predict with)")
    if not lf.get("eval_dataset"):
        raise ConfigError("eval_dataset: missing (LLaMA-Factory predicts on eval_dataset)")
    if not cast("predict_with_generate", bool, lf.get("predict_with_generate", False)):
        out.unsupported.append(
            "predict_with_generate: false (prediction by logits; shardforge eval generates)"
        )
    adapters = names_of(lf["adapter_name_or_path"]) if lf.get("adapter_name_or_path") else []
    if len(adapters) > 1:
        raise ConfigError(f"adapter_name_or_path: {len(adapters)} adapters; shardforge eval takes one")
    folder = Path(str(lf.get("dataset_dir", "data")))
    gen = {k: lf.get(k, v) for k, v in GENERATION.items()}
    parts = ["shardforge", "eval", str(model), "--data", ",".join(names_of(lf["eval_dataset"])),
             "--dataset-info", str(folder / "dataset_info.json")]  # fmt: skip
    if adapters:
        parts += ["--adapter", adapters[0]]
    if lf.get("template") == "chatml":
        parts += ["--template", "chatml"]
    elif lf.get("template") in GENERIC_TEMPLATES:
        out.unsupported.append(f"template: {lf['template']} (LF's generic {lf['template']} format)")
    parts += ["--cutoff-len", str(cast("cutoff_len", int, lf.get("cutoff_len", 2048)))]
    for key, flag in (("max_samples", "--max-samples"), ("default_system", "--system"), ("seed", "--seed")):
        if lf.get(key) is not None:
            parts += [flag, str(lf[key])]
    parts += ["--max-new-tokens", str(cast("max_new_tokens", int, gen["max_new_tokens"]))]
    if cast("do_sample", bool, gen["do_sample"]):
        sampling = {
            "--temperature": ("temperature", float),
            "--top-p": ("top_p", float),
            "--top-k": ("top_k", int),
        }
        for flag, (key, kind) in sampling.items():
            parts += [flag, str(cast(key, kind, gen[key]))]
    else:
        parts += ["--temperature", "0"]
    if float(gen["repetition_penalty"]) != 1.0:
        parts += ["--repetition-penalty", str(cast("repetition_penalty", float, gen["repetition_penalty"]))]
    parts += ["--out", str(lf.get("output_dir", "eval"))]
    out.command = shlex.join(parts)
    for key in lf:
        if key not in PREDICT_KEYS:
            out.notes.append(f"{key}: not part of the equivalent command")
    return out


def export_or_chat_command(lf: dict[str, Any]) -> Converted:
    """LF's merge / export YAML as `shardforge export`, its inference YAML as `shardforge chat`."""
    model = lf.get("model_name_or_path")
    if not model:
        raise ConfigError("model_name_or_path: missing (the model to export or chat with)")
    adapters = names_of(lf["adapter_name_or_path"]) if lf.get("adapter_name_or_path") else []
    if len(adapters) > 1:
        raise ConfigError(f"adapter_name_or_path: {len(adapters)} adapters; shardforge merges one at a time")
    out = Converted({})
    if "export_dir" in lf:
        source = adapters[0] if adapters else model
        base = f" --base {shlex.quote(str(model))}" if adapters else ""
        merge = " --merge" if adapters else ""
        out.command = (
            f"shardforge export {shlex.quote(str(source))} --to {shlex.quote(str(lf['export_dir']))}"
        )
        out.command += merge + base
        if lf.get("export_quantization_bit"):
            out.unsupported.append("export_quantization_bit: quantized export (GPTQ)")
    else:
        out.command = f"shardforge chat {shlex.quote(str(model))}"
        if adapters:
            out.command += f" --adapter {shlex.quote(adapters[0])}"
        if lf.get("infer_backend", "huggingface") not in ("huggingface", "hf"):
            out.notes.append(f"infer_backend: {lf['infer_backend']} -> shardforge's own engine")
    known = {"model_name_or_path", "adapter_name_or_path", "export_dir", "infer_backend", "template",
             "trust_remote_code", "finetuning_type", "export_size", "export_device", "export_legacy_format",
             "export_quantization_bit"}  # fmt: skip
    for key in lf:
        if key not in known:
            out.notes.append(f"{key}: not part of the equivalent command")
    return out
