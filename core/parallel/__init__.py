"""Ranks: tensor and expert parallelism over a ``Communicator`` (NCCL on GPUs, an in-process
fake on the CPU). Modules, one job each: ``communicator`` (the interface), ``fake`` (thread
ranks), ``nccl`` (CuPy NCCL), ``layout`` (flags → per-rank shards, checked), ``tensor``
(weight slicing, vocab-parallel embedding / LM head), ``rank`` (``RankContext``), ``dummy``
(``--load-format dummy``), ``workers`` (SPMD rank workers and rank 0's driver), ``build``
(flags → the engine's model), ``memory_plan`` (what each rank will hold), ``expert`` (expert
parallel MoE: all-reduce over replicated tokens, all-gather + reduce-scatter over sharded ones;
``expert_cuda`` its device path),
``data`` (data-parallel attention under expert parallel: each rank attends for its own
sequences and caches only their KV), ``selftest`` (``python -m openinfer.parallel.selftest``: NCCL checks on the GPUs at hand)."""

from openinfer.parallel.communicator import Communicator, SingleRank, gather_last_axis
from openinfer.parallel.data import DataParallelAttention, LocalStep
from openinfer.parallel.dummy import DummyCheckpoint
from openinfer.parallel.layout import ExpertShard, ParallelLayout, TensorShard, VocabShard, check_devices
from openinfer.parallel.rank import LOAD_FORMATS, RankContext

__all__ = ["LOAD_FORMATS", "Communicator", "DataParallelAttention", "DummyCheckpoint", "LocalStep", "ExpertShard", "ParallelLayout", "RankContext",
           "SingleRank", "TensorShard", "VocabShard", "check_devices", "gather_last_axis"]
