"""Chat templates in two model families' formats, written for the tests (the demo tokenizer's own is plain
ChatML): Qwen 2.5's tool format (a default system message, the functions listed in it, calls in
<tool_call> tags, results as <tool_response> user turns) and Qwen3's thinking switch (a thought block on the
replies after the last question; `enable_thinking=false` puts an empty one in the generation prompt). Each
renders as LLaMA-Factory's `qwen` / `qwen3` template encodes, which is what tests/lf checks."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import TOKENIZER

QWEN_TOOLS = r"""
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = messages[0].content -%}{%- set turns = messages[1:] -%}
{%- else -%}
  {%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}
  {%- set turns = messages -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system -}}
{%- if tools -%}
  {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' -}}
  {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, ' -}}
  {{- '"arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in turns -%}
  {%- if message.role == 'assistant' -%}
    {{- '<|im_start|>assistant' -}}
    {%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}
    {%- for call in message.tool_calls or [] -%}
      {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' -}}
      {{- (call.function.arguments | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or turns[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
    {%- if loop.last or turns[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# Qwen 2.5's call format (<tool_call> blocks, <tool_response> results) with a short system turn listing the
# functions by name and arguments: the demo tokenizer spends 600 tokens on Qwen's own tool preamble; a tiny
# model learns the calls from rows of under 200 tokens in a few hundred steps (tests/e2e/test_tool_calls.py).
HERMES_SHORT = r"""
{%- if tools -%}
  {{- '<|im_start|>system\n<tools>' -}}
  {%- for tool in tools -%}
    {{- ' ' + tool.function.name + '(' + (tool.function.parameters.properties | list | join(', ')) + ')' -}}
  {%- endfor -%}
  {{- ' </tools><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'assistant' -%}
    {{- '<|im_start|>assistant' -}}
    {%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}
    {%- for call in message.tool_calls or [] -%}
      {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' -}}
      {{- (call.function.arguments | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

QWEN3_THINKING = r"""
{%- if messages and messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}{%- set turns = messages[1:] -%}
{%- else -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in turns -%}
  {%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in turns -%}
  {%- if message.role == 'assistant' -%}
    {%- set content = message.content -%}{%- set thought = '' -%}
    {%- if '</think>' in content -%}
      {%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query and (loop.last or thought) -%}
      {{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
"""


def tokenizer_with(template: str, folder: Path) -> Path:
    """The demo tokenizer with `template` as its chat template, in `folder`."""
    shutil.copytree(TOKENIZER, folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").write_text(template.strip() + "\n")
    return folder
