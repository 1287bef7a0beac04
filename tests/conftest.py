"""Shared fixtures: the repo's bundled tokenizer and tiny data files written per test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "examples" / "data" / "tokenizer"

# CI (.ci/run sets CI=true) sees the same generated cases every run: a verdict there is about the change, not
# the draw. Locally each run draws anew and fuzzes further.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# Workers (pytest-xdist, pyproject.toml's addopts): one a core, at most four, since a test of tests/dist
# spawns ranks of its own and each worker holds its built models. Each worker takes its share of the threads:
# two workers on two cores with torch's default thread count each would oversubscribe them (OpenMP spins).
MAX_WORKERS = 4
CORES = len(os.sched_getaffinity(0))


def pytest_xdist_auto_num_workers(config) -> int:
    return max(1, min(CORES, MAX_WORKERS))


if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    threads = max(1, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the CLI runs a test starts, too


def unavailable(reason: str) -> None:
    """A piece the test needs could not be set up: a skip on a developer's machine, a failure in CI, which
    installs every such piece itself (.ci/run), so a broken install there never passes as a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"CI should have set this up: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return TOKENIZER


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lf_messages_entry(file_name: str) -> dict:
    """A LLaMA-Factory dataset_info entry for OpenAI-style `messages` data, declared as sharegpt with tags."""
    return {
        "file_name": file_name,
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    }


def alpaca_records(n: int, seed: int = 0) -> list[dict]:
    """Deterministic alpaca records of varied length (so packing and target counts are uneven)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        words = " ".join(
            rng.choice(["alpha", "beta", "gamma", "delta", "echo"]) for _ in range(rng.randint(0, 12))
        )
        out.append(
            {
                "instruction": f"Add the numbers. {words}".strip(),
                "input": f"{a} + {b}",
                "output": f"The sum is {a + b}." + " ok" * (i % 5),
            }
        )
    return out


def tiny_config(tmp_path: Path, train_file: Path, fmt: str = "alpaca", **sections) -> dict:
    """A config dict for a few fast steps of a tiny preset on `train_file`."""
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "model": {"preset": "tiny-llama", "tokenizer": str(TOKENIZER)},
        # The dataset cache of a test stays in its own folder (not the user's ~/.cache).
        "data": {
            "train": [{"path": str(train_file), "format": fmt}],
            "max_length": 128,
            "cache_dir": str(tmp_path / "dataset-cache"),
        },
        "train": {"steps": 4, "micro_batch": 2, "lr": 1e-3, "warmup": 1, "log_every": 1},
        "log": {"tensorboard": False, "plot": False, "progress": False},
        "hardware": {"peak_flops": 1e11},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values) if isinstance(values, dict) else cfg.__setitem__(
            section, values
        )
    return cfg


# The quick tier (`pytest -m "not slow"`, README): every single-process test under tests/unit (every package
# of the library is exercised there), without the multi-process parity runs and the end-to-end CLI, server and
# browser runs, which are the slow tier and run in CI with the rest.
SLOW_FOLDERS = ("dist", "e2e")


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        parts = Path(str(item.fspath)).relative_to(root).parts
        if parts and parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def logged_warnings():
    """The library's warning messages while the test runs (its one logger, shardforge/log.py)."""
    from shardforge.log import collected

    with collected() as messages:
        yield messages


@pytest.fixture
def logged():
    """The library's messages, info and above, while the test runs."""
    import logging

    from shardforge.log import collected

    with collected(logging.INFO) as messages:
        yield messages


def tiny_chat_model(folder, context: int, hidden: int = 64, layers: int = 2, std: float = 0.2):
    """A small random Llama with the bundled tokenizer (and its chat template), saved to `folder`: weights
    drawn large enough (`std`) that logits are peaked, so greedy tokens have no near-ties."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
