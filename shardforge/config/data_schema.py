"""The config's data section: the data sets, how records become rows, mixing, the held-out split, caching."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shardforge.config.section import FilePath, Section

DataFormat = Literal["alpaca", "sharegpt", "openai", "text"]


class DatasetSpec(Section):
    """One dataset: a file in a known format, or a named entry of a LLaMA-Factory dataset_info.json."""

    path: FilePath | None = None
    format: DataFormat | None = None
    name: str | None = None
    dataset_info: FilePath | None = None
    text_column: str = "text"
    max_samples: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if self.path is not None and self.name is not None:
            raise ValueError("set either path (+ format) or name (+ dataset_info), not both")
        if self.path is None and self.name is None:
            raise ValueError("a dataset needs path (+ format) or name (+ dataset_info)")
        if self.name is not None and self.dataset_info is None:
            raise ValueError(f"dataset name {self.name!r} needs dataset_info (path to dataset_info.json)")
        return self


class DataSection(Section):
    train: list[DatasetSpec] = Field(min_length=1)
    eval: list[DatasetSpec] = []  # noqa: RUF012 (a pydantic field: copied per instance)
    max_length: int = Field(default=1024, ge=8)
    packing: bool = True
    train_on_prompt: bool = False
    template: Literal["auto", "chatml"] = "auto"
    truncation: Literal["right", "error", "lf"] = "right"
    pt_blocks: bool = False  # pt: documents concatenated and cut in max_length blocks (LLaMA-Factory's)
    default_system: str | None = None  # the system message of conversations that have none
    # passed to the chat template as enable_thinking (Qwen3-style: false puts an empty thought in the prompt
    # and trains without the replies' thoughts; true trains on the thought); None: not passed
    enable_thinking: bool | None = None
    # images of a vision-language model's data resized into this many pixels first (LLaMA-Factory's
    # image_max_pixels / image_min_pixels), then through the model's own image processor
    image_max_pixels: int = Field(default=768 * 768, ge=1)
    image_min_pixels: int = Field(default=32 * 32, ge=1)
    mix: Literal["concat", "interleave_under", "interleave_over"] = "concat"  # several data sets (mixing.py)
    mix_probs: list[float] | None = None  # interleaving: each data set's chance per record (None: in turn)
    mask_history: bool = False  # sft: targets on the last assistant turn only (LLaMA-Factory's)
    eval_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    eval_count: int | None = Field(default=None, ge=1)  # hold out this many records instead (LF's val_size N)
    cache: bool = True  # tokenize once into memory-mapped arrays, reused by later runs and every rank
    cache_dir: FilePath | None = None  # None: $XDG_CACHE_HOME/shardforge/datasets (~/.cache/...)
    workers: int | None = Field(default=None, ge=1)  # encoding processes; None: the cores (shared by a node)
    streaming: bool = False  # read, tokenize and pack the training files on the fly (too large to cache)
    stream_window: int = Field(default=4096, ge=1)  # records shuffled and packed together when streaming

    @model_validator(mode="after")
    def _mixing(self) -> DataSection:
        probs = self.mix_probs
        if probs is None:
            return self
        if self.mix == "concat":
            raise ValueError("data.mix_probs: only with data.mix interleave_under or interleave_over")
        for what, sets in (("train", self.train), ("eval", self.eval)):
            if sets and len(sets) != len(probs):
                raise ValueError(f"data.mix_probs has {len(probs)} values for {len(sets)} data.{what} sets")
        if any(p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
            raise ValueError(f"data.mix_probs {probs}: chances of at least 0 that sum to 1")
        return self
