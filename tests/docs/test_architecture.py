"""The layers of docs/architecture.md hold: imports run downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KVOBS = Path(__file__).resolve().parents[2] / "kvobs"

# Lowest first; a module may import its own layer and any layer listed before it.
LAYERS = [
    ("leaves", {"kvobs.errors", "kvobs.semconv", "kvobs._version"}),
    ("runtime", {"kvobs._runtime"}),
    ("services", {"kvobs.locks", "kvobs.integrity", "kvobs.signals", "kvobs.telemetry", "kvobs.policy"}),
    ("lifecycle", {"kvobs._lifecycle"}),
    ("public API", {"kvobs", "kvobs.config", "kvobs.observer", "kvobs.guard", "kvobs.instrument", "kvobs.testing"}),
    ("applications", {"kvobs.integrations", "kvobs.demo", "kvobs.cli", "kvobs.__main__"}),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names `module`'s layer."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(KVOBS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every kvobs import, at any depth (function-level imports count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvobs":  # `from kvobs import semconv`: the names may be modules
                found += [(node.lineno, f"kvobs.{alias.name}") if alias.name in SUBMODULES else (node.lineno, "kvobs")
                          for alias in node.names]
            elif node.module.startswith("kvobs."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "kvobs"]
    return found


SUBMODULES = {p.stem if p.is_file() else p.name for p in KVOBS.iterdir() if p.suffix == ".py" or p.is_dir()}
MODULES = sorted(KVOBS.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(KVOBS.parent)))
def test_imports_run_downwards(path: Path) -> None:
    importer = module_name(path)
    own = layer_of(importer)
    upward = [f"line {line}: {imported} ({LAYERS[layer_of(imported)][0]})"
              for line, imported in imports_of(path) if layer_of(imported) > own]
    assert not upward, f"{importer} ({LAYERS[own][0]}) imports a layer above it: {upward}"


def test_every_package_is_placed_in_a_layer() -> None:
    for path in MODULES:
        layer_of(module_name(path))
