"""A LLaMA-Factory YAML read with LLaMA-Factory's meaning (`shardforge convert lf.yaml`).

A training YAML is resolved as LF's own parser resolves it: every key we map starts from LF's default
(`LF_DEFAULTS`: LF 0.9.5's hparams dataclasses and the transformers `TrainingArguments` it inherits), the
YAML's values on top, and the whole result is written out, so a key left out means LF's value, not ours.
Each mapped key has a rule (RULES); keys whose counterpart changes nothing in a shardforge run are noted
(NOTHING_TO_DO); a key we cannot honour is *unsupported*: the command refuses the file with the list (what
each would need) unless `--allow-unsupported`, and a key at LF's "off" value is harmless. tests/lf/ checks
the table and the rules against LF's own parser, and the schedule against transformers' schedulers.

A merge / export or inference YAML (LF's `examples/merge_lora`, `examples/inference`) is not a training run:
it converts to the equivalent `shardforge export` / `chat` command.
"""

from __future__ import annotations

from typing import Any

from shardforge.config.lf_commands import export_or_chat_command, predict_command
from shardforge.config.lf_rules import READ_WITH, RULES
from shardforge.config.lf_tables import INFER_KEYS, LF_DEFAULTS, NOTHING_TO_DO, OFF, WANTS
from shardforge.config.lf_train_rules import read_deepspeed
from shardforge.config.lf_values import Converted, cast
from shardforge.errors import ConfigError


def is_training(lf: dict[str, Any]) -> bool:
    """A training YAML, as opposed to LF's merge / export and inference ones."""
    return "stage" in lf or not any(k in lf for k in INFER_KEYS)


def convert_lf(lf: dict[str, Any]) -> Converted:
    """`lf`: the LF YAML's mapping, resolved against LF_DEFAULTS (relative paths in it, a deepspeed JSON
    among them, are read from the working directory, as LF reads them)."""
    if not is_training(lf):
        return export_or_chat_command(lf)
    if cast("do_predict", bool, lf.get("do_predict", False)) and not cast(
        "do_train", bool, lf.get("do_train", False)
    ):
        return predict_command(lf)
    if not lf.get("model_name_or_path"):
        raise ConfigError("model_name_or_path: missing (LLaMA-Factory needs the model to train)")
    given = {k: v for k, v in lf.items() if v is not None or k not in LF_DEFAULTS}
    resolved = {**LF_DEFAULTS, **given}
    out = Converted({"data": {"truncation": "lf"}})  # LF's processors shorten prompt and reply each
    for key, rule in RULES.items():
        if key in resolved:
            rule(resolved[key], resolved, out)
    if "deepspeed" in given:
        read_deepspeed(given["deepspeed"], out)
    for key, value in given.items():
        if key in RULES or key in READ_WITH:
            continue
        if key in NOTHING_TO_DO:
            out.notes.append(f"{key}: nothing to set ({NOTHING_TO_DO[key]})")
        elif value in (None, False, "", OFF.get(key, False)) or (key == "report_to" and value == "none"):
            out.notes.append(f"{key}: {value!r} is LF's default, nothing to set")
        else:
            out.unsupported.append(f"{key}: {WANTS.get(key, 'no counterpart in shardforge')}")
    return out
