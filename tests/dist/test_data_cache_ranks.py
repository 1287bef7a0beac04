"""A 4-rank job tokenizes its data once: local rank 0 builds the dataset cache, the other ranks wait for it
and map it, and all four get the same rows."""

from __future__ import annotations

from shardforge.config import load_config
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks


def _rank_data(cfg: dict) -> dict:
    import shardforge.data.loader as loader
    from shardforge.data.build import build_data
    from shardforge.models.build import load_tokenizer
    from shardforge.objectives import build_objective, reading_of

    encoded = []
    original = loader.encode_all
    loader.encode_all = lambda *args, **kwargs: (
        encoded.append(args[4]) or original(*args, **kwargs)
    )  # args[4]: what
    config = load_config(None, base=cfg)
    objective = build_objective(config.method)
    train, evaluation = build_data(config, load_tokenizer(config.model), objective, reading_of(objective))
    return {
        "encoded": encoded,
        "rows": train.rows.tolist(),
        "tokens": [train.examples[i].input_ids for i in range(len(train.examples))],
        "eval_rows": evaluation.rows.tolist(),
    }


def test_four_ranks_tokenize_once(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(60))
    cfg = tiny_config(tmp_path, data, data={"eval_fraction": 0.2, "cache_dir": str(tmp_path / "cache")})
    ranks = run_ranks(_rank_data, 4, cfg)
    assert [r["encoded"] for r in ranks] == [["training data", "evaluation data"], [], [], []]
    assert all(r["rows"] == ranks[0]["rows"] and r["tokens"] == ranks[0]["tokens"] for r in ranks)
    assert all(r["eval_rows"] == ranks[0]["eval_rows"] for r in ranks)
    assert len(list((tmp_path / "cache").iterdir())) == 1
