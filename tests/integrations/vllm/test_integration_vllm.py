"""KVObsConnector as vLLM 0.33 builds and runs it: loaded by its module path through vLLM's own factory, its
options checked, its HMA claim matching its child's, and the wrapped connector's behaviour unchanged: every
method returns what the unwrapped connector returns on the same inputs, and raises what it raises.
"""

# ruff: noqa: F811  (pytest fixtures imported from upstream are parameters of the tests)
from __future__ import annotations

import functools
import inspect
import json
import os
import pickle
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import torch
import upstream
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from upstream import vllm  # noqa: F401  (the fixture)
from vllm_harness import (
    BASE,
    MODULE,
    NUM_BLOCKS,
    Rig,
    backend,
    create,
    default_engine_observer,  # noqa: F401  (autouse fixture)
    engine_label,
    layer_caches,
    load_job,
    offloading_child,
    offloading_metadata,
    store_job,
    vllm_config,
    wrapper_config,
)

from kvobs import semconv as sc

PLAIN = {"kv_connector": "PlainConnector", "kv_connector_module_path": "vllm_harness",
         "kv_role": "kv_both"}


def test_importing_the_integration_imports_no_vllm() -> None:
    code = ("import sys, kvobs, kvobs.integrations.vllm as v\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
            "try:\n    v.KVObsConnector\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "needs vLLM 0.33 (pip install vllm==0.33.0)" in out.stdout


@pytest.mark.parametrize("role", ["WORKER", "SCHEDULER"])
def test_vllm_factory_builds_the_wrapper_by_module_path_around_its_child(vllm: upstream.Upstream, role: str) -> None:
    rig_free = create(vllm, wrapper_config(vllm, offloading_child()), role=role)
    assert type(rig_free).__name__ == "KVObsConnector" and type(rig_free).__module__ == MODULE
    assert type(rig_free.kvobs_wrapped).__name__ == "OffloadingConnector"
    assert rig_free.role is getattr(vllm.attr(f"{BASE}:KVConnectorRole"), role)
    half = rig_free.connector_worker if role == "WORKER" else rig_free.connector_scheduler
    assert half is not None  # the child's own attributes are reachable through the wrapper


def test_the_child_inherits_the_wrappers_engine_id_and_role(vllm: upstream.Upstream) -> None:
    config = wrapper_config(vllm, {"kv_connector": "OffloadingConnector",
                                   "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}})
    connector = create(vllm, config)
    child_config = connector.kvobs_wrapped._kv_transfer_config
    assert child_config.engine_id == config.kv_transfer_config.engine_id
    assert child_config.kv_role == "kv_both" and child_config.kv_connector == "OffloadingConnector"


@pytest.mark.parametrize("options, problem", [
    ({}, 'needs kv_connector_extra_config\\["connector"\\]'),
    ({"connector": {"kv_role": "kv_both"}}, 'at least "kv_connector"'),
    ({"connector": PLAIN, "lock": "thread"}, r"unknown kv_connector_extra_config key\(s\) \['lock'\]"),
    ({"connector": PLAIN, "integrity": "skip"}, "integrity='skip': use one of report, raise, count, off"),
    ({"connector": PLAIN, "deadline": 0}, "deadline=0: use a positive number of seconds"),
    ({"connector": PLAIN, "engine": "req 7"}, "not a valid label value"),
    ({"connector": PLAIN, "check_every": 0}, "check_every=0: use an int >= 1"),
    ({"connector": PLAIN, "tracing": "yes"}, "tracing='yes': use true or false"),
])
def test_bad_options_are_refused_when_vllm_builds_the_connector(
        vllm: upstream.Upstream, options: dict[str, Any], problem: str) -> None:
    config = vllm_config(vllm, kv_connector="KVObsConnectorNoHMA", kv_connector_module_path=MODULE,
                         kv_connector_extra_config=options)
    with pytest.raises(ValueError, match=problem):
        create(vllm, config)


@pytest.mark.parametrize("name, child, right", [
    ("KVObsConnectorNoHMA", offloading_child(), "KVObsConnector"),
    ("KVObsConnector", PLAIN, "KVObsConnectorNoHMA"),
])
def test_a_wrapper_whose_hma_claim_differs_from_its_childs_is_refused(
        vllm: upstream.Upstream, name: str, child: dict[str, Any], right: str) -> None:
    config = wrapper_config(vllm, child, name=name)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True  # HMA off: only the claim differs
    with pytest.raises(ValueError, match=f'use kv_connector="{right}"'):
        create(vllm, config)


@pytest.mark.parametrize("name, child", [("KVObsConnector", offloading_child()), ("KVObsConnectorNoHMA", PLAIN)])
def test_vllm_decides_hma_for_the_wrapper_as_for_its_child_alone(
        vllm: upstream.Upstream, name: str, child: dict[str, Any]) -> None:
    wrapped = wrapper_config(vllm, child, name=name).scheduler_config.disable_hybrid_kv_cache_manager
    alone = vllm_config(vllm, **{k: v for k, v in child.items() if k != "kv_role"}).scheduler_config
    assert wrapped is alone.disable_hybrid_kv_cache_manager


def test_every_method_of_vllms_base_api_is_passed_through_or_observed(vllm: upstream.Upstream) -> None:
    from kvobs.integrations.vllm import KVObsConnector, KVObsConnectorNoHMA
    from kvobs.integrations.vllm._classes import undelegated_classmethods

    bases = (vllm.attr(f"{BASE}:KVConnectorBase_V1"), vllm.attr(f"{BASE}:SupportsHMA"))
    assert undelegated_classmethods(bases) == set()
    for cls in (KVObsConnector, KVObsConnectorNoHMA):
        assert not inspect.isabstract(cls)
        for klass in bases[: 2 if cls is KVObsConnector else 1]:
            for name, attr in vars(klass).items():
                if not name.startswith("_") and (callable(attr) or isinstance(attr, property)):
                    assert inspect.getattr_static(cls, name) is not attr, f"{cls.__name__}.{name} is vLLM's base"


def test_class_level_questions_are_answered_by_the_wrapped_class(vllm: upstream.Upstream) -> None:
    from kvobs.integrations.vllm import KVObsConnectorNoHMA as Wrapper

    child = {**PLAIN, "kv_connector_extra_config": {"layerwise": True}, "kv_role": "kv_consumer"}
    config = wrapper_config(vllm, child, name="KVObsConnectorNoHMA")
    extra = config.kv_transfer_config.kv_connector_extra_config
    assert Wrapper.get_required_kvcache_layout(config) == "PLAIN-PlainConnector"
    assert Wrapper.requires_piecewise_for_cudagraph(extra) is True
    assert Wrapper.supports_sleep_mode(config.kv_transfer_config) is True


def test_stats_and_prometheus_metrics_are_the_wrapped_connectors(vllm: upstream.Upstream) -> None:
    from kvobs.integrations.vllm import KVObsConnector as Wrapper

    config = wrapper_config(vllm, offloading_child())
    offloading = vllm.attr("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:OffloadingConnector")
    # vLLM's stat logger manager builds the Prometheus metrics (with the config) at start-up, in the process
    # that later rebuilds the stats the scheduler sends (without a config): the wrapped class is known then.
    registry = CollectorRegistry()
    types_ = {kind: functools.partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)}
    metrics = Wrapper.build_prom_metrics(config, types_, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert type(metrics).__name__ == "OffloadPromMetrics"
    data = {"types": {}, "data": {"load_bytes": 3}, "info": None}
    assert Wrapper.build_kv_connector_stats(data) == offloading.build_kv_connector_stats(data)
    assert type(Wrapper.build_kv_connector_stats(None)).__name__ == "OffloadingConnectorStats"


def test_the_metadata_pickles_by_name_on_its_way_to_the_workers(vllm: upstream.Upstream) -> None:
    scheduler = create(vllm, wrapper_config(vllm, offloading_child()), role="SCHEDULER")
    metadata = scheduler.build_connector_meta(vllm.attr("vllm.v1.core.sched.output:SchedulerOutput").make_empty())
    assert type(metadata).__qualname__ == "KVObsConnectorMetadata"
    again = pickle.loads(pickle.dumps(metadata))
    assert type(again) is type(metadata) and again == metadata


# --------------------------------------------------------------------------------------------
# Behaviour unchanged: the same calls on a wrapped and an unwrapped connector, compared
# --------------------------------------------------------------------------------------------


class Session:
    """Calls methods and keeps what each returned or raised, for comparison with another connector's."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.log: list[tuple[Any, ...]] = []

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            value = getattr(self.connector, name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - what it raised is the result compared
            self.log.append((name, "raised", type(exc), str(exc)))
            return None
        self.log.append((name, "returned", _comparable(value)))
        return value

    def attribute(self, name: str) -> None:
        self.log.append((name, "is", getattr(self.connector, name)))


def _comparable(value: Any) -> Any:
    if type(value).__name__ == "KVObsConnectorMetadata":  # the wrapped connector's metadata, shipped inside
        assert value.trace_contexts == {}
        return value.wrapped
    if isinstance(value, types.GeneratorType):
        return list(value)
    return value


def _join_copies(connector: Any) -> None:
    for thread in list(backend(connector)._threads.values()):
        thread.join()


def _worker_session(vllm: upstream.Upstream, connector: Any) -> tuple[Session, dict[str, torch.Tensor]]:
    call, caches = Session(connector), layer_caches()
    caches["layer.0"][2] = 5.0
    call("start_load_kv", None)  # nothing bound: the child's own assertion
    call("register_kv_caches", caches)
    for name in ("role", "requires_kv_delivery", "supports_divergent_local_hybrid_hits"):
        call.attribute(name)
    for name in ("get_mem_pool_context", "get_handshake_metadata", "get_finished_count", "get_kv_connector_stats",
                 "get_kv_connector_kv_cache_events", "has_connector_metadata", "finish_forward", "reset_capture_state"):
        call(name)
    call("bind_connector_metadata", offloading_metadata(vllm, load_jobs={1: load_job(vllm, "a", [0], [4])},
                                                        store_jobs={2: store_job(vllm, "b", [2], [3])}))
    call("has_connector_metadata")
    call("start_load_kv", None)
    call("wait_for_layer_load", "layer.0")
    call("save_kv_layer", "layer.0", caches["layer.0"], None)
    call("wait_for_save")
    _join_copies(connector)
    for name, args in (("get_transfer_results", ({"a"},)), ("get_block_ids_with_load_errors", ()),
                       ("build_connector_worker_meta", ()), ("clear_connector_metadata", ()),
                       ("bind_connector_metadata", (offloading_metadata(vllm),)), ("start_load_kv", (None,))):
        call(name, *args)
    _join_copies(connector)
    for name, args in (("get_finished", (set(),)), ("build_connector_worker_meta", ()),
                       ("handle_preemptions", ({"not": "metadata"},)), ("clear_connector_metadata", ()),
                       ("shutdown", ())):
        call(name, *args)
    return call, caches


def test_worker_side_behaviour_is_the_wrapped_connectors(vllm: upstream.Upstream) -> None:
    rig = Rig(vllm)  # wrapped, with a registered observer
    try:
        wrapped, wrapped_caches = _worker_session(vllm, rig.connector)
        bare, bare_caches = _worker_session(vllm, create(vllm, vllm_config(vllm, **{
            k: v for k, v in offloading_child().items() if k != "kv_role"})))
    finally:
        rig.close()
    assert wrapped.log == bare.log
    assert any(entry[1] == "raised" for entry in bare.log)  # errors were compared too
    assert all(torch.equal(wrapped_caches[k], bare_caches[k]) for k in bare_caches)
    assert [(r.path, r.outcome) for r in rig.records] == [("prefetch", "ok"), ("write_back", "ok")]


def _scheduler_session(vllm: upstream.Upstream, connector: Any) -> Session:
    call = Session(connector)
    output = vllm.attr("vllm.v1.core.sched.output:SchedulerOutput").make_empty()
    unknown = types.SimpleNamespace(request_id="nobody", kv_transfer_params=None)
    for name, args in (("build_connector_meta", (output,)), ("get_kv_connector_stats", ()), ("take_events", ()),
                       ("has_pending_push_work", ()), ("has_pending_block_frees", ()), ("reset_cache", ()),
                       ("update_connector_output", (vllm.attr("vllm.v1.outputs:KVConnectorOutput")(),)),
                       ("request_finished", (unknown, [1])), ("request_finished_all_groups", (unknown, ([1],))),
                       ("get_num_new_matched_tokens", (unknown, 0)), ("build_connector_meta", (output,))):
        call(name, *args)
    return call


def test_scheduler_side_behaviour_is_the_wrapped_connectors(vllm: upstream.Upstream) -> None:
    wrapped = _scheduler_session(vllm, create(vllm, wrapper_config(vllm, offloading_child()), role="SCHEDULER"))
    bare = _scheduler_session(vllm, create(vllm, vllm_config(vllm, **{
        k: v for k, v in offloading_child().items() if k != "kv_role"}), role="SCHEDULER"))
    assert wrapped.log == bare.log
    assert ("get_num_new_matched_tokens", "raised", KeyError, "'nobody'") in bare.log


def test_errors_and_arguments_pass_through_unchanged(vllm: upstream.Upstream) -> None:
    wrapper = create(vllm, wrapper_config(vllm, PLAIN, name="KVObsConnectorNoHMA"), role="SCHEDULER")
    request = types.SimpleNamespace(request_id="r-1", kv_transfer_params=None)
    with pytest.raises(LookupError, match="does not know request 'r-1'"):
        wrapper.request_finished(request, [1, 2])
    assert wrapper.get_num_new_matched_tokens(request, 10) == (22, False)
    worker = create(vllm, wrapper_config(vllm, PLAIN, name="KVObsConnectorNoHMA"))
    with pytest.raises(TypeError, match=r"unexpected load options \['layer_hint'\]"):
        worker.start_load_kv(None, layer_hint=3)


def test_multiconnector_children_are_observed_on_either_side_of_the_wrapper(vllm: upstream.Upstream) -> None:
    """KVObsConnector(MultiConnector([Offloading])) and MultiConnector([KVObsConnector(Offloading)])."""
    rig = Rig(vllm)
    try:
        inside = wrapper_config(vllm, {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"connectors": [offloading_child()]}},
                                engine=rig.label)
        outside = vllm_config(vllm, kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [
            {"kv_connector": "KVObsConnector", "kv_connector_module_path": MODULE, "kv_role": "kv_both",
             "kv_connector_extra_config": {"connector": offloading_child(), "engine": rig.label}}]})
        for key, config in enumerate((inside, outside)):
            _one_load(vllm, create(vllm, config), request_id=f"req-{key}", job_id=key)
    finally:
        rig.close()
    assert [(r.key, r.outcome, r.request_id) for r in rig.records] == [(0, "ok", "req-0"), (1, "ok", "req-1")]


def _one_load(vllm: upstream.Upstream, connector: Any, request_id: str, job_id: int) -> None:
    multi = vllm.module("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector")
    connector.register_kv_caches(layer_caches())
    metadata = multi.MultiKVConnectorMetadata(
        metadata=(offloading_metadata(vllm, load_jobs={job_id: load_job(vllm, request_id, [1], [2])}),))
    connector.bind_connector_metadata(metadata)
    connector.start_load_kv(None)
    done = threading.Event()
    while not done.is_set():
        done.wait(0.01)
        if request_id in connector.get_transfer_results(set()).finished_recving:
            done.set()
    connector.clear_connector_metadata()


def test_nothing_in_the_options_needs_more_than_json(vllm: upstream.Upstream) -> None:
    """The whole configuration is plain JSON, as `--kv-transfer-config` takes it."""
    config = wrapper_config(vllm, offloading_child(), engine="vllm-json", integrity="count", deadline=30)
    text = json.dumps({"kv_connector": config.kv_transfer_config.kv_connector,
                       "kv_connector_module_path": config.kv_transfer_config.kv_connector_module_path,
                       "kv_connector_extra_config": config.kv_transfer_config.kv_connector_extra_config})
    assert json.loads(text)["kv_connector_extra_config"]["connector"]["kv_connector"] == "OffloadingConnector"
    assert NUM_BLOCKS == 8


def _example(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "examples" / "vllm_connector.py"
    spec = importlib.util.spec_from_file_location("vllm_connector_example", path)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # vLLM imports its offloading spec by module name
    spec.loader.exec_module(example)
    return example


def test_the_examples_configurations_are_accepted_by_vllm(
        vllm: upstream.Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/vllm_connector.py prints them for `vllm serve`; vLLM's own config and factory take them."""
    from kvobs import KVObserver
    from kvobs.integrations.vllm import use_observer

    example = _example(monkeypatch)
    for name, wrapped in (("CPU offloading", "OffloadingConnector"), ("prefill node", "NixlPullConnector"),
                          ("decode node", "NixlPullConnector")):
        config = example.SETUPS[name]
        engine = config["kv_connector_extra_config"]["engine"]
        # an observer on a registry of its own (the autouse fixture's for "vllm"), not on the global one
        undo = (lambda: None) if engine == "vllm" else use_observer(
            KVObserver(engine, lock=None, registry=CollectorRegistry()))
        try:
            connector = create(vllm, vllm_config(vllm, **config), role="SCHEDULER")
        finally:
            undo()
        assert type(connector.kvobs_wrapped).__name__ == wrapped


def test_the_example_runs_on_the_real_offloading_connector(
        vllm: upstream.Upstream, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _example(monkeypatch).main()
    out = capsys.readouterr().out
    assert "load of a clean block, bad blocks: set()" in out
    assert "load from where the NaN store was left out, bad blocks: {7}" in out
    assert 'kvobs_transfers_total{engine="vllm-example",outcome="error",path="write_back"} 1.0' in out
    assert 'kvobs_transfers_total{engine="vllm-example",outcome="error",path="prefetch"} 1.0' in out


def test_shutdown_puts_the_offloading_workers_methods_back(vllm: upstream.Upstream) -> None:
    rig = Rig(vllm)
    worker = rig.register()
    assert {"submit_load", "submit_store", "get_finished", "wait"} <= set(vars(worker))
    rig.close()
    assert not {"submit_load", "submit_store", "get_finished", "wait"} & set(vars(worker))


@pytest.mark.parametrize(("options", "policy"), [({}, "recompute"), ({"recompute": False}, "fail")])
def test_the_scheduler_side_makes_vllm_recompute_corrupt_loads_unless_told_not_to(vllm, options, policy):
    config = wrapper_config(vllm, offloading_child(), engine=engine_label(), **options)
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    with structlog.testing.capture_logs() as logs:
        create(vllm, config, role="SCHEDULER")
    assert config.kv_transfer_config.kv_load_failure_policy == policy
    said = " ".join(entry["event"] for entry in logs)
    assert "kv_load_failure_policy" in said


def test_a_lookup_covering_a_block_that_loaded_corrupt_is_a_miss(vllm):
    from kvobs.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide(transfers=None, block_size=16)  # the lookup answers touch no transfer
    request = types.SimpleNamespace(request_id="r1", block_hashes=[b"h0", b"h1", b"h2", b"h3"])
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10],))
    assert side.matched(request, 0, (64, True)) == (64, True)
    side.allocated(request, blocks, 64)
    side.output(types.SimpleNamespace(finished_sending=None, invalid_block_ids={9}, failed_recving=set(),
                                      finished_recving={"r1"}))
    assert side.matched(request, 0, (64, True)) == (0, False)  # h2 (block 9) and after are suspect
    assert side.matched(request, 0, (32, True)) == (32, True)  # h0, h1 loaded clean
    other = types.SimpleNamespace(request_id="r2", block_hashes=[b"h0", b"h1", b"h2"])
    assert side.matched(other, 16, (32, True)) == (0, False)  # any request with that prefix


_ENGINE_PROCESS = """
import os, signal, sys
from kvobs.integrations.vllm._observers import observer_for
from kvobs.integrations.vllm._options import read_options

obs = observer_for(read_options({"connector": {"kv_connector": "OffloadingConnector"}}))
if sys.argv[1] == "dies":
    obs.begin("prefetch", key=1, block_ids=[1, 2])  # a load in flight when the process is killed
    from kvobs.telemetry._metrics.refresher import Refresher
    Refresher.shared().refresh()  # its scrape-time gauges written, as every half second
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _server_scrape(directory: Path) -> str:
    """The scrape vLLM's API server answers in multiprocess mode: a fresh registry with prometheus_client's
    MultiProcessCollector over the directory (vllm.v1.metrics.prometheus.get_prometheus_registry)."""
    code = ("from prometheus_client import CollectorRegistry, generate_latest, multiprocess\n"
            "registry = CollectorRegistry()\nmultiprocess.MultiProcessCollector(registry)\n"
            "print(generate_latest(registry).decode())")
    return subprocess.run([sys.executable, "-c", code], env=_multiprocess_env(directory), capture_output=True,
                          text=True, check=True).stdout


def _multiprocess_env(directory: Path) -> dict[str, str]:
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}


def test_a_killed_engine_process_leaves_no_transfer_in_flight_on_the_servers_metrics_once_an_engine_starts(tmp_path):
    """vLLM's server scrapes with prometheus_client's MultiProcessCollector, which never drops a dead
    process's live gauges: the next engine process's connector does, when it builds its observer."""
    from prometheus_client.parser import text_string_to_metric_families

    def in_flight() -> float:
        return sum(sample.value for family in text_string_to_metric_families(_server_scrape(tmp_path))
                   for sample in family.samples
                   if sample.name in (sc.TRANSFERS_IN_FLIGHT, sc.TRANSFER_OLDEST_OPEN_AGE_SECONDS))

    killed = subprocess.run([sys.executable, "-c", _ENGINE_PROCESS, "dies"], env=_multiprocess_env(tmp_path),
                            check=False)
    assert killed.returncode == -9
    assert in_flight() > 0  # the dead process's load, still "in flight"
    subprocess.run([sys.executable, "-c", _ENGINE_PROCESS, "starts"], env=_multiprocess_env(tmp_path), check=True)
    assert in_flight() == 0
