"""``PagedEngine``: the default ``EngineHandle`` for paged-attention models.

Threads: one engine thread owns the model, the KV pool and the scheduler; asyncio callers
talk to it through an inbox (submit / abort) and receive ``TokenEvent``s on per-request
asyncio queues (``call_soon_threadsafe``). The step is: drain inbox → schedule → forward →
sample → emit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from openinfer.errors import EngineDeadError, InvalidRequestError, QueueFullError
from openinfer.graph import create_runner
from openinfer.kv import BlockPool, KVCacheManager
from openinfer.options import EngineOptions
from openinfer.runtime.batch_builder import LogitsRow, build_forward_batch
from openinfer.runtime.model import PagedModel, RequestStateModel
from openinfer.runtime.sampler import SampledStep, sample_step
from openinfer.runtime.step_timer import StepTimer
from openinfer.runtime.validation import resolve_max_tokens, validate_request
from openinfer.sampling import SamplingState
from openinfer.sched import PLACEHOLDER_TOKEN, Request, RequestStatus, Scheduler, SchedulerOutput
from openinfer.tracing import EngineTracer, TraceWriter
from openinfer.v1 import engine_pb2 as pb

logger = logging.getLogger("openinfer.engine")

_CPU_DEFAULT_BATCHED_TOKENS = 512
_GPU_DEFAULT_BATCHED_TOKENS = 2048


@dataclass
class _LaunchedStep:
    plan: SchedulerOutput
    rows: list[LogitsRow]
    samples: SampledStep
    trace: Any = None  # EngineTracer.on_launch's record when tracing


def _samples_on_device_only(request: Request) -> bool:
    """Whether sampling this request's next token needs no token history on the host.
    Penalties count the generated tokens, so their rows wait until the previous step is read back."""
    params = request.sampling.params
    return not (request.want_prompt_logprobs or params.repetition_penalty not in (0.0, 1.0)
                or params.presence_penalty or params.frequency_penalty)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    done: bool = False


class PagedEngine:
    """Continuous batching over a ``PagedModel`` with chunked prefill, prefix cache and preemption."""

    def __init__(self, model: PagedModel, options: EngineOptions | None = None, *, model_path: str = "",
                 plugin: str = "", tokenizer_path: str | None = None):
        self.model = model
        self.options = options or EngineOptions()
        # models with per-request state (recurrent layers) free it through release_request and
        # cannot rebuild it from cached KV blocks, so they never use the prefix cache
        self._release_state = model.release_request if isinstance(model, RequestStateModel) else None
        if self._release_state is not None and self.options.enable_prefix_cache:
            self.options = self.options.with_(enable_prefix_cache=False)
        spec = model.spec
        self.max_model_len = min(self.options.max_model_len or spec.max_model_len, spec.max_model_len)
        self.block_size = self.options.block_size
        num_blocks = self.options.num_kv_blocks or self._size_kv_pool()
        self.pool = BlockPool(num_blocks, self.block_size, self.options.enable_prefix_cache)
        self.kv = KVCacheManager(self.pool)
        self.kv_cache = [model.backend.allocate_kv(num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
                         for _ in range(spec.num_layers)]
        # decode steps replay CUDA graphs on cuda (unless options.cuda_graph is off); else eager
        self.runner = create_runner(model.backend, self._forward, cuda_graph=self.options.cuda_graph,
                                    max_num_seqs=self.options.max_num_seqs, max_model_len=self.max_model_len,
                                    block_size=self.block_size)
        is_cpu = model.backend.name == "numpy"
        batched = self.options.max_num_batched_tokens or (
            _CPU_DEFAULT_BATCHED_TOKENS if is_cpu else _GPU_DEFAULT_BATCHED_TOKENS)
        self.scheduler = Scheduler(self.kv, max_num_seqs=self.options.max_num_seqs,
                                   max_num_batched_tokens=batched, max_model_len=self.max_model_len,
                                   max_queue=self.options.max_queue,
                                   enable_prefix_cache=self.options.enable_prefix_cache)
        self._info = pb.ModelInfo(
            model_id=self.options.served_model_name or (model_path.rstrip("/").split("/")[-1] if model_path else ""),
            model_path=model_path, architectures=list(spec.architectures), model_type=spec.model_type,
            vocab_size=spec.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=list(spec.eos_token_ids), tokenizer_path=tokenizer_path or model_path,
            backend=model.backend.name, plugin=plugin, kv_block_size=self.block_size, num_kv_blocks=num_blocks)
        if spec.bos_token_id is not None:
            self._info.bos_token_id = spec.bos_token_id
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._num_queued = 0  # submitted and not yet scheduled (bounded by max_queue)
        self._arrivals = itertools.count()
        self._stopping = False
        self._fatal: BaseException | None = None
        self.num_steps = 0
        self.async_scheduling = (self.options.async_scheduling if self.options.async_scheduling is not None
                                 else model.backend.name == "cuda")
        self._in_flight: _LaunchedStep | None = None
        self.num_steps_launched_ahead = 0
        self._step_timer = StepTimer.create(model.backend)
        # per-request Chrome traces (--trace-dir): engine-side spans, written off this loop
        self.tracer = EngineTracer(TraceWriter(self.options.trace_dir)) if self.options.trace_dir else None
        self._thread = threading.Thread(target=self._run, name="openinfer-engine", daemon=True)
        self._thread.start()

    # --- sizing ----------------------------------------------------------------------------------

    def _size_kv_pool(self) -> int:
        spec = self.model.spec
        itemsize = 4 if self.model.backend.name == "numpy" else 2
        bytes_per_block = 2 * spec.num_layers * self.block_size * spec.num_kv_heads * spec.head_dim * itemsize
        budget = getattr(self.model.backend, "kv_memory_budget", None)
        budget_bytes = budget(self.options) if budget else int(self.options.cpu_kv_cache_gib * 2**30)
        # never more than every sequence slot at full context could use
        useful = self.options.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        return max(2, min(budget_bytes // bytes_per_block, useful))

    # --- EngineHandle ----------------------------------------------------------------------------

    def info(self) -> pb.ModelInfo:
        return self._info

    def health(self) -> pb.HealthResponse:
        if self._fatal is not None:
            return pb.HealthResponse(healthy=False, message=f"engine loop died: {self._fatal!r}")
        if self._stopping or not self._thread.is_alive():
            return pb.HealthResponse(healthy=False, message="engine is shut down")
        return pb.HealthResponse(healthy=True, message="ok")

    def load(self) -> pb.Load:
        return pb.Load(num_running=len(self.scheduler.running), num_waiting=self._num_queued,
                       kv_blocks_used=self.pool.num_used_blocks, kv_blocks_total=self.pool.num_usable_blocks,
                       max_queue=self.options.max_queue, kv_blocks_cached=self.pool.num_cached_blocks)

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenEvent]:
        if not self.health().healthy:
            raise EngineDeadError(self.health().message)
        validate_request(request, self.model.spec.vocab_size, self.max_model_len)
        max_tokens = resolve_max_tokens(request, self.max_model_len)
        self.scheduler.check_fits(len(request.prompt_token_ids), max_tokens)
        request_id = request.request_id
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in flight", "request_id")
            if self._num_queued >= self.options.max_queue:
                raise QueueFullError(self.options.max_queue)
            self._streams[request_id] = stream
            self._num_queued += 1
        self._inbox.put(("add", self._make_request(request, max_tokens)))
        try:
            while True:
                event: pb.TokenEvent = await stream.events.get()
                yield event
                if event.WhichOneof("event") in ("finished", "error"):
                    return
        finally:
            if not stream.done:
                self._inbox.put(("abort", request_id))

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

    def _make_request(self, request: pb.GenerateRequest, max_tokens: int) -> Request:
        arrival = next(self._arrivals)
        state = SamplingState.create(request.sampling, request.prompt_token_ids, self.options.seed, arrival)
        return Request(
            request_id=request.request_id, token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids), stop=request.stop, max_tokens=max_tokens,
            sampling=state, num_logprobs=int(request.logprobs), want_logprobs=request.logprobs > 0,
            want_prompt_logprobs=bool(request.prompt_logprobs), arrival_order=arrival,
            cache_salt=request.cache_salt)

    def _emit(self, request_id: str, event: pb.TokenEvent, final: bool = False) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return
            if final:
                stream.done = True
                del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.events.put_nowait, event)
        except RuntimeError:  # the caller's event loop is closed; nobody is listening
            pass

    def _finish(self, request: Request, reason: int, matched_stop: int | None = None) -> None:
        del request.token_ids[request.num_resolved_tokens:]  # tokens never read back are not counted
        if not request.was_scheduled:
            self._mark_unqueued()
        self.scheduler.finish(request)
        self._release(request)
        finished = pb.TokenEvent.Finished(reason=reason, prompt_tokens=request.num_prompt_tokens,
                                          completion_tokens=request.num_output_tokens,
                                          cached_tokens=request.num_cached_tokens)
        if matched_stop is not None:
            finished.matched_stop_token_id = matched_stop
        if self.tracer is not None:
            self.tracer.on_finish(request.request_id, pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower(),
                                  request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
        self._emit(request.request_id, pb.TokenEvent(request_id=request.request_id, finished=finished), final=True)

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
                idle = not self.scheduler.has_work and self._in_flight is None
                if not self._drain_inbox(idle):
                    break
                if self.scheduler.has_work or self._in_flight is not None:
                    self.step()
        except BaseException as exc:  # keep the process alive; health() reports it
            logger.exception("engine loop crashed")
            self._fatal = exc
            self._fail_everything(f"engine loop crashed: {exc!r}")
        finally:
            if self._fatal is None:
                self._fail_everything("engine shut down", reason=pb.FINISH_REASON_ABORT)

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

    def step(self) -> None:
        """One engine step: schedule → launch (forward + sampling) → read back and emit.

        With async scheduling, step N+1 is planned and launched while step N still runs on the
        device — its inputs sampled by N are fed on the device (``token_sources``) — and N's
        tokens are read back and emitted only after N+1 is queued, so the GPU never waits on
        Python between decode steps. A request that N finishes has computed one extra token in
        N+1, which is discarded.
        """
        plan = self.scheduler.schedule()
        for request in plan.preempted:  # recomputed from position 0 later: its state goes too
            self._release(request)
            if self.tracer is not None:
                self.tracer.on_preempted(request.request_id)
        for request in plan.newly_scheduled:
            self._mark_unqueued()
            if self.tracer is not None:
                self.tracer.on_scheduled(request.request_id)
            self._emit(request.request_id, pb.TokenEvent(
                request_id=request.request_id,
                scheduled=pb.TokenEvent.Scheduled(cached_tokens=request.num_cached_tokens)))
        in_flight = self._in_flight
        if in_flight is not None and not self._may_launch_ahead(plan):
            self._in_flight = None
            self._resolve(in_flight)
            in_flight = None
            plan.chunks = [c for c in plan.chunks if c.request.status is RequestStatus.RUNNING]
        if not plan.chunks:
            if in_flight is not None:
                self._in_flight = None
                self._resolve(in_flight)
            elif not plan.preempted:
                time.sleep(0.001)
            return
        try:
            launched: _LaunchedStep | None = self._launch(plan, in_flight)
            failure = None
        except Exception as exc:
            logger.exception("model step failed; failing the %d requests in it", len(plan.chunks))
            launched, failure = None, exc
        if in_flight is not None:
            self.num_steps_launched_ahead += launched is not None
            self._in_flight = None
            self._resolve(in_flight)  # the CPU reads step N back while the device runs N+1
        if failure is not None:
            for chunk in plan.chunks:
                if chunk.request.status is RequestStatus.RUNNING:
                    self._fail(chunk.request, f"model step failed: {failure!r}")
        elif self.async_scheduling and self._may_launch_ahead(launched.plan):
            self._in_flight = launched  # the next step may run before this one is read back
        else:
            self._resolve(launched)

    def _may_launch_ahead(self, plan: SchedulerOutput) -> bool:
        """A step may run before the previous one is read back when none of its rows needs
        that step's tokens on the host (penalties count generated tokens; prompt logprobs
        read them). The same test decides whether a launched step may stay unread."""
        return all(_samples_on_device_only(c.request) for c in plan.chunks)

    def _launch(self, plan: SchedulerOutput, previous: _LaunchedStep | None) -> _LaunchedStep:
        """Build the batch, run the model and start sampling; the plan's tokens count as
        computed from here on and each sampled token is a placeholder until read back.
        Raises what the model raises (``step`` fails the plan's requests)."""
        trace = self.tracer.on_launch(plan.chunks) if self.tracer is not None else None
        batch, rows = build_forward_batch(plan.chunks, self.kv)
        start = self._step_timer.start() if self._step_timer else None
        logits = self.runner.run(batch, previous.samples.device_token_ids if previous else None)
        samples = sample_step(self.model.backend, logits, rows, self.model.spec.eos_token_ids,
                              self.async_scheduling)
        if self._step_timer:
            self._step_timer.stop(start)
        self.num_steps += 1
        for chunk in plan.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        for index, row in enumerate(rows):
            if row.samples:
                row.request.token_ids.append(PLACEHOLDER_TOKEN)
                row.request.pending_sample_row = index
        return _LaunchedStep(plan, rows, samples, trace)

    def _resolve(self, launched: _LaunchedStep) -> None:
        """Read a launched step back: publish its full KV blocks, fill placeholders, check
        stops, emit. Blocks are published first so a request finishing here still leaves its
        prefix in the cache."""
        if self.options.enable_prefix_cache:
            for chunk in launched.plan.chunks:
                request = chunk.request
                if request.request_id in self.kv.requests and not request.want_prompt_logprobs:
                    computed = min(request.num_computed_tokens, request.num_resolved_tokens)
                    self.kv.publish_full_blocks(request.request_id, request.token_ids, computed)
        results = launched.samples.results()
        if launched.trace is not None:
            self.tracer.on_resolved(launched.trace)
        for row, sample in zip(launched.rows, results, strict=True):
            request = row.request
            if request.status is RequestStatus.FINISHED:
                continue  # aborted or stopped meanwhile: this row's work is discarded
            if not row.samples:
                request.prompt_logprobs.append(sample.as_proto())
                continue
            self._accept_token(request, row.position + 1, sample)

    def _accept_token(self, request: Request, index: int, sample) -> None:
        token = sample.token_id
        request.token_ids[index] = token
        request.sampling.record(token)
        tokens = pb.TokenEvent.Tokens(ids=[token])
        if request.want_logprobs:
            tokens.logprobs.append(sample.as_proto())
        num_out = index + 1 - request.num_prompt_tokens
        if request.prompt_logprobs and num_out == 1:
            tokens.prompt_logprobs.extend(request.prompt_logprobs)
        self._emit(request.request_id, pb.TokenEvent(request_id=request.request_id, tokens=tokens))
        stop = request.stop
        if num_out >= stop.min_tokens:
            if token in stop.stop_token_ids or (not stop.ignore_eos and token in self.model.spec.eos_token_ids):
                del request.token_ids[index + 1:]  # a token sampled after this one is discarded
                return self._finish(request, pb.FINISH_REASON_STOP, token)
        if num_out >= request.max_tokens or index + 1 >= self.max_model_len:
            del request.token_ids[index + 1:]
            self._finish(request, pb.FINISH_REASON_LENGTH)

    def _forward(self, device_batch):
        return self.model.forward(device_batch, self.kv_cache)

    def _fail(self, request: Request, message: str) -> None:
        if not request.was_scheduled:
            self._mark_unqueued()
        self.scheduler.finish(request)
        self._release(request)
        if self.tracer is not None:
            self.tracer.on_finish(request.request_id, "error", request.num_prompt_tokens,
                                  request.num_output_tokens, request.num_cached_tokens)
        self._emit(request.request_id, pb.TokenEvent(request_id=request.request_id, error=pb.TokenEvent.Error(
            code=pb.ERROR_CODE_INTERNAL, message=message)), final=True)

    def _fail_everything(self, message: str, reason: int | None = None) -> None:
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            if reason is None:
                self._fail(request, message)
            else:
                self._finish(request, reason)
        # anything submitted but never seen by the scheduler
        while True:
            try:
                command, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                self._emit(payload.request_id, pb.TokenEvent(request_id=payload.request_id, error=pb.TokenEvent.Error(
                    code=pb.ERROR_CODE_UNAVAILABLE, message=message)), final=True)

