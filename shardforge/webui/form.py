"""The config as a form: one field per config key, generated from the schema, and the two directions
between form values and the YAML tree `shardforge train` reads. The web UI holds no config knowledge of its
own: a key added to the schema appears in the form, and validation is the config's own.

Scalars are typed widgets (text, number, checkbox, a choice for Literal types); structured values (dataset
lists, rewards, tuples, optional sub-sections such as train.profile) are YAML text fields."""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from shardforge.config import Config, load_config
from shardforge.config.stages import Choices
from shardforge.errors import ConfigError

Kind = Literal["text", "int", "number", "bool", "choice", "yaml"]
REQUIRED = object()  # the default of a key without one (data.train)

# What a command line has that the config tree does not: launch options, not config keys.
CLI_ONLY = {
    "--nproc": "processes to start (the Runs tab's 'processes')",
    "--max-restarts": "elastic restarts (multi-node jobs: shardforge launch)",
}


@dataclass(frozen=True)
class FormField:
    key: str  # the dotted config key
    kind: Kind
    default: Any
    optional: bool = False  # None is a value (an empty field)
    choices: tuple = ()

    @property
    def section(self) -> str:
        """Its group in the form: the top-level section, or method's sub-section (method.lora, ...)."""
        parts = self.key.split(".")
        if len(parts) == 1:
            return "run"
        return ".".join(parts[:2]) if parts[0] == "method" and len(parts) > 2 else parts[0]

    @property
    def elem_id(self) -> str:
        """The HTML id of its widget (what browser tests find it by)."""
        return "cfg-" + self.key.replace(".", "-").replace("_", "-")


def form_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[FormField]:
    """Every leaf key of the config schema, in schema order."""
    out: list[FormField] = []
    for name, info in model.model_fields.items():
        key, annotation = prefix + name, info.annotation
        args = typing.get_args(annotation)
        is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        members = [a for a in args if a is not type(None)] if is_union else [annotation]
        optional = is_union and type(None) in args
        section = len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel)
        if section and not optional:
            out += form_fields(members[0], key + ".")
            continue
        default = info.get_default(call_default_factory=True)
        default = REQUIRED if default is PydanticUndefined else default
        runtime = [m for m in info.metadata if isinstance(m, Choices)]  # e.g. the registered stages
        if runtime:
            out.append(FormField(key, "choice", default, optional, runtime[0]()))
            continue
        if optional and members == [bool]:  # three values: unset (None), true, false; a checkbox has two
            out.append(FormField(key, "choice", default, optional, (None, True, False)))
            continue
        out.append(FormField(key, _kind(members), default, optional, _choices(members)))
    return out


def _kind(members: list) -> Kind:
    if len(members) != 1:
        return "yaml"  # a union (Literal["all"] | list[str]) is written as YAML
    t = members[0]
    if typing.get_origin(t) is typing.Annotated:  # a path type (config/paths.py): str and its FileRef
        t = typing.get_args(t)[0]
    if typing.get_origin(t) is Literal:
        return "choice"
    return {bool: "bool", int: "int", float: "number", str: "text"}.get(t, "yaml")


def _choices(members: list) -> tuple:
    return (
        typing.get_args(members[0]) if len(members) == 1 and typing.get_origin(members[0]) is Literal else ()
    )


FIELDS = form_fields()
BY_KEY = {f.key: f for f in FIELDS}


def widget_value(field: FormField, value: Any) -> Any:
    """A config value as its widget shows it (choices as text, YAML fields as YAML text, None as empty)."""
    if field.kind == "yaml":
        if value is None or value is REQUIRED:
            return ""
        if isinstance(value, list):
            value = [_lean(item) for item in value]
        elif isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        elif isinstance(value, tuple):
            value = list(value)
        return yaml.safe_dump(value, default_flow_style=None, sort_keys=False).strip()
    if field.kind == "choice":
        return str(value)
    if field.kind == "text":
        return "" if value is None else str(value)
    return value


def parse_value(field: FormField, raw: Any) -> Any:
    """A widget's value as the config value; a value that cannot be one is a ConfigError naming the key."""
    if raw is None or (isinstance(raw, str) and not raw.strip() and field.kind != "bool"):
        if field.optional or field.kind == "yaml":
            return None
        if field.kind == "text":
            return ""
        raise ConfigError(f"{field.key}: a value is needed")
    if field.kind == "choice":
        by_text = {str(c): c for c in field.choices}
        if str(raw) not in by_text:
            raise ConfigError(f"{field.key}: {raw!r} is not one of {', '.join(by_text)}")
        return by_text[str(raw)]
    if field.kind == "int":
        number = float(raw)
        if number != int(number):
            raise ConfigError(f"{field.key}: {raw!r} is not a whole number")
        return int(number)
    if field.kind == "number":
        return float(raw)
    if field.kind == "yaml":
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{field.key}: not valid YAML ({exc})") from None
    return raw


def tree_from_values(values: dict[str, Any]) -> dict:
    """Form values (by key) -> the config tree of the keys that differ from the schema's defaults: the YAML
    `shardforge train` is given. Keys not in `values` keep their defaults."""
    tree: dict = {}
    for key, raw in values.items():
        field = BY_KEY[key]
        value = parse_value(field, raw)
        if field.default is not REQUIRED and _same(value, field.default):
            continue
        if field.default is REQUIRED and value is None:
            continue
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _same(value: Any, default: Any) -> bool:
    """Whether a parsed value is the schema's default (list entries compared as the schema reads them)."""
    if isinstance(default, list) and default and isinstance(default[0], BaseModel):
        entry = type(default[0])
        try:
            value = [_lean(entry.model_validate(v)) for v in value]
        except (TypeError, ValueError):
            return False
        default = [_lean(d) for d in default]
    return value == (list(default) if isinstance(default, tuple) else default)


def values_from_config(config: Config) -> dict[str, Any]:
    """A validated config -> every field's widget value (what loading a YAML into the form shows)."""
    out = {}
    for field in FIELDS:
        node: Any = config
        for part in field.key.split("."):
            node = getattr(node, part)
        out[field.key] = widget_value(field, node)
    return out


def values_from_tree(tree: dict) -> dict[str, Any]:
    """A YAML tree as written (not validated: a preset may name a folder a run has yet to make) -> every
    field's widget value, the schema's default where the tree is silent."""
    out = {}
    for field in FIELDS:
        node: Any = tree
        for part in field.key.split("."):
            node = node.get(part, field.default) if isinstance(node, dict) else field.default
        out[field.key] = widget_value(field, node)
    return out


def _lean(item: Any) -> Any:
    """A list entry as written: only what differs from its defaults (a dataset: path and format)."""
    return item.model_dump(mode="json", exclude_defaults=True) if isinstance(item, BaseModel) else item


def check(tree: dict) -> Config:
    """The config's own validation of a form's tree (its errors name the key and what is allowed)."""
    return load_config(None, base=tree)


def to_yaml(tree: dict) -> str:
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)


def command_line(yaml_path: str, nproc: int) -> str:
    procs = f" --nproc {nproc}" if nproc > 1 else ""
    return f"shardforge train {yaml_path}{procs}"


_KEY_IN_MESSAGE = re.compile(r"[a-z_]+(?:\.[a-z_0-9\[\]]+)+|output_dir")


def field_of_error(message: str) -> str | None:
    """The form field a config error is about (the first key it names: errors lead with their subject), to
    show the message next to that field."""
    for named in _KEY_IN_MESSAGE.findall(message):
        key = named.split("[")[0]
        if key in BY_KEY:
            return key
        inside = [f.key for f in FIELDS if f.kind == "yaml" and key.startswith(f.key + ".")]
        if inside:
            return inside[0]
    return None


def read_yaml_file(path: Path) -> dict[str, Any]:
    """A config file -> widget values; its errors are the config's own (file, line, key)."""
    return values_from_config(load_config(str(path)))
