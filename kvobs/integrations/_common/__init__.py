"""What every engine integration shares, so each job is done one way: the integrations' one door into kvobs.

An integration imports kvobs's public names (`kvobs`, `kvobs.errors`, `kvobs.semconv`, ...) and this
package, nothing else (tests/docs/test_integration_public_names.py); what an integration needs of kvobs's
internals is here, under one name:
- replacing an engine's methods: `kvobs.Instrumentation` (public: one mark every patcher sees);
- a hook that failed inside the engine: `HookFailures` (counted and logged once per interval, never raised);
- a cache kvobs can check, or the reason it cannot: `checkable`;
- an integration that keeps many copies open: `require_sharing_lock`;
- ids of any engine form as Python ints: `int_list`;
- kvobs's logger, for an integration part that has no observer: `default_logger`.
"""

from __future__ import annotations

from typing import Any

from kvobs.integrations._common.caches import checkable
from kvobs.integrations._common.hooks import HookFailures
from kvobs.integrations._common.locks import require_sharing_lock
from kvobs.signals._inputs import int_list as _checked_int_list
from kvobs.telemetry._logs import default_logger

__all__ = ["HookFailures", "checkable", "default_logger", "int_list", "require_sharing_lock"]


def int_list(ids: Any) -> list[int]:
    """Ids as an engine hands them over (a list, a NumPy array, a torch or Paddle tensor) as Python ints >= 0,
    read as everywhere in kvobs (`kvobs._runtime.ids`: one `.tolist()`, no per-item device sync); TypeError
    for a value that is not an integer, ValueError for a negative one."""
    return _checked_int_list(ids, "id")
