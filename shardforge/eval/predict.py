"""Prediction with generation, as LLaMA-Factory's `do_predict` + `predict_with_generate` does it: each
record's conversation up to its last reply is the prompt (rendered by the chat template, with the generation
prompt), the reply is the label, our inference engine generates every answer (continuous batching), and the
answers are written as LF writes them (`generated_predictions.jsonl`: prompt, predict, label) with LF's
BLEU-4 / ROUGE metrics (`predict_results.json`, in percent; similarity.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shardforge.config.data_schema import DatasetSpec
from shardforge.data.formats import Record
from shardforge.data.loader import read_dataset
from shardforge.data.templates import ChatTemplate, render, tokenize
from shardforge.data.truncate import infer_seqlen
from shardforge.errors import ConfigError, DataError
from shardforge.eval.similarity import similarity
from shardforge.infer.engine import Engine
from shardforge.infer.sampling import SamplingParams
from shardforge.log import get_logger

log = get_logger(__name__)

PREDICTIONS = "generated_predictions.jsonl"  # LF's file names
METRICS = "predict_results.json"


@dataclass(frozen=True)
class Item:
    """One record to predict: where it came from, its prompt's token ids and its label (the reply)."""

    source: str
    prompt_ids: list[int]
    label: str


@dataclass(frozen=True)
class Prediction:
    prompt: str  # the prompt's tokens decoded with their special tokens (LF's "prompt")
    predict: str
    label: str
    tokens: list[int]  # the generated tokens (not written: LF's file has the text)


def dataset_specs(
    entries: Sequence[str],
    dataset_info: str | Path | None = None,
    fmt: str | None = None,
    max_samples: int | None = None,
) -> list[DatasetSpec]:
    """The data sets a command names, as a training config's `data` entries: a file or folder path (its
    format detected, or `fmt`), or a dataset_info.json entry's name (`dataset_info`: the file, or the folder
    holding it, LF's `dataset_dir`)."""
    info = Path(dataset_info) if dataset_info is not None else None
    if info is not None and info.is_dir():
        info = info / "dataset_info.json"
    if info is not None and not info.is_file():
        raise DataError(f"dataset_info file not found: {info}")
    specs = []
    for entry in entries:
        fields: dict[str, Any] = {"max_samples": max_samples}
        if Path(entry).exists():
            fields |= {"path": entry, "format": fmt}
        elif info is not None:
            fields |= {"name": entry, "dataset_info": str(info)}
        else:
            raise DataError(
                f"data {entry!r}: no such file or folder (a dataset_info.json entry's name needs "
                "--dataset-info FILE_OR_FOLDER)"
            )
        try:
            specs.append(DatasetSpec(**fields))
        except ValidationError as exc:
            raise ConfigError(f"data {entry!r}: {exc.errors()[0]['msg']}") from None
    return specs


def read_records(specs: Sequence[DatasetSpec], system: str | None = None) -> list[Record]:
    """The data sets' conversations, read as SFT reads them (`system`: data.default_system); before any
    model loads, so a wrong name or file fails first."""
    from shardforge.objectives import build_objective, reading_of

    how = reading_of(build_objective("sft"), system)
    return [r for spec in specs for r in read_dataset(spec, how)]


def prompt_items(
    records: Sequence[Record], tokenizer: Any, template: ChatTemplate, cutoff_len: int | None = None
) -> list[Item]:
    """Each conversation's prompt (all but its last reply, as the template renders it for the assistant's
    turn) and label: the reply as the template writes it after the prompt (its end-of-turn marks
    included), decoded without special tokens, as LLaMA-Factory's labels are (chatml's reply ends in a
    newline). `cutoff_len`: prompt and label shortened as LF's `infer_seqlen` cuts them (data/truncate.py)."""
    prompts, wholes, replies = [], [], []
    for record in records:
        messages = list(record.messages or ())
        last = messages[-1] if messages else {}
        if last.get("role") != "assistant":
            raise DataError(f"{record.source}: the conversation does not end with a reply to compare with")
        if record.images:  # the engine here reads text: images would be left out of the prompt silently
            raise DataError(
                f"{record.source}: the record has images; shardforge eval --data predicts on text records"
            )
        prompts.append(render(tokenizer, template, messages[:-1], generation_prompt=True, tools=record.tools))
        wholes.append(render(tokenizer, template, messages, tools=record.tools))
        replies.append(last.get("content") or "")
    items = []
    encoded = zip(
        tokenize(tokenizer, prompts), tokenize(tokenizer, wholes), tokenize(tokenizer, replies), strict=True
    )
    for record, ((ids, _), (whole, _), (reply, _)) in zip(records, encoded, strict=True):
        prompt_ids, whole_ids = ids.tolist(), whole.tolist()
        # the template's reply after the prompt; a template that rewrites earlier turns: the reply alone
        same = whole_ids[: len(prompt_ids)] == prompt_ids
        label_ids = whole_ids[len(prompt_ids) :] if same else reply.tolist()
        if cutoff_len is not None:
            kept_prompt, kept_label = infer_seqlen(len(prompt_ids), len(label_ids), cutoff_len)
            prompt_ids, label_ids = prompt_ids[:kept_prompt], label_ids[:kept_label]
        label = tokenizer.decode(label_ids, skip_special_tokens=True)
        if not prompt_ids:
            raise DataError(f"{record.source}: the prompt has no tokens (cutoff_len {cutoff_len})")
        items.append(Item(record.source, prompt_ids, label))
    return items


def predict(engine: Engine, items: Sequence[Item], params: SamplingParams) -> list[Prediction]:
    """Every item's answer from the engine, all at once (continuous batching), with progress logged; an
    answer has at most `params.max_tokens` tokens and ends at the model's context."""
    last = [time.perf_counter()]

    def progress(done: int, total: int) -> None:
        if time.perf_counter() - last[0] > 5 or done == total:
            log.info(f"predicted {done}/{total}")
            last[0] = time.perf_counter()

    each = []
    for item in items:  # an answer ends at the model's context, as LF's generation would stop being useful
        room = engine.context - len(item.prompt_ids)
        if room < 1:
            raise DataError(
                f"{item.source}: the prompt has {len(item.prompt_ids)} tokens, the model's context is "
                f"{engine.context}; cut prompts with --cutoff-len (LLaMA-Factory's cutoff_len)"
            )
        each.append(replace(params, max_tokens=min(params.max_tokens or room, room)))
    completions = engine.generate([item.prompt_ids for item in items], each, progress)
    tokenizer = engine.tokenizer
    return [
        Prediction(
            tokenizer.decode(item.prompt_ids, skip_special_tokens=False),
            done[0].text,
            item.label,
            done[0].tokens,
        )
        for item, done in zip(items, completions, strict=True)
    ]


def write_predictions(predictions: Sequence[Prediction], out: Path, seconds: float) -> dict[str, float]:
    """`generated_predictions.jsonl` and `predict_results.json` in `out` (LF's files); returns the metrics."""
    metrics = similarity([p.predict for p in predictions], [p.label for p in predictions])
    metrics |= {
        "predict_samples": len(predictions),
        "predict_runtime": round(seconds, 4),
        "predict_samples_per_second": round(len(predictions) / max(seconds, 1e-9), 3),
    }
    out.mkdir(parents=True, exist_ok=True)
    partial = out / (PREDICTIONS + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for p in predictions:
            f.write(
                json.dumps({"prompt": p.prompt, "predict": p.predict, "label": p.label}, ensure_ascii=False)
            )
            f.write("\n")
    partial.replace(out / PREDICTIONS)
    # as transformers' save_metrics writes LF's: indented 4, keys sorted
    (out / METRICS).write_text(json.dumps(metrics, indent=4, sort_keys=True) + "\n", encoding="utf-8")
    return metrics
