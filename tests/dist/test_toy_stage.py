"""A new stage is one file and one registry line: a toy objective defined here, registered as stage `toy`,
is chosen by the config (`method.stage: toy`, validated by the schema against the registry) and trains on
one process, DDP, ZeRO-3, TP2 and PP2 with the same losses, gradient norms, eval loss and weights, without
any library code knowing it. Its loss (each sequence's mean token negative log-likelihood, a loss per
sequence divided by the global batch's sequences) is neither SFT's nor a preference loss, so the layouts
must carry an objective's own normalizer, metrics and per-row sums."""

from __future__ import annotations

import pytest
import torch

from shardforge.config import load_config
from shardforge.config.stages import STAGES, register_stage
from shardforge.data.batching import IGNORE, Batch
from shardforge.errors import ConfigError
from shardforge.objectives import build_objective
from shardforge.objectives.base import Normalizer, Traits, sequence_logprob_sums
from shardforge.objectives.sft import SFTObjective
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, parity_train, train_runs


class MeanTokenStage(SFTObjective):
    """Conversations, each sequence's loss its mean token NLL; logged also: the share of sequences whose
    mean NLL is under 5 nats (a per-row statistic summed over the batch)."""

    name = "toy"
    normalizer: Normalizer = "sequences"
    metrics = ("loss", "short")
    summed = False  # a loss per sequence: the fused head must not assume one coefficient for all tokens
    traits = Traits(reader="chat")

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        tokens = (batch.targets != IGNORE).sum(dim=1).clamp(min=1)
        per_sequence = -sequence_logprob_sums(output.float(), batch) / tokens
        return {"loss": per_sequence.sum(), "short": (per_sequence.detach() < 5).float().sum()}


@pytest.fixture(autouse=True)
def toy_stage():
    """The one registry line, for this file's tests only (other tests see the library's stages)."""
    register_stage("toy", MeanTokenStage)
    yield
    del STAGES["toy"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy")
    return (
        write_jsonl(folder / "train.jsonl", alpaca_records(64, seed=21)),
        write_jsonl(folder / "eval.jsonl", alpaca_records(8, seed=22)),
    )


def _cfg(tmp_path, name: str, data, mb: int, accum: int, **parallel) -> dict:
    cfg = tiny_config(
        tmp_path / name,
        data[0],
        train={**parity_train(3, mb, accum), "eval_every": 3},
        data={"packing": False},
        parallel=parallel,
        method={"stage": "toy"},
        checkpoint={"save_final": False},
    )
    cfg["data"]["eval"] = [{"path": str(data[1]), "format": "alpaca"}]
    return cfg


def _two_ranks(configs: list[dict]) -> list[dict]:
    register_stage("toy", MeanTokenStage)  # a spawned rank's own registry
    return train_runs(configs)


def test_a_stage_registered_in_a_test_file_is_the_configs_choice(tmp_path, data):
    assert STAGES["toy"] is MeanTokenStage
    config = load_config(None, base=_cfg(tmp_path, "choice", data, mb=1, accum=1))
    assert isinstance(build_objective(config.method), MeanTokenStage)
    wrong = _cfg(tmp_path, "choice", data, mb=1, accum=1) | {"method": {"stage": "toys"}}
    with pytest.raises(ConfigError, match=r"'toys' is not one of pt, sft, .*toy"):
        load_config(None, base=wrong)


def test_the_toy_stage_trains_alike_on_every_layout(tmp_path, data):
    (ref,) = train_runs([_cfg(tmp_path, "one", data, mb=4, accum=2)])
    layouts = [
        _cfg(tmp_path, "ddp", data, mb=2, accum=2),
        _cfg(tmp_path, "zero3", data, mb=2, accum=2, zero_stage=3),
        _cfg(tmp_path, "tp2", data, mb=4, accum=2, tp=2),
        _cfg(tmp_path, "pp2", data, mb=4, accum=2, pp=2, pp_microbatches=2),
    ]
    runs = run_ranks(_two_ranks, 2, layouts)[0]
    assert [run["layout"] for run in runs] != [ref["layout"]] * 4
    for run in runs:
        assert_same(run, ref)
    assert ref["losses"][-1] < ref["losses"][0]  # it learns: the runs compared are not all flat
