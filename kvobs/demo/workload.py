"""The seeded workload: requests that share prompt prefixes, so later requests hit the storage cache.

Each request belongs to a prefix family (a popular system prompt, a shared document): its first
`prefix_blocks` blocks are that family's blocks, named by family-wide storage keys (a prefix hash chain in a
real engine), followed by 1..max_suffix_blocks blocks of its own. Families are drawn Zipf-like, so a few are
hot. Every random choice comes from `random.Random(seed)`: one seed, one request sequence (thread timing
still decides how far a run gets through it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvobs.demo.config import SimConfig


@dataclass
class Request:
    """One request as the scheduler sees it. Mutable fields belong to the engine's forward thread."""

    req_id: int
    family: int
    keys: list[str]
    prefix_blocks: int
    register_delay_s: float
    block_size: int
    slot: int = -1
    gpu_block_ids: list[int] = field(default_factory=list)
    computed: int = 0  # blocks written so far (prefetched ones included)
    prefetch: Any = None  # the PrefetchTask of a prefix hit, until it completed
    prefix_free: bool = False  # the prefix counts as loaded (its prefetch started; with a probe: and released)

    @property
    def task_id(self) -> str:
        return f"req-{self.req_id}"

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class Workload:
    """An endless, seeded stream of requests."""

    seed: int
    families: int
    family_blocks: int
    max_suffix_blocks: int
    block_size: int
    early_fraction: float  # the share of requests whose task registers late
    register_delay_s: tuple[float, float]
    _next_id: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._weights = [1.0 / (i + 1) for i in range(self.families)]

    @classmethod
    def of(cls, config: SimConfig) -> Workload:
        """The workload a run's configuration describes."""
        return cls(config.seed, config.families, config.family_blocks, config.max_suffix_blocks,
                   config.block_size, config.early_fraction, config.register_delay_s)

    @staticmethod
    def family_key(family: int, block: int) -> str:
        return f"fam{family}/blk{block}"

    def next_request(self) -> Request:
        rng = self.rng
        req_id = self._next_id
        self._next_id += 1
        family = rng.choices(range(self.families), weights=self._weights)[0]
        prefix = rng.randint(1, self.family_blocks)
        suffix = rng.randint(1, self.max_suffix_blocks)
        keys = [self.family_key(family, j) for j in range(prefix)]
        keys += [f"req{req_id}/blk{j}" for j in range(prefix, prefix + suffix)]
        # Registration of the transfer task may lag the model runner's layer0 signal ("faster request
        # preparation"): for `early_fraction` of requests it comes after a delay, for the rest at once.
        if rng.random() < self.early_fraction:
            delay = rng.uniform(*self.register_delay_s)
        else:
            delay = 0.0
        return Request(req_id, family, keys, prefix, delay, self.block_size)
