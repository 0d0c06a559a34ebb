"""A tiny random Qwen2 checkpoint whose chat template renders tools, the way tool-calling models ship.

The weights are tiny_models' random Qwen2 (6 blocks, vocab 320); the tokenizer is the byte-level one of
byte_tokenizer.py plus ChatML's special tokens and `<tool_call>`/`</tool_call>` as added (non-special)
tokens, as Qwen2.5 has them. The template follows the Hermes convention many tool-calling models use: tool
signatures as JSON inside `<tools>` in the system turn, each call as `<tool_call>{"name": ..., "arguments":
...}</tool_call>`, results in `<tool_response>` user turns. The output is random text unless decoding is
constrained (tool_choice "required" or a named function), which is what the API's tests need.
"""

from __future__ import annotations

from pathlib import Path

from byte_tokenizer import byte_tokenizer
from tiny_models import tiny_config

TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

You may call functions; their signatures, one per line:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
To call one, answer <tool_call>{"name": <name>, "arguments": <arguments as JSON>}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def save_tool_model(path: Path) -> Path:
    """The checkpoint, its tokenizer and its tool-capable chat template, saved in `path`."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    config = tiny_config("qwen2")
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, 258, 256  # <|im_end|>, <eos>
    config.max_position_embeddings = 2048  # a byte per token: tool signatures take hundreds
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    raw = byte_tokenizer()  # ids 0-255 are bytes, 256 is <eos>
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # 257, 258
    raw.add_tokens(["<tool_call>", "</tool_call>"])  # 259, 260
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<eos>", chat_template=TOOL_TEMPLATE
    )
    tokenizer.save_pretrained(path)
    return path
