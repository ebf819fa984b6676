"""A simulated serving engine that reproduces the two incidents of DESIGN.md section 1.

`kvobs demo` runs it twice with one seeded workload: unguarded (kvobs only observes) and guarded (kvobs's lock,
early-signal buffer and NaN checks in force). See docs/demo.md for the model and the summary schema.

Importing this package imports torch; `import kvobs` alone never does.
"""

from kvobs.sim.demo import DemoOptions, run_demo, serve
from kvobs.sim.engine import FAULTS, RunStats, SimConfig, SimEngine
from kvobs.sim.report import RUN_FIELDS, SCHEMA_VERSION, format_table, summary_dict

__all__ = [
    "FAULTS",
    "RUN_FIELDS",
    "SCHEMA_VERSION",
    "DemoOptions",
    "RunStats",
    "SimConfig",
    "SimEngine",
    "format_table",
    "run_demo",
    "serve",
    "summary_dict",
]
