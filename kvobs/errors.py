"""Errors kvobs raises into the engine on purpose (the lock's and the integrity check's live beside them)."""

from __future__ import annotations


class TransferRejected(ValueError):
    """A transfer refused before the lock was touched: bad arguments, or a mode the path does not support.

    Raised instead of `assert` so the guard holds under `python -O`.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"kvobs rejected {path} transfer: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.path, self.reason))
