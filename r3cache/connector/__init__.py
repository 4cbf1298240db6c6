"""The engine side: scheduler metadata in, per-request routed-expert rows out."""

from r3cache.connector.metadata import (
    PackedHashes,
    RequestOutput,
    StepBatch,
    StepMetadata,
    block_key,
)
from r3cache.connector.publisher import RequestPublisher
from r3cache.connector.scheduler import SchedulerConnector
from r3cache.connector.worker import PendingOutput, WorkerConnector, WorkerStats

__all__ = [
    "PackedHashes",
    "PendingOutput",
    "RequestOutput",
    "RequestPublisher",
    "SchedulerConnector",
    "StepBatch",
    "StepMetadata",
    "WorkerConnector",
    "WorkerStats",
    "block_key",
]
