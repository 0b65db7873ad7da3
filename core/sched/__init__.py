"""The default continuous-batching scheduler for paged-attention models."""

from openinfer.sched.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from openinfer.sched.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

__all__ = ["PLACEHOLDER_TOKEN", "Request", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerOutput"]
