"""Which config keys name files or folders: a key's type says so (`FileRef` in its annotation), so that a
face that must keep every path inside one folder (the web UI's --root) finds them all, including keys added
later, without a list of names to keep in step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel


@dataclass(frozen=True)
class FileRef:
    """Marks a key whose value names a file or folder. `words`: values that are settings, not paths (auto,
    none, ...); `urls`: a URL with a scheme other than file:// is a valid value and names no local path;
    `model`: a model to load (an HF folder, an adapter on its base, a run or checkpoint), which may read
    other folders besides (infer/load.py: sources_read)."""

    words: tuple[str, ...] = ()
    urls: bool = False
    model: bool = False

    def path(self, value: str) -> str | None:
        """The local path the value names, or None."""
        if value in self.words:
            return None
        if self.urls and "://" in value:
            return value.removeprefix("file://") if value.startswith("file://") else None
        return value


def file_refs(section: BaseModel, prefix: str = "") -> list[tuple[str, str, FileRef]]:
    """(dotted key, path, its mark) of every FileRef-typed key's value in `section` and the sections under
    it."""
    out: list[tuple[str, str, FileRef]] = []
    for name, info in type(section).model_fields.items():
        value = getattr(section, name)
        key = f"{prefix}{name}"
        mark = _file_ref([*info.metadata, *_metadata(info.annotation)])
        if mark is not None and isinstance(value, str) and (path := mark.path(value)) is not None:
            out.append((key, path, mark))
        elif isinstance(value, BaseModel):
            out += file_refs(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += file_refs(item, f"{key}[{i}].")
    return out


def _metadata(annotation: Any) -> list[Any]:
    """The Annotated metadata inside a type (`Annotated[str, FileRef()] | None` keeps it in the union)."""
    if get_origin(annotation) is Annotated:
        inner, *metadata = get_args(annotation)
        return [*metadata, *_metadata(inner)]
    return [m for arg in get_args(annotation) for m in _metadata(arg)]


def _file_ref(metadata: list[Any]) -> FileRef | None:
    return next((m for m in metadata if isinstance(m, FileRef)), None)
