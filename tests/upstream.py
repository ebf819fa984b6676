"""Load the REAL upstream engine classes (vLLM, SGLang) from their published wheels, for tests.

Why: kvobs integrations must be tested against the engines' own code, never a copy of it in this
repository. The wheels are fetched with ``pip download --no-deps`` into a cache
(``KVOBS_WHEEL_CACHE``, default ``~/.cache/kvobs/wheels``); only their Python sources are unpacked,
once, next to them. A load imports just the modules a test needs, with the engine's GPU-only and
heavyweight dependencies replaced by explicit, named placeholder modules, and then takes every
upstream module and placeholder back out of ``sys.modules``: other tests never see them.
While a test uses an engine, :meth:`Upstream.active` puts them back (lazy imports inside upstream
functions, such as ``KVConnectorFactory`` loading a connector by module path, need them there).

Offline, the tests that need a wheel are skipped with a reason naming it; with ``CI=true`` they fail.

Usage in a test module::

    from upstream import vllm  # the fixture

    def test_x(vllm):
        base = vllm.attr("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1")
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
import types
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
DOWNLOAD_TIMEOUT_S = 900


class UpstreamUnavailable(RuntimeError):
    """A wheel or a dependency needed to load an upstream engine is missing (offline, no pip...)."""


def cache_dir() -> pathlib.Path:
    """Where wheels and their unpacked sources live; shared by every checkout on the machine."""
    return pathlib.Path(os.environ.get("KVOBS_WHEEL_CACHE", "~/.cache/kvobs/wheels")).expanduser()


def _wheel_prefix(name: str, version: str) -> str:
    # Wheel file names spell the distribution with underscores (PEP 427).
    return f"{name.replace('-', '_')}-{version}-"


def _cached_wheel(name: str, version: str) -> pathlib.Path | None:
    matches = sorted(cache_dir().glob(_wheel_prefix(name, version) + "*.whl"))
    return matches[0] if matches else None


def wheel(name: str, version: str) -> pathlib.Path:
    """The wheel file of ``name==version``, downloaded once with pip and reused after that."""
    found = _cached_wheel(name, version)
    if found is not None:
        return found
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    # Download into a private folder, then move: concurrent test processes never see half a wheel.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", "--dest", tmp, f"{name}=={version}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UpstreamUnavailable(f"could not download the {name}=={version} wheel: {exc}") from exc
        downloaded = sorted(pathlib.Path(tmp).glob(_wheel_prefix(name, version) + "*.whl"))
        if done.returncode != 0 or not downloaded:
            reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel produced"]
            raise UpstreamUnavailable(
                f"could not download the {name}=={version} wheel with pip: {reason[0]}")
        target = cache / downloaded[0].name
        os.replace(downloaded[0], target)
    return target


def unpacked(wheel_path: pathlib.Path, data_prefixes: tuple[str, ...] = ()) -> pathlib.Path:
    """The wheel's Python sources, unpacked once beside it; compiled parts stay in the zip.

    ``data_prefixes``: folders inside the wheel whose other files are unpacked too (an engine
    may check at import time that e.g. its kernel headers exist)."""
    spec = repr(sorted(data_prefixes)).encode()
    target = wheel_path.with_name(f"{wheel_path.stem}.src-{hashlib.sha256(spec).hexdigest()[:8]}")
    marker = target / ".complete"
    if marker.exists():
        return target
    with tempfile.TemporaryDirectory(dir=wheel_path.parent, prefix=".unpack-") as tmp:
        with zipfile.ZipFile(wheel_path) as archive:
            members = [m for m in archive.namelist()
                       if m.endswith(".py") or (m.startswith(data_prefixes) and ".so" not in m)]
            archive.extractall(tmp, members)
        (pathlib.Path(tmp) / ".complete").write_text(wheel_path.name)
        os.chmod(tmp, 0o755)  # TemporaryDirectory makes it private; the cache may be shared
        try:
            os.replace(tmp, target)
        except OSError:
            if not marker.exists():  # a concurrent process unpacked it first: use theirs
                raise
    return target


# ---------------------------------------------------------------------------------------------
# Placeholders: what a stubbed module hands out.
# ---------------------------------------------------------------------------------------------


class _PlaceholderType(type):
    """Classes standing in for an absent library's names: usable in annotations, subclassing,
    ``isinstance`` and module-level constants, inert when called."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}")

    def __repr__(cls) -> str:
        return f"<placeholder {cls.__qualname__}>"

    # Registries the engines fill at import time (e.g. ``CONFIG_MAPPING[...] = ...``).
    def __setitem__(cls, key: object, value: object) -> None:
        return None

    def __getitem__(cls, key: object) -> Any:
        return placeholder(f"{cls.__qualname__}[]")

    def __iter__(cls) -> Iterator[Any]:
        return iter(())

    def __len__(cls) -> int:
        return 0

    def __contains__(cls, key: object) -> bool:
        return False


def _placeholder_init(self: object, *args: object, **kwargs: object) -> None:
    return None


def _placeholder_getattr(self: object, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return placeholder(f"{type(self).__qualname__}.{name}")()


def _placeholder_call(self: object, *args: object, **kwargs: object) -> Any:
    return placeholder(f"{type(self).__qualname__}()")()


def _pydantic_any_schema(cls: type, source: object, handler: object) -> Any:
    from pydantic_core import core_schema  # only reached when the engine uses pydantic

    return core_schema.any_schema()


@functools.cache
def placeholder(qualname: str) -> type:
    """One placeholder class per dotted name, so repeated imports see the same object."""
    return _PlaceholderType(qualname.rsplit(".", 1)[-1], (), {
        "__qualname__": qualname,
        "__module__": qualname.split(".", 1)[0],
        "__init__": _placeholder_init,
        "__getattr__": _placeholder_getattr,
        "__call__": _placeholder_call,
        "__class_getitem__": classmethod(lambda cls, item: cls),
        "__init_subclass__": classmethod(lambda cls, **kwargs: None),
        "__setitem__": lambda self, key, value: None,
        "__getitem__": lambda self, key: placeholder(f"{qualname}[]")(),
        "__iter__": lambda self: iter(()),
        "__len__": lambda self: 0,
        "__contains__": lambda self, key: False,
        "__get_pydantic_core_schema__": classmethod(_pydantic_any_schema),
    })


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


@dataclass(frozen=True)
class Stub:
    """A module the engine imports that the tests replace, and why.

    ``empty``: a bare module (for the engine's own import-time side-effect modules);
    otherwise every attribute is a placeholder class and submodules are stubbed too.
    """

    name: str
    why: str
    empty: bool = False


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the listed stubs, and only to imports made from the engine's own sources: a real
    library probing for e.g. ``triton`` while the engine loads must still find it absent."""

    def __init__(self, root: pathlib.Path, stubs: tuple[Stub, ...]) -> None:
        self._root = str(root)
        self._stubs = {stub.name: stub for stub in stubs}

    def _stub_for(self, name: str) -> Stub | None:
        if name in self._stubs:
            return self._stubs[name]
        # A placeholder package stands in for its submodules too.
        return next((stub for head, stub in self._stubs.items()
                     if not stub.empty and name.startswith(head + ".")), None)

    def _imported_by_engine(self) -> bool:
        frame = sys._getframe(1)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not (filename == __file__ or filename.startswith("<frozen")
                    or f"{os.sep}importlib{os.sep}" in filename):
                return filename.startswith(self._root)
            frame = frame.f_back
        return False

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        stub = self._stub_for(fullname)
        if stub is None or not (stub.empty or self._imported_by_engine()):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        stub = self._stub_for(spec.name)
        module = (types.ModuleType if stub is not None and stub.empty else _PlaceholderModule)(spec.name)
        module.__path__ = []
        module.__doc__ = f"kvobs test stub: {stub.why if stub else ''}"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# A loaded engine.
# ---------------------------------------------------------------------------------------------

_ACTIVATION_LOCK = threading.RLock()


@dataclass
class Upstream:
    """The real modules of one engine, loaded from its wheel, kept out of ``sys.modules``."""

    name: str
    version: str
    root: pathlib.Path
    packages: tuple[str, ...]
    stubs: tuple[Stub, ...]
    env: Mapping[str, str]
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    load_seconds: float = 0.0
    _depth: int = 0

    def _owns(self, module_name: str) -> bool:
        heads = self.packages + tuple(stub.name for stub in self.stubs)
        return any(module_name == head or module_name.startswith(head + ".") for head in heads)

    @contextlib.contextmanager
    def active(self) -> Iterator[Upstream]:
        """Put the engine's modules (and its stubs) into ``sys.modules`` for the duration.

        Everything the engine imports meanwhile is kept for the next activation and removed
        again on exit, as are the search path, finder and environment changes."""
        with _ACTIVATION_LOCK:
            if self._depth:  # already active: nothing to swap
                self._depth += 1
                try:
                    yield self
                finally:
                    self._depth -= 1
                return
            self._depth = 1
            saved_modules = {name: module for name, module in sys.modules.items() if self._owns(name)}
            saved_env = dict(os.environ)
            finder = _StubFinder(self.root, self.stubs)
            for name in saved_modules:
                del sys.modules[name]
            sys.modules.update(self.modules)
            sys.path.insert(0, str(self.root))
            sys.meta_path.insert(0, finder)
            os.environ.update(self.env)
            importlib.invalidate_caches()
            try:
                yield self
            finally:
                self._depth = 0
                sys.meta_path.remove(finder)
                sys.path.remove(str(self.root))
                for name in [name for name in sys.modules if self._owns(name)]:
                    self.modules[name] = sys.modules.pop(name)
                sys.modules.update(saved_modules)
                # The engine may set variables when imported (vLLM sets TORCHINDUCTOR_CACHE_DIR).
                os.environ.clear()
                os.environ.update(saved_env)

    def module(self, dotted: str) -> types.ModuleType:
        """An upstream module, imported (within an activation) if this load has not yet."""
        if self._depth:  # active (possibly asked from an engine thread): import in place
            return importlib.import_module(dotted)
        if dotted in self.modules:
            return self.modules[dotted]
        with self.active():
            return importlib.import_module(dotted)

    def attr(self, path: str) -> Any:
        """``"package.module:Name.attr"`` -> that object, from the real upstream module."""
        module_name, _, attribute = path.partition(":")
        value: Any = self.module(module_name)
        for part in filter(None, attribute.split(".")):
            value = getattr(value, part)
        return value

    def source_of(self, module_name: str) -> pathlib.Path:
        """The unpacked file a module was loaded from (for messages and source checks)."""
        return pathlib.Path(self.module(module_name).__file__ or "")


def _check_requirements(name: str, requirements: tuple[str, ...]) -> None:
    missing = [req for req in requirements if importlib.util.find_spec(req) is None]
    if missing:
        raise UpstreamUnavailable(
            f"loading {name} needs these packages in the test environment: {', '.join(missing)} "
            f"(pip install {' '.join(missing)})")


def load(name: str, version: str, *, packages: tuple[str, ...], modules: tuple[str, ...],
         stubs: tuple[Stub, ...], requirements: tuple[str, ...] = (),
         env: Mapping[str, str] | None = None, bare: tuple[str, ...] = (),
         preimports: tuple[str, ...] = (), data_prefixes: tuple[str, ...] = ()) -> Upstream:
    """Import ``modules`` of ``name==version`` from its wheel, stubs in place, then clear them out.

    ``bare``: packages whose ``__init__`` is not run (only their folder is made importable),
    for engines whose top-level package patches other libraries when imported.
    ``preimports``: real modules imported before any stub exists, so that they see the
    environment as it is (torch caches whether ``triton`` is importable)."""
    _check_requirements(name, requirements)
    for module_name in preimports:
        importlib.import_module(module_name)
    if any(stub.name == "triton" for stub in stubs):
        _settle_torch_triton_probes()
    root = unpacked(wheel(name, version), data_prefixes)
    engine = Upstream(name=name, version=version, root=root, packages=packages, stubs=stubs,
                      env=dict(env or {}))
    for package in bare:
        module = types.ModuleType(package)
        module.__path__ = [str(root / package)]
        module.__file__ = None
        engine.modules[package] = module
    started = time.perf_counter()
    with engine.active():
        for dotted in modules:
            importlib.import_module(dotted)
    engine.load_seconds = time.perf_counter() - started
    return engine


def _settle_torch_triton_probes() -> None:
    """Make torch decide, before a ``triton`` stub exists, that triton is absent.

    torch caches ``has_triton_package()`` and imports triton-dependent inductor modules lazily
    (``torch.compile`` used as a decorator at import time triggers them): done while a stub sits
    in ``sys.modules``, they would take the stub for triton and break torch for every later test."""
    import torch._dynamo.repro.after_dynamo  # noqa: F401  (imported by torch.compile's backend lookup)
    import torch._inductor.compile_fx  # noqa: F401  (imported by get_compiler_config)
    from torch.utils import _triton

    _triton.has_triton_package()
    _triton.has_triton()


# ---------------------------------------------------------------------------------------------
# vLLM 0.33
# ---------------------------------------------------------------------------------------------

VLLM_MODULES = (
    "vllm.config",
    "vllm.config.kv_transfer",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.cpu.common",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.request",
)

_VLLM_HEAVY = "not needed by the KV connector code; heavy or GPU-only"
VLLM_STUBS = (
    Stub("vllm.env_override", "patches torch inductor and os.environ when imported", empty=True),
    Stub("vllm._C", "compiled CUDA kernels"),
    Stub("transformers", "model configs and tokenizers; " + _VLLM_HEAVY),
    Stub("huggingface_hub", "model download; " + _VLLM_HEAVY),
    Stub("openai", "API server types; " + _VLLM_HEAVY),
    Stub("openai_harmony", "chat format parser; " + _VLLM_HEAVY),
    Stub("xgrammar", "structured output; " + _VLLM_HEAVY),
    Stub("llguidance", "structured output; " + _VLLM_HEAVY),
    Stub("partial_json_parser", "tool-call parsing; " + _VLLM_HEAVY),
    Stub("fastapi", "API server; " + _VLLM_HEAVY),
    Stub("aiohttp", "HTTP client; " + _VLLM_HEAVY),
    Stub("zmq", "engine IPC sockets; " + _VLLM_HEAVY),
    Stub("uvloop", "event loop; " + _VLLM_HEAVY),
    Stub("cloudpickle", "executor serialization; " + _VLLM_HEAVY),
    Stub("cbor2", "hashing encoder; " + _VLLM_HEAVY),
    Stub("xxhash", "prefix-cache hashing option; " + _VLLM_HEAVY),
    Stub("pybase64", "multimodal payloads; " + _VLLM_HEAVY),
    Stub("cpuinfo", "platform probing; " + _VLLM_HEAVY),
    Stub("cv2", "multimodal media; " + _VLLM_HEAVY),
    Stub("av", "multimodal media; " + _VLLM_HEAVY),
    Stub("soundfile", "multimodal media; " + _VLLM_HEAVY),
    Stub("soxr", "multimodal media; " + _VLLM_HEAVY),
    Stub("scipy", "multimodal media; " + _VLLM_HEAVY),
    Stub("torchaudio", "multimodal media; " + _VLLM_HEAVY),
    Stub("torchcodec", "multimodal media; " + _VLLM_HEAVY),
    Stub("einops", "model layers; " + _VLLM_HEAVY),
    Stub("tqdm", "progress bars; " + _VLLM_HEAVY),
    Stub("runai_model_streamer", "model loading; " + _VLLM_HEAVY),
    Stub("tensorizer", "model loading; " + _VLLM_HEAVY),
    Stub("fastsafetensors", "model loading; " + _VLLM_HEAVY),
    Stub("boto3", "model loading; " + _VLLM_HEAVY),
    Stub("flashinfer", "GPU attention kernels"),
    Stub("flashinfer_cubin", "GPU attention kernels"),
    Stub("aiter", "ROCm kernels"),
    Stub("torchao", "quantization; " + _VLLM_HEAVY),
    Stub("nixl", "NIXL transfer agent (GPU RDMA)"),
)

VLLM_REQUIREMENTS = ("pydantic", "msgspec", "cachetools", "regex", "psutil")


def load_vllm() -> Upstream:
    """vLLM's KV connector API, offloading connector and MultiConnector, on the CPU platform."""
    return load("vllm", VLLM_VERSION, packages=("vllm",), modules=VLLM_MODULES, stubs=VLLM_STUBS,
                requirements=VLLM_REQUIREMENTS, env={"VLLM_TARGET_DEVICE": "cpu"})


# ---------------------------------------------------------------------------------------------
# SGLang 0.5.23
# ---------------------------------------------------------------------------------------------

SGLANG_MODULES = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.disaggregation.common.conn",
)

_SGLANG_HEAVY = "not needed by HiCache or the PD sender; heavy or GPU-only"
SGLANG_STUBS = (
    Stub("triton", "GPU kernel compiler, imported unconditionally by sglang.srt.utils"),
    Stub("tvm_ffi", "compiled kernel runtime"),
    Stub("transformers", "model configs and processors; " + _SGLANG_HEAVY),
    Stub("huggingface_hub", "model download; " + _SGLANG_HEAVY),
    Stub("sentencepiece", "tokenizer; " + _SGLANG_HEAVY),
    Stub("torchvision", "multimodal media; " + _SGLANG_HEAVY),
    Stub("torchcodec", "multimodal media; " + _SGLANG_HEAVY),
    Stub("IPython", "notebook display; " + _SGLANG_HEAVY),
    Stub("zmq", "scheduler and bootstrap sockets; " + _SGLANG_HEAVY),
    Stub("aiohttp", "HTTP client; " + _SGLANG_HEAVY),
    Stub("starlette", "HTTP server; " + _SGLANG_HEAVY),
    Stub("orjson", "JSON encoder; " + _SGLANG_HEAVY),
    Stub("pybase64", "multimodal payloads; " + _SGLANG_HEAVY),
    Stub("tqdm", "progress bars; " + _SGLANG_HEAVY),
    Stub("gguf", "model loading; " + _SGLANG_HEAVY),
    Stub("compressed_tensors", "quantization configs; " + _SGLANG_HEAVY),
    Stub("torch_memory_saver", "GPU memory release; " + _SGLANG_HEAVY),
)

SGLANG_REQUIREMENTS = ("pydantic", "msgspec", "regex", "psutil", "dill", "requests")


def load_sglang() -> Upstream:
    """SGLang's HiCache controller and PD (disaggregation) sender, on CPU.

    The ``sglang`` package's own ``__init__`` is not run: it patches transformers and imports
    the frontend language; the ``sglang.srt`` modules do not need it."""
    return load("sglang", SGLANG_VERSION, packages=("sglang",), modules=SGLANG_MODULES,
                stubs=SGLANG_STUBS, requirements=SGLANG_REQUIREMENTS, bare=("sglang",),
                # sglang.kernels.jit checks at import time that its C++ sources are there.
                data_prefixes=("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/"))


# ---------------------------------------------------------------------------------------------
# Fixtures: one load per test session, an activation per test, skip offline, fail under CI.
# ---------------------------------------------------------------------------------------------

_LOADERS = {"vllm": load_vllm, "sglang": load_sglang}
_loaded: dict[str, Upstream | UpstreamUnavailable] = {}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def require(engine: str) -> Upstream:
    """The loaded engine; skips the calling test when its wheel cannot be had (fails under CI)."""
    if engine not in _loaded:
        try:
            _loaded[engine] = _LOADERS[engine]()
        except UpstreamUnavailable as exc:
            _loaded[engine] = exc
    outcome = _loaded[engine]
    if isinstance(outcome, UpstreamUnavailable):
        if _in_ci():
            pytest.fail(f"CI=true and the upstream {engine} code is unavailable: {outcome}")
        pytest.skip(f"upstream {engine} unavailable: {outcome}")
    return outcome


@pytest.fixture
def vllm() -> Iterator[Upstream]:
    """vLLM 0.33's real modules, in ``sys.modules`` for this test only."""
    with require("vllm").active() as engine:
        yield engine


@pytest.fixture
def sglang() -> Iterator[Upstream]:
    """SGLang 0.5.23's real modules, in ``sys.modules`` for this test only."""
    with require("sglang").active() as engine:
        yield engine
