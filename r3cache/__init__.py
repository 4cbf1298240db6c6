"""r3cache: routed experts of MoE models, from inference to training (rollout routing replay)."""

from r3cache.connector import (
    PendingOutput,
    RequestOutput,
    RequestPublisher,
    SchedulerConnector,
    StepBatch,
    StepMetadata,
    WorkerConnector,
)
from r3cache.layout import RoutingLayout
from r3cache.manifest import Completion
from r3cache.reader import R3Reader
from r3cache.store import BlockStore, open_store

__all__ = [
    "BlockStore",
    "Completion",
    "PendingOutput",
    "R3Reader",
    "RequestOutput",
    "RequestPublisher",
    "RoutingLayout",
    "SchedulerConnector",
    "StepBatch",
    "StepMetadata",
    "WorkerConnector",
    "open_store",
]
__version__ = "0.1.0"
