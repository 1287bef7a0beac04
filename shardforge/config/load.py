"""Read the config: YAML file, then dotted `key=value` overrides, then validation with actionable errors."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shardforge.config.schema import Config, expand_shorthands
from shardforge.errors import ConfigError


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key, so errors can point into the file."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict[str, Any]:
    mapping = loader.construct_mapping(node, deep=True)
    lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return _LineDict(mapping, lines)


class _LineDict(dict):
    """A dict that also knows the YAML line of each key (attribute `key_lines`)."""

    def __init__(self, data: dict, key_lines: dict[str, int]) -> None:
        super().__init__(data)
        self.key_lines = key_lines


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (["train", "lr"], 0.0003); the value is parsed as YAML (so lists and bools work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
    return parts, value


def _set_dotted(tree: dict, parts: list[str], value: Any, text: str) -> None:
    """Set a dotted key; numeric parts index into lists (`data.train.0.max_samples=100`)."""
    node: Any = tree
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {text!r}: {part!r} is not an index of a {len(node)}-item list")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
        else:
            raise ConfigError(f"override {text!r}: {parts[i - 1]!r} is not a section")


def _schema_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at `loc` (for suggesting the closest valid key)."""
    model: Any = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or ()
        candidates = [ann, *args, *[a for arg in args for a in (getattr(arg, "__args__", ()) or ())]]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _line_of(tree: Any, loc: tuple) -> int | None:
    node, line = tree, None
    for part in loc:
        if isinstance(node, dict) and part in node:
            line = getattr(node, "key_lines", {}).get(str(part), line)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            break
    return line


def _explain(exc: ValidationError, tree: dict, source: str, overrides: dict[str, str]) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(tree, loc)
        override = next(
            (
                text
                for k, text in overrides.items()
                if key == k or key.startswith(k + ".") or k.startswith(key + ".")
            ),
            None,
        )
        if override is not None:
            where = f"override {override!r}: "
        else:
            where = f"{source}:{line}: " if line else (f"{source}: " if source else "")
        if err["type"] == "extra_forbidden":
            section = ".".join(str(p) for p in loc[:-1]) or "top level"
            model = _schema_at(loc)
            valid = sorted(model.model_fields) if model else []
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(
                f"{where}unknown key {key!r} in section {section!r}{hint} (valid: {', '.join(valid)})"
            )
        else:
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" = {value!r}"
            lines.append(f"{where}{key}{shown}: {err['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> Config:
    """Build a validated Config from a YAML file (or a dict) plus dotted overrides."""
    source = ""
    tree: dict = copy.deepcopy(base or {})  # overrides must not change the caller's nested dicts
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        try:
            loaded = yaml.load(text, Loader=_LineLoader)  # SafeLoader subclass
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"{where}: not valid YAML: {problem}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}"
            )
        tree = loaded or _LineDict({}, {})
    tree = expand_shorthands(tree)
    applied: dict[str, str] = {}
    for text in overrides or []:
        parts, value = parse_override(text)
        _set_dotted(tree, parts, value, text)
        applied[".".join(parts)] = text
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, tree, source, applied)) from None


def dump_config(config: Config, path: str | Path) -> None:
    """Write the fully resolved config (every default filled in) as YAML."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json")
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
