"""Chat templates render exactly as Hugging Face transformers renders them (a test-only dependency)."""

from __future__ import annotations

import json

import pytest

from openinfer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# Exercises what real templates use: namespace, reverse loops, slicing, loop controls, string
# methods, `is string`, tojson on tools, raise_exception, bos/eos variables, extra kwargs.
RICH_TEMPLATE = """{{- bos_token -}}
{%- if tools %}
<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
{%- if ns.last_user == -1 and message.role == 'user' %}{% set ns.last_user = messages|length - 1 - loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role not in ['user', 'assistant'] %}{{ raise_exception('bad role: ' + message.role) }}{% endif %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'assistant' and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + content.strip() }}
{%- if loop.index0 == ns.last_user %} [last user]{% endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
{{- eos_token if not add_generation_prompt else '' }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": " hello "},
     {"role": "assistant", "content": "<think>hmm</think>\n\nHi!"}, {"role": "user", "content": "é 你好 🙂"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo",
                                           "parameters": {"type": "object", "properties": {"city": {}}}}}]


@pytest.fixture(scope="module")
def model_dir(tokenizer_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("rich_template")
    for name in ("tokenizer.json", "generation_config.json"):
        (directory / name).write_bytes((tokenizer_dir / name).read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config |= {"chat_template": RICH_TEMPLATE, "bos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def ours(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def theirs(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}, {"enable_thinking": False}])
def test_rendering_matches_transformers(ours, theirs, conversation, add_generation_prompt, extra):
    messages = CONVERSATIONS[conversation]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                          **extra)
    tools = extra.get("tools")
    kwargs = {k: v for k, v in extra.items() if k != "tools"}
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    **kwargs) == expected
    expected_ids = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              **extra)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    assert ours.encode(rendered, add_special_tokens=False) == list(expected_ids)


def test_raise_exception_matches(ours, theirs):
    messages = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="bad role: tool"):
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(Exception, match="bad role: tool"):
        ours.apply_chat_template(messages)
