"""A simulated serving engine that reproduces the two incidents kvobs exists for: NaN in the storage cache
(transfers racing the forward pass over shared KV blocks) and hung sends (early layer0 signals dropped).

`kvobs demo` runs it once per configuration in `RUNS` with one seeded workload: unguarded (kvobs only observes),
then guarded (kvobs's lock, early-signal buffer and NaN checks in force) with a global lock and with a block
lock. See docs/demo.md for the model and
the summary schema.

Importing this package imports torch; `import kvobs` alone never does.
"""

from kvobs.demo.app import DemoOptions, run_demo, serve
from kvobs.demo.config import FAULTS, SimConfig
from kvobs.demo.engine import SimEngine
from kvobs.demo.report import RUN_FIELDS, SCHEMA_VERSION, format_table, summary_dict
from kvobs.demo.runs import BLOCK_LOCK, GLOBAL_LOCK, RUNS, UNGUARDED, RunSpec
from kvobs.demo.stats import RunStats

__all__ = [
    "BLOCK_LOCK",
    "FAULTS",
    "GLOBAL_LOCK",
    "RUNS",
    "RUN_FIELDS",
    "SCHEMA_VERSION",
    "UNGUARDED",
    "DemoOptions",
    "RunSpec",
    "RunStats",
    "SimConfig",
    "SimEngine",
    "format_table",
    "run_demo",
    "serve",
    "summary_dict",
]
