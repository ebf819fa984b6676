"""The outcome of one NaN/Inf check (no torch import: the guard and the telemetry read it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvobs.semconv import CHECK_CLEAN, CHECK_INF, CHECK_NAN


@dataclass(frozen=True)
class CheckResult:
    """How many distinct blocks were checked and which were bad (NaN wins over Inf: the two are disjoint)."""

    checked_blocks: int
    nan_block_ids: tuple[int, ...]
    inf_block_ids: tuple[int, ...]

    @property
    def clean(self) -> bool:
        return not self.nan_block_ids and not self.inf_block_ids

    @property
    def bad_block_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.nan_block_ids + self.inf_block_ids))

    @property
    def result(self) -> str:
        if self.nan_block_ids:
            return CHECK_NAN
        return CHECK_INF if self.inf_block_ids else CHECK_CLEAN
