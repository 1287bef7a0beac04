"""Images in records: LLaMA-Factory's `images` column (a list of paths, or one path) beside messages whose
text marks each image's place with `<image>`, and OpenAI's content parts (`{"type": "image_url",
"image_url": {"url": ...}}`, a path or a data URL, beside `{"type": "text", ...}` parts). A relative path is
found in the dataset's folder (LLaMA-Factory's media_dir), else from the working folder; a record must mark
as many places as it has images. Videos and audio are refused by name. Nothing is decoded here: the
encoder opens the images (data/images.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardforge.data.values import kind as _kind
from shardforge.errors import DataError

IMAGE = "<image>"  # where an image goes in a message's text (LLaMA-Factory's IMAGE_PLACEHOLDER)
UNSUPPORTED = ("videos", "audios")


def image_refs(obj: dict[str, Any], column: str | None, src: str, media: Path | None) -> tuple[str, ...]:
    """The record's images (resolved paths or data URLs) from its images column; refuses media it does not
    take."""
    for key in UNSUPPORTED:
        if obj.get(key):
            raise DataError(
                f'{src}: the record has "{key}"; shardforge trains on images only (not {key} yet)'
            )
    value = obj.get(column) if column else None
    if value is None or value == []:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
        raise DataError(f'{src}: "{column}" is {_kind(value)}; expected a list of image paths')
    return tuple(resolve_image(v, src, media) for v in items)


def resolve_image(ref: str, src: str, media: Path | None) -> str:
    """A data URL as it is; a path resolved (the dataset's folder first), or an error naming it."""
    if ref.startswith("data:"):
        if ";base64," not in ref[:100] or not ref.startswith("data:image/"):
            raise DataError(
                f"{src}: image {ref[:40]!r}...: a data URL must be data:image/<type>;base64,<data>"
            )
        return ref
    if ref.startswith(("http://", "https://")):
        raise DataError(f"{src}: image {ref!r} is a remote URL; download it and give its path (no network)")
    path = Path(ref).expanduser()
    candidates = [path] if path.is_absolute() else [*([media / path] if media else []), path]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate.resolve())
    tried = " or ".join(str(c.resolve()) for c in candidates)
    raise DataError(f"{src}: image {ref!r} not found (looked for {tried})")


def content_parts(parts: list[Any], src: str, where: str, media: Path | None) -> tuple[str, list[str]]:
    """OpenAI content parts -> the text with `<image>` where each image was, and the images in order."""
    text, images = [], []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise DataError(f'{src}: {where} part {i}: "image_url" needs {{"url": "<path or data URL>"}}')
            text.append(IMAGE)
            images.append(resolve_image(url, src, media))
        elif kind in ("input_audio", "video_url", "file"):
            raise DataError(f"{src}: {where} part {i} is {kind!r}; shardforge trains on text and images only")
        else:
            raise DataError(
                f'{src}: {where} part {i} is {_kind(part)}; expected {{"type": "text", "text": ...}} or '
                '{"type": "image_url", "image_url": {"url": ...}}'
            )
    return "".join(text), images


def check_placeholders(texts: list[str], images: tuple[str, ...], src: str) -> None:
    """As many `<image>` marks in the record's text as it has images (LLaMA-Factory's rule)."""
    marks = sum(t.count(IMAGE) for t in texts)
    if marks != len(images):
        raise DataError(
            f"{src}: {marks} {IMAGE} mark(s) in the messages but {len(images)} image(s); each image needs "
            f"one {IMAGE} where it goes in the text"
        )
