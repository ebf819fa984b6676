"""kvobs: safety and observability for KV-cache transfers (prefetch, write-back, send).

The public names, nothing else. Importing kvobs changes no process-wide telemetry state and does not
import torch.
"""

from kvobs.version import __version__
from kvobs.block_lock import BlockLock
from kvobs.errors import CorruptKVError, KVObsError, LockTimeout, ReentrantLockError, TransferRejected
from kvobs.guard import Guard
from kvobs.instrument import Instrumentation, instrument
from kvobs.integrity import CheckResult, check_blocks
from kvobs.locks import NullLock, ProcessLock, ThreadLock
from kvobs.observer import KVObserver
from kvobs.policy import IntegrityPolicy
from kvobs.signals import EarlySignalBuffer, ReadySignal
from kvobs.errors import DuplicateEngine, MetricNameConflict, MultiprocessDirError
from kvobs.telemetry.exposition import start_metrics_server
from kvobs.telemetry.logs import add_trace_context
from kvobs.telemetry.recorder import TransferRecord
from kvobs.telemetry.tracing import configure_tracing
from kvobs.transfer import Transfer

__all__ = [
    "BlockLock",
    "CheckResult",
    "CorruptKVError",
    "DuplicateEngine",
    "EarlySignalBuffer",
    "Guard",
    "Instrumentation",
    "IntegrityPolicy",
    "KVObsError",
    "KVObserver",
    "LockTimeout",
    "MetricNameConflict",
    "MultiprocessDirError",
    "NullLock",
    "ProcessLock",
    "ReadySignal",
    "ReentrantLockError",
    "ThreadLock",
    "Transfer",
    "TransferRecord",
    "TransferRejected",
    "add_trace_context",
    "check_blocks",
    "configure_tracing",
    "instrument",
    "start_metrics_server",
]
