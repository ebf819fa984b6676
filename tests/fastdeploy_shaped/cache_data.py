"""`CacheStatus` and the storage tasks (upstream: cache_data.py, cache_tasks.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class CacheStatus(Enum):
    GPU = 0
    CPU = 1
    SWAP2CPU = 2
    SWAP2GPU = 3
    STORAGE2GPU = 4
    GPU2STORAGE = 5


@dataclass(frozen=True, kw_only=True)
class CacheTask:
    task_id: str
    keys: list[str]
    token_ids: list[int] | None
    gpu_block_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class ReadStorageTask(CacheTask):
    start_read_block_idx: int
    timeout: float = 30.0


@dataclass(frozen=True, kw_only=True)
class WriteStorageTask(CacheTask):
    timeout: float = 30.0
