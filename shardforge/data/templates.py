"""Chat formatting with the tokenizer's own Jinja template, and which tokens are the assistant's.

The assistant spans are found by rendering growing prefixes of the conversation: the text added by an
assistant turn is what the template renders for it, whatever the template looks like. Tokens whose first
character lies inside such a span are trained on.
"""

from __future__ import annotations

from typing import Any

from shardforge.errors import DataError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def resolve_template(tokenizer: Any, name: str) -> str:
    """The Jinja template to use: the tokenizer's own for "auto" (ChatML if it has none), or a named one."""
    if name == "chatml":
        return CHATML
    return getattr(tokenizer, "chat_template", None) or CHATML


def render(tokenizer: Any, template: str, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def assistant_spans(
    tokenizer: Any, template: str, messages: list[dict], source: str
) -> tuple[str, list[tuple]]:
    """The rendered conversation and the [start, end) character spans of each assistant turn."""
    text = render(tokenizer, template, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, template, messages[:i], generation_prompt=True)
        through = render(tokenizer, template, messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                f"{source}: the chat template does not render conversations prefix by prefix, so assistant "
                f"tokens cannot be located; use data.template=chatml or data.train_on_prompt=true"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode_chat(
    tokenizer: Any, template: str, messages: list[dict], train_on_prompt: bool, source: str
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is a training target."""
    text, spans = assistant_spans(tokenizer, template, messages, source)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_on_prompt:
        return ids, [True] * len(ids)
    trained, span_i = [], 0
    for start, _ in enc["offset_mapping"]:
        while span_i < len(spans) and start >= spans[span_i][1]:
            span_i += 1
        trained.append(span_i < len(spans) and spans[span_i][0] <= start)
    return ids, trained


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A pretraining document: BOS (if the tokenizer has one) + tokens + EOS, so documents stay separable."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
