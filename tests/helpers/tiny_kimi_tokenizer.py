"""A tiny Kimi-style tiktoken tokenizer written by tests: byte-level BPE ranks trained on a few
sentences (``tiktoken.model``), Kimi's special-token layout and chat template (``tokenizer_config.json``)."""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

CORPUS = ("The quick brown fox jumps over the lazy dog. You are Kimi, an AI assistant created by Moonshot AI. "
          "What is the capital of France? Paris is the capital of France. Hello there, how are you today? "
          "system user assistant tool The the the and and and is is in in of of to to") * 3

# Kimi's special ids, as offsets from the first special id (163584 in the real vocabulary)
KIMI_SPECIAL_OFFSETS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
                        "[EOT]": 9, "<|im_system|>": 10, "<|im_middle|>": 17, "<think>": 22, "</think>": 23,
                        "[PAD]": 255}

# Kimi's format: <|im_system|>system<|im_middle|>…<|im_end|><|im_user|>user<|im_middle|>…<|im_end|>
# <|im_assistant|>assistant<|im_middle|>, with the default system prompt when none is given.
KIMI_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def train_byte_bpe(text: str, num_merges: int) -> dict[bytes, int]:
    """Ranks 0..255 for single bytes, then one rank per merge of the most frequent adjacent pair."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in word.encode()] for word in text.replace(" ", "  ").split(" ") if word]
    for _ in range(num_merges):
        pairs = Counter(p for word in words for p in zip(word, word[1:], strict=False))
        if not pairs:
            break
        (left, right), _count = pairs.most_common(1)[0]
        merged = left + right
        ranks[merged] = len(ranks)
        for i, word in enumerate(words):
            out, j = [], 0
            while j < len(word):
                if j + 1 < len(word) and word[j] == left and word[j + 1] == right:
                    out.append(merged)
                    j += 2
                else:
                    out.append(word[j])
                    j += 1
            words[i] = out
    return ranks


def write_kimi_tokenizer(directory: Path, num_merges: int = 64) -> dict[str, int]:
    """Write tiktoken.model and tokenizer_config.json; returns the
    special token ids (vocabulary size = ``num_base + 256``)."""
    directory.mkdir(parents=True, exist_ok=True)
    ranks = train_byte_bpe(CORPUS, num_merges)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda x: x[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    num_base = len(ranks)
    specials = {name: num_base + offset for name, offset in KIMI_SPECIAL_OFFSETS.items()}
    config = {
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
        "added_tokens_decoder": {str(i): {"content": name, "special": True} for name, i in specials.items()},
        "chat_template": KIMI_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    specials["vocab_size"] = num_base + 256
    return specials
