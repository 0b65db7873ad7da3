"""A tiny ``model_type: kimi_k2`` checkpoint with a tiktoken tokenizer serves chat through the
real ``openai`` client: Kimi's chat format, generation stops on ``<|im_end|>``."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import openai
import pytest
import uvicorn
from safetensors.numpy import load_file, save_file

import openinfer
from openinfer.frontend.http import create_app
from openinfer.tokenizer import Tokenizer
from tests.helpers.engine_utils import make_request, run_one
from tests.helpers.tiny_deepseek_v3 import write_tiny_deepseek_v3
from tests.helpers.tiny_kimi_tokenizer import write_kimi_tokenizer

MODEL = "tiny-kimi-k2"


class LiveServer:
    """The ASGI app under uvicorn on an ephemeral port, in a background thread."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Random weights, then the lm_head rows of the 3rd greedy reply token and <|im_end|> swapped,
    so greedy decoding answers two tokens and then ends the message."""
    directory = tmp_path_factory.mktemp("kimi") / MODEL
    specials = write_kimi_tokenizer(directory)
    write_tiny_deepseek_v3(directory, seed=5, vocab_size=specials["vocab_size"], bos_token_id=specials["[BOS]"],
                           eos_token_id=specials["[EOS]"])  # config.json names [EOS]; the plugin adds <|im_end|>
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(directory)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    engine = openinfer.create_engine(str(directory), device="cpu", num_kv_blocks=64)
    try:
        greedy = run_one(engine, make_request("probe", prompt, max_tokens=3)).token_ids
    finally:
        asyncio.run(engine.close())
    im_end = specials["<|im_end|>"]
    assert im_end not in greedy and greedy[2] not in greedy[:2]
    tensors = load_file(directory / "model.safetensors")
    head = tensors["lm_head.weight"]
    head[[greedy[2], im_end]] = head[[im_end, greedy[2]]]
    save_file(tensors, directory / "model.safetensors")
    return directory, specials, greedy[:2]


def test_kimi_chat_through_the_openai_client_stops_on_im_end(model_dir):
    directory, specials, reply = model_dir
    engine = openinfer.create_engine(str(directory), device="cpu", num_kv_blocks=64)
    assert engine.info().plugin == "openinfer-kimi-k2" and specials["<|im_end|>"] in engine.info().eos_token_ids
    tokenizer = Tokenizer.from_dir(engine.info().tokenizer_path)
    try:
        with LiveServer(create_app(engine, tokenizer, MODEL)) as live:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
            response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
            streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                                           temperature=0, stream=True))
    finally:
        asyncio.run(engine.close())
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == tokenizer.decode(reply)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice.message.content
    assert response.usage.completion_tokens == 3  # two reply tokens and <|im_end|>
    # Kimi's chat format, token by token
    word = tokenizer.encode
    expected = ([specials["<|im_system|>"], *word("system"), specials["<|im_middle|>"],
                 *word("You are Kimi, an AI assistant created by Moonshot AI."), specials["<|im_end|>"],
                 specials["<|im_user|>"], *word("user"), specials["<|im_middle|>"], *word(MESSAGES[0]["content"]),
                 specials["<|im_end|>"], specials["<|im_assistant|>"], *word("assistant"), specials["<|im_middle|>"]])
    assert response.usage.prompt_tokens == len(expected)
    assert tokenizer.encode(tokenizer.apply_chat_template(MESSAGES)) == expected


def test_tiktoken_vocabulary_equals_tiktoken_and_round_trips(model_dir):
    import tiktoken

    from openinfer.tiktoken_tokenizer import KIMI_PATTERN, read_tiktoken_ranks

    directory, specials, _ = model_dir
    tokenizer = Tokenizer.from_dir(directory)
    ranks = read_tiktoken_ranks(directory / "tiktoken.model")
    reference = tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={"<|im_end|>": specials["<|im_end|>"],
                                                  "<|im_user|>": specials["<|im_user|>"]})
    texts = ["Paris is the capital of France. 中文 🙂", "The  quick\n\n brown fox's 12345 jumps!!  ", "",
             "You are Kimi, an AI assistant created by Moonshot AI.", "the the THE The thé 1 22 333 4444 \t\r\n x",
             "Hello<|im_end|><|im_user|>user"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_end|>") == [specials["<|im_end|>"]]
    assert tokenizer.decode([specials["<|im_user|>"], *tokenizer.encode("hi")]) == "hi"
    assert tokenizer.vocab_size == specials["vocab_size"]
    assert tokenizer.raw.id_to_token(specials["[BOS]"] + 5) == f"<|reserved_token_{specials['[BOS]'] + 5}|>"
    detokenizer = tokenizer.detokenizer([])
    ids = tokenizer.encode(texts[0])
    assert "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush() == texts[0]
    assert np.unique(ids).size > 3
