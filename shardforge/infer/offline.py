"""The fast paths that drive the engine in-process: batch generation from a JSONL file, and an interactive
terminal chat that streams each reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from shardforge.data.images import ImageReader
from shardforge.data.media import IMAGE, check_placeholders, content_parts, image_refs, resolve_image
from shardforge.data.templates import render, resolve_template
from shardforge.errors import DataError, ShardforgeError
from shardforge.infer.engine import Engine
from shardforge.infer.protocol import StructuredOutputs, validation_message
from shardforge.infer.sampling import SamplingParams
from shardforge.models.common.images import ImageInputs

# a prompt line's sampling fields; its constraint comes from its `structured_outputs`, as the server's does
_PARAM_KEYS = {f.name for f in fields(SamplingParams)} - {"constraint"}


def chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """A conversation as the model's chat template renders it, ready for the assistant's turn."""
    return token_ids(tokenizer, chat_text(tokenizer, messages), special=False)


def chat_text(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The conversation rendered for the assistant's turn, with the functions it may call (`tools`)."""
    template = resolve_template(tokenizer, "auto")
    return render(tokenizer, template, messages, generation_prompt=True, tools=tools or ())


def token_ids(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    """A text's token ids. Encoded as a batch of one: a fast tokenizer's batch call lets other Python threads
    run meanwhile (its single-text call holds the GIL: a 5 MB prompt stalled a server's event loop 4 s)."""
    return tokenizer([text], add_special_tokens=special)["input_ids"][0]


Prompt = tuple[dict, list[int], SamplingParams, ImageInputs | None]


def _with_images(
    record: dict, where: str, folder: Path, reader: ImageReader | None
) -> tuple[dict, ImageInputs | None]:
    """A prompt line's images: OpenAI image parts in its messages, or an `images` list beside `<image>`
    marks (LLaMA-Factory's form), paths found from the prompts file's folder; the marks written as the
    model's image prompt. The line comes back with plain-text messages (or prompt)."""
    messages = record.get("messages")
    refs = list(image_refs(record, "images", where, folder))
    if isinstance(messages, list):
        plain = []
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                text, found = content_parts(content, where, f"message {i}", folder)
                message = {**message, "content": text}
                refs += found
            plain.append(message)
        record = {**record, "messages": plain}
    if not refs:
        return record, None
    if reader is None:
        raise DataError(f"{where}: the prompt has images but the model is a text model")
    texts = [m.get("content") or "" for m in record.get("messages", [])] + [record.get("prompt") or ""]
    check_placeholders([t for t in texts if isinstance(t, str)], tuple(refs), where)
    pixels, grids = reader.process(refs, where)
    fill = reader.filler(grids)
    if "messages" in record:
        record = {
            **record,
            "messages": [{**m, "content": fill(m.get("content") or "")} for m in record["messages"]],
        }
    else:
        record = {**record, "prompt": fill(record.get("prompt") or "")}
    return record, ImageInputs(torch.from_numpy(pixels), torch.from_numpy(grids))


def _read_prompts(
    path: Path, tokenizer: Any, base: SamplingParams, reader: ImageReader | None
) -> list[Prompt]:
    """Each line: {"prompt": text} | {"messages": [...]} | {"prompt_ids": [...]}, with optional sampling
    fields (max_tokens, temperature, ...) and any other fields, which are copied to the output. Images: in
    OpenAI image parts, or an `images` list with `<image>` marks in the text (`_with_images`)."""
    if not path.is_file():
        raise DataError(f"--prompts {path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: each line must be a JSON object")
        text, images = _with_images(record, where, path.parent, reader)
        if "messages" in record:
            ids = chat_ids(tokenizer, text["messages"])
        elif "prompt" in record:
            ids = tokenizer(text["prompt"])["input_ids"]
        elif "prompt_ids" in record:
            ids = list(record["prompt_ids"])
        else:
            raise DataError(f"{where}: needs one of the keys prompt, messages or prompt_ids")
        overrides = {k: record[k] for k in _PARAM_KEYS & record.keys()}
        if "stop" in overrides:
            overrides["stop"] = (
                (overrides["stop"],) if isinstance(overrides["stop"], str) else tuple(overrides["stop"])
            )
        try:
            if "structured_outputs" in record:  # as the server's extra: {"json": ...}, {"regex": ...}, ...
                overrides["constraint"] = StructuredOutputs.model_validate(
                    record["structured_outputs"]
                ).constraint()
        except ValidationError as exc:
            field = validation_message(exc)[1]
            name = "structured_outputs" if field == "body" else f"structured_outputs.{field}"
            raise DataError(f"{where}: {name}: {exc.errors()[0]['msg']}") from None
        except ShardforgeError as exc:
            raise DataError(f"{where}: {exc}") from None
        try:
            params = replace(base, **overrides).check()
        except (ShardforgeError, TypeError) as exc:
            raise DataError(f"{where}: {exc}") from None
        rows.append((record, ids, params, images))
    if not rows:
        raise DataError(f"--prompts {path}: no prompts in it")
    return rows


def generate_file(
    engine: Engine,
    prompts: Path,
    out: Path,
    base: SamplingParams,
    progress: Callable[[int, int], None] = lambda _done, _total: None,
    reader: ImageReader | None = None,
) -> dict:
    """Generate for every line of `prompts` into `out` (one JSON line per prompt, in input order: the
    record's own fields plus "completions"). Returns counts for the summary. `reader`: a vision-language
    model's images (infer/load.py: Loaded.images)."""
    rows = _read_prompts(prompts, engine.tokenizer, base, reader)
    ids, params = [r[1] for r in rows], [r[2] for r in rows]
    for line, (prompt, asked) in enumerate(zip(ids, params, strict=True), 1):
        if asked.constraint is not None:  # compiled before any generation: a bad one names its line
            try:
                engine.check(prompt, asked)
            except ShardforgeError as exc:
                raise DataError(f"--prompts {prompts}: line {line}: {exc}") from None
    completions = engine.generate(ids, params, progress, [r[3] for r in rows])
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for (record, *_), done in zip(rows, completions, strict=True):
            made = [{"text": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason} for c in done]
            f.write(json.dumps({**record, "completions": made}, ensure_ascii=False) + "\n")
    partial.replace(out)
    return {"prompts": len(rows), "tokens": sum(len(c.tokens) for done in completions for c in done)}


def chat_loop(
    engine: Engine,
    params: SamplingParams,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = lambda text: print(text, end="", flush=True),
    reader: ImageReader | None = None,
) -> None:
    """Read a line, stream the reply, until end of input or /exit. /reset forgets the conversation;
    /system TEXT sets the system message (and resets); /image PATH puts an image before the next message
    (a vision-language model: `reader`)."""
    system: str | None = None
    history: list[dict] = []
    images: list[str] = []  # the conversation's, in order
    pending: list[str] = []  # those the next message carries
    turn = 0
    extra = ", /image PATH adds a picture to your next message" if reader is not None else ""
    write(
        f"chat: /reset forgets the conversation, /system TEXT sets the system prompt{extra}, "
        "/exit or Ctrl-D quits\n"
    )
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            write("\n")
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset" or line.startswith("/system"):
            if line.startswith("/system"):
                system = line[len("/system") :].strip() or None
            history, images, pending = [], [], []
            write("(conversation reset)\n")
            continue
        if line.startswith("/image"):
            if reader is None:
                write("(this model reads text only)\n")
                continue
            try:
                pending.append(resolve_image(line[len("/image") :].strip(), "/image", Path.cwd()))
            except DataError as exc:
                write(f"({exc})\n")
                continue
            write(f"(image {len(images) + len(pending)} goes with your next message)\n")
            continue
        history.append({"role": "user", "content": IMAGE * len(pending) + line})
        images, pending = images + pending, []
        messages = ([{"role": "system", "content": system}] if system else []) + history
        turn += 1
        request_id = f"chat-{turn}"
        pictures = None
        if images:
            assert reader is not None
            try:
                pixels, grids = reader.process(images, "chat")
            except DataError as exc:
                write(f"({exc}; /reset starts over)\n")
                history.pop()
                continue
            fill = reader.filler(grids)
            messages = [{**m, "content": fill(m["content"])} for m in messages]
            pictures = ImageInputs(torch.from_numpy(pixels), torch.from_numpy(grids))
        engine.add(request_id, chat_ids(engine.tokenizer, messages), params, pictures)
        reply = ""
        try:
            while engine.has_work():
                for update in engine.step():
                    reply += update.text
                    write(update.text)
        except KeyboardInterrupt:
            engine.abort(request_id)
            write(" [interrupted]")
        write("\n")
        history.append({"role": "assistant", "content": reply})
