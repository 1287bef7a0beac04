"""Chat formatting with the tokenizer's own Jinja template, and which tokens are the assistant's.

The assistant spans are found by rendering growing prefixes of the conversation: the text added by an
assistant turn is what the template renders for it, whatever the template looks like. Tokens whose first
character lies inside such a span are trained on. Tool use (the functions, the calls, their results) is the
template's to render, in its family's tool format; a template that leaves any of it out is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardforge.errors import DataError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A reasoning reply's thought, as Qwen3 / DeepSeek-R1 templates write it; `enable_thinking: false` trains
# without it (LLaMA-Factory's remove_thought, with its thought words)
THOUGHT = re.compile(r"<think>\n(.*?)\n</think>\n\n", re.DOTALL)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and what it is rendered with: `thinking` is data.enable_thinking, passed to the
    template as `enable_thinking` (None: not passed). A plain object, so encoding workers can receive it."""

    jinja: str
    thinking: bool | None = None


def resolve_template(tokenizer: Any, name: str, thinking: bool | None = None) -> ChatTemplate:
    """The template to use: the tokenizer's own for "auto" (ChatML if it has none), or a named one."""
    if name == "chatml":
        return ChatTemplate(CHATML, thinking)
    return ChatTemplate(getattr(tokenizer, "chat_template", None) or CHATML, thinking)


def render(
    tokenizer: Any,
    template: ChatTemplate,
    messages: list[dict],
    generation_prompt: bool = False,
    tools: Sequence[dict] = (),
) -> str:
    """The conversation as the template writes it, with the functions it may call (`tools`). With thinking
    off, an assistant turn's thought is left out (the template then puts an empty one in the prompt)."""
    options = {} if template.thinking is None else {"enable_thinking": template.thinking}
    if template.thinking is False:
        messages = [_without_thought(m) for m in messages]
    return tokenizer.apply_chat_template(
        messages,
        tools=list(tools) or None,
        chat_template=template.jinja,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **options,
    )


def _without_thought(message: dict) -> dict:
    if message["role"] != "assistant" or not message["content"]:
        return message
    return {**message, "content": THOUGHT.sub("", message["content"]).lstrip("\n")}


def check_tools(
    tokenizer: Any, template: ChatTemplate, messages: list[dict], tools: Sequence[dict], text: str, src: str
) -> None:
    """A template without a tool format drops the functions, calls or results it is given without a word:
    every one of them must show in the rendering `text`."""
    if tools and render(tokenizer, template, messages) == text:
        raise DataError(
            f"{src}: the chat template has no tool format (it leaves out the record's tools); use a model "
            "whose chat template renders tools (data.template: auto), or data without a tools column"
        )
    for message in messages:
        calls = [c["function"]["name"] for c in message.get("tool_calls", ())]
        shown = [message["content"]] if message["role"] == "tool" else calls
        missing = [part for part in shown if part not in text]
        if missing:
            raise DataError(
                f"{src}: the chat template does not render {message['role']} turns with function calls or "
                f"results (leaves out {missing[0][:60]!r}); use a model whose chat template has a tool format"
            )


def assistant_spans(
    tokenizer: Any, template: ChatTemplate, messages: list[dict], source: str, tools: Sequence[dict] = ()
) -> tuple[str, list[tuple]]:
    """The rendered conversation and the [start, end) character spans of each assistant turn."""
    text = render(tokenizer, template, messages, tools=tools)
    check_tools(tokenizer, template, messages, tools, text, source)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, template, messages[:i], generation_prompt=True, tools=tools)
        through = render(tokenizer, template, messages[: i + 1], tools=tools)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                f"{source}: the chat template does not render conversations prefix by prefix, so assistant "
                f"tokens cannot be located; use data.template=chatml or data.train_on_prompt=true"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize(tokenizer: Any, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids (uint32) and each token's first character, for a batch of texts without special tokens.

    A fast tokenizer encodes the batch in its Rust backend in one call, on several threads and without the
    Python wrapper's per-text conversions (1.6x faster here); another tokenizer goes through its own call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        pairs = [(e.ids, e.offsets) for e in encodings]
    else:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        pairs = list(zip(enc["input_ids"], enc["offset_mapping"], strict=True))
    return [
        (np.asarray(ids, dtype=np.uint32), np.asarray([start for start, _ in offsets], dtype=np.int64))
        for ids, offsets in pairs
    ]


def encode_chats(
    tokenizer: Any,
    template: ChatTemplate,
    conversations: list[tuple[list[dict], Sequence[dict], str]],
    train_on_prompt: bool,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids of each rendered conversation (given with its tools and source) and, per token, whether
    it is a training target: a token whose first character lies in an assistant span."""
    rendered = [assistant_spans(tokenizer, template, m, src, tools) for m, tools, src in conversations]
    tokens = tokenize(tokenizer, [text for text, _ in rendered])
    out = []
    for (ids, starts), (_, spans) in zip(tokens, rendered, strict=True):
        if train_on_prompt:
            out.append((ids, np.ones(len(ids), dtype=bool)))
            continue
        begin = np.asarray([b for b, _ in spans], dtype=np.int64)
        end = np.asarray([e for _, e in spans], dtype=np.int64)
        span = np.searchsorted(end, starts, side="right")  # the first span ending after the token starts
        inside = span < len(spans)
        inside[inside] = begin[span[inside]] <= starts[inside]
        out.append((ids, inside))
    return out


def encode_pairs(
    tokenizer: Any, template: ChatTemplate, pairs: list[tuple[list[dict], str, Sequence[dict], str]]
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Each (prompt turns + chosen reply, rejected reply, tools, source) as two sequences that share the
    prompt's tokens exactly: the prompt (rendered up to the assistant's turn) is tokenized once, each reply's
    rest of the rendering on its own, and only the reply's tokens are targets."""
    texts, parts = [], []
    for messages, rejected, tools, src in pairs:
        prompt = render(tokenizer, template, messages[:-1], generation_prompt=True, tools=tools)
        replies = []
        for reply in (messages[-1]["content"], rejected):
            conversation = [*messages[:-1], {"role": "assistant", "content": reply}]
            full = render(tokenizer, template, conversation, tools=tools)
            check_tools(tokenizer, template, conversation, tools, full, src)
            if not full.startswith(prompt):
                raise DataError(
                    f"{src}: the chat template does not render the prompt as a prefix of the conversation, "
                    f"so the reply's tokens cannot be located; use data.template=chatml"
                )
            replies.append(full[len(prompt) :])
        parts.append(len(texts))
        texts += [prompt, *replies]
    tokens = [ids for ids, _ in tokenize(tokenizer, texts)]
    out = []
    for i in parts:
        prompt = tokens[i]
        out.append(
            [
                (np.concatenate([prompt, reply]), np.arange(len(prompt) + len(reply)) >= len(prompt))
                for reply in (tokens[i + 1], tokens[i + 2])
            ]
        )
    return out


def encode_texts(tokenizer: Any, texts: list[str], bos: bool = True) -> list[np.ndarray]:
    """Pretraining documents: BOS (if the tokenizer has one, and `bos`) + tokens + EOS, so documents stay
    separable."""
    bos, eos = tokenizer.bos_token_id if bos else None, tokenizer.eos_token_id
    head = np.asarray([] if bos is None else [bos], dtype=np.uint32)
    tail = np.asarray([] if eos is None else [eos], dtype=np.uint32)
    return [np.concatenate([head, ids, tail]) for ids, _ in tokenize(tokenizer, texts)]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """One pretraining document's token ids (see encode_texts)."""
    return encode_texts(tokenizer, [text])[0].tolist()
