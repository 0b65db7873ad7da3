"""Tiny model directories written by tests: a byte-level BPE tokenizer trained here with
``tokenizers`` (ChatML special tokens and chat template), and a random Qwen3 checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! What is the capital of France? Paris is the capital of France.",
    "one two three four five six seven eight nine ten",
    "héllo wörld, naïve café, crème brûlée",
    "你好世界，今天天气很好。",
    "emoji: 🙂 🎉 🚀 ✨",
    "def main():\n    return 42\n",
]


def write_tokenizer(directory: Path, chat_template: str | None = CHATML_TEMPLATE, vocab_size: int = 400) -> int:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json; return the vocab size."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in ids.items()},
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    return tokenizer.get_vocab_size()


def write_tiny_qwen3(directory: Path, seed: int = 0, max_position_embeddings: int = 512,
                     tokenizer_writer=write_tokenizer) -> None:
    """A 2-layer random Qwen3 (float32 safetensors) sharing the tokenizer written beside it
    (``tokenizer_writer(directory)`` writes it and returns its vocabulary size)."""
    from safetensors.numpy import save_file

    vocab = tokenizer_writer(directory)
    eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    hidden, heads, kv_heads, head_dim, inter, layers = 64, 4, 2, 16, 128, 2
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": None, "eos_token_id": eos[0],
    }
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden, scale=1.0),
               "model.norm.weight": 1.0 + weight(hidden, scale=0.1),
               "lm_head.weight": weight(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1.0 + weight(hidden, scale=0.1),
            p + "post_attention_layernorm.weight": 1.0 + weight(hidden, scale=0.1),
            p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": 1.0 + weight(head_dim, scale=0.1),
            p + "self_attn.k_norm.weight": 1.0 + weight(head_dim, scale=0.1),
            p + "mlp.gate_proj.weight": weight(inter, hidden),
            p + "mlp.up_proj.weight": weight(inter, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inter),
        }
    save_file(tensors, str(directory / "model.safetensors"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of ``text`` (so multi-byte characters are split across tokens)."""
    table = _bytes_to_unicode()
    ids = [tokenizer.raw.token_to_id(table[b]) for b in text.encode("utf-8")]
    assert all(i is not None for i in ids), "the byte-level alphabet is in every tokenizer written here"
    return ids
