"""The streamed pipeline: on a corpus that fits in one window it gives the in-memory pipeline's rows in its
order (tokens, targets, counts) over several epochs; its position resumes exactly, also with another
data-parallel split, across windows, shards of every kind and epochs; files are read from a position."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardforge.config import load_config
from shardforge.config.data_schema import DataSection
from shardforge.data.batch_source import DatasetSource
from shardforge.data.batching import collate
from shardforge.data.files import iter_from
from shardforge.data.loader import build_datasets
from shardforge.data.stream import StreamSource
from shardforge.errors import ConfigError, DataError
from shardforge.objectives import build_objective, reading_for
from tests.conftest import alpaca_records, tiny_config, write_jsonl

SEED = 3


def _stream(data: DataSection, stage: str, tokenizer, split: tuple[int, int, int, int]) -> StreamSource:
    encoder = build_objective(stage).encoder(tokenizer, data)
    return StreamSource(data, reading_for(stage), encoder, SEED, split, collate, tokenizer.pad_token_id)


def _rows_of(batch) -> list[torch.Tensor]:
    """A global batch's rows (one per micro-batch of one row), each cut to its tokens."""
    return [mb.input_ids[0, : mb.num_tokens] for mb in batch.micro]


@pytest.mark.parametrize(("stage", "fmt"), [("pt", "text"), ("sft", "alpaca")])
def test_a_corpus_in_one_window_streams_the_in_memory_rows_in_order(tmp_path, tokenizer, stage, fmt):
    records = [{"text": "word " * (3 + i % 40)} for i in range(50)] if fmt == "text" else alpaca_records(40)
    path = write_jsonl(tmp_path / "train.jsonl", records)
    data = DataSection(train=[{"path": str(path), "format": fmt}], max_length=64, stream_window=1000)
    encoder = build_objective(stage).encoder(tokenizer, data)
    rows, _ = build_datasets(data, reading_for(stage), encoder, SEED)
    split = (2, 2, 1, 0)
    memory = DatasetSource(rows, SEED, *split, collate, tokenizer.pad_token_id)
    stream = _stream(data, stage, tokenizer, split)
    steps = 3 * rows.num_groups // 4 + 2  # three epochs and a bit
    for _ in range(steps):
        want, got = memory.next_batch(), stream.next_batch()
        assert got.counts == want.counts
        for a, b in zip(want.micro, got.micro, strict=True):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
            assert torch.equal(a.position_ids, b.position_ids)
    assert got.state["epoch"] == 3 and got.state["samples"] == want.state["samples"] == 4 * steps
    stream.close()


@pytest.fixture
def corpus(tmp_path):
    """Three shards of every kind in a folder (.txt, .jsonl, .parquet), and a second entry capped by
    max_samples over its two files."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("".join(f"line {i} " + "x " * (i % 9) + "\n\n" for i in range(23)))
    write_jsonl(folder / "b.jsonl", [{"text": f"json {i} " + "y " * (i % 13)} for i in range(17)])
    table = pa.table({"text": [f"parquet {i} " + "z " * (i % 5) for i in range(19)]})
    pq.write_table(table, folder / "c.parquet", row_group_size=4)
    capped = tmp_path / "capped"
    capped.mkdir()
    for name in ("d.jsonl", "e.jsonl"):
        write_jsonl(capped / name, [{"text": f"{name} {i} w"} for i in range(6)])
    specs = [
        {"path": str(folder), "format": "text"},
        {"path": str(capped), "format": "text", "max_samples": 9},
    ]
    return DataSection(train=specs, max_length=24, stream_window=7)


def test_the_stream_reads_every_record_once_an_epoch_and_honours_max_samples(corpus, tokenizer):
    stream = _stream(corpus, "pt", tokenizer, (1, 1, 1, 0))
    seen = []
    while stream.epoch == 0:
        window = stream._current()
        seen += [window.rows.examples[d] for r in window.order for d in window.rows.rows[int(r)]]
        stream.epoch, stream.index, stream.start = stream._next_coordinates(window)
        stream._window = None
    texts = sorted(tokenizer.decode(e.input_ids, skip_special_tokens=True) for e in seen)
    assert len(texts) == 23 + 17 + 19 + 9  # the capped entry gives 6 + 3 records
    assert sum(t.startswith("e.jsonl") for t in texts) == 3
    stream.close()


def test_the_position_resumes_exactly_with_another_split(corpus, tokenizer):
    """Straight: one rank, four rows a step. Resumed after 5 steps (saved through JSON) on two ranks: the
    two ranks' rows, interleaved as the split takes them, are the straight run's rows, to the last step."""
    straight = _stream(corpus, "pt", tokenizer, (1, 4, 1, 0))
    batches = [straight.next_batch() for _ in range(30)]  # 120 rows: windows, shards and epochs crossed
    assert batches[-1].state["epoch"] >= 1
    saved = json.loads(json.dumps(batches[4].state))
    ranks = []
    for rank in (0, 1):
        resumed = _stream(corpus, "pt", tokenizer, (1, 2, 2, rank))
        resumed.load_state_dict(saved)
        ranks.append([resumed.next_batch() for _ in range(25)])
        resumed.close()
    for want, got0, got1 in zip(batches[5:], *ranks, strict=True):
        a, b = _rows_of(got0), _rows_of(got1)
        interleaved = [a[0], b[0], a[1], b[1]]  # micro-step j, rank r takes row j*dp + r
        assert all(torch.equal(x, y) for x, y in zip(_rows_of(want), interleaved, strict=True))
        assert got0.counts == got1.counts == want.counts  # counted over the whole global batch
        assert got0.state == want.state
    straight.close()


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".parquet"])
def test_files_are_read_from_a_position(tmp_path, suffix):
    path = tmp_path / f"f{suffix}"
    texts = [f"record {i} é" for i in range(11)]
    if suffix == ".jsonl":
        write_jsonl(path, [{"text": t} for t in texts])
    elif suffix == ".txt":
        path.write_text("\n".join(texts[:5]) + "\n\n" + "\n".join(texts[5:]) + "\n")
    else:
        pq.write_table(pa.table({"text": texts}), path, row_group_size=3)
    everything = list(iter_from(path, (0, 1)))
    for k in range(len(everything)):
        tail = list(iter_from(path, everything[k][2]))
        assert tail == everything[k + 1 :]
    assert [obj if isinstance(obj, str) else obj["text"] for _, obj, _ in everything] == texts


def test_streaming_refuses_what_it_cannot_do(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])
    base = tiny_config(tmp_path, path, "text", data={"streaming": True}, method={"stage": "pt"})
    with pytest.raises(ConfigError, match=r"train.epochs=1.0: with data.streaming .* set train.steps"):
        load_config(None, base=base, overrides=["train.epochs=1", "train.steps=null"])
    with pytest.raises(ConfigError, match=r"data.eval_fraction=0.1: a stream cannot hold out"):
        load_config(None, base=base, overrides=["data.eval_fraction=0.1"])
    array = tmp_path / "t.json"
    array.write_text('[{"text": "a b"}]')
    data = DataSection(train=[{"path": str(array), "format": "text"}], streaming=True)
    with pytest.raises(DataError, match=r"data.train\[0\]: .*t.json: a .json array cannot be streamed"):
        StreamSource(data, "pt", None, 0, (1, 1, 1, 0), collate, 0)
