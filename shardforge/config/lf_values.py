"""What every LLaMA-Factory rule shares: the converted result, and values read as LF's parser reads them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardforge.errors import ConfigError


@dataclass
class Converted:
    """What convert_lf gives: a config tree (or, for a YAML that is no training run, a command) and what
    the user is told about it."""

    config: dict[str, Any]  # the shardforge config tree
    notes: list[str] = field(default_factory=list)  # how keys were read, where it is not one to one
    unsupported: list[str] = field(default_factory=list)  # "key: what it would need"
    command: str | None = None  # a merge / inference YAML: the equivalent shardforge command


def put(tree: dict, dotted: str, value: Any) -> None:
    """`value` at a dotted key of the config tree, its sections made on the way."""
    *path, last = dotted.split(".")
    for key in path:
        tree = tree.setdefault(key, {})
    tree[last] = value


def names_of(value: Any) -> list[str]:
    """LF's comma-separated lists (dataset: a,b; lora_target: q_proj,v_proj)."""
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


def cast(key: str, kind: type, value: Any) -> Any:
    """`value` as LF's type for `key`, or a one-line error naming the key (LF's parser refuses it too)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
    else:
        try:
            if kind is int and float(value) != int(float(value)):
                raise ValueError
            return kind(float(value)) if kind is int else kind(value)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{key}: {value!r} is not {'an' if kind is int else 'a'} {kind.__name__}")


Rule = Callable[[Any, dict, Converted], None]
