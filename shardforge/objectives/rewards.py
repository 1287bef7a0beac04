"""Reward functions for RL stages: scores of completions, combined by weight.

Built in: `math_answer` (1 when the completion's final answer, the last `\\boxed{...}` or else the last
number, equals the reference answer's), `format` (1 when a regex matches the completion), `length` (DAPO's
overlong shaping: 0 up to max_new_tokens - cache tokens, then linearly down to -1 at max_new_tokens). Also
any Python callable named by import path `pkg.mod:fn`, called as fn(prompts, completions, answers) ->
[float] (TRL's form), and a reward model folder from the `rm` stage (`{model: FOLDER}`), which scores the
rendered conversation at its last token.

Every function is called once per rollout with the whole batch of this rank: lists of equal length."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.config.method_schema import RewardSpec
from shardforge.errors import ConfigError

BUILT_IN = ("math_answer", "format", "length")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass
class Completions:
    """What a reward sees of one rollout batch: the prompts (as text), the completions (text and token
    counts), each prompt's reference answer (None where the data has none) and the conversation turns."""

    prompts: list[str]
    texts: list[str]
    lengths: list[int]
    answers: list[str | None]
    messages: list[list[dict[str, str]]]


def final_answer(text: str) -> str | None:
    """The answer a math completion gives: the content of its last `\\boxed{...}` (braces balanced), else
    its last number (commas dropped); None if it has neither."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def answers_equal(given: str | None, reference: str | None) -> bool:
    """Numerically equal when both are numbers (1e-6 relative), else equal as stripped strings."""
    if given is None or reference is None:
        return False
    try:
        a, b = float(given.replace(",", "")), float(reference.replace(",", ""))
    except ValueError:
        return given.strip() == reference.strip()
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def math_answer(batch: Completions) -> list[float]:
    scores = []
    for text, answer in zip(batch.texts, batch.answers, strict=True):
        reference = None if answer is None else final_answer(answer) or answer.strip()
        scores.append(1.0 if answers_equal(final_answer(text), reference) else 0.0)
    return scores


def format_reward(pattern: str) -> Callable[[Completions], list[float]]:
    regex = re.compile(pattern, re.DOTALL)
    return lambda batch: [1.0 if regex.search(text) else 0.0 for text in batch.texts]


def overlong_penalty(max_new_tokens: int, cache: int) -> Callable[[Completions], list[float]]:
    """DAPO's soft overlong punishment with L_max = max_new_tokens and an L_cache of `cache` tokens."""
    expected = max_new_tokens - cache

    def score(batch: Completions) -> list[float]:
        return [
            0.0 if n <= expected else -1.0 if n > max_new_tokens else (expected - n) / cache
            for n in batch.lengths
        ]

    return score


def imported(path: str, where: str) -> Callable[[Completions], list[float]]:
    """`pkg.mod:fn`, called as fn(prompts, completions, answers)."""
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: cannot import the reward function {path!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"{where}: {path!r} is not callable")

    def score(batch: Completions) -> list[float]:
        out = [float(x) for x in fn(batch.prompts, batch.texts, batch.answers)]
        if len(out) != len(batch.texts):
            raise ConfigError(
                f"reward {path!r} returned {len(out)} scores for {len(batch.texts)} completions"
            )
        return out

    return score


class RewardModel:
    """A reward model folder (stage rm's `final/`): scores each conversation (prompt turns + completion)
    rendered by the folder's own tokenizer and chat template, at its last token, in batches."""

    def __init__(self, folder: str, where: str, device: torch.device, batch_size: int = 16) -> None:
        from transformers import AutoTokenizer

        from shardforge.data.templates import resolve_template
        from shardforge.models import load_model

        path = Path(folder)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{where}: reward model folder {folder!r} has no config.json")
        self.model = load_model(path, device=device, num_labels=1).eval().requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise ConfigError(f"{where}: {folder!r} is not a reward model (no score head of one output)")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.template = resolve_template(self.tokenizer, "auto")
        self.device, self.batch_size = device, batch_size

    @torch.no_grad()
    def __call__(self, batch: Completions) -> list[float]:
        from shardforge.data.templates import render

        texts = [
            render(self.tokenizer, self.template, [*turns, {"role": "assistant", "content": text}])
            for turns, text in zip(batch.messages, batch.texts, strict=True)
        ]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            ids = [
                self.tokenizer(t, add_special_tokens=False)["input_ids"]
                for t in texts[start : start + self.batch_size]
            ]
            width = max(map(len, ids))
            tokens = torch.zeros(len(ids), width, dtype=torch.long, device=self.device)
            mask = torch.zeros(len(ids), width, dtype=torch.bool, device=self.device)
            for r, row in enumerate(ids):
                tokens[r, : len(row)] = torch.tensor(row)
                mask[r, len(row) - 1] = True
            out = self.model(tokens, output_mask=mask)
            scores += out.float().view(-1).tolist()
        return scores


@dataclass
class Reward:
    name: str
    weight: float
    fn: Callable[[Completions], list[float]]


def build_rewards(specs: Sequence[RewardSpec], max_new_tokens: int, device: torch.device) -> list[Reward]:
    """The configured reward functions, each checked now (an unknown name or a bad path fails before any
    rollout)."""
    out = []
    for i, spec in enumerate(specs):
        where = f"method.rl.rewards[{i}]"
        if spec.model is not None:
            out.append(
                Reward(f"rm:{Path(spec.model).name}", spec.weight, RewardModel(spec.model, where, device))
            )
            continue
        name = spec.name or ""
        if ":" in name:
            fn: Any = imported(name, where)
        elif name == "math_answer":
            fn = math_answer
        elif name == "format":
            if spec.pattern is None:
                raise ConfigError(f"{where}: the format reward needs a `pattern` (a regular expression)")
            fn = format_reward(spec.pattern)
        elif name == "length":
            cache = spec.cache if spec.cache is not None else max(1, max_new_tokens // 4)
            if not 0 < cache <= max_new_tokens:
                raise ConfigError(f"{where}: cache={cache} must be in [1, max_new_tokens={max_new_tokens}]")
            fn = overlong_penalty(max_new_tokens, cache)
        else:
            raise ConfigError(
                f"{where}: unknown reward {name!r}; expected one of {', '.join(BUILT_IN)}, an import path "
                f"'pkg.mod:fn', or {{model: FOLDER}} for a reward model"
            )
        out.append(Reward(name, spec.weight, fn))
    return out
