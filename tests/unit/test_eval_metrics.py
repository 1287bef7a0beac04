"""`shardforge eval`'s BLEU/ROUGE are LLaMA-Factory's: the same numbers as LF's own `ComputeSimilarity` (LF
0.9.5's train/sft/metric.py, imported from the reference tree) on the same decoded strings."""

from __future__ import annotations

import importlib
import sys
import types

import jieba  # noqa: F401  (pinned in the dev extra)
import nltk  # noqa: F401  (pinned in the dev extra)
import numpy as np
import pytest
import rouge_chinese  # noqa: F401  (pinned in the dev extra)

from shardforge.eval.similarity import item_scores, similarity

# English and Chinese pairs, an exact match, an empty prediction, one with no words at all (punctuation and
# spaces only), and a label that is empty
PAIRS = [
    ("The sum is 42.", "The sum is 42."),
    ("The sum is 41, I think.", "The sum is 42."),
    ("Paris is the capital of France", "The capital of France is Paris."),
    ("", "An empty prediction scores zero."),
    ("   ", "Whitespace only."),
    ("今天天气很好，我们去公园散步吧。", "今天天气不错，我们去公园走走。"),
    ("我喜欢机器学习", "我非常喜欢深度学习和机器学习"),
    ("hello 世界", "hello world 世界"),
    ("a b c d e f", ""),
]


def _lf_compute_similarity():
    """LF's ComputeSimilarity class, imported from its source without LF's package __init__ files (they
    import every trainer): the parent packages are put in place as bare packages over LF's folders; the
    transformers hook LF's extras/packages.py installs on import is put back afterwards."""
    from tests.lf.reference_env import reference

    lf_package = reference().src / "src" / "llamafactory"  # made on first use, as tests/lf's are
    import transformers.utils.import_utils as import_utils

    original = import_utils._is_package_available
    added = []
    try:
        for name, folder in (
            ("llamafactory", lf_package),
            ("llamafactory.train", lf_package / "train"),
            ("llamafactory.train.sft", lf_package / "train" / "sft"),
        ):
            if name not in sys.modules:
                package = types.ModuleType(name)
                package.__path__ = [str(folder)]
                sys.modules[name] = package
                added.append(name)
        metric = importlib.import_module("llamafactory.train.sft.metric")
        return metric.ComputeSimilarity
    finally:
        import_utils._is_package_available = original


class _StringTokenizer:
    """A tokenizer whose token i decodes to the i-th string: LF's metric then scores exactly these strings."""

    pad_token_id = 0

    def __init__(self, strings: list[str]) -> None:
        self.strings = ["", *strings]

    def batch_decode(self, rows, skip_special_tokens: bool = True) -> list[str]:
        return ["".join(self.strings[int(t)] for t in row if int(t) != self.pad_token_id) for row in rows]


def test_bleu_rouge_equal_llamafactorys_compute_similarity():
    from transformers import EvalPrediction

    ComputeSimilarity = _lf_compute_similarity()
    preds, labels = [p for p, _ in PAIRS], [t for _, t in PAIRS]
    tokenizer = _StringTokenizer(preds + labels)
    n = len(PAIRS)
    # each row one token (its string), padded with LF's IGNORE_INDEX as a generation's labels are
    pred_ids = np.array([[1 + i, -100] for i in range(n)])
    label_ids = np.array([[-100, 1 + n + i] for i in range(n)])
    theirs = ComputeSimilarity(tokenizer=tokenizer)(EvalPrediction(predictions=pred_ids, label_ids=label_ids))
    ours = similarity(preds, labels)
    assert set(ours) == {f"predict_{k}" for k in theirs}
    for key, value in theirs.items():
        assert ours[f"predict_{key}"] == value, key  # the same arithmetic: equal, not close


def test_scores_that_pin_the_formulas():
    """Values LF's formulas give, kept so a changed package version shows up here too."""
    assert item_scores("The sum is 42.", "The sum is 42.") == {
        "rouge-1": 100.0, "rouge-2": 100.0, "rouge-l": 100.0, "bleu-4": 100.0,
    }  # fmt: skip
    empty = item_scores("", "An empty prediction scores zero.")
    assert empty == {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0, "bleu-4": 0.0}
    words = item_scores("   ", "Whitespace only.")  # characters to BLEU, but no words to ROUGE
    assert words["rouge-1"] == words["rouge-l"] == 0.0
    partial = item_scores("我喜欢机器学习", "我非常喜欢深度学习和机器学习")
    assert 0 < partial["bleu-4"] < 100 and 0 < partial["rouge-1"] < 100


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 predictions for 1 labels"):
        similarity(["a", "b"], ["a"])
