"""Built-in chat turn formats (Jinja templates) for files without `tokenizer.chat_template`: the
architecture table (arch.py) names one per architecture as its `chat_fallback`."""

from __future__ import annotations

# Gemma's turns: no system role, so system text opens the next user turn; the model's role is "model".
GEMMA_TURNS = r"""{{- bos_token -}}
{%- set ns = namespace(system='', pending=false) -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- set ns.system = (ns.system + '\n\n' if ns.pending else '') + (message.content | trim) -%}
    {%- set ns.pending = true -%}
  {%- else -%}
    {{- '<start_of_turn>' + ('model' if message.role == 'assistant' else 'user') + '\n' -}}
    {%- if ns.pending and message.role == 'user' -%}
      {{- ns.system + '\n\n' -}}
      {%- set ns.pending = false -%}
    {%- endif -%}
    {{- (message.content | trim) + '<end_of_turn>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if ns.pending -%}
  {{- '<start_of_turn>user\n' + ns.system + '<end_of_turn>\n' -}}
{%- endif -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# Llama 2 chat ([INST] turns, system text in <<SYS>> inside the next user turn).
LLAMA2_INST = r"""{%- set ns = namespace(system='', pending=false) -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- set ns.system = (ns.system + '\n\n' if ns.pending else '') + (message.content | trim) -%}
    {%- set ns.pending = true -%}
  {%- elif message.role == 'user' -%}
    {{- bos_token + '[INST] ' -}}
    {%- if ns.pending -%}
      {{- '<<SYS>>\n' + ns.system + '\n<</SYS>>\n\n' -}}
      {%- set ns.pending = false -%}
    {%- endif -%}
    {{- (message.content | trim) + ' [/INST]' -}}
  {%- else -%}
    {{- ' ' + (message.content | trim) + ' ' + eos_token -}}
  {%- endif -%}
{%- endfor -%}
{%- if ns.pending -%}
  {{- bos_token + '[INST] <<SYS>>\n' + ns.system + '\n<</SYS>>\n\n [/INST]' -}}
{%- endif -%}
"""

# ChatML (Qwen's turns): <|im_start|>role, the content, <|im_end|>; a system turn as its own turn.
CHATML = r"""{%- for message in messages -%}
  {{- '<|im_start|>' + message.role + '\n' + (message.content | trim) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
