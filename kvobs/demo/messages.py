"""What the engine's threads hand each other through their queues: storage tasks and messager events."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvobs.demo.workload import Request


@dataclass
class PrefetchTask:
    """FastDeploy-shaped storage task (`task_id`, `keys`, `gpu_block_ids`) plus the stored blocks to load."""

    task_id: str
    keys: list[str]
    gpu_block_ids: list[int]
    sources: list[Any]
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    failed: bool = False


@dataclass
class WriteBackTask:
    """Store `keys` from `gpu_block_ids`; then the request's `owned_block_ids` may go back to the allocator."""

    task_id: str
    keys: list[str]
    gpu_block_ids: list[int]
    owned_block_ids: list[int]


@dataclass(frozen=True)
class Registration:
    """The forward pass finished a prefill: register its slot's transfer task once `due` (monotonic) passes."""

    request: Request
    due: float


@dataclass(frozen=True)
class LayerReady:
    """The model runner's signal: `layer` of `slot` holds `tokens` prompt tokens."""

    slot: int
    layer: int
    tokens: int


@dataclass(frozen=True)
class SendEnded:
    """A request's send is over: every layer sent (`sent`), or given up, or never started (hung, aborted).
    The send worker tells the messager; the messager tells the scheduler."""

    request: Request
    sent: bool
