"""The worker's load as the SGLang protocol reports it (``GetLoads``), for load-aware router policies.

KV usage and queue lengths come from the engine's ``load()``; the generation rate and the
prefix-cache hit rate are measured here, over the requests this service ran in the last
``window_s`` seconds (behind a router that is all of the worker's traffic).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb

from openinfer.v1 import engine_pb2 as pb

WINDOW_S = 10.0


class RecentRates:
    """Generated tokens per second and prompt tokens served from the prefix cache, recently.

    Invariant: ``_tokens`` and ``_prompts`` hold only samples younger than ``window_s``
    (pruned on every read and write), oldest first.
    """

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._tokens: deque[tuple[float, int]] = deque()
        self._prompts: deque[tuple[float, int, int]] = deque()

    def _prune(self, now: float) -> None:
        for samples in (self._tokens, self._prompts):
            while samples and samples[0][0] <= now - self.window_s:
                samples.popleft()

    def record_tokens(self, num_tokens: int) -> None:
        now = self.clock()
        self._prune(now)
        self._tokens.append((now, num_tokens))

    def record_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        now = self.clock()
        self._prune(now)
        self._prompts.append((now, num_prompt_tokens, num_cached_tokens))

    def tokens_per_second(self) -> float:
        self._prune(self.clock())
        return sum(n for _, n in self._tokens) / self.window_s

    def cache_hit_rate(self) -> float:
        self._prune(self.clock())
        prompt = sum(p for _, p, _ in self._prompts)
        return sum(c for _, _, c in self._prompts) / prompt if prompt else 0.0


def loads_response(info: pb.ModelInfo, load: pb.Load, rates: RecentRates, *, include: Iterable[str],
                   dp_rank: int | None, version: str) -> sglang_pb.GetLoadsResponse:
    """``GetLoads`` for a worker with one data-parallel rank (rank 0)."""
    block = max(info.kv_block_size, 1)
    used_tokens, total_tokens = load.kv_blocks_used * block, load.kv_blocks_total * block
    token_usage = used_tokens / total_tokens if total_tokens else 0.0
    throughput = rates.tokens_per_second()
    scheduler_load = sglang_pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=load.num_running,
        num_waiting_reqs=load.num_waiting,
        num_total_reqs=load.num_running + load.num_waiting,
        num_used_tokens=used_tokens,
        max_total_num_tokens=total_tokens,
        token_usage=token_usage,
        gen_throughput=throughput,
        cache_hit_rate=rates.cache_hit_rate(),
        utilization=token_usage,
    )
    sections = set(include) or {"core"}
    if sections & {"memory", "all"}:
        scheduler_load.memory.CopyFrom(sglang_pb.MemoryMetrics(token_capacity=total_tokens))
    if sections & {"queues", "all"}:
        scheduler_load.queues.CopyFrom(sglang_pb.QueueMetrics(waiting=load.num_waiting))
    return sglang_pb.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(),
        version=version,
        dp_rank_count=1,
        loads=[scheduler_load] if dp_rank in (None, 0) else [],
        aggregate=sglang_pb.AggregateMetrics(
            total_running_reqs=load.num_running,
            total_waiting_reqs=load.num_waiting,
            total_reqs=load.num_running + load.num_waiting,
            avg_token_usage=token_usage,
            avg_throughput=throughput,
            avg_utilization=token_usage,
        ),
    )
