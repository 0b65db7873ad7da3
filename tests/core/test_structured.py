"""Structured-output constraints, bitmasks and the sampler's logit_bias / mask handling (no model)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from openinfer.errors import InvalidRequestError
from openinfer.sampling import SamplingState, sample_row, validate_sampling
from openinfer.structured import (
    GrammarCompiler,
    StepMasks,
    allocate_bitmask,
    allowed_tokens,
    apply_bitmask,
    apply_bitmasks,
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


def _random_bitmasks(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Random masks of every kind the packed application tells apart: dense random bits, all
    allowed / none allowed, a few allowed tokens, a few forbidden ones, and bits set past the
    vocabulary's end."""
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(rows, words), dtype=np.int64).astype(np.int32)
    for row in range(rows):
        kind = row % 5
        if kind == 1:
            bitmask[row] = -1 if row % 2 else 0
        elif kind in (2, 3):
            ids = rng.choice(vocab, size=int(rng.integers(1, max(2, vocab // 64))), replace=False)
            bits = np.zeros(words * 32, np.uint8)
            bits[ids] = 1
            packed = np.packbits(bits, bitorder="little").view(np.int32)
            bitmask[row] = packed if kind == 2 else ~packed  # a few allowed / a few forbidden
    return bitmask


def _table_gather_apply(logits: np.ndarray, bitmask_row: np.ndarray) -> np.ndarray:
    """The NumPy sampler's former mask application (a byte table gather and an add per row)."""
    table = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                     np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    return logits + table[bitmask_row.view(np.uint8)].reshape(-1)[:logits.shape[-1]]


@pytest.mark.parametrize("vocab", [33, 70, 4096, 49152, 151936])
def test_packed_bitmask_application_equals_the_former_one(vocab):
    """``apply_bitmasks`` (the whole step's packed masks, by index for sparse rows) gives exactly
    the logits of the former per-row table gather and of a boolean assignment, for random masks."""
    rng = np.random.default_rng(vocab)
    rows = 10
    bitmask = _random_bitmasks(rng, rows, vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    expected_gather = np.stack([_table_gather_apply(logits[i], bitmask[i]) for i in range(rows)])
    expected_bool = logits.copy()
    for i in range(rows):
        expected_bool[i][~allowed_tokens(bitmask[i], vocab)] = -np.inf
    batch = apply_bitmasks(logits.copy(), bitmask)
    assert np.array_equal(batch, expected_gather)
    assert np.array_equal(batch, expected_bool)
    assert np.array_equal(np.signbit(batch), np.signbit(expected_bool))  # allowed logits untouched, -0.0 included
    for i in range(rows):  # one row at a time, as sample_row applies it
        assert np.array_equal(apply_bitmask(logits[i].copy(), bitmask[i]), expected_bool[i])


def test_packed_bitmask_application_refuses_a_narrow_bitmask():
    with pytest.raises(ValueError):
        apply_bitmasks(np.zeros((2, 70), np.float32), np.zeros((2, 2), np.int32))


def test_background_masks_equal_masks_computed_when_asked(tokenizer):
    """A step's masks computed on the background worker (``start_masks``) are the very masks
    computed on the calling thread and row by row (``fill``), in the compact layout (one bitmask
    row per constrained logits row, ``mask_rows`` mapping the others to -1), along random walks
    of several requests at once; a matcher consuming a token waits for the computation first."""
    from openinfer.runtime.sampler import GrammarMasks

    vocab = tokenizer.get_vocab_size() + 5
    eos = [tokenizer.token_to_id("<eos>")]
    constraints = [pb.StructuredOutput(json_schema=json.dumps({"type": "array", "items": {"enum": [1, 2, True]}})),
                   pb.StructuredOutput(regex="(yes|no|maybe)( (yes|no|maybe)){0,8}"),
                   pb.StructuredOutput(json_object=True)] * 3
    background, on_demand = (GrammarCompiler(tokenizer.to_str(), vocab, eos, background_masks=flag)
                             for flag in (True, False))
    walkers = [(background.compile(c), on_demand.compile(c)) for c in constraints]
    rng = np.random.default_rng(0)
    num_rows = len(walkers) + 2  # rows 0 and 1 of the step carry no grammar
    for _ in range(30):
        live = [(i, pair) for i, pair in enumerate(walkers) if not pair[1].is_terminated()]
        if not live:
            break
        steps = [compiler.start_masks([(pair[side], i + 2) for i, pair in live], num_rows)
                 for side, compiler in enumerate((background, on_demand))]
        fast, slow = (masks.wait() for masks in steps)
        assert isinstance(fast, GrammarMasks)
        assert np.array_equal(fast.bitmask, slow.bitmask) and np.array_equal(fast.mask_rows, slow.mask_rows)
        assert fast.constrained == [i + 2 for i, _ in live] and fast.row(0) is None and fast.row(1) is None
        for i, (walker, _) in live:
            one = allocate_bitmask(1, vocab)
            walker.fill(one[0])
            assert np.array_equal(one[0], fast.row(i + 2))
        again = background.start_masks([(pair[0], i + 2) for i, pair in live], num_rows)
        for i, (fast_walker, slow_walker) in live:  # consuming waits for the computation under way
            token = int(rng.choice(np.nonzero(allowed_tokens(fast.row(i + 2), vocab))[0]))
            assert fast_walker.accept(token) == slow_walker.accept(token)
        again.wait()
    subset = fast.subset([2, 0, 4])
    assert subset.row(1) is None and np.array_equal(subset.row(0), fast.row(2))


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
compiler.start_masks([(m, i) for i, m in enumerate(matchers)], 64)
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


def test_step_sampler_with_packed_masks_equals_masking_row_by_row():
    """The NumPy step sampler applies a step's packed masks to its constrained rows at once
    (before penalties and logit_bias); every row samples the very token and logprobs that
    ``sample_row`` gives when it masks the row itself, over several steps of one batch mixing
    greedy, seeded, penalised, biased, logprob, min_tokens and unconstrained rows."""
    from types import SimpleNamespace

    from openinfer.runtime.batch_builder import LogitsRow
    from openinfer.runtime.sampler import GrammarMasks, sample_rows
    from openinfer.sampling import SamplingState, sample_row

    vocab, eos = 3000, [7]
    rng = np.random.default_rng(5)
    params = [pb.SamplingParams(temperature=0.0), pb.SamplingParams(temperature=1.0, seed=3, top_p=0.9),
              pb.SamplingParams(temperature=0.8, seed=4, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.2, logit_bias={5: 100.0, 9: -100.0, 11: 3.0}),
              pb.SamplingParams(temperature=1.0, seed=5, top_k=40), pb.SamplingParams(temperature=0.0),
              pb.SamplingParams(temperature=1.0, seed=6, min_p=0.05)]
    want_logprobs = [False, False, False, True, False, False]
    min_tokens = [0, 0, 0, 0, 3, 0]

    def requests():
        return [SimpleNamespace(sampling=SamplingState.create(p, [1, 2, 3], 0, i), want_logprobs=want_logprobs[i],
                                num_logprobs=2 if want_logprobs[i] else 0, num_output_tokens=0,
                                stop=pb.StopConditions(min_tokens=min_tokens[i], stop_token_ids=[8]))
                for i, p in enumerate(params)]

    batched, row_by_row = requests(), requests()
    backend = SimpleNamespace(to_host=lambda x: x)
    for step in range(4):
        logits = rng.standard_normal((len(params), vocab)).astype(np.float32) * 3
        bitmask = _random_bitmasks(rng, len(params), vocab)
        bitmask[:, 0] |= 1 << 7  # eos allowed, so min_tokens bans something
        constrained = frozenset(i for i in range(len(params)) if (i + step) % 4 != 0)
        masks = GrammarMasks.from_rows(bitmask, constrained)
        rows = [LogitsRow(r, 3 + step, True) for r in batched]
        got = sample_rows(backend, logits.copy(), rows, eos, masks)
        for i, request in enumerate(row_by_row):
            banned = [8, 7] if step < min_tokens[i] else []
            expected = sample_row(logits[i].copy(), request.sampling, banned, request.num_logprobs,
                                  request.want_logprobs, bitmask[i] if i in constrained else None)
            assert (got[i].token_id, got[i].logprob, got[i].top) == (expected.token_id, expected.logprob,
                                                                     expected.top)
            request.sampling.record(expected.token_id)
            batched[i].sampling.record(got[i].token_id)
            request.num_output_tokens += 1
            batched[i].num_output_tokens += 1


@pytest.mark.parametrize("on_worker", [True, False], ids=["worker_consumes", "caller_consumes"])
def test_pending_masks_consume_then_fill(tokenizer, on_worker):
    """``StepMasks.pending`` (a step sampled before its matchers consumed the previous tokens):
    ``start_masks(consume=..., into=...)`` advances the matchers by their tokens (in the worker's
    job, or first on the calling thread: ``tokens_consumed_on_worker``) and fills the pending
    masks on the worker; the masks equal those of matchers that accepted the same tokens one by
    one, rows whose request finished meanwhile allow everything, the ready callbacks run once
    (at once when registered after), a second start is refused, and abandoning a started step
    is a no-op while abandoning an unstarted one fails its ``wait``."""
    vocab = tokenizer.get_vocab_size() + 5
    eos = [tokenizer.token_to_id("<eos>")]
    constraints = [pb.StructuredOutput(regex="(yes|no|maybe)( (yes|no|maybe)){0,8}"),
                   pb.StructuredOutput(json_object=True), pb.StructuredOutput(regex="[a-z]{2,12}")]
    background, reference = (GrammarCompiler(tokenizer.to_str(), vocab, eos, background_masks=flag,
                                             tokens_consumed_on_worker=on_worker) for flag in (True, False))
    walkers = [(background.compile(c), reference.compile(c)) for c in constraints]
    rng = np.random.default_rng(3)
    rows = [1, 2, 4]  # logits rows 0 and 3 carry no grammar
    first = background.start_masks([(w, row) for (w, _), row in zip(walkers, rows, strict=True)], 5).wait()
    tokens = [int(rng.choice(np.flatnonzero(allowed_tokens(first.row(row), vocab)))) for row in rows]
    pending = StepMasks.pending(rows, 5, first.bitmask.shape[1])
    assert not pending.is_ready and not pending.is_started
    seen = []
    pending.when_ready(lambda masks: seen.append(masks.is_ready))
    live = [(walkers[k][0], rows[k]) for k in (0, 1)]  # the third request finished meanwhile
    started = background.start_masks(live, 5, consume=[(w, t) for (w, _), t in zip(walkers, tokens, strict=True)], into=pending)
    assert started is pending
    with pytest.raises(RuntimeError, match="started already"):
        background.start_masks(live, 5, into=pending)
    pending.abandon()  # started: nothing happens
    pending.wait()
    assert seen == [True] and not pending.failed
    pending.when_ready(lambda masks: seen.append("late"))
    assert seen == [True, "late"]
    for k, ((_, walker), token) in enumerate(zip(walkers, tokens, strict=True)):
        assert walker.accept(token)
        if k < 2:
            expected = allocate_bitmask(1, vocab)
            walker.fill(expected[0])
            assert np.array_equal(pending.row(rows[k]), expected[0])
    assert np.all(pending.row(4) == -1) and pending.row(0) is None and pending.row(3) is None
    abandoned = StepMasks.pending(rows, 5, first.bitmask.shape[1])
    abandoned.abandon()
    assert abandoned.is_ready and abandoned.failed
    with pytest.raises(RuntimeError, match="grammar masks failed"):
        abandoned.wait()


def test_tokens_consumed_by_the_caller_failing_fail_the_pending_masks(tokenizer):
    """With the step's tokens consumed on the calling thread, a consume that raises (here a
    matcher without an llguidance state) raises to the caller and leaves the pending masks failed
    with every token allowed, so a device waiting for them is released and the sampling fails,
    instead of a step started but never finished."""
    from openinfer.structured import GrammarMatcher

    vocab = tokenizer.get_vocab_size() + 5
    compiler = GrammarCompiler(tokenizer.to_str(), vocab, [tokenizer.token_to_id("<eos>")],
                               tokens_consumed_on_worker=False)
    walker = compiler.compile(pb.StructuredOutput(regex="[a-z]{2,12}"))
    pending = StepMasks.pending([0], 1, (vocab + 31) // 32)
    with pytest.raises(AttributeError):
        compiler.start_masks([(walker, 0)], 1, consume=[(GrammarMatcher(None), 5)], into=pending)
    assert pending.is_started and pending.is_ready and pending.failed and np.all(pending.bitmask == -1)
    with pytest.raises(RuntimeError, match="grammar masks failed"):
        pending.wait()


def test_string_length_slices_give_the_same_masks(tokenizer):
    """Matchers compiled with ``string_length_slices`` set mask exactly as those with llguidance's
    general slices, along seeded random walks through length-bounded strings (every length left
    from the bound down to 0), an unbounded one and a regex; the switch applies to matchers
    compiled after it, each keeping its own, whichever slices the compiler was built with."""
    vocab = tokenizer.get_vocab_size() + 5
    compilers = [GrammarCompiler(tokenizer.to_str(), vocab, [tokenizer.token_to_id("<eos>")], background_masks=False,
                                 string_length_slices=built_sliced) for built_sliced in (False, True)]
    schema = {"type": "array", "minItems": 3, "items": {
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"type": "string"},
                                         "c": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["a", "b", "c"], "additionalProperties": False}}
    constraints = [pb.StructuredOutput(json_schema=json.dumps(schema)), pb.StructuredOutput(regex="[a-z ]{3,15}")]
    rng = np.random.default_rng(5)
    for compiler, constraint in itertools.product(compilers, constraints):
        for _ in range(3):
            compiler.string_length_slices = False
            general = compiler.compile(constraint)
            compiler.string_length_slices = True
            sliced = compiler.compile(constraint)
            assert sliced.matcher is not general.matcher
            for _ in range(60):
                if general.is_terminated():
                    assert sliced.is_terminated()
                    break
                masks = [allocate_bitmask(1, vocab) for _ in range(2)]
                general.fill(masks[0][0])
                sliced.fill(masks[1][0])
                assert np.array_equal(masks[0], masks[1])
                token = int(rng.choice(np.flatnonzero(allowed_tokens(masks[0][0], vocab))))
                assert general.accept(token) and sliced.accept(token)


def test_compiler_cache_switches_reach_the_compiler(tokenizer, tmp_path, monkeypatch):
    """By default the engine thread consumes a step's tokens and matchers use the string length
    slices; ``OPENINFER_GRAMMAR_CONSUME_ON_WORKER=1`` / ``OPENINFER_GRAMMAR_STRING_LENGTH_SLICES=0``
    set the compiler's switches the other way when the cache is created; setting them on the
    cache afterwards reaches the compiler, built before or after."""
    from openinfer.structured import CONSUME_ON_WORKER_ENV, STRING_LENGTH_SLICES_ENV, CompilerCache

    tokenizer.save(str(tmp_path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size() + 5
    default = CompilerCache(str(tmp_path), vocab, [0]).get()
    assert not default.tokens_consumed_on_worker and default.string_length_slices
    monkeypatch.setenv(CONSUME_ON_WORKER_ENV, "1")
    monkeypatch.setenv(STRING_LENGTH_SLICES_ENV, "0")
    cache = CompilerCache(str(tmp_path), vocab, [0])
    assert cache.tokens_consumed_on_worker and not cache.string_length_slices
    built = cache.get()
    assert built.tokens_consumed_on_worker and not built.string_length_slices
    cache.tokens_consumed_on_worker, cache.string_length_slices = False, True
    assert not built.tokens_consumed_on_worker and built.string_length_slices


def test_mask_threads_switch_reaches_the_worker_and_keeps_the_masks(tokenizer, tmp_path, monkeypatch, caplog):
    """``OPENINFER_GRAMMAR_MASK_THREADS`` sets llguidance's thread count when the cache is created
    (an invalid value is logged and the default kept); switching it on the cache reaches the built
    compiler and its mask worker (a new pool), and the masks stay the same; < 1 is refused."""
    from openinfer.structured import MASK_THREADS_ENV, CompilerCache, default_mask_threads

    tokenizer.save(str(tmp_path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size() + 5
    monkeypatch.setenv(MASK_THREADS_ENV, "lots")
    assert CompilerCache(str(tmp_path), vocab, [0]).mask_threads == default_mask_threads(False)
    assert "not a positive integer" in caplog.text
    monkeypatch.setenv(MASK_THREADS_ENV, "3")
    cache = CompilerCache(str(tmp_path), vocab, [0])
    compiler = cache.get()
    assert cache.mask_threads == compiler.mask_threads == 3
    constraint = pb.StructuredOutput(regex="(yes|no|maybe)( (yes|no|maybe)){0,8}")
    before = compiler.start_masks([(compiler.compile(constraint), 0)], 1).wait().bitmask.copy()
    cache.mask_threads = 2
    assert compiler.mask_threads == 2 and compiler._worker.executor is compiler._executor
    assert np.array_equal(compiler.start_masks([(compiler.compile(constraint), 0)], 1).wait().bitmask, before)
    with pytest.raises(ValueError, match=">= 1"):
        cache.mask_threads = 0


def test_gil_switch_interval_is_lowered_while_masks_are_computed(tokenizer, monkeypatch, caplog):
    """``OPENINFER_GRAMMAR_GIL_SWITCH_INTERVAL_US``: from ``start_masks`` until the mask worker is
    idle, the GIL switch interval is the value asked for (seen from a ready callback, which runs on
    the worker in its job); once idle, the interpreter's own interval again; the masks are the same.
    Unset: the default (200 us); 0 or not a number (logged): left alone."""
    import sys
    import time

    from openinfer.structured import GIL_SWITCH_INTERVAL_ENV, MaskWorker, gil_switch_interval_s

    for raw, expected in (("", 200e-6), ("0", None), ("250", 250e-6), ("1.5", 1.5e-6), ("fast", None), ("-3", None),
                          ("nan", None)):
        monkeypatch.setenv(GIL_SWITCH_INTERVAL_ENV, raw)
        assert gil_switch_interval_s() == expected, raw
    assert "is not a number of microseconds" in caplog.text
    vocab = tokenizer.get_vocab_size() + 5
    eos = [tokenizer.token_to_id("<eos>")]
    constraint = pb.StructuredOutput(regex="(yes|no|maybe)( (yes|no|maybe)){0,8}")
    original = sys.getswitchinterval()
    monkeypatch.setattr(MaskWorker, "IDLE_EXIT_S", 0.05)
    for raw, during in (("250", 250e-6), ("0", original)):
        monkeypatch.setenv(GIL_SWITCH_INTERVAL_ENV, raw)
        background, reference = (GrammarCompiler(tokenizer.to_str(), vocab, eos, background_masks=flag)
                                 for flag in (True, False))
        expected = reference.start_masks([(reference.compile(constraint), 0)], 1).wait()
        masks = StepMasks.pending([0], 1, expected.bitmask.shape[1])
        seen = []  # the callback runs on the worker, in its job
        masks.when_ready(lambda _, seen=seen: seen.append(sys.getswitchinterval()))
        background.start_masks([(background.compile(constraint), 0)], 1, into=masks)
        assert np.array_equal(masks.wait().bitmask, expected.bitmask)
        assert seen == [pytest.approx(during)]
        deadline = time.monotonic() + 5
        while sys.getswitchinterval() != original and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker restores the interval when it is idle
        assert sys.getswitchinterval() == original
    monkeypatch.setenv(GIL_SWITCH_INTERVAL_ENV, "250")
    background._worker.close()  # masks after the worker closed: computed on the caller, interval restored
    masks = background.start_masks([(background.compile(constraint), 0)], 1)
    assert np.array_equal(masks.wait().bitmask, expected.bitmask) and sys.getswitchinterval() == original


def test_timing_logs_keep_the_last_durations_and_masks_log_their_latency(tokenizer):
    """``TimingLog``: the last ``keep`` values oldest first, the count of all; every step's masks
    log the time from ``start_masks`` to their release in ``MASK_LATENCIES`` (failed ones not)."""
    from openinfer.structured import MASK_LATENCIES, TimingLog

    log = TimingLog(keep=3)
    for value in (1.0, 2.0, 3.0, 4.0):
        log.add(value)
    assert log.count == 4 and log.last(2) == [3.0, 4.0] and log.last(10) == [2.0, 3.0, 4.0] and log.last(0) == []
    vocab = tokenizer.get_vocab_size() + 5
    compiler = GrammarCompiler(tokenizer.to_str(), vocab, [tokenizer.token_to_id("<eos>")])
    constraint = pb.StructuredOutput(regex="(yes|no|maybe)( (yes|no|maybe)){0,8}")
    before = MASK_LATENCIES.count
    compiler.start_masks([(compiler.compile(constraint), 0)], 1).wait()
    compiler.start_masks([(compiler.compile(constraint), 0)], 1, background=False).wait()
    assert MASK_LATENCIES.count == before + 2 and all(0 <= ms < 10_000 for ms in MASK_LATENCIES.last(2))
    StepMasks.pending([0], 1, 1).abandon()
    assert MASK_LATENCIES.count == before + 2
