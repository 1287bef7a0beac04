"""Dataset readers: the rows of data files (data/files.py) in alpaca, sharegpt, openai or text form ->
normalized records.

No tokenization here. Every malformed record raises a DataError that starts with the record's source
("file:line", "file:row N" or "file:record N (line L)") so the user can open the file at the right place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any, Literal

from shardforge.data.files import iter_raw
from shardforge.data.media import check_placeholders, content_parts, image_refs
from shardforge.data.tools import Tool, function_calls, tool_definitions
from shardforge.data.values import kind as _kind
from shardforge.data.values import show as _show
from shardforge.errors import DataError

# How an objective takes its records: plain text (pretraining), a conversation, a preference pair, a
# completion labelled desirable or not (KTO), or a prompt to sample completions of (RL).
Reader = Literal["text", "chat", "pair", "labelled", "prompt"]


@dataclass(frozen=True)
class Reading:
    """What the readers need of the objective a data set is read for: its reader, and for messages the
    stage being run and the stages that read each kind of record (objectives.reading_of makes it)."""

    reader: Reader
    stage: str
    stages: tuple[tuple[str, str], ...] = ()  # (reader, "dpo or rm"): who trains on such records
    system: str | None = None  # data.default_system: the system message of conversations that have none

    def serving(self, reader: Reader) -> str:
        """The stages that read records of `reader`, as a message names them."""
        return dict(self.stages).get(reader, f"a {reader} stage")


CHAT_FORMATS = ("alpaca", "sharegpt", "openai")
FORMATS = (*CHAT_FORMATS, "text")

Message = dict[str, Any]  # {"role", "content"}; an assistant's function calls also have "tool_calls"


@dataclass(frozen=True)
class Record:
    """One example: chat messages (for sft; for a preference pair, the prompt and the chosen reply, with the
    rejected reply beside them; for KTO, the prompt and the completion, with its label) or plain text (for
    pt); `source` points back into the file. `mismatched` is another KTO example's completion, the loader's
    pairing for the KL estimate."""

    source: str
    messages: tuple[Message, ...] | None
    text: str | None
    rejected: str | None = None
    label: bool | None = None  # KTO: True = desirable
    mismatched: str | None = None
    answer: str | None = None  # RL: the reference answer of a prompt (verifiable rewards)
    tools: tuple[Tool, ...] = ()  # the functions the conversation may call (the template shows them)
    images: tuple[str, ...] = ()  # resolved paths or data URLs, in the order of the `<image>` marks


@dataclass(frozen=True)
class FieldMap:
    """Where each field lives and which role names mean what, so one reader serves every naming
    (our standard keys, or a LLaMA-Factory dataset_info entry's columns and tags)."""

    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"
    system: str = "system"
    history: str = "history"
    messages: str = "conversations"
    role: str = "from"
    content: str = "value"
    user_roles: tuple[str, ...] = ("human", "user")
    assistant_roles: tuple[str, ...] = ("gpt", "assistant", "model")
    system_roles: tuple[str, ...] = ("system",)
    function_roles: tuple[str, ...] = ("function_call",)  # an assistant's function call (a JSON value)
    observation_roles: tuple[str, ...] = ("observation", "tool")  # a function's result, on the user's side
    tools: str | None = "tools"  # the functions' definitions: a JSON list (LLaMA-Factory: a string of one)
    text: str = "text"
    chosen: str = "chosen"
    rejected: str = "rejected"
    completion: str = "completion"  # KTO's reply, beside a prompt
    label: str = "label"  # KTO's desirable flag (LLaMA-Factory's kto_tag column)
    answer: str = "answer"  # RL: a prompt's reference answer (else its reply, when it has one)
    images: str | None = "images"  # a list of image paths (data/media.py)
    media: Path | None = None  # where relative image paths are found first (the dataset's folder)


def default_fields(fmt: str, text_column: str = "text") -> FieldMap:
    """The standard keys of a format (openai differs from sharegpt only in its key and role names)."""
    if fmt == "openai":
        return FieldMap(
            messages="messages",
            role="role",
            content="content",
            user_roles=("user",),
            assistant_roles=("assistant",),
            text=text_column,
        )
    return FieldMap(text=text_column)


def read_records(
    path: Path, fmt: str, how: Reading, fields: FieldMap | None = None, max_samples: int | None = None
) -> list[Record]:
    """Read a file or a folder of files in format `fmt`; a chat format read as text becomes text."""
    if fmt not in FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r}; expected one of: {', '.join(FORMATS)}")
    if fmt == "text" and how.reader != "text":
        raise DataError(
            f"{path}: stage {how.stage} needs a chat format ({', '.join(CHAT_FORMATS)}); "
            f'format "text" is plain text for pretraining (stage {how.serving("text")})'
        )
    fields = fields or default_fields(fmt)
    if fields.media is None:
        fields = replace(fields, media=path if path.is_dir() else path.parent)
    rows = islice(iter_raw(path, fmt), max_samples)
    records = [parse_record(obj, src, fmt, fields, how) for src, obj in rows]
    if not records:
        raise DataError(f"{path} has no records")
    return records


def detect_format(path: Path, text_column: str = "text") -> str:
    """Guess the format from the first record's keys, for a dataset configured without `format`."""
    for src, obj in islice(iter_raw(path), 1):
        if isinstance(obj, str):  # a line of a .txt file
            return "text"
        if isinstance(obj, dict):
            for fmt, key in (
                ("alpaca", "instruction"),
                ("sharegpt", "conversations"),
                ("openai", "messages"),
                ("alpaca", "chosen"),  # a preference pair {prompt, chosen, rejected}
                ("alpaca", "completion"),  # a KTO example {prompt, completion, label}
            ):
                if key in obj:
                    return fmt
            if text_column in obj:
                return "text"
        raise DataError(
            f"{src}: cannot tell the dataset format from this record; "
            f"set format to one of: {', '.join(FORMATS)}"
        )
    raise DataError(f"{path} has no records")


# ---------------------------------------------------------------- objects -> records


def parse_record(obj: Any, src: str, fmt: str, f: FieldMap, how: Reading) -> Record:
    """One decoded object (or .txt line) as a record of format `fmt`, as `how.reader` takes it; a
    conversation without a system message gets `how.system` (LLaMA-Factory's default_system)."""
    record = _parse_record(obj, src, fmt, f, how)
    if isinstance(obj, dict) and fmt != "text" and how.reader != "text":
        record = replace(
            record, tools=tool_definitions(obj.get(f.tools) if f.tools else None, src, fmt, f.tools)
        )
    if isinstance(obj, dict):
        record = _with_images(record, obj, f, how)
    if how.system and record.messages and record.messages[0]["role"] != "system":
        record = replace(record, messages=({"role": "system", "content": how.system}, *record.messages))
    return record


def _with_images(record: Record, obj: dict[str, Any], f: FieldMap, how: Reading) -> Record:
    """The record's images: its images column's, or its OpenAI image parts' (moved off the messages),
    each with its `<image>` mark in the text."""
    src = record.source
    column = image_refs(obj, f.images, src, f.media)
    messages = list(record.messages or ())
    parts = tuple(ref for m in messages for ref in m.get("images", ()))
    if column and parts:
        raise DataError(f'{src}: images both in "{f.images}" and in image_url parts; give them one way')
    images = column or parts
    if not images:
        return record
    if how.reader == "text":
        raise DataError(f"{src}: a record with images cannot be read as plain text (stage {how.stage})")
    messages = [{k: v for k, v in m.items() if k != "images"} for m in messages]
    texts = [m["content"] for m in messages] + [t for t in (record.rejected,) if t]
    check_placeholders(texts, images, src)
    return replace(record, messages=tuple(messages), images=images)


def _parse_record(obj: Any, src: str, fmt: str, f: FieldMap, how: Reading) -> Record:
    if fmt == "text" and isinstance(obj, str):  # a line of a .txt file
        return Record(src, None, obj)
    if not isinstance(obj, dict):
        raise DataError(f"{src}: {fmt} record is {_kind(obj)}; expected a JSON object")
    if fmt == "text":
        return Record(src, None, _text(obj, src, f))
    paired = f.chosen in obj and f.rejected in obj
    if how.reader == "prompt":
        return _rl_prompt(obj, src, fmt, f)
    if how.reader == "pair":
        msgs, rejected = _preference(obj, src, fmt, f)
        return Record(src, tuple(msgs), None, rejected)
    if paired and f.output not in obj:
        raise DataError(
            f'{src}: a preference record ("{f.chosen}" and "{f.rejected}"); it trains under method.stage: '
            f"{how.serving('pair')}, not {how.stage}"
        )
    if how.reader == "labelled":
        msgs, label = _kto(obj, src, fmt, f)
        return Record(src, tuple(msgs), None, label=label)
    if f.completion in obj and f.label in obj:
        raise DataError(
            f'{src}: a KTO record ("{f.completion}" and "{f.label}"); it trains under method.stage: '
            f"{how.serving('labelled')}, not {how.stage}"
        )
    msgs = _alpaca(obj, src, f) if fmt == "alpaca" else _conversation(obj, src, fmt, f)
    if how.reader == "text":
        return Record(src, None, "\n".join(m["content"] for m in msgs))
    return Record(src, tuple(msgs), None)


def _text(obj: dict[str, Any], src: str, f: FieldMap) -> str:
    value = obj.get(f.text)
    if value is None:
        raise DataError(
            f'{src}: text record has no "{f.text}" (expected a string; text_column names the key)'
        )
    if not isinstance(value, str):
        raise DataError(f'{src}: text record "{f.text}" is {_kind(value)}; expected a string')
    return value


def _optional_str(obj: dict[str, Any], key: str, src: str, fmt: str) -> str:
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f'{src}: {fmt} "{key}" is {_kind(value)}; expected a string')
    return value


def _alpaca(obj: dict[str, Any], src: str, f: FieldMap) -> list[Message]:
    expected = f"expected keys: {f.instruction}, {f.input}, {f.output}, optional {f.system}, {f.history}"
    for key in (f.instruction, f.output):
        if obj.get(key) is None:
            raise DataError(f'{src}: alpaca record has no "{key}" ({expected})')
    instruction = _optional_str(obj, f.instruction, src, "alpaca")
    output = _optional_str(obj, f.output, src, "alpaca")
    query = _optional_str(obj, f.input, src, "alpaca")
    system = _optional_str(obj, f.system, src, "alpaca")
    msgs = [{"role": "system", "content": system}] if system else []
    history = obj.get(f.history)
    if history is not None and not isinstance(history, list):
        raise DataError(
            f'{src}: alpaca "{f.history}" is {_kind(history)}; expected a list of [user, assistant]'
        )
    for i, pair in enumerate(history or []):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise DataError(
                f'{src}: alpaca "{f.history}" item {i} is {_show(pair)}; '
                "expected a [user, assistant] pair of strings"
            )
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    msgs.append({"role": "user", "content": f"{instruction}\n{query}" if query else instruction})
    msgs.append({"role": "assistant", "content": output})
    return msgs


def _conversation(obj: dict[str, Any], src: str, fmt: str, f: FieldMap) -> list[Message]:
    """sharegpt / openai: map role names, check user/assistant alternation after an optional system turn."""
    turns = obj.get(f.messages)
    shape = f'a list of {{"{f.role}": ..., "{f.content}": ...}} turns'
    if turns is None:
        raise DataError(f'{src}: {fmt} record has no "{f.messages}" (expected {shape})')
    if not isinstance(turns, list):
        raise DataError(f'{src}: {fmt} "{f.messages}" is {_kind(turns)}; expected {shape}')
    if not turns:
        raise DataError(f'{src}: {fmt} "{f.messages}" is empty; expected a user turn and an assistant turn')
    msgs: list[Message] = []
    expect = "user"
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(
                f"{src}: {fmt} turn {i} is {_kind(turn)}; "
                f'expected an object with "{f.role}" and "{f.content}"'
            )
        role = _role(turn.get(f.role), src, i, fmt, f)
        side = SIDES[role]
        if role == "system" and i > 0:
            raise DataError(f"{src}: {fmt} turn {i} is a system turn; a system turn is only allowed first")
        if role != "system":
            if side != expect:
                raise DataError(
                    f"{src}: {fmt} turn {i} is a {role} turn where a {expect} turn was expected; roles must "
                    "alternate user (or a function's result) / assistant (or its function call) after an "
                    "optional leading system turn"
                )
            expect = "assistant" if side == "user" else "user"
        msgs.append(_message(turn, role, src, i, fmt, f))
    if SIDES[msgs[-1]["role"]] != "assistant":
        raise DataError(
            f"{src}: {fmt} conversation ends with a {msgs[-1]['role']} turn; "
            "it must end with an assistant turn"
        )
    system = _optional_str(obj, f.system, src, fmt)  # LLaMA-Factory's separate system column
    if system and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system})
    return msgs


def _rl_prompt(obj: dict[str, Any], src: str, fmt: str, f: FieldMap) -> Record:
    """An RL prompt: the conversation up to its last user turn, and the reference answer (the `answer`
    column, else the reply the record has: alpaca's output, or a final assistant turn; None without)."""
    answer = obj.get(f.answer)
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise DataError(f'{src}: "{f.answer}" is {_kind(answer)}; expected a string or a number')
    if fmt == "alpaca":
        msgs = _alpaca({**obj, f.output: obj.get(f.output) or ""}, src, f)
    else:
        turns = obj.get(f.messages)
        last = turns[-1] if isinstance(turns, list) and turns and isinstance(turns[-1], dict) else {}
        if last.get(f.role) in f.user_roles:  # a prompt alone: an empty reply keeps the reader's checks
            obj = {**obj, f.messages: [*turns, {f.role: f.assistant_roles[0], f.content: ""}]}
        msgs = _conversation(obj, src, fmt, f)
    reply = msgs.pop()["content"]
    reference = str(answer) if answer is not None else reply or None
    return Record(src, tuple(msgs), None, answer=reference)


def _preference(obj: dict[str, Any], src: str, fmt: str, f: FieldMap) -> tuple[list[Message], str]:
    """A pair: (the prompt's turns and the chosen reply, the rejected reply). The prompt is alpaca's fields
    (or our `prompt`), or a conversation ending with a user turn; a reply is a string or, as LLaMA-Factory's
    sharegpt pairs have it, an assistant turn object."""
    replies = []
    for key in (f.chosen, f.rejected):
        if obj.get(key) is None:
            raise DataError(
                f'{src}: preference record has no "{key}" (expected "{f.chosen}" and "{f.rejected}" replies '
                f"beside the prompt)"
            )
        replies.append(_reply(obj[key], key, src, fmt, f))
    chosen, rejected = replies
    if chosen == rejected:
        raise DataError(f'{src}: "{f.chosen}" and "{f.rejected}" are the same text; a pair must differ')
    return _prompt_and_reply(obj, chosen, src, fmt, f, "preference"), rejected


def _kto(obj: dict[str, Any], src: str, fmt: str, f: FieldMap) -> tuple[list[Message], bool]:
    """A KTO example: (the prompt's turns and the completion, its label). The completion is a `completion`
    beside the prompt (TRL's unpaired form, ours), or the conversation's last assistant turn (LLaMA-Factory's
    kto_tag datasets)."""
    label = obj.get(f.label)
    if not isinstance(label, bool):
        what = f'has no "{f.label}"' if label is None else f'"{f.label}" is {_show(label)}'
        raise DataError(
            f"{src}: KTO record {what}; expected true (a desirable completion) or false (an undesirable one)"
        )
    if f.completion not in obj:
        msgs = _alpaca(obj, src, f) if fmt == "alpaca" else _conversation(obj, src, fmt, f)
        if "tool_calls" in msgs[-1]:
            raise DataError(f"{src}: a KTO completion is a text reply; this one is a function call")
        return msgs, label
    completion = _reply(obj[f.completion], f.completion, src, fmt, f)
    return _prompt_and_reply(obj, completion, src, fmt, f, "KTO"), label


def _prompt_and_reply(obj: dict[str, Any], reply: str, src: str, fmt: str, f: FieldMap, what: str) -> list:
    """A record's prompt (alpaca's fields or our `prompt`, or conversation turns ending with a user turn)
    followed by `reply` as the assistant's turn."""
    if fmt == "alpaca":
        fields = {**obj, f.output: reply}
        if f.instruction not in fields and isinstance(obj.get("prompt"), str):
            fields[f.instruction] = obj["prompt"]
        return _alpaca(fields, src, f)
    turns = obj.get(f.messages)
    if not isinstance(turns, list) or not turns:
        raise DataError(
            f'{src}: {fmt} {what} record needs "{f.messages}": the prompt turns, ending with a user turn'
        )
    turn = {f.role: f.assistant_roles[0], f.content: reply}
    return _conversation({**obj, f.messages: [*turns, turn]}, src, fmt, f)


def _reply(value: Any, key: str, src: str, fmt: str, f: FieldMap) -> str:
    if isinstance(value, list) and len(value) == 1:  # TRL's conversational form: [assistant turn]
        value = value[0]
    if isinstance(value, dict):
        if value.get(f.role) not in f.assistant_roles or not isinstance(value.get(f.content), str):
            raise DataError(
                f'{src}: {fmt} "{key}" is {_show(value)}; expected a string or an assistant turn '
                f'{{"{f.role}": "{f.assistant_roles[0]}", "{f.content}": ...}}'
            )
        return value[f.content]
    if not isinstance(value, str):
        raise DataError(f'{src}: {fmt} "{key}" is {_kind(value)}; expected a string or an assistant turn')
    return value


# Our role of a turn -> the side of the conversation it is on (a function call is the assistant's turn, its
# result answers it on the user's side, as LLaMA-Factory and chat templates alternate them)
SIDES = {
    "user": "user",
    "tool": "user",
    "assistant": "assistant",
    "function_call": "assistant",
    "system": "system",
}


def _role(value: Any, src: str, i: int, fmt: str, f: FieldMap) -> str:
    named = (
        ("user", f.user_roles),
        ("assistant", f.assistant_roles),
        ("system", f.system_roles),
        ("function_call", f.function_roles),
        ("tool", f.observation_roles),
    )
    for role, names in named:
        if value in names:
            return role
    allowed = ", ".join(name for _, names in named for name in names)
    what = f'has no "{f.role}"' if value is None else f'has "{f.role}" {_show(value)}'
    raise DataError(f"{src}: {fmt} turn {i} {what}; allowed: {allowed} (system only first)")


def _message(turn: dict[str, Any], role: str, src: str, i: int, fmt: str, f: FieldMap) -> Message:
    """A turn as chat templates take it: a function call (LLaMA-Factory's function_call turn, whose content
    is the call as JSON, or an OpenAI assistant turn with `tool_calls`) becomes an assistant turn with
    `tool_calls`; a function's result a `tool` turn."""
    content = turn.get(f.content)
    native = turn.get("tool_calls") if role == "assistant" else None
    if native is not None:  # OpenAI's form: the calls beside an optional text
        calls = function_calls(native, src, f"{fmt} turn {i} tool_calls")
        return {"role": "assistant", "content": _optional_str(turn, f.content, src, fmt), "tool_calls": calls}
    if isinstance(content, list) and role in ("user", "system", "assistant"):  # OpenAI's content parts
        text, images = content_parts(content, src, f"{fmt} turn {i}", f.media)
        return {"role": role, "content": text, **({"images": images} if images else {})}
    if not isinstance(content, str):
        raise DataError(f'{src}: {fmt} turn {i} "{f.content}" is {_kind(content)}; expected a string')
    if role != "function_call":
        return {"role": role, "content": content}
    try:
        value = json.loads(content)
    except json.JSONDecodeError as e:
        raise DataError(
            f'{src}: {fmt} turn {i} is a function call whose "{f.content}" is not JSON ({e.msg}); expected '
            '{"name": ..., "arguments": {...}} or a list of such calls'
        ) from None
    return {"role": "assistant", "content": "", "tool_calls": function_calls(value, src, f"{fmt} turn {i}")}
