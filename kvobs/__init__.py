"""kvobs: safety and observability for KV-cache transfers (prefetch, write-back, send).

The public names, nothing else. Importing kvobs changes no process-wide telemetry state and does not
import torch.
"""

from kvobs._lifecycle.transfer import Transfer
from kvobs._version import __version__ as __version__
from kvobs.errors import (
    AlreadyInstrumented,
    CorruptKVError,
    DuplicateEngine,
    InvalidOption,
    KVObsError,
    LockTimeout,
    MetricNameConflict,
    MultiprocessDirError,
    ReentrantLockError,
    SharingLockRequired,
    SignalBufferFull,
    TransferRejected,
)
from kvobs.guard import Guard
from kvobs.instrument import Instrumentation, instrument
from kvobs.integrity import CheckResult, check_blocks
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import NullLock, ProcessLock, ThreadLock
from kvobs.observer import KVObserver
from kvobs.policy import IntegrityPolicy
from kvobs.signals import EarlySignalBuffer, Progress, ReadySignal, StepAlignedSignalBuffer
from kvobs.telemetry._logs import add_trace_context
from kvobs.telemetry._metrics.exposition import start_metrics_server
from kvobs.telemetry._metrics.multiprocess import clear_dead_processes
from kvobs.telemetry._recorder import TransferRecord
from kvobs.telemetry._tracing import configure_tracing

__all__ = [
    "AlreadyInstrumented",
    "BlockLock",
    "CheckResult",
    "CorruptKVError",
    "DuplicateEngine",
    "EarlySignalBuffer",
    "Guard",
    "Instrumentation",
    "InvalidOption",
    "IntegrityPolicy",
    "KVObsError",
    "KVObserver",
    "LockTimeout",
    "MetricNameConflict",
    "MultiprocessDirError",
    "NullLock",
    "ProcessLock",
    "Progress",
    "ReadySignal",
    "ReentrantLockError",
    "SharingLockRequired",
    "SignalBufferFull",
    "StepAlignedSignalBuffer",
    "ThreadLock",
    "Transfer",
    "TransferRecord",
    "TransferRejected",
    "add_trace_context",
    "check_blocks",
    "clear_dead_processes",
    "configure_tracing",
    "instrument",
    "start_metrics_server",
]
