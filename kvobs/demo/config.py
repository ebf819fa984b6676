"""What one run of the simulated engine depends on: the kvobs configuration, the workload and the timings."""

from __future__ import annotations

from dataclasses import dataclass

from kvobs.demo.runs import GLOBAL_LOCK, RunSpec

FAULTS = ("stale-signal", "nan")


@dataclass
class SimConfig:
    """Everything a run depends on. The defaults make both incidents appear reliably in a few seconds."""

    run: RunSpec = GLOBAL_LOCK
    seed: int = 0
    engine: str = ""  # the `engine` label; default: the run's (demo-unguarded, demo-global-lock, ...)
    faults: frozenset[str] = frozenset()
    # the paged cache: [num_blocks, block_size, heads, head_dim] fp16
    num_blocks: int = 256
    block_size: int = 16
    heads: int = 4
    head_dim: int = 32
    # the workload
    num_slots: int = 8
    num_layers: int = 4
    families: int = 12
    family_blocks: int = 8
    max_suffix_blocks: int = 3
    storage_capacity: int = 96
    early_fraction: float = 0.5
    register_delay_s: tuple[float, float] = (0.005, 0.04)
    # timing: the race windows are deliberately wide
    chunk_blocks: int = 2  # prefill blocks computed per step per request
    step_s: float = 0.002  # "GPU time" of one forward step
    step_gap_s: float = 0.0005  # scheduler gap between steps
    prefetch_block_s: float = 0.002  # storage read per block
    write_back_block_s: float = 0.002  # storage write per block
    send_layer_s: float = 0.0005
    layer_gap_s: float = 0.0005  # model runner: time between layer signals
    send_deadline_s: float = 0.25  # a registered task whose send has not started by then is hung
    write_back_queue_max: int = 32  # a busy engine skips write-backs beyond this backlog
    # kvobs
    lock_timeout_s: float = 5.0
    signal_ttl_s: float = 30.0
    poison_interval_s: float = 0.5

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(FAULTS)}")
        self.faults = frozenset(self.faults)
        if not self.engine:
            self.engine = self.run.engine_label
