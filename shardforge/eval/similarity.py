"""BLEU-4 and ROUGE-1/2/L of generated answers against their labels, computed as LLaMA-Factory's
`ComputeSimilarity` does (LF 0.9.5, train/sft/metric.py), so a `shardforge eval` number can be set beside one
from LF's `do_predict`: ROUGE's F-scores over jieba's words (0 when either side has no words), BLEU-4 over the
characters with nltk's smoothing method 3, each item's score x 100 rounded to 4 places, then the mean of the
items. The packages are pinned (the `eval` extra): their tokenizers and smoothing decide the numbers."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from shardforge.errors import ShardforgeError
from shardforge.extras import MissingExtra, install_hint

KEYS = ("rouge-1", "rouge-2", "rouge-l", "bleu-4")


def _libraries():
    """jieba, nltk's BLEU and rouge_chinese, imported on first use (an optional extra)."""
    try:
        import jieba
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
        from rouge_chinese import Rouge
    except ImportError as exc:
        hint = install_hint("eval")
        raise MissingExtra(f"BLEU/ROUGE need {exc.name}: {hint} (jieba, nltk, rouge-chinese)") from None
    jieba.setLogLevel(logging.WARNING)  # its dictionary's load is announced on stderr otherwise
    return jieba, SmoothingFunction, sentence_bleu, Rouge


def require_libraries() -> None:
    """The one-line error for a missing package before a model loads and predicts for nothing."""
    _libraries()


def item_scores(pred: str, label: str) -> dict[str, float]:
    """One prediction's four scores, in percent rounded to 4 places (LF's per-item values)."""
    jieba, SmoothingFunction, sentence_bleu, Rouge = _libraries()
    hypothesis = list(jieba.cut(pred))
    reference = list(jieba.cut(label))
    if len(" ".join(hypothesis).split()) == 0 or len(" ".join(reference).split()) == 0:
        rouge = {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0}
    else:
        found = Rouge().get_scores(" ".join(hypothesis), " ".join(reference))[0]
        rouge = {k: v["f"] for k, v in found.items()}
    scores = {k: round(v * 100, 4) for k, v in rouge.items()}
    bleu = sentence_bleu([list(label)], list(pred), smoothing_function=SmoothingFunction().method3)
    scores["bleu-4"] = round(bleu * 100, 4)
    return scores


def similarity(preds: Sequence[str], labels: Sequence[str], prefix: str = "predict_") -> dict[str, float]:
    """The mean of each score over the pairs, named as LF's metrics file has them (`predict_bleu-4`, ...)."""
    if len(preds) != len(labels):
        raise ValueError(f"{len(preds)} predictions for {len(labels)} labels")
    if not preds:
        raise ShardforgeError("no predictions to score")
    items = [item_scores(p, t) for p, t in zip(preds, labels, strict=True)]
    return {f"{prefix}{k}": float(np.mean([item[k] for item in items])) for k in KEYS}
