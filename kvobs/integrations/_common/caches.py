"""A cache kvobs can check, or why not: one answer for every integration.

An engine's cache kvobs cannot check (integer storage such as fp8 kept as uint8, a layout it cannot read)
is left out, with the reason, so a transfer is never refused because of the cache: it is still locked,
counted and traced.
"""

from __future__ import annotations

from typing import Any


def checkable(cache: Any) -> tuple[Any, str]:
    """(`cache`, "") when kvobs's NaN/Inf check can read it, else (None, the reason)."""
    from kvobs.integrity import validate_cache  # the checks' modules load with the first cache, not with kvobs

    try:
        validate_cache(cache)
    except (TypeError, ValueError) as exc:
        return None, str(exc)
    return cache, ""
