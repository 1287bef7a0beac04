"""Images into a vision-language model's sequences, for any objective: each `<image>` mark of a record
becomes the family's image prompt with one image token per merged patch (the count the image processor's
patch grid gives), the images are regularized as LLaMA-Factory does (its data.image_max_pixels /
image_min_pixels resize, RGB, Qwen2-VL's 28-pixel minimum side and aspect ratio limit) and run through the
model's own image processor once, and the patches travel with the sequence into the dataset cache. Image
tokens are never targets."""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from shardforge.data.examples import Encoder, ImageArrays, Sequence_
from shardforge.data.formats import Record
from shardforge.data.media import IMAGE
from shardforge.errors import DataError
from shardforge.models.common.images import ImagePrompt


def open_image(ref: str, src: str) -> Any:
    """A PIL image from a path or a data URL; a missing, corrupt or non-image file is an error naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        if ref.startswith("data:"):
            data = base64.b64decode(ref.split(",", 1)[1], validate=True)
            image = Image.open(io.BytesIO(data))
        else:
            image = Image.open(ref)
        image.load()
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, binascii.Error, ValueError) as exc:
        shown = f"{ref[:40]}..." if ref.startswith("data:") else ref
        raise DataError(f"{src}: cannot read image {shown} ({exc})") from None
    return image


def regularize(image: Any, max_pixels: int, min_pixels: int, prompt: ImagePrompt) -> Any:
    """LLaMA-Factory's resize into [min_pixels, max_pixels] (keeping the aspect ratio), then RGB, then the
    family's side and aspect limits (Qwen2-VL's plugin: a side of at least 28, an aspect ratio up to 200)."""
    for limit, too in ((max_pixels, lambda a: a > max_pixels), (min_pixels, lambda a: a < min_pixels)):
        if too(image.width * image.height):
            factor = math.sqrt(limit / (image.width * image.height))
            image = image.resize((max(1, int(image.width * factor)), max(1, int(image.height * factor))))
    if image.mode != "RGB":
        image = image.convert("RGB")
    side = prompt.min_side
    if side and min(image.width, image.height) < side:
        image = image.resize((max(image.width, side), max(image.height, side)))
    if prompt.max_aspect and image.width / image.height > prompt.max_aspect:
        image = image.resize((image.height * 180, image.height))
    if prompt.max_aspect and image.height / image.width > prompt.max_aspect:
        image = image.resize((image.width, image.width * 180))
    return image


@dataclass(frozen=True)
class ImageReader:
    """A model's images as its processor makes them, and its prompt's text for each: what training's
    encoder and the inference faces share."""

    processor: Any  # the model's image processor (transformers', PIL-based)
    prompt: ImagePrompt
    max_pixels: int = 768 * 768
    min_pixels: int = 32 * 32

    def process(self, refs: tuple[str, ...] | list[str], src: str) -> tuple[np.ndarray, np.ndarray]:
        """Images (paths or data URLs) as [rows, features] patches and [images, 3] grids. A processor with
        patch grids (Qwen2-VL) gives both; one of whole resized images (LLaVA's [images, channels, height,
        width]) is kept an image per row, its grid (1, height, width) in the tower's patches; one of tiles
        (LLaVA-NeXT's [images, most tiles, channels, height, width] and each image's size) is kept a tile
        per row, its grid (tiles, height, width) with the size in pixels, which its tokens depend on."""
        images = [
            regularize(open_image(ref, src), self.max_pixels, self.min_pixels, self.prompt) for ref in refs
        ]
        out = self.processor(images=images, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if "image_grid_thw" in out:
            return pixels, np.asarray(out["image_grid_thw"], np.int64)
        if "image_sizes" in out:  # tiles, padded to the most any image has: each image's own are kept
            sizes = np.asarray(out["image_sizes"], np.int64)
            tiling = self.prompt.tiling
            if tiling is None:
                raise DataError(f"{src}: the image processor cuts images into tiles; the model does not")
            tiles = [tiling.tiles(h, w) for h, w in sizes.tolist()]
            kept = [pixels[i, :n].reshape(n, -1) for i, n in enumerate(tiles)]
            grids = np.asarray([[n, h, w] for n, (h, w) in zip(tiles, sizes.tolist(), strict=True)], np.int64)
            return np.concatenate(kept), grids
        side = self.prompt.patch  # whole images: their grid of the tower's patches
        grids = np.array([[1, pixels.shape[-2] // side, pixels.shape[-1] // side]] * len(pixels), np.int64)
        return pixels.reshape(len(pixels), -1), grids

    def filler(self, grids: np.ndarray) -> Callable[[str], str]:
        """A function that writes each `<image>` mark of the texts it is given, in order, as the next
        image's prompt text."""
        texts = iter(self.prompt.text(tuple(g)) for g in grids.tolist())

        def fill(text: str) -> str:
            parts = text.split(IMAGE)
            return "".join(p + (next(texts) if i < len(parts) - 1 else "") for i, p in enumerate(parts))

        return fill

    def tokens(self, grids: np.ndarray) -> int:
        return sum(self.prompt.tokens(tuple(g)) for g in grids.tolist())


@dataclass(frozen=True)
class ImageEncoder(Encoder):
    """Wraps an objective's encoder: a record with images is encoded with its marks expanded, its image
    tokens untrained, and its patches attached; a record without passes through."""

    inner: Encoder
    reader: ImageReader | None  # None: the model reads no images
    refusal: str = "the model reads no images"  # why, said where a record has some

    def encode_one(self, record: Record) -> list[Sequence_]:
        expanded, arrays = with_images(record, self.reader, self.refusal)
        if arrays is None:
            encoded = self.inner.encode_batch([record])[0]
            if self.reader is not None:
                for ids, *_ in encoded:
                    check_image_tokens(ids, self.reader.prompt.token_id, 0, record.source)
            return encoded
        out: list[Sequence_] = []
        for ids, trained, *_ in self.inner.encode_batch([expanded])[0]:
            ids = np.asarray(ids, dtype=np.int64)
            check_image_tokens(ids, arrays.token, arrays.tokens, record.source)
            out.append((ids, np.asarray(trained, dtype=bool) & (ids != arrays.token), arrays))
        return out

    def __call__(self, record: Record) -> list[Sequence_]:
        return self.encode_one(record)


def with_images(
    record: Record, reader: ImageReader | None, refusal: str
) -> tuple[Record, ImageArrays | None]:
    """The record with each `<image>` mark (in message order, then the rejected reply's) written as its
    image's prompt text, and its images as the model's processor makes them; a record without images as it
    is (None). `reader` None: the model reads no images (`refusal` says why), and a record with some is
    refused."""
    if not record.images:
        return record, None
    if reader is None:
        raise DataError(f"{record.source}: the record has images, but {refusal}; or drop the images")
    pixels, grids = reader.process(record.images, record.source)
    patches = sum(reader.prompt.patches(tuple(g)) for g in grids.tolist())
    arrays = ImageArrays(pixels, grids, reader.prompt.token_id, reader.tokens(grids), patches)
    fill = reader.filler(grids)
    messages = tuple({**m, "content": fill(m["content"])} for m in record.messages or ())
    rejected = fill(record.rejected) if record.rejected else record.rejected
    return replace(record, messages=messages, rejected=rejected), arrays


def check_image_tokens(ids: Any, token: int, tokens: int, source: str) -> None:
    """A sequence must hold every image token of its record's images (`tokens` of them; none in a reply),
    and a record without images none: its text spelling the image token would be taken for an image's."""
    held = int((np.asarray(ids) == token).sum())
    if held == tokens:
        return
    if not tokens:
        raise DataError(
            f"{source}: its text holds the model's image token {held} time(s) but the record has no images; "
            f"give each image as an <image> mark with an images list, or drop the token from the text"
        )
    raise DataError(
        f"{source}: a sequence of this record holds {held} of its images' {tokens} image tokens; images go "
        f"in the prompt (a reply of a pair or a KTO completion takes none)"
    )


def image_processor(folder: str | Path) -> Any:
    """The model folder's image processor (its preprocessor_config.json), PIL-based: transformers'
    AutoProcessor would also want a video processor, which needs torchvision."""
    from transformers import AutoImageProcessor

    if not (Path(folder) / "preprocessor_config.json").is_file():
        raise DataError(
            f"{folder}: a vision-language model needs its image processor (preprocessor_config.json)"
        )
    try:
        processor = AutoImageProcessor.from_pretrained(folder)
    except ImportError as exc:  # transformers 5.17's processors need torchvision; 5.24 (tested) reads PIL
        import transformers

        raise DataError(
            f"{folder}: transformers {transformers.__version__} cannot load this image processor here: "
            f"{' '.join(str(exc).split())[:300]} (install the torchvision built for your torch, or the "
            "tested transformers, constraints.txt)"
        ) from None
    if getattr(processor, "do_pan_and_scan", False):
        raise DataError(
            f"{folder}: its image processor cuts images into pan-and-scan crops (do_pan_and_scan: true in "
            f"preprocessor_config.json), which shardforge does not read yet; set it false"
        )
    return processor
