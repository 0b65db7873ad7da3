"""Structured-output constraints, bitmasks and the sampler's logit_bias / mask handling (no model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from openinfer.errors import InvalidRequestError
from openinfer.sampling import SamplingState, sample_row, validate_sampling
from openinfer.structured import (
    GrammarCompiler,
    allocate_bitmask,
    allowed_tokens,
    apply_bitmask,
    check_constraint,
    grammar_tokenizer_json,
)
from openinfer.v1 import engine_pb2 as pb


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(['{"a": 1, "b": [true, false]}', "yes no maybe"] * 10, trainer=trainer)
    raw.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    return raw


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_str(), tokenizer.get_vocab_size() + 5, [tokenizer.token_to_id("<eos>")])


@pytest.mark.parametrize(("constraint", "named"), [
    (pb.StructuredOutput(json_schema="{not json"), "not valid JSON"),
    (pb.StructuredOutput(json_schema="[1, 2]"), "JSON Schema is an object"),
    (pb.StructuredOutput(json_schema=json.dumps({"type": "wat"})), "wat"),
    (pb.StructuredOutput(json_schema=json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (pb.StructuredOutput(regex="a("), "unclosed group"),
    (pb.StructuredOutput(regex=""), "empty"),
    (pb.StructuredOutput(choice=pb.ChoiceList()), "at least one"),
    (pb.StructuredOutput(grammar="start: (("), "grammar"),
    (pb.StructuredOutput(), "no kind"),
])
def test_bad_constraints_name_the_problem(constraint, named):
    with pytest.raises(InvalidRequestError) as error:
        check_constraint(constraint)
    assert named in str(error.value) and error.value.field == "structured_output"


def walk(compiler: GrammarCompiler, tokenizer: Tokenizer, constraint: pb.StructuredOutput, seed: int) -> str:
    """Sample uniformly among allowed tokens until the grammar ends; the text generated."""
    rng = np.random.default_rng(seed)
    matcher = compiler.compile(constraint)
    eos = tokenizer.token_to_id("<eos>")
    ids = []
    for _ in range(200):
        bitmask = allocate_bitmask(1, compiler.vocab_size)
        matcher.fill(bitmask[0])
        allowed = np.nonzero(allowed_tokens(bitmask[0], compiler.vocab_size))[0]
        assert allowed.max() < tokenizer.get_vocab_size()  # padding ids are never allowed
        token = int(rng.choice(allowed))
        if token == eos:
            return tokenizer.decode(ids)
        assert matcher.accept(token)
        ids.append(token)
    raise AssertionError("the grammar did not end")


def test_choice_and_regex_hold_under_random_walks(compiler, tokenizer):
    for seed in range(10):
        assert walk(compiler, tokenizer, pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no", "maybe"])),
                    seed) in ("yes", "no", "maybe")
        assert len(walk(compiler, tokenizer, pb.StructuredOutput(regex="[ab]{2,4}"), seed)) in (2, 3, 4)


def test_json_schema_walks_give_compact_valid_json(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "array", "items": {
        "type": "boolean"}, "maxItems": 2}}, "required": ["a", "b"], "additionalProperties": False}
    for seed in range(5):
        text = walk(compiler, tokenizer, pb.StructuredOutput(json_schema=json.dumps(schema)), seed)
        value = json.loads(text)
        assert value["a"] in (1, 2) and len(value["b"]) <= 2
        assert text == json.dumps(value)  # Python's separators, no other whitespace


def test_non_special_added_tokens_are_text_for_the_grammar(compiler, tokenizer):
    moved = json.loads(grammar_tokenizer_json(tokenizer.to_str()))
    token_id = tokenizer.token_to_id("<tool_call>")
    assert moved["model"]["vocab"]["<tool_call>"] == token_id
    assert all(t["content"] != "<tool_call>" for t in moved["added_tokens"])
    matcher = compiler.compile(pb.StructuredOutput(grammar='start: "<tool_call>" "yes"'))
    assert matcher.accept(token_id)  # the one-token spelling of the literal is consumable


def test_bitmask_layout_and_application():
    bitmask = allocate_bitmask(1, 70)
    assert bitmask.shape == (1, 3)
    bitmask[0] = 0
    bitmask[0, 0] = 1 << 3
    bitmask[0, 2] = 1 << (65 - 64)
    assert np.nonzero(allowed_tokens(bitmask[0], 70))[0].tolist() == [3, 65]
    logits = np.zeros(70, np.float32)
    apply_bitmask(logits, bitmask[0])
    assert np.isfinite(logits).sum() == 2


@pytest.mark.parametrize("vocab", [70, 96, 49152])
def test_mask_application_keeps_allowed_logits_exactly(vocab):
    rng = np.random.default_rng(vocab)
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(4, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1
    bitmask[2] = 0
    for row in bitmask:
        logits = rng.standard_normal(vocab).astype(np.float32)
        expected = np.where(allowed_tokens(row, vocab), logits, np.float32(-np.inf))
        assert np.array_equal(apply_bitmask(logits, row), expected)


def test_background_masks_equal_masks_computed_when_asked(tokenizer):
    """Matchers that compute their next mask on the background thread as they consume a token
    give the very masks of matchers that compute them on demand, row for row, along random walks
    of several requests at once."""
    vocab = tokenizer.get_vocab_size() + 5
    eos = [tokenizer.token_to_id("<eos>")]
    constraints = [pb.StructuredOutput(json_schema=json.dumps({"type": "array", "items": {"enum": [1, 2, True]}})),
                   pb.StructuredOutput(regex="(yes|no|maybe)( (yes|no|maybe)){0,8}"),
                   pb.StructuredOutput(json_object=True)] * 3
    background, on_demand = (GrammarCompiler(tokenizer.to_str(), vocab, eos, background_masks=flag)
                             for flag in (True, False))
    walkers = [(background.compile(c), on_demand.compile(c)) for c in constraints]
    rng = np.random.default_rng(0)
    for step in range(30):
        live = [(i, pair) for i, pair in enumerate(walkers) if not pair[1].is_terminated()]
        if not live:
            break
        masks = [allocate_bitmask(len(walkers), vocab) for _ in range(2)]
        if step:  # every live matcher has consumed a token: its next mask came from the background
            assert all(fast.computed_mask() is not None and slow.computed_mask() is None for _, (fast, slow) in live)
        for side in range(2):
            compiler = (background, on_demand)[side]
            compiler.fill_bitmasks([(pair[side], i) for i, pair in live], masks[side])
        assert np.array_equal(masks[0], masks[1])
        for i, (fast, slow) in live:
            token = int(rng.choice(np.nonzero(allowed_tokens(masks[1][i], vocab))[0]))
            assert fast.accept(token) == slow.accept(token)


EXIT_MID_FILL = """
import json, sys
import numpy as np
from openinfer.structured import GrammarCompiler, allocate_bitmask, allowed_tokens
from openinfer.v1 import engine_pb2 as pb
tokenizer_json = open(sys.argv[1]).read()
compiler = GrammarCompiler(tokenizer_json, int(sys.argv[2]), [0], background_masks=True)
schema = {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}, "minItems": 50}
matchers = [compiler.compile(pb.StructuredOutput(json_schema=json.dumps(schema))) for _ in range(64)]
bitmask = allocate_bitmask(64, int(sys.argv[2]))
compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
for i, m in enumerate(matchers):
    m.accept(int(np.nonzero(allowed_tokens(bitmask[i], int(sys.argv[2])))[0][0]))
print("exiting while the background thread fills 64 masks")
"""


def test_exiting_while_masks_are_computed_in_the_background_is_clean():
    """The interpreter exits right after the last tokens were consumed: the background thread is
    closed first (without that, its llguidance call wrote into freed memory: a segfault). On the
    demo model's 49k vocabulary, where filling 64 masks takes long enough to be caught in it."""
    import subprocess
    import sys

    from openinfer.demo import ensure_demo_model

    try:
        directory = ensure_demo_model(progress=False)
    except Exception as exc:  # the demo package is part of the CI install; say why when it is missing
        pytest.skip(f"demo model unavailable: {exc}")
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", EXIT_MID_FILL, str(directory / "tokenizer.json"), str(vocab)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]


def state(**fields) -> SamplingState:
    params = pb.SamplingParams(**{k: v for k, v in fields.items() if k != "logit_bias"})
    params.logit_bias.update(fields.get("logit_bias", {}))
    return SamplingState.create(params, [1, 2], 0, 0)


def test_logit_bias_forces_and_forbids():
    logits = np.linspace(0, 5, 50).astype(np.float32)
    assert sample_row(logits.copy(), state(temperature=0.0)).token_id == 49
    assert sample_row(logits.copy(), state(temperature=0.0, logit_bias={7: 100.0})).token_id == 7
    assert sample_row(logits.copy(), state(temperature=0.0, logit_bias={49: -100.0})).token_id == 48
    forced = state(temperature=1.0, seed=3, logit_bias={11: 100.0})
    assert {sample_row(logits.copy(), forced).token_id for _ in range(20)} == {11}
    # logprobs stay those of the model (before the bias), as vLLM returns by default
    result = sample_row(logits.copy(), state(temperature=0.0, logit_bias={7: 100.0}), want_logprob=True)
    assert result.logprob < -4


def test_logit_bias_out_of_range_is_refused():
    params = pb.SamplingParams()
    params.logit_bias[3] = 100.5
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        validate_sampling(params)


def test_mask_wins_over_min_tokens_when_only_a_stop_is_allowed():
    bitmask = allocate_bitmask(1, 10)
    bitmask[0] = 1 << 9  # the grammar is complete: only the stop token 9 may follow
    token = sample_row(np.zeros(10, np.float32), state(temperature=0.0), banned_ids=[9], bitmask_row=bitmask[0])
    assert token.token_id == 9


def test_tiktoken_vocabularies_are_served_too(tmp_path):
    """Kimi-K2 ships tiktoken.model instead of tokenizer.json: the grammar uses it as is."""
    from openinfer.tokenizer import Tokenizer as TextTokenizer
    from tests.helpers.tiny_kimi_tokenizer import write_kimi_tokenizer

    ids = write_kimi_tokenizer(tmp_path)
    text = TextTokenizer.from_dir(tmp_path)
    eos = ids["<|im_end|>"]
    compiler = GrammarCompiler.from_dir(str(tmp_path), text.vocab_size, [eos])
    matcher = compiler.compile(pb.StructuredOutput(grammar='start: <think> "ok"'))
    assert matcher.accept(ids["<think>"])
    for token in text.encode("ok", add_special_tokens=False):
        assert matcher.accept(token)
    bitmask = allocate_bitmask(1, text.vocab_size)
    matcher.fill(bitmask[0])
    assert np.nonzero(allowed_tokens(bitmask[0], text.vocab_size))[0].tolist() == [eos]


def test_a_vocabulary_the_grammar_engine_cannot_read_is_a_clear_refusal(tmp_path):
    from tokenizers import decoders as raw_decoders
    from tokenizers import models as raw_models

    from openinfer.structured import CompilerCache

    raw = Tokenizer(raw_models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    raw.decoder = raw_decoders.Fuse()
    raw.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(InvalidRequestError, match="not available for this model"):
        CompilerCache(str(tmp_path), 2, [0]).get()
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        CompilerCache(str(tmp_path / "missing"), 2, [0]).get()
