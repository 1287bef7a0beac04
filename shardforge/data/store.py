"""Encoded sequences in flat arrays, in memory or memory-mapped from the dataset cache.

Token ids are one uint32 array, target flags one bit-packed array, and each sequence is a slice given by an
offsets array, so a data set costs about 4 bytes per token (Python tuples cost about 37) and a memory-mapped
one costs each rank only the pages it reads. Sequences come out as `Example`s one at a time, for the few
that a micro-batch holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shardforge.data.examples import Example, ImageArrays
from shardforge.errors import DataError

ARRAYS = ("tokens", "flags", "offsets", "num_targets", "tags")
IMAGE_ARRAYS = (
    "pixels",
    "pixel_offsets",
    "grids",
    "grid_offsets",
    "patches",
)  # only where sequences have images


class ExampleStore(Sequence[Example]):
    """tokens [total] uint32, flags [ceil(total/8)] uint8 (np.packbits of the target flags), offsets [n+1]
    int64, num_targets [n] int64 (targets of each sequence: flags after its first token), tags [n] int8
    (each sequence's record tag, see Example). With images: pixels [patches, features] float32 (the image
    processor's output), pixel_offsets [n+1] int64 (each sequence's patches), grids [images, 3] int64 (each
    image's patch grid), grid_offsets [n+1] int64 (each sequence's images), patches [n] int64 (each
    sequence's tower patches: the tower's work)."""

    def __init__(
        self,
        tokens: np.ndarray,
        flags: np.ndarray,
        offsets: np.ndarray,
        num_targets: np.ndarray,
        tags: np.ndarray | None = None,
        pixels: np.ndarray | None = None,
        pixel_offsets: np.ndarray | None = None,
        grids: np.ndarray | None = None,
        grid_offsets: np.ndarray | None = None,
        patches: np.ndarray | None = None,
    ):
        self.tokens, self.flags, self.offsets, self.num_targets = tokens, flags, offsets, num_targets
        self.tags = np.zeros(len(num_targets), dtype=np.int8) if tags is None else tags
        self.pixels, self.pixel_offsets, self.grids, self.grid_offsets = (
            pixels,
            pixel_offsets,
            grids,
            grid_offsets,
        )
        self._patches = patches

    @property
    def has_images(self) -> bool:
        return self.grids is not None

    @classmethod
    def from_examples(cls, examples: Sequence[Example]) -> ExampleStore:
        return cls.from_arrays(
            [np.asarray(e.input_ids, dtype=np.uint32) for e in examples],
            [np.asarray(e.trained, dtype=bool) for e in examples],
            [len(e.input_ids) for e in examples],
            [e.num_targets for e in examples],
            [e.tag for e in examples],
        )

    @classmethod
    def from_arrays(
        cls,
        tokens: list[np.ndarray],
        flags: list[np.ndarray],
        lengths: list[int],
        targets: list[int],
        tags: list[int] | None = None,
        images: list[ImageArrays | None] | None = None,
    ) -> ExampleStore:
        """From each sequence's token ids and target flags (as encoding produces them), and its images
        where any sequence has some."""
        offsets = _offsets(lengths)
        media: tuple[np.ndarray | None, ...] = (None,) * 5
        if images is not None and any(i is not None for i in images):
            pixels = [i.pixels for i in images if i is not None]
            grids = [i.grids for i in images if i is not None]
            media = (
                np.concatenate(pixels).astype(np.float32, copy=False),
                _offsets([0 if i is None else len(i.pixels) for i in images]),
                np.concatenate(grids).astype(np.int64, copy=False),
                _offsets([0 if i is None else len(i.grids) for i in images]),
                np.asarray([0 if i is None else i.patches for i in images], dtype=np.int64),
            )
        return cls(
            np.concatenate(tokens).astype(np.uint32, copy=False),
            np.packbits(np.concatenate(flags)),
            offsets,
            np.asarray(targets, dtype=np.int64),
            None if tags is None else np.asarray(tags, dtype=np.int8),
            *media,
        )

    @classmethod
    def load(cls, folder: Path) -> ExampleStore:
        """Memory-map the arrays `save` wrote (read-only: every rank shares the page cache). A cache written
        before sequences had tags has none: all 0."""
        arrays = {
            name: np.load(folder / f"{name}.npy", mmap_mode="r")
            for name in ARRAYS + IMAGE_ARRAYS
            if name in ARRAYS[:4] or (folder / f"{name}.npy").is_file()
        }
        if "grids" in arrays and "patches" not in arrays:
            raise DataError(
                f"{folder}: a dataset cache with images but no patches.npy (an older shardforge's): delete "
                f"the folder, and the next run rebuilds it"
            )
        return cls(**arrays)

    def save(self, folder: Path) -> list[Path]:
        paths = []
        for name in ARRAYS + (IMAGE_ARRAYS if self.has_images else ()):
            path = folder / f"{name}.npy"
            np.save(path, np.asarray(self.patches if name == "patches" else getattr(self, name)))
            paths.append(path)
        return paths

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def patches(self) -> np.ndarray:
        """Each sequence's tower patches (ImagePrompt.patches of its images): the tower's work."""
        if not self.has_images or self._patches is None:
            return np.zeros(len(self), dtype=np.int64)
        return np.asarray(self._patches)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def arrays(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence i's token ids (int64) and target flags (bool), sliced from the flat arrays."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"example {i} of {len(self)}")
        i %= len(self)
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        first_byte, last_byte = start // 8, (end + 7) // 8
        bits = np.unpackbits(self.flags[first_byte:last_byte])[start - 8 * first_byte :][: end - start]
        return self.tokens[start:end].astype(np.int64), bits.astype(bool)

    def images(self, i: int) -> ImageArrays | None:
        """Sequence i's images (its patches and their grids), or None."""
        if not self.has_images:
            return None
        i %= len(self)
        first, last = int(self.grid_offsets[i]), int(self.grid_offsets[i + 1])
        if first == last:
            return None
        start, end = int(self.pixel_offsets[i]), int(self.pixel_offsets[i + 1])
        return ImageArrays(np.asarray(self.pixels[start:end]), np.asarray(self.grids[first:last]))

    def __getitem__(self, i: int | slice) -> Example | list[Example]:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        ids, flags = self.arrays(i)
        i %= len(self)
        return Example(tuple(ids.tolist()), tuple(flags.tolist()), f"#{i}", int(self.tags[i]))


def _offsets(lengths: list[int]) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    return offsets
