"""The default continuous-batching scheduler for paged-attention models."""

from openinfer.sched.request import Request, RequestStatus
from openinfer.sched.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

__all__ = ["Request", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerOutput"]
