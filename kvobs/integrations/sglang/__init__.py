"""Put kvobs on SGLang (0.5.23): HiCache's device <-> host copies and the PD prefill -> decode transfer.

    import kvobs
    from kvobs.integrations import sglang as kvobs_sglang

    obs = kvobs.KVObserver("sglang", lock=None, page_size=64)  # SGLang's --page-size
    undo_hicache = kvobs_sglang.instrument_hicache(obs)          # HiCacheController, HybridCacheController
    undo_pd = kvobs_sglang.instrument_pd(obs, cache=device_pool)  # CommonKVSender / CommonKVReceiver

Run it in the process that runs SGLang's scheduler (SGLang's own modules are imported by these calls, never
by `import kvobs`). Every call returns a handle whose `undo()` restores SGLang's classes exactly.
"""

from kvobs import Instrumentation as Patches
from kvobs.errors import CopyNotConfirmed
from kvobs.integrations.sglang._hicache import instrument_hicache
from kvobs.integrations.sglang._pd import instrument_pd

is_instrumented = Patches.is_instrumented

__all__ = ["CopyNotConfirmed", "Patches", "instrument_hicache", "instrument_pd", "is_instrumented"]
