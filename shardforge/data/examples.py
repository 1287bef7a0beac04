"""Tokenized training examples: token ids plus which tokens are targets, with truncation counted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from shardforge.data.formats import Record


@dataclass(frozen=True)
class Example:
    """One document. `trained[t]` says whether token t is a target (it is predicted from tokens < t); `tag`
    is a small per-sequence number from its record (KTO: 1 for a desirable example, else 0)."""

    input_ids: tuple[int, ...]
    trained: tuple[bool, ...]
    source: str
    tag: int = 0

    @property
    def num_targets(self) -> int:
        return sum(self.trained[1:])


@dataclass(frozen=True)
class ImageArrays:
    """A sequence's images as its model's image processor made them: patches [patches, features] (float32)
    and each image's patch grid [images, 3] (LLaVA-NeXT: tiles, height, width); `token` is the image
    token, of which the sequence holds `tokens` (truncation must not cut into them)."""

    pixels: Any
    grids: Any
    token: int = -1
    tokens: int = 0
    patches: int = 0  # the tower's patches of these images (its work; ImagePrompt.patches)


@dataclass
class EncodeStats:
    records: int = 0
    truncated: int = 0
    tokens_cut: int = 0
    dropped_no_target: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{self.records} records"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to max_length ({self.tokens_cut} tokens cut)")
        if self.dropped_no_target:
            parts.append(f"{len(self.dropped_no_target)} dropped with no trainable token left")
        return ", ".join(parts)


# token ids and per-token target flags (lists or numpy arrays), and the sequence's images where it has some
Sequence_ = tuple[Any, Any] | tuple[Any, Any, ImageArrays]


class Encoder(ABC):
    """A record -> the sequences of its group (`__call__`). `encode_batch` encodes many records at once,
    which encoding calls (an encoder overrides it with a tokenizer's batch call); by default one by one.
    Encoders are plain objects (not closures), so encoding worker processes can receive them."""

    @abstractmethod
    def __call__(self, record: Record) -> list[Sequence_]: ...

    def encode_batch(self, records: list[Record]) -> list[list[Sequence_]]:
        return [self(record) for record in records]
