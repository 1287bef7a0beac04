"""The dataset cache: the cached pipeline gives exactly today's examples and rows on every format; a warm
cache encodes nothing and memory-maps its arrays; changed inputs, template or code get a new key; a damaged
cache is rebuilt, never used; ranks that are not the builder wait for it and do not tokenize."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import shardforge.data.loader as loader
from shardforge.config.data_schema import DataSection
from shardforge.data.cache import DatasetCache
from shardforge.data.loader import build_datasets
from shardforge.data.store import ExampleStore
from shardforge.errors import DataError
from shardforge.objectives import build_objective, reading_for
from tests.conftest import alpaca_records, lf_messages_entry, write_jsonl


@pytest.fixture
def files(tmp_path):
    chat = [
        {
            "messages": [
                {"role": "user", "content": f"q{i} " * (i % 7)},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(30)
    ]
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": f"hi {i}"},
                {"from": "gpt", "value": "yo " * (i % 5 + 1)},
            ]
        }
        for i in range(20)
    ]
    (tmp_path / "info").mkdir()
    write_jsonl(tmp_path / "info" / "lf.jsonl", chat)
    (tmp_path / "info" / "dataset_info.json").write_text(json.dumps({"lf": lf_messages_entry("lf.jsonl")}))
    return {
        "alpaca": write_jsonl(tmp_path / "alpaca.jsonl", alpaca_records(40)),
        "sharegpt": write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt),
        "openai": write_jsonl(tmp_path / "openai.jsonl", chat),
        "text": write_jsonl(tmp_path / "text.jsonl", [{"text": "word " * (3 + i % 40)} for i in range(50)]),
        "info": tmp_path / "info" / "dataset_info.json",
    }


def _data(files, fmt: str, **extra) -> DataSection:
    spec = (
        {"name": "lf", "dataset_info": str(files["info"])}
        if fmt == "info"
        else {"path": str(files[fmt]), "format": fmt}
    )
    return DataSection(train=[spec], max_length=64, eval_fraction=0.2, **extra)


def _build(data, tokenizer, cache=None, stage="sft"):
    objective = build_objective(stage)
    encoder = objective.encoder(tokenizer, data)
    identity = {"template": data.template}
    return build_datasets(data, reading_for(stage), encoder, 3, 1, cache, identity)


def _same(a, b):
    assert a.rows == b.rows and a.group_size == b.group_size
    assert len(a.examples) == len(b.examples)
    for i in range(len(a.examples)):
        assert a.examples[i].input_ids == b.examples[i].input_ids
        assert a.examples[i].trained == b.examples[i].trained


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt", "openai", "text", "info"])
def test_cached_pipeline_gives_the_same_examples_and_rows(tmp_path, files, tokenizer, fmt):
    stage = "pt" if fmt == "text" else "sft"
    data = _data(files, fmt)
    plain = _build(data, tokenizer, stage=stage)
    cache = DatasetCache(tmp_path / "cache", builder=True)
    cold = _build(data, tokenizer, cache, stage)
    warm = _build(data, tokenizer, cache, stage)
    for split in (0, 1):
        _same(cold[split], plain[split])
        _same(warm[split], plain[split])
        assert cold[split].stats == plain[split].stats == warm[split].stats
    assert isinstance(warm[0].examples.tokens, np.memmap)  # mapped, not read into every rank's memory


def test_a_warm_cache_encodes_nothing_and_changed_inputs_get_a_new_key(
    tmp_path, files, tokenizer, monkeypatch, logged
):
    data = _data(files, "alpaca")
    said = logged
    cache = DatasetCache(tmp_path / "cache", builder=True)
    _build(data, tokenizer, cache)
    assert len(list((tmp_path / "cache").iterdir())) == 1 and "tokenizing" in said[0]

    def no_encoding(*args, **kwargs):
        raise AssertionError("a warm cache must not encode")

    with monkeypatch.context() as patch:
        patch.setattr(loader, "encode_all", no_encoding)
        _build(data, tokenizer, cache)  # the same inputs: read from the cache
        _build(data.model_copy(update={"packing": False}), tokenizer, cache)  # packing lays rows out only
    write_jsonl(files["alpaca"], alpaca_records(41))  # the file changed
    _build(data, tokenizer, cache)
    _build(data.model_copy(update={"max_length": 48}), tokenizer, cache)
    _build(data.model_copy(update={"template": "chatml"}), tokenizer, cache)
    assert len(list((tmp_path / "cache").iterdir())) == 4


def test_a_damaged_cache_is_rebuilt_not_used(tmp_path, files, tokenizer, logged):
    data = _data(files, "alpaca")
    said = logged
    cache = DatasetCache(tmp_path / "cache", builder=True)
    _build(data, tokenizer, cache)
    reference = _build(data, tokenizer)  # in memory: the damage below must not reach it through a mapping
    (folder,) = (tmp_path / "cache").iterdir()
    tokens = folder / "train" / "tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-8])  # truncated
    rebuilt = _build(data, tokenizer, cache)
    assert any("not usable" in line and "tokens.npy" in line for line in said)
    _same(rebuilt[0], reference[0])
    (folder / "manifest.json").unlink()  # a build that died before its manifest
    _same(_build(data, tokenizer, cache)[0], reference[0])


def test_other_ranks_wait_for_the_builder_and_do_not_tokenize(tmp_path, files, tokenizer, monkeypatch):
    data = _data(files, "alpaca")
    waiting = DatasetCache(tmp_path / "cache", builder=False, wait_s=60)
    results = {}
    encoded = []
    original = loader.encode_all
    monkeypatch.setattr(loader, "encode_all", lambda *a, **k: encoded.append(1) or original(*a, **k))
    thread = threading.Thread(target=lambda: results.update(rows=_build(data, tokenizer, waiting)))
    thread.start()
    built = _build(data, tokenizer, DatasetCache(tmp_path / "cache", builder=True))
    thread.join(60)
    assert len(encoded) == 2  # train and eval, by the builder alone
    _same(results["rows"][0], built[0])
    lonely = DatasetCache(tmp_path / "elsewhere", builder=False, wait_s=0.5)
    with pytest.raises(DataError, match="waited 0 min for local rank 0 to build the dataset cache"):
        _build(data, tokenizer, lonely)


def test_the_store_round_trips_examples(tmp_path):
    from shardforge.data.examples import Example

    examples = [
        Example(tuple(range(i, i + 5 + i)), tuple(bool((i + t) % 3) for t in range(5 + i)), "x")
        for i in range(9)
    ]
    store = ExampleStore.from_examples(examples)
    store.save(tmp_path)
    for kept in (store, ExampleStore.load(tmp_path)):
        assert [kept[i].input_ids for i in range(9)] == [e.input_ids for e in examples]
        assert [kept[i].trained for i in range(9)] == [e.trained for e in examples]  # bit-packed flags
        assert kept.num_targets.tolist() == [e.num_targets for e in examples]
    assert store.tokens.dtype == np.uint32 and store.flags.nbytes == (store.offsets[-1] + 7) // 8


@pytest.mark.parametrize("fmt", ["openai", "text"])
def test_worker_processes_encode_exactly_what_one_process_does(files, tokenizer, fmt, monkeypatch):
    import shardforge.data.encode as encode
    from shardforge.data.encode import encode_all
    from shardforge.data.loader import read_dataset

    stage = "pt" if fmt == "text" else "sft"
    data = _data(files, fmt)
    records = read_dataset(data.train[0], reading_for(stage)) * 3
    encoder = build_objective(stage).encoder(tokenizer, data)
    one, stats = encode_all(records, encoder, 16, "right", "x", workers=1)
    monkeypatch.setattr(encode, "RECORDS_PER_WORKER", 10)  # use workers even for this small set
    monkeypatch.setattr(encode, "CHUNK", 7)
    pools = []

    class CountedPool(encode.ProcessPoolExecutor):
        def __init__(self, workers, *args, **kwargs):
            pools.append(workers)
            super().__init__(workers, *args, **kwargs)

    monkeypatch.setattr(encode, "ProcessPoolExecutor", CountedPool)
    two, stats_two = encode_all(records, encoder, 16, "right", "x", workers=2)
    assert pools == [2]  # two worker processes encoded the chunks
    for name in ("tokens", "flags", "offsets", "num_targets"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    assert stats == stats_two and stats.truncated > 0
    with pytest.raises(DataError, match=r"tokens > data.max_length=8"):
        encode_all(records, encoder, 8, "error", "x", workers=2)  # an error comes back as itself


def test_an_unwritable_cache_folder_is_a_clear_error(tmp_path, files, tokenizer):
    (tmp_path / "a_file").write_text("")
    cache = DatasetCache(tmp_path / "a_file" / "cache", builder=True)
    with pytest.raises(DataError, match=r"data.cache_dir '.*a_file/cache': cannot write the dataset cache"):
        _build(_data(files, "alpaca"), tokenizer, cache)


def test_a_cache_built_meanwhile_by_another_process_is_kept(tmp_path, files, tokenizer, monkeypatch):
    """Two builders of the same key (two jobs, or nodes sharing a filesystem): the second rename finds the
    first's complete folder and keeps it."""
    import shardforge.data.cache as cache_module

    data = _data(files, "alpaca")
    cache = DatasetCache(tmp_path / "cache", builder=True)
    _build(data, tokenizer, cache)
    (folder,) = (tmp_path / "cache").iterdir()
    monkeypatch.setattr(cache_module, "_check", lambda f: "no manifest" if f == folder and not seen else None)
    seen: list[int] = []
    original_rename = cache_module.os.rename

    def rename(src, dst):
        seen.append(1)  # from now on the other builder's folder counts as complete
        raise OSError("Directory not empty")

    monkeypatch.setattr(cache_module.os, "rename", rename)
    monkeypatch.setattr(cache_module.shutil, "rmtree", lambda path, ignore_errors=False: None)
    rows = _build(data, tokenizer, cache)
    monkeypatch.setattr(cache_module.os, "rename", original_rename)
    _same(rows[0], _build(data, tokenizer)[0])


def _reference_encoding(tokenizer, encoder, record):
    """The encoding before the tokenizer's batch API, record by record through the transformers call."""
    from shardforge.data.templates import assistant_spans

    if record.text is not None:
        ids = tokenizer(record.text, add_special_tokens=False)["input_ids"]
        ids = [tokenizer.bos_token_id] * (tokenizer.bos_token_id is not None) + ids + [tokenizer.eos_token_id]
        return ids, [True] * len(ids)
    messages = list(record.messages)
    text, spans = assistant_spans(tokenizer, encoder.template, messages, record.source)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if encoder.train_on_prompt:
        return enc["input_ids"], [True] * len(enc["input_ids"])
    trained, span_i = [], 0
    for start, _ in enc["offset_mapping"]:
        while span_i < len(spans) and start >= spans[span_i][1]:
            span_i += 1
        trained.append(span_i < len(spans) and spans[span_i][0] <= start)
    return enc["input_ids"], trained


@pytest.mark.parametrize("train_on_prompt", [False, True])
@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt", "openai", "text", "info"])
def test_batch_encoding_equals_record_by_record_encoding(tmp_path, files, tokenizer, fmt, train_on_prompt):
    """The batch tokenizer call gives the same tokens and targets as the transformers call per record, also
    on text with accents, CJK and emoji (the targets come from character offsets)."""
    from shardforge.data.loader import read_dataset

    stage = "pt" if fmt == "text" else "sft"
    data = _data(files, fmt, train_on_prompt=train_on_prompt)
    records = read_dataset(data.train[0], reading_for(stage))
    unicode = write_jsonl(
        tmp_path / "unicode.jsonl",
        [{"instruction": "héllo wörld 世界", "input": "", "output": "ça va 🎉 très bien, 谢谢 " * 3}],
    )
    records += read_dataset(
        DataSection(train=[{"path": str(unicode), "format": "alpaca"}]).train[0], reading_for(stage)
    )
    encoder = build_objective(stage).encoder(tokenizer, data)
    batch = encoder.encode_batch(records)
    for record, [(ids, trained)] in zip(records, batch, strict=True):
        want_ids, want_trained = _reference_encoding(tokenizer, encoder, record)
        assert ids.tolist() == list(want_ids), record.source
        assert trained.tolist() == list(want_trained), record.source
    assert any(not all(t) for [(_, t)] in batch) != (train_on_prompt or stage == "pt")
