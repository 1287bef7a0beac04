"""LLaMA-Factory dataset_info.json support.

A named entry is only translated into (file path, format, FieldMap); the readers in formats.py do the rest,
so LF datasets get exactly the same validation and error messages as ours.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardforge.data.formats import FieldMap, Reading, default_fields
from shardforge.errors import DataError

HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
# LF column name -> our FieldMap attribute, per formatting.
ALPACA_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "system": "system",
    "history": "history",
    "tools": "tools",
    "images": "images",
}
CHAT_COLUMNS = {"messages": "messages", "system": "system", "tools": "tools", "images": "images"}
TAG_KEYS = (
    "role_tag",
    "content_tag",
    "user_tag",
    "assistant_tag",
    "system_tag",
    "observation_tag",
    "function_tag",
)
MAX_LISTED = 20


@dataclass(frozen=True)
class ResolvedEntry:
    """What a dataset_info entry means for our readers."""

    path: Path
    format: str
    fields: FieldMap


def load_dataset_info(info_path: str | Path) -> dict[str, Any]:
    """Parse dataset_info.json, with file:line:column on syntax errors."""
    path = Path(info_path)
    if not path.is_file():
        raise DataError(f"dataset_info file not found: {path} (resolved to {path.resolve()})")
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}); dataset_info is JSON text") from None
    if not isinstance(info, dict):
        raise DataError(f"{path}: expected a JSON object mapping dataset names to entries")
    return info


def resolve_entry(name: str, info_path: str | Path, how: Reading, text_column: str = "text") -> ResolvedEntry:
    """Look up `name` in dataset_info.json and translate its file_name, formatting, columns and tags."""
    info_path = Path(info_path)
    info = load_dataset_info(info_path)
    if name not in info:
        raise DataError(f'{info_path}: no dataset named "{name}"; {_available(name, list(info))}')
    entry = info[name]
    where = f'{info_path}: dataset "{name}"'
    if not isinstance(entry, dict):
        raise DataError(f"{where} is not a JSON object")
    ranking = bool(entry.get("ranking"))
    labelled = isinstance(entry.get("columns"), dict) and "kto_tag" in entry["columns"]
    if labelled != (how.reader == "labelled") and not (labelled and how.reader == "chat"):
        raise DataError(
            f"{where} is KTO data (a kto_tag column); it trains under method.stage: {how.serving('labelled')}"
            if labelled
            else f"{where} has no kto_tag column; method.stage {how.stage} needs each example's label"
        )
    if ranking != (how.reader == "pair"):
        raise DataError(
            f"{where} is preference data (ranking: true); it trains under method.stage: {how.serving('pair')}"
            if ranking
            else f"{where} is not preference data (no ranking: true); method.stage {how.stage} needs pairs"
        )
    if "file_name" not in entry:
        if any(key in entry for key in HUB_KEYS):
            raise DataError(
                f"{where} is a hub dataset; hub datasets cannot be fetched, use a local file (file_name)"
            )
        raise DataError(f"{where} has no file_name")
    path = info_path.parent / str(entry["file_name"])
    if not path.exists():
        raise DataError(
            f"{where}: file_name {entry['file_name']!r} not found at {path} (resolved to {path.resolve()})"
        )

    fmt = entry.get("formatting", "alpaca")
    if fmt not in ("alpaca", "sharegpt", "openai"):
        raise DataError(f"{where} has formatting {fmt!r}; expected alpaca, sharegpt or openai")
    columns = _str_dict(entry.get("columns", {}), f"{where} columns")
    tags = _str_dict(entry.get("tags", {}), f"{where} tags")

    if fmt == "alpaca" and set(columns) == {"prompt"} and how.reader == "text":  # LF pretraining text
        return ResolvedEntry(path, "text", replace(default_fields("text"), text=columns["prompt"]))

    allowed = ALPACA_COLUMNS if fmt == "alpaca" else CHAT_COLUMNS
    if ranking:
        allowed = {**allowed, "chosen": "chosen", "rejected": "rejected"}
    if labelled:
        allowed = {**allowed, "kto_tag": "label"}
    if how.reader == "prompt":  # a prompt's reference answer (verifiable rewards)
        allowed = {**allowed, "answer": "answer"}
    unknown = sorted(set(columns) - set(allowed))
    if unknown:
        raise DataError(f"{where}: unsupported columns {unknown} for {fmt} (supported: {', '.join(allowed)})")
    fields = replace(default_fields(fmt, text_column), **{allowed[k]: v for k, v in columns.items()})
    if "tools" not in columns:  # LF reads a tools column only where the entry names one
        fields = replace(fields, tools=None)
    if "images" not in columns:  # ... and an images column likewise; its paths are found in media_dir first
        fields = replace(fields, images=None)
    fields = replace(fields, media=info_path.parent)
    if tags and fmt == "alpaca":
        raise DataError(f"{where}: tags only apply to sharegpt/openai formatting, not alpaca")
    return ResolvedEntry(path, fmt, _apply_tags(fields, tags, where))


def _apply_tags(fields: FieldMap, tags: dict[str, str], where: str) -> FieldMap:
    """A given tag replaces our lenient defaults for that role."""
    unknown = sorted(set(tags) - set(TAG_KEYS))
    if unknown:
        raise DataError(f"{where}: unknown tags {unknown} (supported: {', '.join(TAG_KEYS)})")
    changes: dict[str, Any] = {}
    for key, attr in (("role_tag", "role"), ("content_tag", "content")):
        if key in tags:
            changes[attr] = tags[key]
    for key, attr in (
        ("user_tag", "user_roles"),
        ("assistant_tag", "assistant_roles"),
        ("system_tag", "system_roles"),
        ("observation_tag", "observation_roles"),
        ("function_tag", "function_roles"),
    ):
        if key in tags:
            changes[attr] = (tags[key],)
    return replace(fields, **changes)


def _str_dict(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise DataError(f"{what} must be a JSON object of strings, got {json.dumps(value)[:80]}")
    return value


def _available(name: str, names: list[str]) -> str:
    """Every name, closest to the typo first, so the likely intended one is read first."""
    if not names:
        return "the file has no entries"
    ordered = difflib.get_close_matches(name, names, n=len(names), cutoff=0.0)
    more = f", ... ({len(ordered) - MAX_LISTED} more)" if len(ordered) > MAX_LISTED else ""
    return f"available (closest first): {', '.join(ordered[:MAX_LISTED])}{more}"
