"""``RankContext``: what one rank's model builder needs to know about its place in the group."""

from __future__ import annotations

from dataclasses import dataclass, field

from openinfer.parallel.communicator import Communicator, SingleRank
from openinfer.parallel.layout import ExpertShard, ParallelLayout, TensorShard

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class RankContext:
    """Rank ``rank`` of ``layout.world_size``; ``comm`` talks to the other ranks.
    ``load_format``: "auto" reads the checkpoint, "dummy" fills every tensor with random values
    at its real shape (benchmarks of shapes no checkpoint here holds)."""

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    rank: int = 0
    comm: Communicator = field(default_factory=SingleRank)
    load_format: str = "auto"

    @property
    def tensor(self) -> TensorShard:
        return self.layout.tensor_shard(self.rank)

    @property
    def expert(self) -> ExpertShard:
        return self.layout.expert_shard(self.rank)

    @property
    def world_size(self) -> int:
        return self.layout.world_size


SINGLE = RankContext()
