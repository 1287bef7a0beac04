"""The fast paths that drive the engine in-process: batch generation from a JSONL file, and an interactive
terminal chat that streams each reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from shardforge.data.templates import render, resolve_template
from shardforge.errors import DataError, ShardforgeError
from shardforge.infer.engine import Engine
from shardforge.infer.sampling import SamplingParams

_PARAM_KEYS = {f.name for f in fields(SamplingParams)}


def chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """A conversation as the model's chat template renders it, ready for the assistant's turn."""
    return token_ids(tokenizer, chat_text(tokenizer, messages), special=False)


def chat_text(tokenizer: Any, messages: list[dict]) -> str:
    return render(tokenizer, resolve_template(tokenizer, "auto"), messages, generation_prompt=True)


def token_ids(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    """A text's token ids. Encoded as a batch of one: a fast tokenizer's batch call lets other Python threads
    run meanwhile (its single-text call holds the GIL: a 5 MB prompt stalled a server's event loop 4 s)."""
    return tokenizer([text], add_special_tokens=special)["input_ids"][0]


def _read_prompts(
    path: Path, tokenizer: Any, base: SamplingParams
) -> list[tuple[dict, list[int], SamplingParams]]:
    """Each line: {"prompt": text} | {"messages": [...]} | {"prompt_ids": [...]}, with optional sampling
    fields (max_tokens, temperature, ...) and any other fields, which are copied to the output."""
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
        if "messages" in record:
            ids = chat_ids(tokenizer, record["messages"])
        elif "prompt" in record:
            ids = tokenizer(record["prompt"])["input_ids"]
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
            params = replace(base, **overrides).check()
        except (ShardforgeError, TypeError) as exc:
            raise DataError(f"{where}: {exc}") from None
        rows.append((record, ids, params))
    if not rows:
        raise DataError(f"--prompts {path}: no prompts in it")
    return rows


def generate_file(
    engine: Engine,
    prompts: Path,
    out: Path,
    base: SamplingParams,
    progress: Callable[[int, int], None] = lambda _done, _total: None,
) -> dict:
    """Generate for every line of `prompts` into `out` (one JSON line per prompt, in input order: the
    record's own fields plus "completions"). Returns counts for the summary."""
    rows = _read_prompts(prompts, engine.tokenizer, base)
    completions = engine.generate([ids for _, ids, _ in rows], [params for _, _, params in rows], progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for (record, _, _), done in zip(rows, completions, strict=True):
            made = [{"text": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason} for c in done]
            f.write(json.dumps({**record, "completions": made}, ensure_ascii=False) + "\n")
    partial.replace(out)
    return {"prompts": len(rows), "tokens": sum(len(c.tokens) for done in completions for c in done)}


def chat_loop(
    engine: Engine,
    params: SamplingParams,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = lambda text: print(text, end="", flush=True),
) -> None:
    """Read a line, stream the reply, until end of input or /exit. /reset forgets the conversation;
    /system TEXT sets the system message (and resets)."""
    system: str | None = None
    history: list[dict] = []
    turn = 0
    write(
        "chat: /reset forgets the conversation, /system TEXT sets the system prompt, /exit or Ctrl-D quits\n"
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
            history = []
            write("(conversation reset)\n")
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        turn += 1
        request_id = f"chat-{turn}"
        engine.add(request_id, chat_ids(engine.tokenizer, messages), params)
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
