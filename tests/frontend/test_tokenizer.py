"""The text side: loading, chat templates (HF semantics), incremental detokenization, stop strings."""

from __future__ import annotations

import json

import pytest
from tiny_checkpoints import byte_token_ids

from openinfer.errors import InvalidRequestError
from openinfer.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, TokenizerNotFoundError


def test_loads_special_tokens_and_generation_eos(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    im_end, endoftext = tokenizer.raw.token_to_id("<|im_end|>"), tokenizer.raw.token_to_id("<|endoftext|>")
    assert tokenizer.eos_token_ids == [im_end, endoftext]  # generation_config.json wins
    assert tokenizer.bos_token is None and tokenizer.bos_token_id is None
    assert tokenizer.decode(tokenizer.encode("héllo 你好 🙂")) == "héllo 你好 🙂"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert with_prompt == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                           "<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert without == with_prompt.removesuffix("<|im_start|>assistant\n")


def test_chat_template_text_parts_are_joined(tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\na\nb<|im_end|>" in tokenizer.apply_chat_template(messages)


def test_chat_template_raise_exception_is_invalid_request(tokenizer):
    with pytest.raises(InvalidRequestError, match="unsupported role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_image_parts_are_refused(tokenizer):
    with pytest.raises(InvalidRequestError, match="image_url"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_hf_globals_bos_eos_tojson_strftime_and_trim(tokenizer_dir, tmp_path):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|endoftext|>"}
    config["chat_template"] = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "  {{ m['content'] | tojson }}|{{ strftime_now('%Y') | length }}\n"
        "{% endfor %}{{ eos_token }}")
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "é<b>"}])
    # trim_blocks/lstrip_blocks drop the {% %} lines (not text around {{ }}); tojson keeps non-ASCII
    # and does not HTML-escape
    assert rendered == '<|endoftext|>\n  "é<b>"|4\n<|im_end|>'


def test_generation_tag_renders_its_body(plain_tokenizer_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((plain_tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}<{{ m['content'] }}>{% endgeneration %}{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "assistant", "content": "a"}]) == "<a>"


def test_no_chat_template_is_invalid_request(plain_tokenizer_dir):
    tokenizer = Tokenizer.from_dir(plain_tokenizer_dir)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_is_used(plain_tokenizer_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((plain_tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_detokenizer_never_splits_a_character(tokenizer):
    text = "a é 你好 🙂!"
    ids = byte_token_ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt:"))
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    # every character arrives whole: bytes of a multi-byte character are held back
    assert [d for d in deltas if d] == ["a", " ", "é", " ", "你", "好", " ", "🙂", "!"]


def test_detokenizer_flushes_an_incomplete_character(tokenizer):
    ids = byte_token_ids(tokenizer, "ok 你")[:-1]  # last character cut after two of its three bytes
    detok = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(detok.push([i]) for i in ids)
    assert emitted == "ok "
    assert detok.flush() == tokenizer.decode(ids)[len("ok "):]


def test_detokenizer_skips_special_tokens(tokenizer):
    im_end = tokenizer.raw.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(tokenizer.encode("hi")) + detok.push([im_end]) + detok.flush() == "hi"


@pytest.mark.parametrize(("pieces", "stops", "expected_text", "stopped"), [
    (["Hel", "lo wo", "rld"], ["wor"], "Hello ", True),
    (["a", "b", "c"], ["bd"], "abc", False),
    (["xx", "STO", "P yy"], ["STOP"], "xx", True),
    (["one", " two"], ["two", "on"], "", True),
    (["ab"], [], "ab", False),
])
def test_stop_strings(pieces, stops, expected_text, stopped):
    matcher = StopStringMatcher(stops)
    out, found = "", False
    for piece in pieces:
        text, found = matcher.push(piece)
        out += text
        if found:
            break
    if not found:
        out += matcher.flush()
    assert (out, found) == (expected_text, stopped)


def test_stop_string_prefix_is_withheld_until_disproved():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("answer </") == ("answer ", False)
    assert matcher.push("b>") == ("</b>", False)


def test_token_bytes_of_sentencepiece_byte_fallback_pieces(tmp_path):
    """Metaspace pieces: '▁' is a space, '<0xNN>' pieces are that byte; an emoji split into byte
    pieces joins back to its UTF-8."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models

    byte_pieces = {f"<0x{b:02X}>": b for b in range(256)}
    vocab = {"<unk>": 0, "▁Hello": 1, "▁wörld": 2, **{piece: 3 + b for piece, b in byte_pieces.items()}}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = Tokenizer(raw)
    assert tokenizer.token_bytes(1) == b" Hello" and tokenizer.token_text(2) == " wörld"
    emoji = "🙂".encode()
    ids = [3 + b for b in emoji]
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == emoji
    assert tokenizer.token_text(ids[0]) == "\\xf0"
