"""A run's data, built from its config: the packing the model allows, the train and eval rows through the
dataset cache (or a stream), the batch source that splits each global batch over ranks and micro-steps, and
the report `shardforge data prepare` prints.

The objective is taken as it is declared (objectives/base.py: `name`, `group_size`, `collate`,
`encoder(tokenizer, data)`); `how` says how its records are read (objectives.reading_of)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shardforge.config.data_schema import DataSection
from shardforge.config.schema import Config
from shardforge.data.batch_source import BatchSource, DatasetSource
from shardforge.data.cache import DatasetCache, code_fingerprint, default_root, file_fingerprint
from shardforge.data.examples import Encoder
from shardforge.data.formats import Reading
from shardforge.data.images import ImageEncoder, ImageReader, image_processor
from shardforge.data.loader import RowSet, build_datasets
from shardforge.data.stream import StreamSource, stream_shards
from shardforge.errors import ConfigError, DataError, ModelError
from shardforge.log import get_logger
from shardforge.models.build import check_model_source, model_source
from shardforge.models.generic.model import packs_per_document
from shardforge.models.io import PROCESSOR_FILES

log = get_logger(__name__)


class EncodingObjective(Protocol):
    """What the data layer reads of an objective (objectives/base.py: `Objective` implements it): its name,
    how many sequences a group holds, and its encoder. The data layer sits below objectives/."""

    @property
    def name(self) -> str: ...

    @property
    def group_size(self) -> int: ...

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder: ...


@dataclass(frozen=True)
class BatchSplit:
    """How each global batch is split: `micro_batch` groups per micro-step, `grad_accum` micro-steps, over
    `dp` data-parallel ranks, of which this is `dp_rank`."""

    micro_batch: int
    grad_accum: int
    dp: int
    dp_rank: int

    def astuple(self) -> tuple[int, int, int, int]:
        return self.micro_batch, self.grad_accum, self.dp, self.dp_rank

    @property
    def global_batch(self) -> int:
        """Groups per optimizer step."""
        return self.micro_batch * self.grad_accum * self.dp


@dataclass(frozen=True)
class Collation:
    """How rows become micro-batches: the objective's collate, the pad id, and the multiple of which every
    row width is (sequence and context parallel, pipeline schedules)."""

    collate: Callable[..., Any]
    pad_id: int
    multiple: int


def packing_for(cfg: Config, shape: Any) -> Config:
    """The config with packing off where the model cannot keep packed documents apart (a generic-backend
    family not verified to attend per document), said once."""
    if not (str(shape.family).startswith("hf:") and cfg.data.packing and not packs_per_document(shape.hf)):
        return cfg
    log.info(
        f"data.packing is off: the generic backend's per-document attention is not verified for "
        f"{shape.model_type} (docs/families.md), so rows are padded (one example each)"
    )
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"packing": False})})


def build_data(
    cfg: Config, tokenizer: Any, objective: EncodingObjective, how: Reading, builder: bool | None = None
) -> tuple[RowSet | None, RowSet | None]:
    """Train and eval rows through the dataset cache (local rank 0 builds it, unless `builder` says). With
    data.streaming the training files are streamed (no train rows here) and only the eval files cached. An
    objective that samples its own rows (`how.reader` prompt) has none."""
    data = cfg.data
    if how.reader == "prompt":
        return None, None
    if data.streaming:
        if objective.group_size > 1:
            raise ConfigError(
                f"data.streaming: objective {objective.name} trains on groups of {objective.group_size} "
                f"sequences, which a stream does not keep together; set data.streaming=false"
            )
        shards = stream_shards(data.train, how)  # errors in the file list show before any step
        log.info(
            f"train data: streamed from {len(shards)} file(s), {data.stream_window} records packed together"
        )
        if not data.eval:
            return None, None
        only_eval = data.model_copy(update={"train": data.eval, "eval": [], "streaming": False})
        evaluation, _ = _cached_rows(cfg, only_eval, tokenizer, objective, how, builder, ("eval",))
        return None, evaluation
    return _cached_rows(cfg, data, tokenizer, objective, how, builder, ("train", "eval"))


def _cached_rows(
    cfg: Config,
    data: DataSection,
    tokenizer: Any,
    objective: EncodingObjective,
    how: Reading,
    builder: bool | None,
    names: tuple[str, ...],
) -> tuple[RowSet, RowSet | None]:
    """The rows of `data` (its train and eval files, called `names`) through the dataset cache."""
    encoder = record_encoder(cfg, objective, tokenizer, data)
    cache, encoders = None, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks of this node that encode
    if data.cache:
        root = Path(data.cache_dir) if data.cache_dir else default_root()
        builder = int(os.environ.get("LOCAL_RANK", "0")) == 0 if builder is None else builder
        cache, encoders = DatasetCache(root, builder), 1
    workers = data.workers or max(1, len(os.sched_getaffinity(0)) // encoders)
    identity = encoding_identity(tokenizer, objective, how, cfg)
    # LLaMA-Factory's blocks start with BOS where its tokenizer adds one (transformers' add_bos_token)
    head = tokenizer.bos_token_id if data.pt_blocks and getattr(tokenizer, "add_bos_token", False) else None
    rows = build_datasets(
        data, how, encoder, cfg.train.seed, objective.group_size, cache, identity, workers, head
    )
    for what, part in zip(names, rows, strict=False):
        if part is not None:
            log.info(f"{what} data: {describe_rows(part, cfg)}")
    return rows


def record_encoder(cfg: Config, objective: EncodingObjective, tokenizer: Any, data: DataSection) -> Encoder:
    """The objective's encoder, taking images where the model is a vision-language one (its image
    processor from the model folder) and refusing them, by record, where it is not."""
    return ImageEncoder(objective.encoder(tokenizer, data), *record_images(cfg, tokenizer, data))


def record_images(cfg: Config, tokenizer: Any, data: DataSection) -> tuple[ImageReader | None, str]:
    """How the model reads a record's images (its image processor, data's pixel limits), or None and why
    it cannot (a text model; a vision-language one without its image processor or image tokens, which
    only data with images needs)."""
    name = str(cfg.model.path or cfg.model.preset)
    shape = check_model_source(cfg.model, weights=False)
    if not shape.takes_images:
        return None, f"the model ({name}) is a text model; train a vision-language one (docs/vision.md)"
    try:
        prompt = shape.image_prompt(tokenizer)
        processor = image_processor(str(cfg.model.path))
    except (ModelError, DataError) as exc:
        return None, f"the model ({name}) cannot read them: {exc}"
    return ImageReader(processor, prompt, data.image_max_pixels, data.image_min_pixels), ""


def encoding_identity(tokenizer: Any, objective: EncodingObjective, how: Reading, cfg: Config) -> dict:
    """What encoding depends on besides the data: the tokenizer (its files, size and chat template), the
    objective (its settings and code) and the encoding code."""
    folder = Path(getattr(tokenizer, "name_or_path", "") or ".")
    tokenizer_files = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    code = [
        Path(inspect.getfile(cls))
        for cls in type(objective).__mro__
        if cls.__module__.startswith("shardforge")
    ]
    model = Path(cfg.model.path) if cfg.model.path else None  # its image processor and image tokens
    processor = [model / n for n in (*PROCESSOR_FILES, "config.json") if model and (model / n).is_file()]
    return {
        "tokenizer": (
            file_fingerprint(tokenizer_files),
            len(tokenizer),
            getattr(tokenizer, "chat_template", None),
        ),
        "images": file_fingerprint(processor),
        "objective": (objective.name, objective.group_size, how.reader, cfg.method.model_dump()),
        "code": code_fingerprint(code),
    }


def describe_rows(rows: RowSet, cfg: Config) -> str:
    fill = rows.num_tokens / (len(rows.rows) * cfg.data.max_length)
    mode = f"packed into {len(rows.rows)} rows ({fill:.0%} full)" if cfg.data.packing else "one per row"
    if rows.group_size > 1:
        mode = f"{rows.num_groups} groups of {rows.group_size} rows"
    return (
        f"{rows.stats.summary()}; {len(rows.examples)} examples, {rows.num_tokens} tokens, "
        f"{rows.num_targets} targets, {mode}"
    )


def build_batch_source(
    cfg: Config,
    rows: RowSet | None,
    objective: EncodingObjective,
    how: Reading,
    tokenizer: Any,
    split: BatchSplit,
    collation: Collation,
) -> BatchSource:
    """The training rows' source: the cached rows in a seeded global order, or the stream."""
    c = collation
    if rows is not None:
        return DatasetSource(rows, cfg.train.seed, *split.astuple(), c.collate, c.pad_id, c.multiple)
    encoder = record_encoder(cfg, objective, tokenizer, cfg.data)
    return StreamSource(
        cfg.data, how, encoder, cfg.train.seed, split.astuple(), c.collate, c.pad_id, c.multiple
    )


def prepare_data(cfg: Config, objective: EncodingObjective, how: Reading) -> dict[str, Any]:
    """Build the dataset cache ahead of a job (`shardforge data prepare`) and report what it holds: per
    split, records, sequences, tokens, targets, truncation, drops, rows, fill and a histogram of sequence
    lengths."""
    if not cfg.data.cache:
        raise ConfigError("data.cache=false: there is no dataset cache to prepare (set data.cache=true)")
    _, tokenizer = model_source(cfg.model)
    rows = build_data(cfg, tokenizer, objective, how, builder=True)
    report = {}
    for what, part in zip(("train", "eval"), rows, strict=True):
        if part is None:
            continue
        lengths = part.examples.lengths
        edges = [0, *(2**k for k in range(4, 17)), 2**62]  # tokens per sequence: 0-16, 16-32, ... 64k+
        counts, _ = np.histogram(lengths, bins=edges)
        report[what] = {
            "records": part.stats.records,
            "sequences": len(part.examples),
            "tokens": part.num_tokens,
            "targets": part.num_targets,
            "truncated": part.stats.truncated,
            "dropped_no_target": len(part.stats.dropped_no_target),
            "rows": len(part.rows),
            "row_fill": part.num_tokens / (len(part.rows) * cfg.data.max_length),
            "length_histogram": {
                f"{lo}-{hi}": int(n) for lo, hi, n in zip(edges, edges[1:], counts, strict=False) if n
            },
        }
    return report
