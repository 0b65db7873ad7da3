"""Tiny model directories whose tokenizers carry the special tokens and chat formats of Qwen3,
Kimi-K2 and DeepSeek-V4 (the real tokenizer files are not available offline): a byte-level BPE
trained here plus each family's markers, a chat template in that family's format (tools, tool
calls, tool results, thinking), and a tiny random Qwen3 network sized to the vocabulary.

The templates follow the formats documented in ``/work/shared/MODELS.md`` and the models' own
templates/encoders; they are the test fixtures of the parsers, not copies of those files.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_checkpoints import CORPUS, write_tiny_qwen3
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN3_TEMPLATE = r"""
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
{% if loop.first and message.content %}
{% endif %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

KIMI_TEMPLATE = r"""
{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}
{%- if messages[0].role != 'system' %}<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}<|im_system|>system<|im_middle|>{{ message.content }}<|im_end|>
{%- elif message.role == 'user' %}<|im_user|>user<|im_middle|>{{ message.content }}<|im_end|>
{%- elif message.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>
{%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{- message.content or '' }}
{%- if message.tool_calls %}<|tool_calls_section_begin|>
{%- for call in message.tool_calls %}<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>{{ call.function.arguments | tojson }}<|tool_call_end|>{% endfor %}
{%- endif %}{% if message.tool_calls %}<|tool_calls_section_end|>{% endif %}<|im_end|>
{%- elif message.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ message.tool_call_id }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"""

DSV4_TEMPLATE = r"""
{%- set thinking = (thinking is defined and thinking) or (enable_thinking is defined and enable_thinking) %}
{%- set last_user = namespace(index=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set last_user.index = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token }}
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}

## Tools
You can invoke functions by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>

<functions>
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}</functions>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<｜User｜>{{ message.content }}<｜Assistant｜>{% if thinking and loop.index0 == last_user.index %}<think>{% else %}</think>{% endif %}
{%- elif message.role == 'assistant' %}
{%- if thinking and loop.index0 > last_user.index %}{{ message.reasoning_content or '' }}</think>{% endif %}
{{- message.content or '' }}
{%- if message.tool_calls %}

<｜DSML｜tool_calls>
{% for call in message.tool_calls %}<｜DSML｜invoke name="{{ call.function.name }}">
{% for key, value in call.function.arguments.items() %}<｜DSML｜parameter name="{{ key }}" string="{{ 'true' if value is string else 'false' }}">{{ value if value is string else value | tojson }}</｜DSML｜parameter>
{% endfor %}</｜DSML｜invoke>
{% endfor %}</｜DSML｜tool_calls>
{%- endif %}<｜end▁of▁sentence｜>
{%- elif message.role == 'tool' %}

<function_results>
<result>{{ message.content }}</result>
</function_results>

{% if thinking and loop.index0 > last_user.index %}<think>{% else %}</think>{% endif %}
{%- endif %}
{%- endfor %}"""

# name → (special tokens (never split, skipped when decoding with skip_special_tokens),
#         added non-special tokens, eos tokens, bos token, chat template)
FAMILIES = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              ["<|im_end|>", "<|endoftext|>"], None, QWEN3_TEMPLATE),
    "kimi_k2": (["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>",
                 "[PAD]"],
                [], ["<|im_end|>", "[EOS]"], "[BOS]", KIMI_TEMPLATE),
    "deepseek_v4": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                    ["<think>", "</think>"], ["<｜end▁of▁sentence｜>"], "<｜begin▁of▁sentence｜>", DSV4_TEMPLATE),
}
EXTRA_CORPUS = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', "functions.get_weather:0",
                '<｜DSML｜invoke name="x">', 'string="true"', "</｜DSML｜parameter>"]


def write_family_tokenizer(directory: Path, family: str, vocab_size: int = 420) -> int:
    """Write tokenizer.json / tokenizer_config.json / generation_config.json for ``family``."""
    special, added, eos, bos, template = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((CORPUS + EXTRA_CORPUS) * 20, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in special + added}
    config = {"bos_token": bos, "eos_token": eos[0], "chat_template": template.strip("\n"),
              "added_tokens_decoder": {str(ids[t]): {"content": t, "special": t in special} for t in special + added}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[t] for t in eos]}))
    return tokenizer.get_vocab_size()


def write_family_model(directory: Path, family: str, seed: int = 0, max_position_embeddings: int = 1024) -> Path:
    """A tiny random Qwen3 network behind ``family``'s tokenizer."""
    write_tiny_qwen3(directory, seed=seed, max_position_embeddings=max_position_embeddings,
                     tokenizer_writer=lambda d: write_family_tokenizer(d, family))
    return directory
