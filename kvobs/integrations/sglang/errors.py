"""Why SGLang's transfer ended without the data kvobs waited for, recorded as the transfer's error."""

from __future__ import annotations

from typing import Any

from kvobs.errors import KVObsError


class CopyNotConfirmed(KVObsError):
    """SGLang reported a transfer failed, aborted it, or dropped its acknowledgement before the copy finished.

    Recorded on the transfer (`outcome="error"`), never raised into SGLang.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"SGLang did not confirm the {path} copy: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason)
