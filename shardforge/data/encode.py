"""Records -> encoded examples in flat arrays, in worker processes for large data sets.

Encoding (chat-template rendering, then one tokenizer batch call per chunk of records) runs in `workers`
processes, each given the encoder once (an objective's encoder is a plain, picklable object) and chunks of
records in order; the parent applies truncation, drops groups without targets and counts, in record order,
so the result, the counts and the first error are the same whatever the number of workers. Sequences travel
and are kept as numpy arrays, never as Python lists of ints (about 37 bytes per token), so the parent's
memory grows by about 5 bytes per token while it encodes.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from shardforge.data.examples import Encoder, EncodeStats, ImageArrays
from shardforge.data.formats import Record
from shardforge.data.store import ExampleStore
from shardforge.data.truncate import cut_each, cut_shared_prompt, cut_turns
from shardforge.data.truncate import last_reply_only as last_reply_only_of
from shardforge.errors import DataError

# A spawned worker starts in about 2-3 s (torch, the tokenizer): with fewer records each, it costs more than
# it saves (one process encodes about 2500 records/s here).
RECORDS_PER_WORKER = 5000
CHUNK = 256  # records per task: small enough to balance, large enough to amortize the pickling

# a record's sequences: (uint32 ids, bool target flags, its images or None)
Encoded = list[tuple[np.ndarray, np.ndarray, ImageArrays | None]]

_ENCODER: Encoder | None = None  # a worker's encoder, set once by its initializer


def _start_worker(encoder_bytes: bytes) -> None:
    global _ENCODER
    _ENCODER = pickle.loads(encoder_bytes)


def _encode_records(encode: Encoder, records: list[Record]) -> list[Encoded]:
    """Each record's sequences as arrays, from the encoder's batch call."""
    groups = encode.encode_batch(records)
    return [
        [
            (
                np.asarray(seq[0], dtype=np.uint32),
                np.asarray(seq[1], dtype=bool),
                seq[2] if len(seq) > 2 else None,
            )
            for seq in group
        ]
        for group in groups
    ]


def _encode_chunk(records: list[Record]) -> list[Encoded]:
    assert _ENCODER is not None
    return _encode_records(_ENCODER, records)


def _encoded(records: Sequence[Record], encode: Encoder, workers: int) -> Iterator[Encoded]:
    """Each record's sequences, in order: in this process, or in `workers` spawned processes."""
    workers = min(workers, len(records) // RECORDS_PER_WORKER)
    if workers > 1:
        try:
            encoder_bytes = pickle.dumps(encode)
        except (pickle.PicklingError, AttributeError, TypeError):  # a closure: encode here
            workers = 1
    chunks = [list(records[i : i + CHUNK]) for i in range(0, len(records), CHUNK)]
    if workers <= 1:
        for chunk in chunks:
            yield from _encode_records(encode, chunk)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds threads (gloo, torch)
    with ProcessPoolExecutor(workers, context, initializer=_start_worker, initargs=(encoder_bytes,)) as pool:
        for encoded in pool.map(_encode_chunk, chunks):
            yield from encoded


def encode_all(
    records: Sequence[Record],
    encode: Encoder,
    max_length: int,
    truncation: str,
    what: str,
    group_size: int = 1,
    workers: int = 1,
    shared_prompt: bool = False,
    last_reply_only: bool = False,
) -> tuple[ExampleStore, EncodeStats]:
    """Tokenize records into groups of `group_size` sequences (consecutive in the result); cut sequences
    longer than max_length (counted, or an error when truncation=error; `lf`: prompt and reply each, as
    LLaMA-Factory does, truncate.py, a group's replies after one prompt when `shared_prompt`);
    `last_reply_only`: a conversation's targets on its last reply alone (data.mask_history, whose `lf` cut
    keeps the last turns first). A group with a sequence left without any target is dropped whole, so
    groups never lose a member."""
    stats = EncodeStats(records=len(records))
    tokens, flags, lengths, targets, tags, images = [], [], [], [], [], []
    for record, encoded in zip(records, _encoded(records, encode, workers), strict=True):
        media = [seq[2] for seq in encoded]
        group = [(ids, trained) for ids, trained, _ in encoded]
        if len(group) != group_size:
            raise DataError(f"{record.source}: encoded into {len(group)} sequences, expected {group_size}")
        if truncation == "lf" and any(len(ids) > max_length for ids, _ in group):
            before = sum(len(ids) for ids, _ in group)
            if group_size == 1:
                group = [cut_turns(group[0], max_length, last_first=last_reply_only)]
            elif shared_prompt:
                group = cut_shared_prompt(group, max_length)
            else:
                group = [cut_each(seq, max_length) for seq in group]
            stats.truncated += 1
            stats.tokens_cut += before - sum(len(ids) for ids, _ in group)
        kept = []
        if last_reply_only:
            group = [last_reply_only_of(seq) for seq in group]
        for ids, trained in group:
            if len(ids) > max_length:
                if truncation == "error":
                    raise DataError(
                        f"{record.source}: {len(ids)} tokens > data.max_length={max_length} "
                        f"(raise data.max_length or set data.truncation=right)"
                    )
                stats.truncated += 1
                stats.tokens_cut += len(ids) - max_length
                ids, trained = ids[:max_length], trained[:max_length]
            kept.append((ids, trained, int(trained[1:].sum())))
        for (ids, _, _), pictures in zip(kept, media, strict=True):
            if pictures is not None and int((ids == pictures.token).sum()) != pictures.tokens:
                raise DataError(
                    f"{record.source}: truncated to data.max_length={max_length}, it keeps "
                    f"{int((ids == pictures.token).sum())} of its {pictures.tokens} image tokens: an "
                    f"image is never cut; raise data.max_length or lower data.image_max_pixels"
                )
        if any(count == 0 for _, _, count in kept):
            stats.dropped_no_target.append(record.source)
            continue
        for (ids, trained, count), pictures in zip(kept, media, strict=True):
            images.append(pictures)
            tokens.append(ids)
            flags.append(trained)
            lengths.append(len(ids))
            targets.append(count)
            tags.append(int(bool(record.label)))
    if not lengths:
        first = f" (e.g. {stats.dropped_no_target[0]})" if stats.dropped_no_target else ""
        raise DataError(
            f"{what}: no example has a trainable token after formatting and truncation{first}; check the "
            f"template, data.max_length and data.train_on_prompt"
        )
    return ExampleStore.from_arrays(tokens, flags, lengths, targets, tags, images), stats
