"""Registries: all of kvobs's families or none, one live observer per engine label, a usable multiprocess dir."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap
import weakref

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvobs import semconv as sc
from kvobs.errors import DuplicateEngine, MetricNameConflict, MultiprocessDirError
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.exposition import scrape_registry
from kvobs.telemetry._metrics.families import MetricFamilies


def names(registry: CollectorRegistry) -> set[str]:
    return {m.name for m in registry.collect()}


def test_a_conflicting_name_registers_nothing_and_later_observers_still_work():
    registry = CollectorRegistry()
    theirs = Counter("kvobs_nan_blocks", "someone else's", registry=registry)  # one of kvobs's last families
    with pytest.raises(MetricNameConflict, match="kvobs_nan_blocks") as info:
        MetricFamilies.of(registry)
    assert "nothing of kvobs was registered" in str(info.value)
    assert names(registry) == {"kvobs_nan_blocks"}
    registry.unregister(theirs)
    metrics = EngineMetrics(MetricFamilies.of(registry), "after", "cache")
    metrics.path(sc.PATH_SEND).rejected()
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "after", "path": "send",
                                                          "outcome": "rejected"}) == 1


def test_a_second_live_observer_with_the_same_engine_label_is_refused():
    registry = CollectorRegistry()
    families = MetricFamilies.of(registry)
    first = EngineMetrics(families, "engine-a", "cache")
    with pytest.raises(DuplicateEngine) as info:
        EngineMetrics(families, "engine-a", "other-lock")
    assert "'engine-a'" in str(info.value) and "distinct engine label" in str(info.value)
    assert isinstance(info.value, ValueError)
    EngineMetrics(families, "engine-b", "cache")  # another label on the same registry
    EngineMetrics(MetricFamilies.of(CollectorRegistry()), "engine-a", "cache")  # another registry
    assert first.engine == "engine-a"


class Observer:
    """Stands for an engine's observer: holds its metrics, and sits in a reference cycle as observers do."""

    def __init__(self, registry: CollectorRegistry, engine: str) -> None:
        self.metrics = EngineMetrics(MetricFamilies.of(registry), engine, "cache")
        self.me = self
        self.metrics.bind_lock_held(self, lambda observer: 2.0)


def test_a_dropped_observer_frees_its_label_and_its_counts_continue():
    registry = CollectorRegistry()
    first = Observer(registry, "again")
    first.metrics.path(sc.PATH_SEND).finished("ok", 0.5, 0.0, 0.5, 1, 1, None)
    held = {"engine": "again", "lock": "cache"}
    assert registry.get_sample_value(sc.LOCK_HELD_SECONDS, held) == 2.0
    gone = weakref.ref(first)
    del first  # still alive in its cycle: the new observer's construction collects it
    second = Observer(registry, "again")
    assert gone() is None
    second.metrics.path(sc.PATH_SEND).finished("ok", 0.5, 0.0, 0.5, 1, 1, None)
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "again", "path": "send", "outcome": "ok"}) == 2
    assert registry.get_sample_value(sc.LOCK_HELD_SECONDS, held) == 2.0


def test_observers_created_and_dropped_do_not_stay_alive():
    registry = CollectorRegistry()
    families = MetricFamilies.of(registry)
    refs = []
    for i in range(2000):
        observer = Observer(registry, f"churn-{i}")
        observer.metrics.bind_open_transfers(sc.PATH_SEND, observer, lambda o: 1, lambda o: 0.5)
        observer.metrics.bind_pending_signals(observer, lambda o: 3, lambda o: 0.1)
        refs.append(weakref.ref(observer))
        del observer
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0
    assert len(families.lock_held.children) == 0 and len(families.pending.children) == 0  # gauge series gone


def test_configuration_errors_pickle():
    for error in (MetricNameConflict("Duplicated timeseries"), DuplicateEngine("e"),
                  MultiprocessDirError(sc.ENV_MULTIPROC_DIR, "/x", "does not exist")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)


CREATE = textwrap.dedent("""
    from prometheus_client import CollectorRegistry
    from kvobs.telemetry._metrics.families import MetricFamilies
    from kvobs.errors import MultiprocessDirError
    try:
        MetricFamilies.of(CollectorRegistry())
    except MultiprocessDirError as exc:
        print("refused:", exc)
    else:
        print("accepted")
""")


def create_families_with(directory: str) -> str:
    env = {**os.environ, sc.ENV_MULTIPROC_DIR: directory}
    out = subprocess.run([sys.executable, "-c", CREATE], env=env, check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_missing_multiprocess_dir_is_refused_naming_the_variable(tmp_path):
    said = create_families_with(str(tmp_path / "missing"))
    assert said.startswith("refused: PROMETHEUS_MULTIPROC_DIR=") and "does not exist" in said


def test_a_multiprocess_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    assert "is not a directory" in create_families_with(str(tmp_path / "file"))


@pytest.mark.skipif(os.access("/sys", os.W_OK) and os.geteuid() != 0, reason="needs a directory it cannot write")
def test_a_read_only_multiprocess_dir_is_refused_naming_the_variable(tmp_path):
    if os.geteuid() == 0:
        directory = "/sys"  # refuses new files even to root
    else:
        directory = str(tmp_path / "ro")
        os.mkdir(directory, 0o555)
    said = create_families_with(directory)
    assert said.startswith("refused: PROMETHEUS_MULTIPROC_DIR=") and "is not writable" in said


def test_a_usable_multiprocess_dir_is_accepted(tmp_path):
    assert create_families_with(str(tmp_path)) == "accepted"


def test_a_multiprocess_dir_set_after_prometheus_client_was_imported_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(sc.ENV_MULTIPROC_DIR, str(tmp_path))  # this process imported prometheus_client long ago
    with pytest.raises(MultiprocessDirError, match="set after prometheus_client was imported"):
        MetricFamilies.of(CollectorRegistry())


def test_scraping_a_missing_multiprocess_dir_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(sc.ENV_MULTIPROC_DIR, str(tmp_path / "gone"))
    with pytest.raises(MultiprocessDirError, match="PROMETHEUS_MULTIPROC_DIR=.*does not exist"):
        scrape_registry()
