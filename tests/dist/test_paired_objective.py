"""The objective seam, proven with a toy paired objective before the preference stages use it: two sequences
per group (kept together on one rank and in one micro-batch), a loss per pair from per-sequence sums, and
the loop dividing by the number of pairs in the global batch. One process, two data-parallel ranks and a
two-stage pipeline give the same losses, eval loss and weights; the logged loss equals the formula computed
independently, sequence by sequence."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shardforge.config import load_config
from shardforge.config.data_schema import DataSection
from shardforge.data.batching import GlobalOrder
from shardforge.data.examples import Encoder
from shardforge.data.formats import Record
from shardforge.data.loader import read_dataset
from shardforge.data.mixing import split_order
from shardforge.data.templates import encode_text
from shardforge.models import build_preset
from shardforge.objectives import reading_for
from shardforge.objectives.base import CausalLM, Traits, sequence_logprob_sums
from tests.conftest import tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, logged, parity_train, train_runs

WORDS = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf"]


@dataclass(frozen=True)
class ToyPairEncoder(Encoder):
    """A document and its reversal: the group of two a third party's stage trains on."""

    tokenizer: Any

    def __call__(self, record: Record) -> list:
        ids = encode_text(self.tokenizer, record.text or "")
        return [(ids, [True] * len(ids)), (ids[::-1], [True] * len(ids))]


class ToyPairs(CausalLM):
    """Prefer each text to its reversal: -log sigmoid(log p(text) - log p(reversed)), per pair."""

    name = "toy_pairs"
    normalizer = "groups"
    group_size = 2
    metrics = ("loss", "accuracy")
    traits = Traits(reader="text")
    summed = False  # a loss per pair, not a sum of token log-probs

    def encoder(self, tokenizer, data: DataSection):
        return ToyPairEncoder(tokenizer)

    @staticmethod
    def loss(output, batch):
        logps = sequence_logprob_sums(output, batch).view(-1, 2)  # a group's rows are consecutive
        margin = logps[:, 0] - logps[:, 1]
        return {"loss": -F.logsigmoid(margin).sum(), "accuracy": (margin > 0).float().sum()}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import random

    rng = random.Random(4)
    texts = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14)))} for _ in range(40)]
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "texts.jsonl", texts)


def _cfg(tmp_path, name, data, mb, accum, **parallel):
    cfg = tiny_config(
        tmp_path / name,
        data,
        fmt="text",
        # a rate that leaves the pair loss well above 0: at ~1e-4 it is fp32 noise on the log-prob sums
        train={**parity_train(3, mb, accum), "eval_every": 3, "lr": 2e-4},
        data={"packing": False, "eval_fraction": 0.2},
        parallel=parallel,
        checkpoint={"save_final": False},
        method={"stage": "pt"},
    )
    return cfg


def _two_ranks(configs):
    return train_runs(configs, ToyPairs())


def test_paired_objective_is_the_same_on_one_process_and_two_ranks(tmp_path, data, tokenizer):
    one = _cfg(tmp_path, "one", data, mb=2, accum=2)
    (ref,) = train_runs([one], ToyPairs())
    ddp = _cfg(tmp_path, "ddp", data, mb=1, accum=2)  # 2 ranks x 1 pair x 2 micro-steps: 4 pairs a step
    pp = _cfg(tmp_path, "pp", data, mb=2, accum=2, pp=2, pp_microbatches=2)  # 1 pair per pipeline chunk
    runs = run_ranks(_two_ranks, 2, [ddp, pp])[0]
    for run in runs:
        assert_same(run, ref)

    # The first logged loss is the mean over the step's 4 pairs, computed here sequence by sequence.
    config = load_config(None, base=one)
    records = read_dataset(config.data.train[0], reading_for("pt"))
    model = build_preset("tiny-llama", vocab_size=len(tokenizer), seed=config.train.seed)
    encode = ToyPairs().encoder(tokenizer, config.data)

    def logp(ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids])
        logits = model(x)[0, :-1]
        return torch.log_softmax(logits, -1).gather(1, x[0, 1:, None]).sum()

    # eval_fraction's held-out records and the training ones, in the order the loader keeps them
    _, kept = split_order(len(records), 0.2, config.train.seed)
    train_records = [records[i] for i in kept]
    step_groups = GlobalOrder(len(train_records), config.train.seed).take(4)
    with torch.no_grad():
        losses = []
        for g in step_groups:
            (chosen, _), (rejected, _) = encode(train_records[g])
            losses.append(-F.logsigmoid(logp(chosen) - logp(rejected)))
    # Each margin is a difference of two log-prob sums of ~100, which fp32 holds to ~1e-5: the reference
    # (log_softmax, then gather) and the fused head (logit - logsumexp) round it apart by a few units.
    assert ref["losses"][0] == pytest.approx(torch.stack(losses).mean().item(), rel=3e-5)
    # The objective's other sums are logged per pair too, for training and evaluation.
    last = logged(Path(ref["run_dir"]))[-1]
    assert 0 <= last["accuracy"] <= 1 and 0 <= last["eval_accuracy"] <= 1 and "eval_loss" in last
