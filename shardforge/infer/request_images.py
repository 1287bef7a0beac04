"""Images in a chat request to the server (OpenAI's image_url parts), as a vision-language model reads
them: a data URL always; a local path (or file:// URL) only under the server's --image-root, never outside
it; a remote URL never (the server is not assumed to reach the network). Every refusal is a 400 naming the
part, never a 500."""

from __future__ import annotations

from pathlib import Path

import torch

from shardforge.data.images import ImageReader
from shardforge.errors import DataError
from shardforge.infer.http import APIError
from shardforge.infer.protocol import Message
from shardforge.models.common.images import ImageInputs


def _bad(message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param="messages")


def image_source(url: str, root: Path | None) -> str:
    """A part's url as the image reader takes it (a data URL, or a resolved path under `root`)."""
    if url.startswith("data:"):
        return url
    if url.startswith(("http://", "https://")):
        raise _bad(
            f"image {url[:80]!r}: remote image URLs are not fetched (the server does not reach the network); "
            f"send the image as a data URL (data:image/png;base64,...)"
        )
    if root is None:
        raise _bad(
            f"image {url[:80]!r}: local image paths are read only under the server's --image-root, and none "
            f"is set; send the image as a data URL"
        )
    path = Path(url.removeprefix("file://")).expanduser()
    resolved = (path if path.is_absolute() else root / path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise _bad(f"image {url[:80]!r} is outside the server's --image-root")
    if not resolved.is_file():
        raise _bad(f"image {url[:80]!r}: no such file under the server's --image-root")
    return str(resolved)


def request_images(
    messages: list[Message], reader: ImageReader | None, root: Path | None, model: str
) -> tuple[list[dict], ImageInputs | None]:
    """The chat as the template takes it (each image part written as the model's image prompt) and the
    images as the engine takes them; a text-only chat comes back as it is, with None."""
    urls = [url for m in messages for url in m.image_urls()]
    if not urls:
        return _chat(messages, [m.text() for m in messages]), None
    if reader is None:
        raise _bad(
            f"{model} reads no images (a text model, or a vision-language one without its image processor "
            f"or image tokens: the server's log says which); send text only"
        )
    refs = [image_source(url, root) for url in urls]
    try:
        pixels, grids = reader.process(refs, "messages")
    except DataError as exc:
        raise _bad(str(exc)) from None
    fill = reader.filler(grids)
    chat = _chat(messages, [fill(m.marked_text()) for m in messages])
    return chat, ImageInputs(torch.from_numpy(pixels), torch.from_numpy(grids))


def _chat(messages: list[Message], texts: list[str]) -> list[dict]:
    """The messages as the template takes them, with these texts (tool calls and results carried over)."""
    try:
        return [m.for_template(text) for m, text in zip(messages, texts, strict=True)]
    except DataError as exc:
        raise _bad(str(exc)) from None
