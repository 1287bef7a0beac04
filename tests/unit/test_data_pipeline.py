"""Encoding, masking, packing and ordering: packed rows must compute exactly what separate documents do."""

from __future__ import annotations

import pytest
import torch

from shardforge.config.data_schema import DataSection
from shardforge.data.batch_source import DatasetSource, GlobalBatchLoader
from shardforge.data.batching import IGNORE, GlobalOrder, collate, split_global_batch
from shardforge.data.encode import encode_all
from shardforge.data.examples import EncodeStats, Example
from shardforge.data.formats import Record
from shardforge.data.loader import RowSet
from shardforge.data.packing import pack_rows, single_rows
from shardforge.data.store import ExampleStore
from shardforge.errors import DataError
from shardforge.models import build_preset
from shardforge.objectives import build_objective
from tests.oracles import causal_lm_loss_sum

DOCS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three",
    "packing must never let attention cross from one document into the next one in the row",
    "short",
    "a b c d e f g h i j k l m n o p",
]


def _data(**kw) -> DataSection:
    return DataSection(train=[{"path": "x.jsonl", "format": "text"}], **kw)


def _pt_examples(tokenizer) -> list[Example]:
    stage = build_objective("pt")
    records = [Record(f"x:{i}", None, t) for i, t in enumerate(DOCS)]
    examples, _ = encode_all(records, stage.encoder(tokenizer, _data()), 512, "right", "x")
    return examples


@pytest.fixture(params=["per-document", "mask"])
def attention_path(request, monkeypatch):
    """Run a test once with packed rows attended per document and once through the block-diagonal mask."""
    import shardforge.data.batching as batching

    monkeypatch.setattr(batching, "use_per_document", lambda lengths, width: request.param == "per-document")
    return request.param


def test_pretrain_packing_is_exact(tokenizer, attention_path):
    """Loss and gradients of pt on one packed row equal those of the documents run one by one."""
    examples = _pt_examples(tokenizer)
    model = build_preset("tiny-qwen3", vocab_size=len(tokenizer), seed=3)
    pad = tokenizer.pad_token_id

    packed = collate(examples, [list(range(len(examples)))], pad)
    assert (packed.doc_layout is not None) == (attention_path == "per-document")
    assert packed.doc_ids is not None and packed.input_ids.shape[0] == 1
    loss_packed = causal_lm_loss_sum(model, packed)
    loss_packed.backward()
    grads_packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    loss_single = torch.zeros(())
    targets_single = 0
    for i in range(len(examples)):
        one = collate(examples, [[i]], pad)
        assert one.doc_ids is None
        loss_single = loss_single + causal_lm_loss_sum(model, one)
        targets_single += one.num_targets
    loss_single.backward()

    assert packed.num_targets == targets_single == sum(len(e.input_ids) - 1 for e in examples)
    torch.testing.assert_close(loss_packed, loss_single, rtol=1e-5, atol=1e-5)
    for gp, p in zip(grads_packed, model.parameters(), strict=True):
        torch.testing.assert_close(gp, p.grad, rtol=1e-4, atol=1e-6)


def test_padding_rows_match_packing(tokenizer):
    examples = _pt_examples(tokenizer)
    model = build_preset("tiny-llama", vocab_size=len(tokenizer), seed=1)
    padded = collate(examples, [[i] for i in range(len(examples))], tokenizer.pad_token_id)
    packed = collate(examples, [list(range(len(examples)))], tokenizer.pad_token_id)
    assert padded.input_ids.shape[0] == len(examples) and padded.num_targets == packed.num_targets
    torch.testing.assert_close(
        causal_lm_loss_sum(model, padded), causal_lm_loss_sum(model, packed), rtol=1e-5, atol=1e-5
    )


def test_targets_do_not_cross_documents(tokenizer):
    examples = _pt_examples(tokenizer)[:2]
    batch = collate(examples, [[0, 1]], tokenizer.pad_token_id)
    first = len(examples[0].input_ids)
    assert batch.targets[0, first - 1].item() == IGNORE  # last token of doc 0 predicts nothing
    assert batch.position_ids[0, first].item() == 0  # positions restart
    assert batch.targets[0, first].item() == examples[1].input_ids[1]


def test_sft_labels_only_assistant_tokens(tokenizer):
    stage = build_objective("sft")
    messages = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 + 2"},
        {"role": "assistant", "content": "The sum is 4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    )
    [(ids, trained)] = stage.encoder(tokenizer, _data())(Record("x:1", messages, None))
    # The end marker and the newline after it are targets, as in LLaMA-Factory's chatml template
    # (format_assistant "{{content}}<|im_end|>\n"): a model trained so stops by itself.
    assert (
        tokenizer.decode([t for t, m in zip(ids, trained, strict=True) if m])
        == "The sum is 4.<|im_end|>\n6<|im_end|>\n"
    )
    [(ids2, trained2)] = stage.encoder(tokenizer, _data(train_on_prompt=True))(Record("x:1", messages, None))
    assert ids2.tolist() == ids.tolist() and all(trained2)


def test_truncation_is_counted_or_an_error(tokenizer):
    stage = build_objective("pt")
    enc = stage.encoder(tokenizer, _data())
    records = [Record(f"f.jsonl:{i + 1}", None, t) for i, t in enumerate(DOCS)]
    examples, stats = encode_all(records, enc, 8, "right", "x")
    assert all(len(e.input_ids) <= 8 for e in examples)
    assert stats.truncated == 3 and stats.tokens_cut > 0 and "3 truncated" in stats.summary()
    with pytest.raises(DataError, match=r"f.jsonl:1: \d+ tokens > data.max_length=8"):
        encode_all(records, enc, 8, "error", "x")


def test_no_trainable_tokens_is_an_error(tokenizer):
    stage = build_objective("sft")
    long_prompt = ({"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"})
    with pytest.raises(DataError, match="no example has a trainable token"):
        encode_all(
            [Record("f.jsonl:1", long_prompt, None)], stage.encoder(tokenizer, _data()), 32, "right", "x"
        )


def test_pack_rows_fills_and_respects_capacity():
    lengths = [7, 3, 5, 1, 9, 2, 4, 4, 8, 6]
    rows = pack_rows(lengths, 10).tolist()
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) <= 6  # 49 tokens need at least 5 rows of 10
    assert pack_rows(lengths, 10).tolist() == rows and pack_rows(lengths, 10, seed=1).tolist() != rows
    # Online best fit in random order, not best-fit decreasing (which fills rows longest first: here
    # 9+1, 8+2, 7+3, 6+4, 5+4, row sizes in decreasing order).
    sizes = [sum(lengths[i] for i in r) for r in rows]
    assert sizes != sorted(sizes, reverse=True) and 4 not in rows[0]
    import random

    rng = random.Random(0)
    many = [rng.randint(10, 200) for _ in range(3000)]
    assert sum(many) / (len(pack_rows(many, 512)) * 512) > 0.97  # random order still packs tightly
    with pytest.raises(ValueError):
        pack_rows([11], 10)


def _best_fit_reference(lengths: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Online best fit written plainly: in the seeded order, each document joins the open row with the least
    room that still fits it (the newest such row on a tie), else a new row."""
    import random

    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    room: list[int] = []
    last_touched: list[int] = []
    for step, doc in enumerate(order):
        fits = [r for r in range(len(rows)) if room[r] >= lengths[doc]]
        if fits:
            row = min(fits, key=lambda r: (room[r], -last_touched[r]))
        else:
            row = len(rows)
            rows.append([])
            room.append(capacity)
            last_touched.append(0)
        rows[row].append(doc)
        room[row] -= lengths[doc]
        last_touched[row] = step
    return [sorted(r) for r in rows]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_pack_rows_is_online_best_fit(seed):
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(400)]
    assert pack_rows(lengths, 64, seed).tolist() == _best_fit_reference(lengths, 64, seed)


def test_global_order_is_split_invariant_and_covers_each_epoch():
    order = GlobalOrder(10, seed=5)
    first_epoch = order.take(10).tolist()
    assert sorted(first_epoch) == list(range(10))
    assert sorted(order.take(10)) == list(range(10))
    step = GlobalOrder(100, seed=1).take(8).tolist()
    for mb, accum, dp in [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2)]:
        parts = [split_global_batch(step, mb, accum, dp, r) for r in range(dp)]
        assert sorted(i for rank in parts for micro in rank for i in micro) == sorted(step)
    resumed = GlobalOrder(10, seed=5)
    resumed.position = 7  # what a resumed loader sets (test below)
    assert resumed.take(6).tolist() == (first_epoch + GlobalOrder(10, seed=5).take(20).tolist()[10:])[7:13]


def test_loader_state_is_the_position_after_the_batches_handed_out():
    """The loader draws one batch ahead on a thread; its state counts only batches handed out, and a loader
    resumed from that state hands out exactly the batches the uninterrupted one does next."""
    examples = [Example(tuple(range(2, 4 + i % 5)), (True,) * (2 + i % 5), f"x:{i}") for i in range(10)]
    store = ExampleStore.from_examples(examples)
    rows = RowSet(store, single_rows(10), EncodeStats())

    def loader(batches: int) -> GlobalBatchLoader:
        return GlobalBatchLoader(DatasetSource(rows, 3, 2, 1, 2, 0, collate, pad_id=0), batches)

    straight = loader(5)
    seen = [straight.next() for _ in range(5)]
    assert [b.state["samples"] for b in seen] == [4, 8, 12, 16, 20]
    first = loader(5)
    first.next(), first.next()
    assert first.state_dict() == {"samples": 8}  # although the third batch is already drawn
    first.close()
    resumed = loader(3)
    resumed.load_state_dict(first.state_dict())
    for expected in seen[2:]:
        got = resumed.next()
        assert torch.equal(got.micro[0].input_ids, expected.micro[0].input_ids)
        assert got.counts == expected.counts  # counts over the whole global batch (both dp ranks)
    ids = GlobalOrder(10, seed=3).take(4).tolist()  # the first global batch: 2 rows x 2 data-parallel ranks
    assert seen[0].counts["targets"] == sum(examples[i].num_targets for i in ids)
    assert seen[0].counts["tokens"] == sum(len(examples[i].input_ids) for i in ids)
    assert seen[0].counts["groups"] == 4


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral"])
def test_per_document_attention_equals_masked_attention(tokenizer, preset, monkeypatch):
    """The per-document layout (gather, causal SDPA, scatter) and the block-diagonal mask give the same
    logits and gradients on packed rows, also with a sliding window shorter than the documents (tiny-mistral:
    32)."""
    import dataclasses

    long_docs = [Record(f"x:{i}", None, " ".join(["word"] * (10 + 15 * i))) for i in range(4)]
    stage = build_objective("pt")
    examples, _ = encode_all(long_docs, stage.encoder(tokenizer, _data()), 512, "right", "x")
    model = build_preset(preset, vocab_size=len(tokenizer), seed=4)
    import shardforge.data.batching as batching

    monkeypatch.setattr(batching, "use_per_document", lambda lengths, width: True)
    fast = collate(examples, [[0, 1, 2], [3]], tokenizer.pad_token_id)
    assert fast.doc_layout is not None and max(len(e.input_ids) for e in examples) > 32
    masked = dataclasses.replace(fast, doc_layout=None)
    results = []
    for batch in (fast, masked):
        model.zero_grad()
        loss = causal_lm_loss_sum(model, batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
