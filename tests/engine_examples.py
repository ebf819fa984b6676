"""Run an engine example on the engine's real modules, as a user with the engine installed would: an installed
engine, else the wheel the tests cache (`upstream.py`), active around the example.

    python tests/engine_examples.py examples/vllm_connector.py

Exit status 3 with "cannot be had" on stderr when the engine is neither installed nor downloadable.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import upstream


def load(example: str) -> upstream.Upstream:
    if example == "vllm_connector.py":
        return upstream.load_vllm()
    if example == "sglang_hicache.py":
        return upstream.load(
            "sglang", upstream.SGLANG_VERSION, packages=("sglang",),
            modules=upstream.SGLANG_MODULES + ("sglang.srt.mem_cache.allocator.paged",),
            stubs=upstream.SGLANG_STUBS, requirements=upstream.SGLANG_REQUIREMENTS, bare=("sglang",),
            data_prefixes=("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/"),
        )
    raise SystemExit(f"{example} is not an engine example")


def main(path: str) -> None:
    engine = {"vllm_connector.py": "vllm", "sglang_hicache.py": "sglang"}.get(Path(path).name)
    if engine is not None and importlib.util.find_spec(engine) is not None:  # installed: nothing to load
        runpy.run_path(path, run_name="__main__")
        return
    try:
        loaded = load(Path(path).name)
    except upstream.UpstreamUnavailable as exc:
        print(f"{Path(path).name}: its engine cannot be had: {exc}", file=sys.stderr)
        raise SystemExit(3) from None
    with loaded.active():
        runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1])
