"""The rules for LLaMA-Factory's data keys: data sets, template, packing, mixing and the held-out split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardforge.config.lf_tables import GENERIC_TEMPLATES
from shardforge.config.lf_values import Converted, Rule, cast, names_of, put
from shardforge.errors import ConfigError


def read_datasets(key: str) -> Rule:
    def rule(value: Any, lf: dict, out: Converted) -> None:
        if value is None:
            return
        folder = str(lf["dataset_dir"])
        if folder == "ONLINE" or (
            folder.count("/") == 1 and not Path(folder).exists() and "://" not in folder
        ):
            out.unsupported.append(
                f"dataset_dir: {folder} (datasets from a hub; shardforge reads local files: download the "
                "dataset and point dataset_dir at its folder)"
            )
            return
        limit = lf["max_samples"]
        specs = [
            {"name": n, "dataset_info": str(Path(folder) / "dataset_info.json"),
             **({"max_samples": cast("max_samples", int, limit)} if limit else {})}
            for n in names_of(value)
        ]  # fmt: skip
        put(out.config, key, specs)

    return rule


def read_template(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        out.notes.append("template unset: the tokenizer's own chat template (data.template: auto)")
        put(out.config, "data.template", "auto")
    elif value == "chatml":
        put(out.config, "data.template", "chatml")
    elif value in GENERIC_TEMPLATES:
        out.unsupported.append(
            f"template: {value} (LF's generic {value} format is not a model's own template)"
        )
    else:
        put(out.config, "data.template", "auto")
        out.notes.append(f"template: {value} -> data.template: auto (the model's own chat template)")


def read_packing(value: Any, lf: dict, out: Converted) -> None:
    packing = lf["stage"] == "pt" if value is None else cast("packing", bool, value)
    neat = cast("neat_packing", bool, lf["neat_packing"])
    put(out.config, "data.packing", packing or neat)
    if lf["stage"] == "pt" and packing and not neat:  # LF concatenates the documents and cuts blocks
        put(out.config, "data.pt_blocks", True)
    if value or neat:  # LF's data arguments: packing asked for shortens rows by one (not pt's default)
        put(out.config, "data.max_length", cast("cutoff_len", int, lf["cutoff_len"]) - 1)
        out.notes.append("packing: true -> data.max_length is cutoff_len - 1, as LF's data arguments make it")
    if packing and not neat and lf["stage"] != "pt":
        out.notes.append(
            "packing: LF lets a packed row's documents attend to each other; shardforge's packed rows "
            "attend per document (as LF's neat_packing)"
        )


def read_mixing(value: Any, lf: dict, out: Converted) -> None:
    if value not in ("concat", "interleave_under", "interleave_over"):
        mixes = "concat, interleave_under, interleave_over"
        out.unsupported.append(f"mix_strategy: {value} (shardforge mixes {mixes})")
        return
    put(out.config, "data.mix", value)
    probs = lf["interleave_probs"]
    if probs is not None:
        put(out.config, "data.mix_probs", [cast("interleave_probs", float, p) for p in names_of(probs)])


def read_val_size(value: Any, lf: dict, out: Converted) -> None:
    size = float(value)
    if size >= 1:
        if size != int(size):
            raise ConfigError(f"val_size: {value}: a fraction below 1 or a whole number of examples")
        put(out.config, "data.eval_count", int(size))
    elif size > 0:
        put(out.config, "data.eval_fraction", size)
