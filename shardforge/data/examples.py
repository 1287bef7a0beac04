"""Tokenized training examples: token ids plus which tokens are targets, with truncation counted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shardforge.data.formats import Record
from shardforge.errors import DataError


@dataclass(frozen=True)
class Example:
    """One document. `trained[t]` says whether token t is a target (it is predicted from tokens < t)."""

    input_ids: tuple[int, ...]
    trained: tuple[bool, ...]
    source: str

    @property
    def num_targets(self) -> int:
        return sum(self.trained[1:])


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


Sequence_ = tuple[list[int], list[bool]]  # token ids and per-token target flags
Encoder = Callable[[Record], list[Sequence_]]  # a record -> the sequences of its group


def encode_all(
    records: Sequence[Record],
    encode: Encoder,
    max_length: int,
    truncation: str,
    what: str,
    group_size: int = 1,
) -> tuple[list[Example], EncodeStats]:
    """Tokenize records into groups of `group_size` sequences (consecutive in the result); cut sequences
    longer than max_length (counted, or an error when truncation=error). A group with a sequence left
    without any target is dropped whole, so groups never lose a member."""
    stats = EncodeStats(records=len(records))
    examples: list[Example] = []
    for record in records:
        group = []
        for ids, trained in encode(record):
            if len(ids) > max_length:
                if truncation == "error":
                    raise DataError(
                        f"{record.source}: {len(ids)} tokens > data.max_length={max_length} "
                        f"(raise data.max_length or set data.truncation=right)"
                    )
                stats.truncated += 1
                stats.tokens_cut += len(ids) - max_length
                ids, trained = ids[:max_length], trained[:max_length]
            group.append(Example(tuple(ids), tuple(trained), record.source))
        if len(group) != group_size:
            raise DataError(f"{record.source}: encoded into {len(group)} sequences, expected {group_size}")
        if any(example.num_targets == 0 for example in group):
            stats.dropped_no_target.append(record.source)
            continue
        examples.extend(group)
    if not examples:
        first = f" (e.g. {stats.dropped_no_target[0]})" if stats.dropped_no_target else ""
        raise DataError(
            f"{what}: no example has a trainable token after formatting and truncation{first}; check the "
            f"template, data.max_length and data.train_on_prompt"
        )
    return examples, stats
