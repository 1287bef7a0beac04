"""Dataset readers: every format from every file type, and errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardforge.config.data_schema import DatasetSpec
from shardforge.data.formats import Record
from shardforge.data.loader import read_dataset
from shardforge.errors import DataError
from shardforge.objectives import reading_for
from tests.conftest import lf_messages_entry

EXTS = ["jsonl", "json", "parquet"]


def write(path: Path, rows: list[Any]) -> Path:
    """Write rows as .jsonl, pretty-printed .json (one key per line) or .parquet, by the path's suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read(path: Path, fmt: str | None, stage: str = "sft", **kw: Any) -> list[Record]:
    return read_dataset(DatasetSpec(path=str(path), format=fmt, **kw), reading_for(stage))


def chat(*pairs: tuple[str, str]) -> tuple[dict[str, str], ...]:
    return tuple({"role": r, "content": c} for r, c in pairs)


ALPACA = [
    {
        "instruction": "Add",
        "input": "1 2",
        "output": "3",
        "system": "Be terse.",
        "history": [["hi", "hello"]],
    },
    {"instruction": "Say hi", "input": "", "output": "hi", "system": "", "history": []},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q1"},
            {"from": "gpt", "value": "A1"},
            {"from": "user", "value": "Q2"},
            {"from": "assistant", "value": "A2"},
        ]
    },
    {"conversations": [{"from": "human", "value": "Q"}, {"from": "model", "value": "A"}]},
]
OPENAI = [
    {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
        ]
    }
]


@pytest.mark.parametrize("ext", EXTS)
def test_alpaca_system_history_and_empty_input(tmp_path: Path, ext: str) -> None:
    recs = read(write(tmp_path / f"a.{ext}", ALPACA), "alpaca")
    assert recs[0].messages == chat(
        ("system", "Be terse."),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "Add\n1 2"),
        ("assistant", "3"),
    )
    assert recs[1].messages == chat(("user", "Say hi"), ("assistant", "hi"))
    assert recs[0].text is None


def test_alpaca_optional_keys_may_be_absent(tmp_path: Path) -> None:
    recs = read(write(tmp_path / "a.jsonl", [{"instruction": "I", "output": "O"}]), "alpaca")
    assert recs[0].messages == chat(("user", "I"), ("assistant", "O"))


@pytest.mark.parametrize("ext", EXTS)
def test_sharegpt_with_system(tmp_path: Path, ext: str) -> None:
    recs = read(write(tmp_path / f"s.{ext}", SHAREGPT), "sharegpt")
    assert recs[0].messages == chat(
        ("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")
    )
    assert recs[1].messages == chat(("user", "Q"), ("assistant", "A"))


@pytest.mark.parametrize("ext", EXTS)
def test_openai(tmp_path: Path, ext: str) -> None:
    recs = read(write(tmp_path / f"o.{ext}", OPENAI), "openai")
    assert recs[0].messages == chat(("system", "S"), ("user", "Q"), ("assistant", "A"))


@pytest.mark.parametrize("ext", EXTS)
def test_text(tmp_path: Path, ext: str) -> None:
    recs = read(
        write(tmp_path / f"t.{ext}", [{"body": "one"}, {"body": "two"}]), "text", "pt", text_column="body"
    )
    assert [r.text for r in recs] == ["one", "two"]
    assert recs[0].messages is None


def test_sources(tmp_path: Path) -> None:
    assert read(write(tmp_path / "a.jsonl", ALPACA), "alpaca")[1].source == f"{tmp_path}/a.jsonl:2"
    assert read(write(tmp_path / "a.parquet", ALPACA), "alpaca")[1].source == f"{tmp_path}/a.parquet:row 1"
    src = read(write(tmp_path / "a.json", ALPACA), "alpaca")[1].source
    assert src == f"{tmp_path}/a.json:record 1 (line 14)"  # pretty-printed: record 0 spans lines 2-13


def test_pt_from_chat_formats(tmp_path: Path) -> None:
    recs = read(write(tmp_path / "a.jsonl", ALPACA), "alpaca", "pt")
    assert recs[0].text == "Be terse.\nhi\nhello\nAdd\n1 2\n3" and recs[0].messages is None
    assert read(write(tmp_path / "o.jsonl", OPENAI), "openai", "pt")[0].text == "S\nQ\nA"


def test_sft_rejects_text(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="sft needs a chat format"):
        read(write(tmp_path / "t.jsonl", [{"text": "x"}]), "text", "sft")


def test_max_samples_and_folder(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "b.jsonl", ALPACA)
    write(tmp_path / "d" / "a.json", ALPACA[:1])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    recs = read(tmp_path / "d", "alpaca")
    assert [Path(r.source).name for r in recs] == ["a.json:record 0 (line 2)", "b.jsonl:1", "b.jsonl:2"]
    assert len(read(tmp_path / "d", "alpaca", max_samples=2)) == 2


def test_format_detected_when_unset(tmp_path: Path) -> None:
    assert read(write(tmp_path / "s.jsonl", SHAREGPT), None)[1].messages == chat(
        ("user", "Q"), ("assistant", "A")
    )


# ---------------------------------------------------------------- errors name file:line


def test_bad_jsonl_line_names_line(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "a"}\n')
    with pytest.raises(DataError) as e:
        read(p, "alpaca")
    assert str(e.value) == (
        f'{p}:3: alpaca record has no "output" '
        "(expected keys: instruction, input, output, optional system, history)"
    )


def test_jsonl_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b",}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2:14: invalid JSON"):
        read(p, "text", "pt")


def test_bad_json_record_names_start_line(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text(
        '[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c",\n   "output": "d"},\n'
        '  {\n    "instruction": 5,\n    "output": "e"\n  }\n]\n'
    )
    with pytest.raises(DataError) as e:
        read(p, "alpaca")
    assert str(e.value).startswith(f"{p}:record 2 (line 5): ")
    assert '"instruction" is a number; expected a string' in str(e.value)


def test_json_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text('[\n  {"text": "a"},\n  {"text": "b" "c"}\n]\n')
    with pytest.raises(DataError, match=r"x\.json:3:16: invalid JSON"):
        read(p, "text", "pt")
    p.write_text('[\n  {"text": "a"},\n]\n')  # trailing comma
    with pytest.raises(DataError, match=r"x\.json:3:1: invalid JSON \(Expecting value\)"):
        read(p, "text", "pt")
    p.write_text('{"text": "a"}')
    with pytest.raises(DataError, match=r"x\.json:1:1: expected a top-level JSON array"):
        read(p, "text", "pt")


def test_bad_parquet_row(tmp_path: Path) -> None:
    p = write(tmp_path / "x.parquet", [{"text": "a"}, {"text": None}])
    with pytest.raises(DataError, match=r'x\.parquet:row 1: text record has no "text"'):
        read(p, "text", "pt")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([["not", "an", "object"]], ":1: sharegpt record is an array; expected a JSON object"),
        ([{"conversations": []}], ':1: sharegpt "conversations" is empty'),
        ([{"chat": []}], ':1: sharegpt record has no "conversations"'),
        (
            [{"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f"}]}],
            ':1: sharegpt turn 1 is a function call whose "value" is not JSON',
        ),
        (
            [{"conversations": [{"from": "human", "value": "q"}, {"from": "wizard", "value": "f"}]}],
            (
                ':1: sharegpt turn 1 has "from" "wizard"; allowed: human, user, gpt, assistant, model, '
                "system, function_call, observation, tool (system only first)"
            ),
        ),
        (
            [{"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]}],
            ":1: sharegpt turn 1 is a user turn where a assistant turn was expected",
        ),
        (
            [{"conversations": [{"from": "gpt", "value": "a"}]}],
            ":1: sharegpt turn 0 is a assistant turn where a user turn was expected",
        ),
        (
            [{"conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "s"}]}],
            ":1: sharegpt turn 1 is a system turn; a system turn is only allowed first",
        ),
        (
            [{"conversations": [{"from": "human", "value": "q"}]}],
            ":1: sharegpt conversation ends with a user turn; it must end with an assistant turn",
        ),
        (
            [{"conversations": [{"from": "human", "value": 1}, {"from": "gpt", "value": "a"}]}],
            ':1: sharegpt turn 0 "value" is a number; expected a string',
        ),
    ],
)
def test_sharegpt_bad_records(tmp_path: Path, rows: list[Any], message: str) -> None:
    p = write(tmp_path / "x.jsonl", rows)
    with pytest.raises(DataError) as e:
        read(p, "sharegpt")
    assert str(e.value).startswith(f"{p}{message}")


def test_openai_bad_role(tmp_path: Path) -> None:
    p = write(tmp_path / "x.jsonl", [{"messages": [{"role": "human", "content": "q"}]}])
    with pytest.raises(
        DataError, match=r'x\.jsonl:1: openai turn 0 has "role" "human"; allowed: user, assistant'
    ):
        read(p, "openai")


def test_alpaca_bad_history(tmp_path: Path) -> None:
    p = write(tmp_path / "x.jsonl", [{"instruction": "i", "output": "o", "history": [["only one"]]}])
    with pytest.raises(DataError, match=r'x\.jsonl:1: alpaca "history" item 0 is \["only one"\]'):
        read(p, "alpaca")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"dataset file not found: .*nope\.jsonl"):
        read(tmp_path / "nope.jsonl", "alpaca")


def test_unknown_extension(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(
        DataError, match=r"unsupported file type '\.csv'; supported: \.jsonl, \.json, \.parquet"
    ):
        read(tmp_path / "x.csv", "alpaca")


@pytest.mark.parametrize(
    ("name", "content"), [("x.jsonl", ""), ("x.jsonl", "\n\n"), ("x.json", " "), ("x.json", "[]")]
)
def test_empty_file(tmp_path: Path, name: str, content: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=f"{name} has no records"):
        read(tmp_path / name, "alpaca")


def test_empty_parquet(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"x\.parquet has no records"):
        read(tmp_path / "x.parquet", "text", "pt")


# ---------------------------------------------------------------- LLaMA-Factory dataset_info.json


def info_spec(tmp_path: Path, entries: dict[str, Any], name: str, **kw: Any) -> DatasetSpec:
    (tmp_path / "dataset_info.json").write_text(json.dumps(entries))
    return DatasetSpec(name=name, dataset_info=str(tmp_path / "dataset_info.json"), **kw)


def test_dataset_info_sharegpt_custom_columns_and_tags(tmp_path: Path) -> None:
    write(tmp_path / "chat.jsonl", OPENAI)
    entry = lf_messages_entry("chat.jsonl")
    recs = read_dataset(info_spec(tmp_path, {"mine": entry}, "mine"), reading_for("sft"))
    assert recs[0].messages == chat(("system", "S"), ("user", "Q"), ("assistant", "A"))


def test_dataset_info_alpaca_columns_and_defaults(tmp_path: Path) -> None:
    write(tmp_path / "a.json", [{"q": "Q", "a": "A", "sys": "S"}])
    write(tmp_path / "b.jsonl", ALPACA[1:])
    entries = {
        "custom": {"file_name": "a.json", "columns": {"prompt": "q", "response": "a", "system": "sys"}},
        "plain": {"file_name": "b.jsonl"},
    }
    recs = read_dataset(info_spec(tmp_path, entries, "custom"), reading_for("sft"))
    assert recs[0].messages == chat(("system", "S"), ("user", "Q"), ("assistant", "A"))
    assert read_dataset(info_spec(tmp_path, entries, "plain"), reading_for("sft"))[0].messages == chat(
        ("user", "Say hi"), ("assistant", "hi")
    )


def test_dataset_info_pretraining_text(tmp_path: Path) -> None:
    write(tmp_path / "c4.jsonl", [{"text": "doc one"}, {"text": "doc two"}])
    spec = info_spec(
        tmp_path, {"c4_demo": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}}}, "c4_demo"
    )
    assert [r.text for r in read_dataset(spec, reading_for("pt"))] == ["doc one", "doc two"]


def test_dataset_info_tool_tags_name_the_tool_turns(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "human", "value": "q"}, {"from": "obs", "value": "x"}]}]
    write(tmp_path / "s.jsonl", rows)
    entry = {"file_name": "s.jsonl", "formatting": "sharegpt", "tags": {"observation_tag": "obs"}}
    with pytest.raises(DataError, match=r"s\.jsonl:1: sharegpt turn 1 is a tool turn where a assistant turn"):
        read_dataset(info_spec(tmp_path, {"s": entry}, "s"), reading_for("sft"))


def test_dataset_info_unknown_name_suggests_closest(tmp_path: Path) -> None:
    spec = info_spec(tmp_path, {"alpaca_en": {"file_name": "x"}, "glaive": {}, "alpaca_zh": {}}, "alpaca_em")
    with pytest.raises(
        DataError, match=r'no dataset named "alpaca_em"; available \(closest first\): alpaca_en, '
    ):
        read_dataset(spec, reading_for("sft"))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"hf_hub_url": "org/data"}, "hub datasets cannot be fetched, use a local file"),
        (
            {"file_name": "x.jsonl", "ranking": True},
            "is preference data (ranking: true); it trains under method.stage: dpo",
        ),
        ({"file_name": "missing.jsonl"}, "file_name 'missing.jsonl' not found"),
        ({"file_name": "x.jsonl", "formatting": "xml"}, "formatting 'xml'"),
        ({"file_name": "x.jsonl", "columns": {"videos": "vid"}}, "unsupported columns ['videos']"),
    ],
)
def test_dataset_info_bad_entries(tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    write(tmp_path / "x.jsonl", ALPACA)
    with pytest.raises(DataError) as e:
        read_dataset(info_spec(tmp_path, {"d": entry}, "d"), reading_for("sft"))
    assert message in str(e.value)
