"""The engine integrations and the demo are built on kvobs's public names only, as an integration outside this
repository would be: every kvobs module they import is public (or their own package, or the integrations'
shared `kvobs.integrations._common`), and every name they take from a kvobs module is public there (in its
`__all__`, or not `_`-prefixed where it has none). `_common` is the one door to kvobs's internals."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvobs

PACKAGE = Path(kvobs.__file__).resolve().parent
PUBLIC_MODULES = frozenset({"kvobs", "kvobs.errors", "kvobs.semconv", "kvobs.config", "kvobs.policy",
                            "kvobs.integrity", "kvobs.locks", "kvobs.signals", "kvobs.testing"})
COMMON = "kvobs.integrations._common"
ENGINE_PACKAGES = ("kvobs.integrations.vllm", "kvobs.integrations.sglang", "kvobs.integrations.fastdeploy",
                   "kvobs.demo")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package: str) -> list[tuple[int, str, list[str]]]:
    """(line, module, names taken from it) of every import in the file, nested ones included; relative
    imports resolved from `package`, the file's package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def refusals(path: Path, own_package: str, package: str) -> list[str]:
    """What the file (in `package`, part of `own_package`) imports of kvobs that is not public, one line each."""
    problems = []
    for line, module, names in imports(path, package):
        if module != "kvobs" and not module.startswith("kvobs."):
            continue
        if module == own_package or module.startswith(own_package + ".") or module == COMMON:
            continue
        where = f"{package}/{path.name}:{line}"
        if module not in PUBLIC_MODULES:
            problems.append(f"{where}: imports {module}, not a public kvobs module")
            continue
        public = getattr(importlib.import_module(module), "__all__", None)
        for name in names:
            if module == "kvobs" and f"kvobs.{name}" in PUBLIC_MODULES:
                continue  # a public module, taken by name
            dunder = name.startswith("__") and name.endswith("__")  # __version__
            if not dunder and (name.startswith("_") or (public is not None and name not in public)):
                problems.append(f"{where}: takes {name} from {module}, where it is not public")
    return problems


@pytest.mark.parametrize("package", ENGINE_PACKAGES)
def test_an_engine_package_imports_only_public_kvobs_names(package: str) -> None:
    directory = PACKAGE.parent.joinpath(*package.split("."))
    problems = [problem for path in sorted(directory.rglob("*.py"))
                for problem in refusals(path, package, _package_of(path))]
    assert problems == []


def _package_of(path: Path) -> str:
    return module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]


def test_the_check_finds_an_internal_import(tmp_path: Path) -> None:
    """The test above can fail: an import of an internal, or of a private name, is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("from kvobs.observer import KVObserver\nfrom kvobs import _probe\n"
                     "from kvobs.integrity import kernel\nfrom ..sglang import hicache\n"
                     "from . import transfers\nfrom kvobs import KVObserver, semconv\n\n"
                     "def later():\n    import kvobs.locks._cache_lock\n")
    found = refusals(probe, "kvobs.integrations.vllm", "kvobs.integrations.vllm")
    assert [problem.split(": ", 1)[1] for problem in found] == [
        "imports kvobs.observer, not a public kvobs module",
        "takes _probe from kvobs, where it is not public",
        "takes kernel from kvobs.integrity, where it is not public",
        "imports kvobs.integrations.sglang, not a public kvobs module",
        "imports kvobs.locks._cache_lock, not a public kvobs module",
    ]


def test_common_is_the_only_door_and_its_package_names_are_used() -> None:
    """Integrations take `_common`'s names from the package, never from its modules."""
    problems = []
    for package in ENGINE_PACKAGES:
        directory = PACKAGE.parent.joinpath(*package.split("."))
        for path in sorted(directory.rglob("*.py")):
            problems.extend(f"{path.name}:{line}: {module}" for line, module, _ in imports(path, _package_of(path))
                            if module.startswith(COMMON + "."))
    assert problems == []
