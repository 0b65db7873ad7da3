"""``PagedEngine``: the default ``EngineHandle`` for paged-attention models.

Threads: one engine thread owns the model, the KV pool and the scheduler; callers talk to it
through an inbox (submit / abort). The step is: drain inbox → schedule → forward → sample →
emit. Emitting appends cheap entries ``(destination, request_id, kind, payload)`` (see
``openinfer.engine_core.slots``) to the step's outbox; at the end of the step the whole outbox
is delivered at once: in process, one ``call_soon_threadsafe`` per event loop per step that
merges the entries into per-request ``RequestSlot``s; in the engine-core process
(``attach_transport``), one message per client per step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from openinfer.backend.base import StateLayer
from openinfer.engine_core.slots import ERROR, FINISHED, SCHEDULED, TOKEN, TOKENS_PB, RequestSlot, drain
from openinfer.engine_core.startup import (
    note_event,
    wait_for_deferred_weights,
    weights_join_point,
    weights_joined_later,
)
from openinfer.errors import (
    DeviceFaultError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    is_device_fault,
)
from openinfer.graph import create_runner
from openinfer.kv import BlockPool, KVCacheManager, KVCachePlan, StateSlots, group_specs, plan_kv_cache
from openinfer.options import EngineOptions
from openinfer.parallel.workers import RunnerSetup
from openinfer.runtime.batch_builder import LogitsRow, build_forward_batch
from openinfer.runtime.model import PagedModel, RequestStateModel, kv_cache_specs_of
from openinfer.runtime.sampler import (
    GrammarMasks,
    SampledStep,
    grammar_rows,
    needs_host_history,
    pending_grammar_masks,
    sample_step,
    samples_on_device,
    samples_on_device_behind_masks,
    start_grammar_masks,
)
from openinfer.runtime.step_timer import StepTimer
from openinfer.runtime.synthetic_batches import StepLayout
from openinfer.runtime.validation import prompt_ids, resolve_max_tokens, validate_request
from openinfer.runtime.warmup import (
    PrefillWarmup,
    one_compile_wave,
    warm_up_prefill,
    warmup_enabled,
    warmup_steps,
)
from openinfer.sampling import SamplingState
from openinfer.sched import Request, RequestStatus, Scheduler, SchedulerOutput
from openinfer.sched.request import TokenIds
from openinfer.structured import DEVICE_WAIT_ENV, CompilerCache, GrammarMatcher, early_grammar_masks
from openinfer.tracing import EngineTracer, TraceWriter
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger("openinfer.engine")

_CPU_DEFAULT_BATCHED_TOKENS = 512
# measured on an H200 (Qwen3-4B shape, 256 streams of 1k in / 128 out): 8192 gives 3,616 out tok/s and
# TTFT p50 2.0 s against 2,927 and 4.1 s at 2048 (benchmarks/results/gpu_concurrency_8k.json)
_GPU_DEFAULT_BATCHED_TOKENS = 8192


@dataclass
class _LaunchedForward:
    """A step whose forward is queued and whose sampling has not started yet."""

    plan: SchedulerOutput
    rows: list[LogitsRow]
    logits: Any
    timer_start: Any = None  # StepTimer.start()'s event when timing
    forward_end: Any = None  # and the event after the forward
    trace: Any = None  # EngineTracer.on_launch's record when tracing
    accounted: bool = False  # its tokens count as computed and its rows hold placeholders
    masks: GrammarMasks | None = None  # its grammar masks, started once the matchers consumed N's tokens


@dataclass
class _BuiltForward:
    """A step's batch built on the host, its forward not launched yet."""

    plan: SchedulerOutput
    batch: Any
    rows: list[LogitsRow]
    trace: Any = None


@dataclass
class _LaunchedStep:
    plan: SchedulerOutput
    rows: list[LogitsRow]
    samples: SampledStep
    trace: Any = None  # EngineTracer.on_launch's record when tracing
    masks: GrammarMasks | None = None  # pending grammar masks the device waits for (started at read-back)
    # rows of the previous step whose tokens the mask worker consumes for these masks, when they were
    # handed to it before that step's read-back (structured.EARLY_MASKS_ENV)
    early_consumers: list[int] | None = None


def _no_host_history(request: Request) -> bool:
    return not needs_host_history(request)


def _deliver_in_process(entries: list) -> None:
    """Hand a step's entries to their slots: one ``call_soon_threadsafe`` per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for slot, _, kind, payload in entries:
        by_loop.setdefault(slot.loop, []).append((slot, kind, payload))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_push_all, items)
        except RuntimeError:  # the caller's event loop is closed; nobody is listening
            pass


def _push_all(items: list) -> None:
    for slot, kind, payload in items:
        slot.push(kind, payload)


class PagedEngine:
    """Continuous batching over a ``PagedModel`` with chunked prefill, prefix cache and preemption."""

    def __init__(self, model: PagedModel, options: EngineOptions | None = None, *, model_path: str = "",
                 plugin: str = "", tokenizer_path: str | None = None):
        began = time.perf_counter()
        note_event("paged_engine_started")  # the model is loaded (its weights' copies may still run)
        # seconds of this constructor's start-up phases (the engine-core process reports them)
        self.startup_phases: dict[str, float] = {}
        self.model = model
        mark_serving = getattr(model.backend, "mark_serving", None)  # kernels built from here on are expected
        if mark_serving is not None:
            mark_serving(False)
        self.options = options or EngineOptions()
        spec = model.spec
        self.kv_cache_specs = kv_cache_specs_of(model)
        self.kv_groups = group_specs(self.kv_cache_specs)
        # models keeping private per-request state (release_request, no RecurrentStateSpec)
        # cannot rebuild it from cached KV blocks, so they never use the prefix cache
        self._release_state = model.release_request if isinstance(model, RequestStateModel) else None
        if self._release_state is not None and not self.kv_groups.has_state and self.options.enable_prefix_cache:
            self.options = self.options.with_(enable_prefix_cache=False)
        self.max_model_len = min(self.options.max_model_len or spec.max_model_len, spec.max_model_len)
        self.block_size = self.options.block_size
        is_cpu = model.backend.name == "numpy"
        batched = self.options.max_num_batched_tokens or (
            _CPU_DEFAULT_BATCHED_TOKENS if is_cpu else _GPU_DEFAULT_BATCHED_TOKENS)
        self.kv_plan = self._plan_kv_cache(batched)
        if self.kv_plan.max_num_seqs < self.options.max_num_seqs:  # live state slots cap the batch
            self.options = self.options.with_(max_num_seqs=self.kv_plan.max_num_seqs)
        num_blocks = self.kv_plan.num_blocks
        # one block pool per paged group (None for state groups), one state-slot pool
        self.pools = [BlockPool(n, self.block_size, self.options.enable_prefix_cache) if g.paged else None
                      for g, n in zip(self.kv_groups.groups, self.kv_plan.group_blocks, strict=True)]
        self.state_slots = StateSlots(self.kv_plan.num_state_slots) if self.kv_groups.has_state else None
        self.kv = KVCacheManager(self.pools, groups=self.kv_groups, state_slots=self.state_slots,
                                 num_snapshot_slots=self.kv_plan.num_snapshot_slots, block_size=self.block_size)
        self.pool = self.kv.pool  # the first paged group's (a dense model's only) pool
        self.startup_phases["kv_planning"] = time.perf_counter() - began
        create_step_runner = getattr(model, "create_step_runner", None)
        dry_run_safe = bool(getattr(model, "dry_run_safe", False))
        join_later = False  # OPENINFER_WEIGHTS_JOIN=serve (below)
        warmup = self._prefill_warmup(spec) if create_step_runner is None and not is_cpu and warmup_enabled() else None
        if create_step_runner is not None:  # a group of ranks: each allocates its KV and captures its graphs
            self.kv_cache, self.runner = create_step_runner(RunnerSetup(
                num_blocks=num_blocks, num_state_slots=self.kv_plan.num_state_slots, block_size=self.block_size,
                cuda_graph=self.options.cuda_graph, max_num_seqs=self.options.max_num_seqs,
                max_model_len=self.max_model_len, num_groups=len(self.kv_groups.groups),
                with_state=self.kv_groups.has_state, group_blocks=self.kv_plan.group_blocks))
        else:
            # the model owns the layout: one allocation per spec, its group's blocks or state slots
            allocating = time.perf_counter()
            self.kv_cache = [
                model.backend.allocate_kv(
                    s, self.kv_plan.group_blocks[gid] if s.paged else self.kv_plan.num_state_slots, self.block_size)
                for s, gid in zip(self.kv_cache_specs, self.kv_groups.group_of_layer, strict=True)]
            self.startup_phases["kv_allocation"] = time.perf_counter() - allocating
            # the prefill warm-up's kernels join the capture's compile (OPENINFER_ONE_COMPILE_WAVE=1)
            extra_dry_run = None
            if warmup is not None and one_compile_wave():
                extra_dry_run = warmup.dry_run(model.backend, self._forward)
            # OPENINFER_WEIGHTS_JOIN=serve: the capture and warm-up forwards run beside the weight copies, only
            # for a forward that computes no indices on the device (garbage weights give garbage, no fault)
            join_later = dry_run_safe and weights_join_point() == "serve"
            # decode steps replay CUDA graphs on cuda (unless options.cuda_graph is off); else eager
            with weights_joined_later(join_later):
                self.runner = create_runner(model.backend, self._forward, cuda_graph=self.options.cuda_graph,
                                            max_num_seqs=self.options.max_num_seqs, max_model_len=self.max_model_len,
                                            block_size=self.block_size, num_groups=len(self.kv_groups.groups),
                                            with_state=self.kv_groups.has_state, discover_kernels=dry_run_safe,
                                            kv_specs=self.kv_cache_specs, extra_dry_run=extra_dry_run)
        # graph capture includes compiling the kernels (in parallel when the model may run dry) and warm-ups;
        # a CudaGraphRunner splits it into kernel_compile, graph_capture and prefill_graph_capture
        phases = getattr(self.runner, "capture_phases", None)
        self.startup_phases.update(phases or {"graph_capture": getattr(self.runner, "capture_seconds", 0.0)})
        # a deferred load's weight copies (joined by the graph runner; else here, before any real step)
        waited = 0.0 if join_later else wait_for_deferred_weights()
        note_event("graphs_captured")
        if warmup is not None:
            with weights_joined_later(join_later):
                self._warm_up_prefill(model, warmup)
        if join_later:  # before the first forward whose results are kept
            waited = wait_for_deferred_weights()
        if waited:
            self.startup_phases["deferred_weights_wait"] = self.startup_phases.get("deferred_weights_wait", 0.0) + waited
        if mark_serving is not None:  # from here on, a kernel build is one the start-up missed
            mark_serving(True)
        self._state_layers = [c for c in self.kv_cache if isinstance(c, StateLayer)]
        self.scheduler = Scheduler(self.kv, max_num_seqs=self.options.max_num_seqs,
                                   max_num_batched_tokens=batched, max_model_len=self.max_model_len,
                                   max_queue=self.options.max_queue,
                                   enable_prefix_cache=self.options.enable_prefix_cache,
                                   policy=self.options.scheduler_policy)
        self._info = pb.ModelInfo(
            model_id=self.options.served_model_name or (model_path.rstrip("/").split("/")[-1] if model_path else ""),
            model_path=model_path, architectures=list(spec.architectures), model_type=spec.model_type,
            vocab_size=spec.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=list(spec.eos_token_ids), tokenizer_path=tokenizer_path or model_path,
            backend=model.backend.name, plugin=plugin, kv_block_size=self.block_size, num_kv_blocks=num_blocks,
            tensor_parallel_size=self.options.tensor_parallel_size,
            expert_parallel_size=self.options.expert_parallel_size)
        if spec.bos_token_id is not None:
            self._info.bos_token_id = spec.bos_token_id
        # structured outputs: the vocabulary is read from tokenizer.json on the first constrained request
        self._grammars = CompilerCache(self._info.tokenizer_path, spec.vocab_size, list(spec.eos_token_ids),
                                       device_forward=not is_cpu)
        self._inbox: Any = queue.SimpleQueue()
        # request id -> where its events go (a RequestSlot in process, a client id in the core)
        self._streams: dict[str, Any] = {}
        self._outbox: list = []
        self._deliver: Callable[[list], None] = _deliver_in_process
        self._streams_lock = threading.Lock()
        self._num_queued = 0  # submitted and not yet scheduled (bounded by max_queue)
        self._arrivals = itertools.count()
        self._stopping = False
        self._fatal: BaseException | None = None
        self.num_steps = 0
        self.async_scheduling = (self.options.async_scheduling if self.options.async_scheduling is not None
                                 else model.backend.name == "cuda")
        self._in_flight: _LaunchedStep | None = None
        # a launched forward whose sampling waits for its grammar masks (see ``_step``)
        self._unsampled: _LaunchedForward | None = None
        # every forward may be launched before the previous step is read back; its sampling may
        # too when, on a backend sampling asynchronously, the kernel samples every row without the
        # previous tokens on the host (one predicate: samples_on_device); a host sampler reads
        # every row back anyway, so there only rows needing the previous step's tokens wait
        self._samples_async = hasattr(model.backend, "sample_rows_async")
        # grammar rows sampled ahead too: the CUDA sampler queues their sampling at once and the
        # GPU waits there for the masks the host computes meanwhile (structured.DEVICE_WAIT_ENV=0 turns it off)
        self._masks_waited_on_device = False
        self.grammar_masks_waited_on_device = (self.can_wait_for_grammar_masks_on_device
                                               and os.environ.get(DEVICE_WAIT_ENV, "1") != "0")
        self.num_steps_launched_ahead = 0
        self._step_timer = StepTimer.create(model.backend)
        # per-request Chrome traces (--trace-dir): engine-side spans, written off this loop
        self.tracer = EngineTracer(TraceWriter(self.options.trace_dir)) if self.options.trace_dir else None
        self._thread = threading.Thread(target=self._run, name="openinfer-engine", daemon=True)
        self._thread.start()

    # --- sizing ----------------------------------------------------------------------------------

    def _plan_kv_cache(self, chunk_tokens: int) -> KVCachePlan:
        """Each group's blocks and the state slots from the specs' bytes and the memory budget
        (an explicit ``num_kv_blocks`` fixes every group's pool at that many blocks)."""
        budget_bytes = 0
        if self.options.num_kv_blocks is None or self.kv_groups.has_state:
            budget = getattr(self.model.backend, "kv_memory_budget", None)
            budget_bytes = budget(self.options) if budget else int(self.options.cpu_kv_cache_gib * 2**30)
        plan = plan_kv_cache(self.kv_groups, block_size=self.block_size, budget_bytes=budget_bytes,
                             max_num_seqs=self.options.max_num_seqs, max_model_len=self.max_model_len,
                             num_blocks=self.options.num_kv_blocks,
                             prefix_cache=self.options.enable_prefix_cache, chunk_tokens=chunk_tokens)
        # the budget is one rank's memory; a group whose ranks each cache only part of the engine's
        # blocks (data-parallel attention) gets the pool those parts add up to
        engine_blocks = getattr(self.model, "engine_kv_blocks", None)
        if engine_blocks is not None and self.options.num_kv_blocks is None:
            plan = replace(plan, group_blocks=tuple(engine_blocks(n) if n else 0 for n in plan.group_blocks))
        return plan

    # --- EngineHandle ----------------------------------------------------------------------------

    def info(self) -> pb.ModelInfo:
        return self._info

    def health(self) -> pb.HealthResponse:
        if self._fatal is not None:
            return pb.HealthResponse(healthy=False, message=f"engine loop died: {self._fatal!r}")
        if self._stopping or not self._thread.is_alive():
            return pb.HealthResponse(healthy=False, message="engine is shut down")
        return pb.HealthResponse(healthy=True, message="ok")

    @property
    def can_wait_for_grammar_masks_on_device(self) -> bool:
        """The backend samples asynchronously and its stream can wait for grammar masks the
        host is still computing (CUDA: ``backend.cuda.sampler``)."""
        backend = self.model.backend
        return self._samples_async and bool(getattr(backend, "waits_for_grammar_masks", backend.name == "cuda"))

    @property
    def grammar_masks_waited_on_device(self) -> bool:
        """Grammar rows are sampled ahead like the others and the device waits for their masks
        (the default where the backend can: ``OPENINFER_GRAMMAR_MASKS_DEVICE_WAIT=0`` at creation
        turns it off); else their sampling waits on the host. May be switched while no request runs (side-by-side measurements)."""
        return self._masks_waited_on_device

    @grammar_masks_waited_on_device.setter
    def grammar_masks_waited_on_device(self, value: bool) -> None:
        if value and not self.can_wait_for_grammar_masks_on_device:
            raise ValueError(f"the {self.model.backend.name} backend cannot wait for grammar masks on the device")
        self._masks_waited_on_device = bool(value)

    @property
    def grammar_tokens_consumed_on_worker(self) -> bool:
        """Whether the grammar-mask worker advances the matchers by a step's tokens before
        filling their masks (``OPENINFER_GRAMMAR_CONSUME_ON_WORKER=1`` at creation), or the
        engine thread does, in parallel with the GIL released, before handing over the fill (the
        default; ``structured.GrammarCompiler.tokens_consumed_on_worker`` says why). May be switched
        while no request runs (side-by-side measurements)."""
        return self._grammars.tokens_consumed_on_worker

    @grammar_tokens_consumed_on_worker.setter
    def grammar_tokens_consumed_on_worker(self, value: bool) -> None:
        self._grammars.tokens_consumed_on_worker = value

    @property
    def grammar_mask_threads(self) -> int:
        """llguidance's threads for a step's grammar masks (``structured.default_mask_threads``, or
        ``OPENINFER_GRAMMAR_MASK_THREADS`` at creation). May be switched while no request runs
        (side-by-side measurements)."""
        return self._grammars.mask_threads

    @grammar_mask_threads.setter
    def grammar_mask_threads(self, value: int) -> None:
        self._grammars.mask_threads = value

    @property
    def grammar_string_length_slices(self) -> bool:
        """Whether new grammar matchers mask through ``structured.string_length_slices``
        (the default; ``OPENINFER_GRAMMAR_STRING_LENGTH_SLICES=0`` at creation: the general
        slices): the same masks, less work in length-bounded strings. May be switched while no request runs (side-by-side measurements)."""
        return self._grammars.string_length_slices

    @grammar_string_length_slices.setter
    def grammar_string_length_slices(self, value: bool) -> None:
        self._grammars.string_length_slices = value

    @property
    def step_timer(self) -> StepTimer | None:
        """CUDA-event timing of each step and of the device's idle gaps between steps (None on
        the NumPy backend): ``reset()`` it, run a load, read ``report()``."""
        return self._step_timer

    def load(self) -> pb.Load:
        pools = [p for p in self.pools if p is not None]
        return pb.Load(num_running=len(self.scheduler.running), num_waiting=self._num_queued,
                       kv_blocks_used=sum(p.num_used_blocks for p in pools),
                       kv_blocks_total=sum(p.num_usable_blocks for p in pools),
                       max_queue=self.options.max_queue, kv_blocks_cached=sum(p.num_cached_blocks for p in pools))

    def admit(self, request: pb.GenerateRequest, destination: Any, prompt: np.ndarray | None = None) -> None:
        """Validate and queue a request whose events go to ``destination``; raises
        ``InvalidRequestError`` / ``QueueFullError`` / ``EngineDeadError`` when refused.
        ``prompt``: its ids as an int array beside it (its ``prompt_token_ids`` empty), e.g. the
        engine-core protocol's prompt buffer, read without a copy."""
        if not self.health().healthy:
            raise EngineDeadError(self.health().message)
        validate_request(request, self.model.spec.vocab_size, self.max_model_len, prompt)
        prompt = prompt_ids(request, prompt)
        max_tokens = resolve_max_tokens(request, self.max_model_len, len(prompt))
        self.scheduler.check_fits(len(prompt), max_tokens)
        # a constraint is compiled here (about a millisecond; llguidance releases the GIL), so an
        # invalid one is refused before anything is queued
        grammar = self._compile_grammar(request.structured_output) if request.HasField("structured_output") else None
        request_id = request.request_id
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in flight", "request_id")
            if self._num_queued >= self.options.max_queue:
                raise QueueFullError(self.options.max_queue)
            self._streams[request_id] = destination
            self._num_queued += 1
        self._inbox.put(("add", self._make_request(request, prompt, max_tokens, grammar)))

    def attach_transport(self, inbox: Any, deliver: Callable[[list], None]) -> None:
        """Run behind the engine-core process: commands come from ``inbox`` (``get(timeout)``,
        ``get_nowait()`` raising ``queue.Empty``, ``put``; read on the engine thread only) and
        each step's outbox ``[(destination, request_id, kind, payload)]`` goes to ``deliver``
        (called on the engine thread). Call before any request is submitted."""
        self._deliver = deliver
        # a finished request's blocks go back after its last tokens are sent (``_flush``); the
        # transport's load of that step still counts them, its next message does not
        self.kv.defer_frees = True
        previous, self._inbox = self._inbox, inbox
        previous.put(("noop", None))  # wake the engine thread, idle in the old inbox

    def requests_of(self, destination: Any) -> list[str]:
        """Ids of the in-flight requests whose events go to ``destination``."""
        with self._streams_lock:
            return [rid for rid, dest in self._streams.items() if dest == destination]

    def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        return self.generate_prompt_array(request, None)

    async def generate_prompt_array(self, request: pb.GenerateRequest, prompt_ids: np.ndarray | None
                                    ) -> AsyncIterator[pb.TokenEvent]:
        """``generate`` with the prompt as an int array beside the request (its
        ``prompt_token_ids`` empty); None: the request's own ids."""
        slot = RequestSlot(request.request_id, asyncio.get_running_loop())
        self.admit(request, slot, prompt_ids)
        try:
            async for event in slot.events():
                yield event
        finally:
            if not slot.done:
                self._inbox.put(("abort", request.request_id))

    async def abort(self, request_id: str) -> bool:
        with self._streams_lock:
            found = request_id in self._streams
        if found:
            self._inbox.put(("abort", request_id))
        return found

    async def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._inbox.put(("stop", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        if self.tracer is not None:  # the requests the shutdown ended are traced too
            await asyncio.get_running_loop().run_in_executor(None, self.tracer.writer.flush)

    def close_sync(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(30)
        if self.tracer is not None:
            self.tracer.writer.flush()

    # --- requests --------------------------------------------------------------------------------

    def _compile_grammar(self, constraint: pb.StructuredOutput) -> GrammarMatcher:
        return self._grammars.get().compile(constraint)

    def _make_request(self, request: pb.GenerateRequest, prompt: np.ndarray, max_tokens: int,
                      grammar: GrammarMatcher | None = None) -> Request:
        """``prompt``: the request's validated ids as an array (``validation.prompt_ids``)."""
        arrival = next(self._arrivals)
        state = SamplingState.create(request.sampling, prompt, self.options.seed, arrival, grammar)
        return Request(
            request_id=request.request_id, token_ids=TokenIds(prompt),  # the prompt stays an array
            num_prompt_tokens=len(prompt), stop=request.stop, max_tokens=max_tokens,
            sampling=state, num_logprobs=int(request.logprobs), want_logprobs=request.logprobs > 0,
            want_prompt_logprobs=bool(request.prompt_logprobs), arrival_order=arrival,
            cache_salt=request.cache_salt,
            # its block hashes read the prompt from this array, not from token_ids' list
            prefix_hashes=self.kv.prefix_hashes(request.cache_salt, prompt))

    def _emit(self, request_id: str, kind: int, payload: Any, final: bool = False) -> None:
        with self._streams_lock:
            destination = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if destination is not None:
            self._outbox.append((destination, request_id, kind, payload))

    def _flush(self) -> None:
        """Deliver everything this step emitted, at once; then return the blocks of the requests
        it finished (``KVCacheManager.defer_frees``)."""
        if self._outbox:
            entries, self._outbox = self._outbox, []
            self._deliver(entries)
        self.kv.settle_frees()

    def _finish(self, request: Request, reason: int, matched_stop: int | None = None) -> None:
        request.drop_placeholders()  # tokens never read back are not counted
        if not request.was_scheduled:
            self._mark_unqueued()
        self.scheduler.finish(request)
        self._release(request)
        if self.tracer is not None:
            self.tracer.on_finish(request.request_id, pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower(),
                                  request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
        self._emit(request.request_id, FINISHED, [reason, request.num_prompt_tokens, request.num_output_tokens,
                                                  request.num_cached_tokens,
                                                  -1 if matched_stop is None else matched_stop], final=True)

    def _release(self, request: Request) -> None:
        if self._release_state is not None:
            self._release_state(request.request_id)

    def _mark_unqueued(self) -> None:
        with self._streams_lock:
            self._num_queued = max(0, self._num_queued - 1)

    # --- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.scheduler.has_work and self._in_flight is None and self._unsampled is None
                running = self._drain_inbox(idle)
                self._flush()
                if not running:
                    break
                if self.scheduler.has_work or self._in_flight is not None or self._unsampled is not None:
                    self.step()
        except BaseException as exc:  # keep the process alive; health() reports it
            logger.exception("engine loop crashed")
            self._fatal = exc
            self._fail_everything(f"engine loop crashed: {exc!r}")
        finally:
            if self._fatal is None:
                self._fail_everything("engine shut down", reason=pb.FINISH_REASON_ABORT)
            self._flush()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply pending submissions and aborts; False when asked to stop."""
        while True:
            try:
                command, payload = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block and not self._stopping:
                    continue
                return not self._stopping
            block = False
            if command == "stop":
                return False
            if command == "add":
                if self.tracer is not None:
                    self.tracer.on_arrival(payload.request_id)
                self.scheduler.add(payload)
            elif command == "abort":
                request = self.scheduler.find(payload)
                if request is not None:
                    self._finish(request, pb.FINISH_REASON_ABORT)
            elif command == "reject":  # refused at admission (engine core): no stream was registered
                self._outbox.append(payload)

    def step(self) -> None:
        """One engine step (see ``_step``); its outputs are delivered at once at the end."""
        try:
            self._step()
        finally:
            self._flush()

    def _step(self) -> None:
        """One engine step: schedule → launch the forward → sample → read back and emit.

        With async scheduling, step N+1 is planned and its forward launched while step N still
        runs on the device — its inputs sampled by N are fed on the device (``token_sources``) —
        and N's tokens are read back and emitted only after that, so the GPU never waits on
        Python between decode steps. Only *sampling* N+1 may need N's tokens on the host (a
        grammar consumes them before it masks the next token; penalties count them): then N is
        read back while N+1's forward runs, the matchers consume N's tokens and N+1's masks
        start on a background thread, and N+1's sampling is deferred to the next call, which
        first plans and builds N+2's batch and then queues N+1's sampling and N+2's forward
        back to back. So the engine's scheduling and batch building overlap the forward and
        the mask work as they do without grammars. A request that N finishes has computed one
        extra token in N+1, which is discarded.
        """
        plan = self.scheduler.schedule()
        for request in plan.preempted:  # recomputed from position 0 later: its state goes too
            request.num_full_blocks_published = -1
            self._release(request)
            if self.tracer is not None:
                self.tracer.on_preempted(request.request_id)
        for request in plan.newly_scheduled:
            self._mark_unqueued()
            if self.tracer is not None:
                self.tracer.on_scheduled(request.request_id)
            self._emit(request.request_id, SCHEDULED, request.num_cached_tokens)
        in_flight, self._in_flight = self._in_flight, None
        unsampled, self._unsampled = self._unsampled, None
        built: _BuiltForward | None = None
        failure: Exception | None = None
        if plan.chunks:
            try:
                built = self._build_forward(plan)
            except Exception as exc:
                logger.exception("building the step failed; failing the %d requests in it", len(plan.chunks))
                failure = exc
        if unsampled is not None:  # the deferred step: sampled now, right before the next forward
            assert in_flight is None
            in_flight, unsampled_failure = self._sample_or_fail(unsampled)
            if unsampled_failure is not None:
                self._fail_plan(unsampled.plan, unsampled_failure)
                return  # this plan's inputs were to come from those samples: it is planned again
        if built is None:
            if failure is not None:
                self._fail_plan(plan, failure)
            if in_flight is not None:
                self._resolve(in_flight)
            elif not plan.preempted and failure is None:
                time.sleep(0.001)
            return
        launched: _LaunchedStep | None = None
        forward: _LaunchedForward | None = None
        try:
            forward = self._run_forward(built, in_flight)
        except Exception as exc:
            logger.exception("model step failed; failing the %d requests in it", len(plan.chunks))
            failure = exc
        if forward is not None and (in_flight is None or self._may_sample_ahead(plan)):
            launched, failure = self._sample_or_fail(forward, ahead=in_flight is not None)
            if in_flight is not None and launched is not None and launched.masks is not None and early_grammar_masks():
                self._start_masks_early(in_flight, launched)
        defer = forward is not None and launched is None and failure is None and self.async_scheduling
        if in_flight is not None:
            self.num_steps_launched_ahead += forward is not None
            # the CPU reads step N back while the device runs N+1 (and starts N+1's masks)
            pending = launched if launched is not None and launched.masks is not None else None
            self._resolve(in_flight, forward if defer else pending)
        if forward is not None and launched is None and failure is None:
            if defer:
                try:
                    self._defer_sampling(forward)
                except Exception as exc:
                    logger.exception("starting the grammar masks failed; failing the %d requests in the step",
                                     len(plan.chunks))
                    failure = exc
                else:
                    return
            else:
                launched, failure = self._sample_or_fail(forward)
        if failure is not None:
            self._fail_plan(plan, failure)
        elif self.async_scheduling:
            self._in_flight = launched  # the next step's forward may run before this one is read back
        else:
            self._resolve(launched)

    def _fail_plan(self, plan: SchedulerOutput, failure: Exception) -> None:
        fault = None
        if is_device_fault(failure):
            # every later step would fail the same way: stop the loop (health turns unhealthy, the
            # engine-core process exits and its supervisor starts a fresh one). Unhealthy before the
            # step's requests hear of it, so a client that sees the error never sees "ok" after it.
            fault = DeviceFaultError(f"the device faulted ({failure!r}); the engine stops to be restarted")
            self._fatal = fault
        for chunk in plan.chunks:
            if chunk.request.status is RequestStatus.RUNNING:
                self._fail(chunk.request, f"model step failed: {failure!r}")
        if fault is not None:
            raise fault from failure

    def _may_sample_ahead(self, plan: SchedulerOutput) -> bool:
        """Whether a step may be sampled before the previous one is read back: none of its rows
        needs that step's tokens on the host (a grammar, penalties, prompt logprobs) and, on a
        backend that samples asynchronously, the kernel samples every row (else sampling reads
        the step back at once, better done after the previous step's read-back)."""
        if self._masks_waited_on_device:
            ready = samples_on_device_behind_masks
        else:
            ready = samples_on_device if self._samples_async else _no_host_history
        return all(ready(c.request) for c in plan.chunks)

    def _build_forward(self, plan: SchedulerOutput) -> _BuiltForward:
        """The step's batch on the host (nothing on the device yet)."""
        trace = self.tracer.on_launch(plan.chunks) if self.tracer is not None else None
        batch, rows = build_forward_batch(plan.chunks, self.kv)
        return _BuiltForward(plan, batch, rows, trace)

    def _run_forward(self, built: _BuiltForward, previous: _LaunchedStep | None) -> _LaunchedForward:
        """Run the model on a built batch (inputs sampled by ``previous`` are read on the
        device). Raises what the model raises (``step`` fails the plan's requests)."""
        plan = built.plan
        start = self._step_timer.start() if self._step_timer else None
        self._copy_state_slots()  # snapshot restores of requests starting from a cached prefix
        logits = self.runner.run(built.batch, previous.samples.device_token_ids if previous else None)
        if self._state_layers and self.options.enable_prefix_cache:
            for chunk in plan.chunks:  # the state at a block boundary may serve a later request
                end = chunk.start + chunk.num_tokens
                self.kv.snapshot_state(chunk.request.request_id, end, end <= chunk.request.num_prompt_tokens)
            self._copy_state_slots()
        forward_end = self._step_timer.start() if self._step_timer else None
        return _LaunchedForward(plan, built.rows, logits, start, forward_end, built.trace)

    def _sample_or_fail(self, forward: _LaunchedForward,
                        ahead: bool = False) -> tuple[_LaunchedStep | None, Exception | None]:
        try:
            return self._sample(forward, ahead), None
        except Exception as exc:
            logger.exception("sampling failed; failing the %d requests in the step", len(forward.plan.chunks))
            return None, exc

    def _account(self, forward: _LaunchedForward) -> None:
        """The plan's tokens count as computed from here on and each row to be sampled holds a
        placeholder until read back (so the next step can be planned before this one samples)."""
        if forward.accounted:
            return
        forward.accounted = True
        for chunk in forward.plan.chunks:
            if not chunk.request.is_finished:
                chunk.request.num_computed_tokens += chunk.num_tokens
        for index, row in enumerate(forward.rows):
            if row.samples and not row.request.is_finished:
                row.request.append_placeholder(index)

    def _defer_sampling(self, forward: _LaunchedForward) -> None:
        """Account a launched forward whose matchers have consumed the previous step's tokens
        (its grammar masks under way since, see ``_resolve``) and leave its sampling to the next
        ``_step`` (after the next batch is built)."""
        if forward.masks is None:
            forward.masks = start_grammar_masks(forward.rows, self._grammars)
        self._account(forward)
        self._unsampled = forward

    def _sample(self, forward: _LaunchedForward, ahead: bool = False) -> _LaunchedStep:
        """Start sampling a launched forward (accounting it first, unless deferred sampling did).
        Rows of requests finished meanwhile (the previous step stopped them) are sampled and
        discarded. ``ahead``: the previous step is not read back yet (its tokens not consumed by
        the matchers: only when the device waits for the masks, see ``_masks_waited_on_device``)."""
        plan, rows = forward.plan, forward.rows
        # grammar masks: computed on the CPU while the device runs the forward (on a background
        # thread from the moment the matchers consumed the previous tokens, see ``structured``)
        pending = None
        if forward.accounted:
            masks = forward.masks
        elif self._masks_waited_on_device:  # the device waits for them: started now, or at the read-back
            masks = pending = (pending_grammar_masks(rows, self._grammars) if ahead
                               else start_grammar_masks(rows, self._grammars))
            if not ahead:
                pending = None
        else:  # needed at once: computed on this thread, sparing the hand-over to the worker
            masks = start_grammar_masks(rows, self._grammars, background=False)
        if masks is not None and not self._masks_waited_on_device:
            masks.wait()
        sampling_start = self._step_timer.start() if self._step_timer else None
        try:
            samples = sample_step(self.model.backend, forward.logits, rows, self.model.spec.eos_token_ids,
                                  self.async_scheduling, masks)
        except BaseException:
            if pending is not None:
                pending.abandon()
            raise
        if self._step_timer:  # the device may have waited for the CPU between the forward and the sampling
            self._step_timer.stop(forward.timer_start, (forward.forward_end, sampling_start))
        self.num_steps += 1
        self._account(forward)
        return _LaunchedStep(plan, rows, samples, forward.trace, pending)

    def _resolve(self, launched: _LaunchedStep, following: _LaunchedForward | _LaunchedStep | None = None) -> None:
        """Read a launched step back: fill placeholders, publish full KV blocks, check stops,
        emit. ``following``: the step launched next, whose grammar masks start as soon as the
        matchers consumed this step's tokens, before the rest (a forward whose sampling waits,
        or a step sampled ahead whose pending masks the device waits for: those are always
        started or abandoned here, never left for the device to wait on)."""
        try:
            try:
                results = launched.samples.results()
            except Exception as exc:  # e.g. the step's grammar masks failed
                logger.exception("reading the step back failed; failing the %d requests in it",
                                 len(launched.plan.chunks))
                self._fail_plan(launched.plan, exc)
                return
            if launched.trace is not None:
                self.tracer.on_resolved(launched.trace)
            recorded = self._start_next_masks(launched, results, following) if following is not None else ()
        finally:
            if isinstance(following, _LaunchedStep) and following.masks is not None:
                following.masks.abandon()  # a no-op once started
        # blocks are published before emitting, so a request finishing here still leaves its
        # prefix in the cache (after the masks started: publishing does not delay them)
        if self.options.enable_prefix_cache:
            for chunk in launched.plan.chunks:
                request = chunk.request
                if request.request_id in self.kv.requests and not request.want_prompt_logprobs:
                    computed = min(request.num_computed_tokens, request.num_resolved_tokens)
                    full = computed // self.block_size
                    if full != request.num_full_blocks_published:  # else publishing is a no-op
                        request.num_full_blocks_published = full
                        self.kv.publish_full_blocks(request.request_id, request.token_ids, computed)
        for index, (row, sample) in enumerate(zip(launched.rows, results, strict=True)):
            request = row.request
            if request.status is RequestStatus.FINISHED:
                continue  # aborted or stopped meanwhile: this row's work is discarded
            if not row.samples:
                request.prompt_logprobs.append(sample.as_proto())
                continue
            self._accept_token(request, row.position + 1, sample, index in recorded)

    def _start_masks_early(self, previous: _LaunchedStep, following: _LaunchedStep) -> None:
        """Hand ``following``'s pending masks to the mask worker now, before ``previous`` is read
        back: the worker waits for its tokens, the grammar rows' matchers consume them and the
        masks are filled, whatever this thread does meanwhile (``_start_next_masks`` then only
        counts the tokens). Without a worker, or when handing over fails, they start at the
        read-back as usual."""
        consumers = [index for index, row in enumerate(previous.rows)
                     if row.samples and row.request.sampling.grammar is not None
                     and row.request.status is not RequestStatus.FINISHED]
        samples = previous.samples

        def tokens() -> list[int]:
            results = samples.results()
            return [results[index].token_id for index in consumers]

        try:
            started = self._grammars.get().start_masks_after(
                tokens, [previous.rows[index].request.sampling.grammar for index in consumers],
                grammar_rows(following.rows), following.masks)
        except Exception:
            logger.exception("handing the grammar masks over early failed; they start at the read-back")
            return
        if started:
            following.early_consumers = consumers

    def _start_next_masks(self, launched: _LaunchedStep, results: list,
                          following: _LaunchedForward | _LaunchedStep) -> set[int]:
        """The next step's masks start on the mask worker, which first advances the grammar rows'
        matchers by this step's tokens (one parallel llguidance call; the mask work is the
        longest stretch between two forwards); the rows recorded here are returned. A failure
        fails the following step's masks (its sampling then fails its requests)."""
        if isinstance(following, _LaunchedStep) and following.early_consumers is not None:
            for index in following.early_consumers:  # consumed on the mask worker already
                launched.rows[index].request.sampling.count(results[index].token_id)
            return set(following.early_consumers)
        recorded = set()
        consume = []
        for index, (row, sample) in enumerate(zip(launched.rows, results, strict=True)):
            request = row.request
            if row.samples and request.sampling.grammar is not None and request.status is not RequestStatus.FINISHED:
                request.sampling.count(sample.token_id)  # the mask worker advances the grammar
                consume.append((request.sampling.grammar, sample.token_id))
                recorded.add(index)
        into = following.masks if isinstance(following, _LaunchedStep) else None
        if recorded or into is not None:
            try:
                masks = start_grammar_masks(following.rows, self._grammars, consume=consume, into=into)
            except Exception:
                logger.exception("starting the grammar masks failed")
                masks = into or GrammarMasks.pending([], len(following.rows), 0)
                masks.abandon()  # its sampling (or read-back) raises: the step's requests fail
            if into is None:
                following.masks = masks
        return recorded

    def _accept_token(self, request: Request, index: int, sample, recorded: bool = False) -> None:
        token = sample.token_id
        request.resolve_placeholder(index, token)
        if not recorded:
            request.sampling.record(token)
        num_out = index + 1 - request.num_prompt_tokens
        with_prompt_logprobs = bool(request.prompt_logprobs) and num_out == 1
        if request.want_logprobs or with_prompt_logprobs:
            tokens = pb.TokenEvent.Tokens(ids=[token])
            if request.want_logprobs:
                tokens.logprobs.append(sample.as_proto())
            if with_prompt_logprobs:
                tokens.prompt_logprobs.extend(request.prompt_logprobs)
            self._emit(request.request_id, TOKENS_PB, tokens)
        else:
            self._emit(request.request_id, TOKEN, token)
        stop = request.stop
        if num_out >= stop.min_tokens:
            if token in stop.stop_token_ids or (not stop.ignore_eos and token in self.model.spec.eos_token_ids):
                request.truncate_after(index)  # a token sampled after this one is discarded
                return self._finish(request, pb.FINISH_REASON_STOP, token)
        if num_out >= request.max_tokens or index + 1 >= self.max_model_len:
            request.truncate_after(index)
            self._finish(request, pb.FINISH_REASON_LENGTH)

    def _copy_state_slots(self) -> None:
        """Run the state-slot copies the KV manager queued, on every state layer, in stream
        order with the steps (a restore before the step that reads it, a snapshot after the
        step that wrote it)."""
        copies = self.kv.take_state_copies() if self._state_layers else []
        if not copies:
            return
        copy_on_every_rank = getattr(self.runner, "copy_state_slots", None)
        if copy_on_every_rank is not None:  # a group of ranks: each copies its own state layers
            copy_on_every_rank(copies)
            return
        copy_state_slots(self.model.backend, self._state_layers, copies)

    def _forward(self, device_batch):
        return self.model.forward(device_batch, self.kv_cache)

    def _prefill_warmup(self, spec: Any) -> PrefillWarmup:
        """The prefill warm-up's steps that fit this engine's cache (``openinfer.runtime.warmup``)."""
        paged = [n for g, n in zip(self.kv_groups.groups, self.kv_plan.group_blocks, strict=True) if g.paged]
        steps = warmup_steps(self.max_model_len, min(paged) if paged else 0, self.kv_plan.num_state_slots,
                             self.kv_groups.has_state)
        return PrefillWarmup(steps, StepLayout(int(spec.vocab_size), tuple(bool(g.paged) for g in self.kv_groups.groups),
                                               bool(self.kv_groups.has_state)))

    def _warm_up_prefill(self, model: Any, warmup: PrefillWarmup) -> None:
        """Long-prompt and mixed steps once on synthetic tokens (``openinfer.runtime.warmup``), so
        the first request builds no kernel; a start-up phase of its own (its kernels compiled
        here, or with the graphs' when the capture's discovery went through its steps)."""
        began = time.perf_counter()
        try:
            ran = warm_up_prefill(model.backend, self.runner.run, self._forward, warmup.layout, warmup.steps,
                                  dry_run_safe=bool(getattr(model, "dry_run_safe", False)),
                                  discovered=warmup.discovered)
        except Exception:  # noqa: BLE001 — an optimisation only: the first long prompt builds what it needs
            logger.warning("prefill warm-up failed; kernels build at first use instead", exc_info=True)
            ran = 0
        self.startup_phases["prefill_warmup"] = time.perf_counter() - began
        logger.info("prefill warm-up: %d steps in %.2f s", ran, self.startup_phases["prefill_warmup"])

    def _fail(self, request: Request, message: str) -> None:
        if not request.was_scheduled:
            self._mark_unqueued()
        self.scheduler.finish(request)
        self._release(request)
        if self.tracer is not None:
            self.tracer.on_finish(request.request_id, "error", request.num_prompt_tokens,
                                  request.num_output_tokens, request.num_cached_tokens)
        self._emit(request.request_id, ERROR, [pb.ERROR_CODE_INTERNAL, message], final=True)

    def _fail_everything(self, message: str, reason: int | None = None) -> None:
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            if reason is None:
                self._fail(request, message)
            else:
                self._finish(request, reason)
        # anything submitted but never seen by the scheduler
        for command, payload in drain(self._inbox):
            if command == "add":
                self._emit(payload.request_id, ERROR, [pb.ERROR_CODE_UNAVAILABLE, message], final=True)


FEW_STATE_COPIES = 2  # copies up to which each is a plain row copy (no index upload, no gather + scatter)


def copy_state_slots(backend, state_layers: list[StateLayer], copies: list[tuple[int, int]]) -> None:
    """``state[dst] = state[src]`` for every (src, dst) in ``copies``, on every state layer. A
    few copies (a warm request's restore, a step's snapshot) go row by row: one launch a tensor,
    where index arrays cost an upload (on cuda, one that waits for the device) and two launches."""
    if len(copies) <= FEW_STATE_COPIES:
        for layer in state_layers:
            for tensor in layer.tensors.values():
                for src, dst in copies:
                    tensor[dst] = tensor[src]
        return
    xp = backend.xp
    src = xp.asarray(np.asarray([c[0] for c in copies], np.int64))
    dst = xp.asarray(np.asarray([c[1] for c in copies], np.int64))
    for layer in state_layers:
        layer.copy_slots(src, dst)
