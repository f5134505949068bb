"""The connector's metrics in vLLM's ``/metrics`` and stats log (issue 14).

Part 1, no engine: a real ``WorkerHalf`` on LMCache's disk tier (stores, a damaged
object, a good load) reports per-step deltas through ``WorkerStats``; the stats
objects aggregate and reduce, survive vLLM's msgpack and pickle, and reach
Prometheus and the ``KV Transfer metrics`` log line through vLLM's own
``KVConnectorProm`` and ``KVConnectorLogging``.

Part 2, end to end: one ``lmcache-hma serve`` process of the tiny Gemma-3 with the
CPU tier; a ~3000-token prompt, ``POST /reset_prefix_cache`` (dev mode), the same
prompt again; ``/metrics`` scraped over HTTP shows the hit tokens, the loaded bytes
by group kind (equal to what the connector logged) and a load-latency observation.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import time
import uuid
from pathlib import Path

import pytest
import torch

from lmcache_hma.config.settings import load_config
from lmcache_hma.connector import LMCacheHMAConnector
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.metadata import HMAConnectorMetadata, LoadSpec, ObjectRef, SaveSpec, hit_objects
from lmcache_hma.metrics import HMAConnectorStats, SchedulerStats, WorkerStats
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.worker.worker_half import WorkerHalf
from tests.engines import write_yaml
from tests.servers import ServeProcess
from tests.fakes import kv_caches, layout
from tests.waiting import on_disk, wait_for

LABELS = {"model_name": "tiny", "engine": "0"}


# ======================================================================================
# Part 1: no engine
# ======================================================================================

def _worker(tmp_path):
    disk = tmp_path / "disk"
    cfg = load_config({"lmcache_config_file": str(write_yaml(
        tmp_path / "w.yaml", chunk_size=8, local_cpu=False, local_disk=f"file://{disk}/",
        max_local_disk_size=0.01))})
    lay = layout("SSF")
    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=lay, kv_layout="LBHNC/test",
                   world_size=1, rank=0)
    # the only worker is the first one: it reports the per-request figures
    worker = WorkerHalf(cfg, lay, ns, f"metrics-{uuid.uuid4().hex}", 64, serves_lookups=True)
    worker.register_kv_caches(kv_caches(lay, num_blocks=64))
    return worker, ns, disk


def _wait_for_files(worker, path: Path, objects) -> list[Path]:
    """The files of ``path`` once the worker's store wrote ``objects`` (kind, hash) there."""
    wait_for(lambda: on_disk(worker.store, objects), what="the disk writes")
    return [path / f for f in os.listdir(path)]


def test_worker_reports_what_each_step_added(tmp_path):
    """Stores, an integrity failure (failed load, recomputed) and a good load, as deltas."""
    worker, ns, disk = _worker(tmp_path)
    stats = WorkerStats(worker)
    try:
        hasher = ChunkHasher(ns)
        good, bad = hasher.chunk_hashes(list(range(8)), 1), hasher.chunk_hashes(list(range(100, 108)), 1)
        saves = [SaveSpec(name, ([1, 2], [3, 4], [5, 6]),
                          [ObjectRef(ObjectKind.FULL, 0, h[0]), ObjectRef(ObjectKind.TAIL, 0, h[0])])
                 for name, h in (("good", good), ("bad", bad))]
        worker.wait_for_save(HMAConnectorMetadata(saves=saves))
        worker.drain()
        files = _wait_for_files(worker, disk, [(kind, h[0]) for h in (good, bad)
                                               for kind in (ObjectKind.FULL, ObjectKind.TAIL)])
        s = stats.collect()
        page = worker.paged.page_bytes
        # A FULL object is the full group's 2 layers x 2 blocks; a TAIL object the two sliding
        # groups' 4 layers x the blocks of the window (8 tokens = 2 blocks).
        assert s.counters == {"objects_stored": 4, "stored_bytes_full_attention": 2 * 4 * page,
                              "stored_bytes_sliding_window": 2 * 8 * page}
        assert len(s.histograms["store_seconds"]) == 4 and "redis_bypassed" not in s.gauges
        assert stats.collect() is None  # nothing happened since

        damaged = next(f for f in files if f.name.split("@")[0] == ns.model_field(ObjectKind.FULL)
                       and f.name.split("@")[3] == bad[0].hex())
        raw = bytearray(damaged.read_bytes())
        raw[10] ^= 0xFF
        damaged.write_bytes(bytes(raw))
        target = ([6, 7], [8, 9], [10, 11])  # both blocks of the window are live
        worker.start_load_kv(HMAConnectorMetadata(loads=[
            LoadSpec("bad", target, 0, 8, hit_objects(0, bad, True), sync=False),
            LoadSpec("good", target, 0, 8, hit_objects(0, good, True), sync=False)]))
        assert worker.take_transfer_results() == ({"bad", "good"}, {"bad"})
        s = stats.collect()  # the failed load is the scheduler's to count (vLLM's failed_recving)
        assert s.counters == {"integrity_failures": 1, "loads_async": 1,
                              "loaded_tokens": 8, "loaded_tokens_disk": 8,
                              "loaded_bytes_full_attention": 2 * 2 * page,
                              "loaded_bytes_sliding_window": 4 * 2 * page}
        assert list(s.histograms) == ["load_seconds_async"] and len(s.histograms["load_seconds_async"]) == 1
        assert 0 < s.histograms["load_seconds_async"][0] < 5
        assert stats.collect() is None
    finally:
        worker.shutdown()


def _two_workers_and_scheduler():
    w0 = HMAConnectorStats(data={"counters": {"loads_sync": 1, "loaded_tokens": 2816, "loaded_tokens_cpu": 2816,
                                              "loaded_bytes_full_attention": 1000,
                                              "loaded_bytes_sliding_window": 100, "objects_stored": 2,
                                              "stored_bytes_full_attention": 4000},
                                 "histograms": {"load_seconds_sync": [0.010],
                                                "store_seconds": [0.001, 0.003]},
                                 "gauges": {"redis_bypassed": 0}})
    # the other rank loaded the same request: its bytes, not the request again (PER_REQUEST_COUNTERS)
    w1 = HMAConnectorStats(data={"counters": {"loaded_bytes_full_attention": 1000,
                                              "loaded_bytes_sliding_window": 100, "objects_dropped": 3,
                                              "integrity_failures": 1},
                                 "gauges": {"redis_bypassed": 1}})
    sched = SchedulerStats()

    class Req:  # the two attributes SchedulerStats reads of a vllm Request
        def __init__(self, rid, n):
            self.request_id, self.num_tokens = rid, n

    sched.on_lookup("a", (2816, False), time.perf_counter())
    sched.on_alloc(Req("a", 3005), 2816)
    sched.on_lookup("b", (0, False), time.perf_counter())
    sched.on_alloc(Req("b", 995), 0)
    sched.on_lookup("c", (256, True), time.perf_counter())
    sched.on_finished("c")  # aborted before admission: no hit counted
    return w0, w1, sched.collect()


def test_stats_aggregate_and_reduce():
    w0, w1, sched = _two_workers_and_scheduler()
    assert sched.counters == {"lookups": 2, "lookup_tokens": 4000, "hit_tokens_sync": 2816}
    assert len(sched.histograms["lookup_seconds"]) == 3
    total = w0.aggregate(w1).aggregate(sched)  # vLLM: workers first, then the scheduler's
    assert total.counters["loaded_bytes_full_attention"] == 2000 and total.counters["loads_sync"] == 1
    assert total.histograms["load_seconds_sync"] == [0.010]
    assert total.gauges == {"redis_bypassed": 1}  # the latest value wins
    assert total.aggregate(HMAConnectorStats()) is total and not total.is_empty()
    assert HMAConnectorStats().is_empty()
    assert total.reduce() == {
        "lookups": 2, "hit_tokens": 2816, "hit_rate_pct": 70.4, "loads": 1, "loaded_tokens": 2816,
        "loaded_tokens_cpu": 2816, "loaded_MB_full_attention": 0.0, "loaded_MB_sliding_window": 0.0,
        "load_ms_avg": 10.0, "load_ms_max": 10.0, "stored_objects": 2, "stored_MB": 0.0,
        "store_ms_avg": 2.0, "objects_dropped": 3, "integrity_failures": 1, "redis_bypassed": 1}
    # worker -> engine core (pickle), engine core -> API server (vLLM's msgpack)
    from vllm.v1.metrics.stats import SchedulerStats as VllmSchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    assert pickle.loads(pickle.dumps(w1)).data == w1.data
    bufs = MsgpackEncoder().encode(VllmSchedulerStats(kv_connector_stats=total.to_dict()))
    data = MsgpackDecoder(VllmSchedulerStats).decode(bufs).kv_connector_stats
    again = LMCacheHMAConnector.build_kv_connector_stats(data)
    assert isinstance(again, HMAConnectorStats) and again.reduce() == total.reduce()
    assert LMCacheHMAConnector.build_kv_connector_stats().is_empty()


class _Rank:
    """What ``WorkerStats`` reads of a ``WorkerHalf``, after one step in which this rank loaded
    request "a" (2816 tokens from the CPU tier, its share of the bytes) and failed to load "b"."""

    def __init__(self, first: bool):
        self.serves_lookups = first  # the first worker (tensor- and pipeline-parallel rank 0)
        self.writer = self.store = None
        self.load_seconds = [(True, 0.010 if first else 0.030)]
        self._counters = {"loads_ok": 1, "loads_sync": 1, "loaded_tokens": 2816, "loaded_tokens_cpu": 2816,
                          "loaded_bytes_full_attention": 1000, "loads_failed": 1, "integrity_failures": 1}

    def counters(self):
        return dict(self._counters)


class _NoScheduler:  # the scheduler half's part of update_connector_output
    def on_failed_loads(self, req_ids):
        pass


def test_two_ranks_count_a_request_once_and_sum_their_bytes():
    """Tensor parallelism 2: both ranks load request "a" and both fail "b". Aggregated the way
    vLLM does (KVOutputAggregator over the workers' outputs, then the scheduler's stats), the
    requests count once and the bytes and each rank's own failures twice."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    outputs = []
    for first in (True, False):
        stats = WorkerStats(_Rank(first)).collect()
        outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
            finished_recving={"a", "b"}, failed_recving={"b"}, kv_connector_stats=stats)))
    kv_output = KVOutputAggregator(expected_finished_count=2).aggregate(outputs).kv_connector_output
    workers = kv_output.kv_connector_stats
    c = workers.counters
    assert (c["loads_sync"], c["loaded_tokens"], c["loaded_tokens_cpu"]) == (1, 2816, 2816)  # one request
    assert workers.histograms["load_seconds_sync"] == [0.010]  # one load, timed by the first worker
    assert c["loaded_bytes_full_attention"] == 2000 and c["integrity_failures"] == 2  # each rank's own
    assert kv_output.failed_recving == {"b"}  # vLLM's union of the ranks' failures

    connector = object.__new__(LMCacheHMAConnector)  # the scheduler's connector, just its stats
    connector._scheduler, connector._stats, connector._events = _NoScheduler(), SchedulerStats(), None
    connector.update_connector_output(kv_output)
    total = workers.aggregate(connector.get_kv_connector_stats() or HMAConnectorStats())  # as vLLM's Scheduler
    assert total.counters.get("loads_failed") == 1  # "b": one request, recomputed
    assert total.reduce()["loads"] == 1 and total.reduce()["failed_loads"] == 1


def test_prometheus_and_log_line_through_vllm():
    """vLLM's KVConnectorProm / KVConnectorLogging load the connector class and use its stats."""
    from prometheus_client import REGISTRY
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    transfer = KVTransferConfig(kv_connector="LMCacheHMAConnector", kv_connector_module_path="lmcache_hma",
                                kv_role="kv_both")
    unregister_vllm_metrics()
    try:
        prom = KVConnectorProm(VllmConfig(kv_transfer_config=transfer), ["model_name", "engine"],
                               {0: ["tiny", "0"]})
        logging = KVConnectorLogging(transfer)
        for step in _two_workers_and_scheduler():  # three steps' payloads
            prom.observe(step.to_dict(), 0)
            logging.observe(step.to_dict())

        def value(name, **labels):
            return REGISTRY.get_sample_value("vllm:lmcache_hma_" + name, {**LABELS, **labels})

        assert value("lookups_total") == 2 and value("lookup_tokens_total") == 4000
        assert value("hit_tokens_total", load="sync") == 2816 and value("hit_tokens_total", load="async") == 0
        assert value("loaded_bytes_total", kind="full_attention") == 2000
        assert value("loaded_bytes_total", kind="sliding_window") == 200
        assert value("stored_bytes_total", kind="full_attention") == 4000
        assert value("loads_total", load="sync") == 1
        assert value("loaded_tokens_total", tier="cpu") == 2816 and value("loaded_tokens_total", tier="redis") == 0
        assert value("load_seconds_count", load="sync") == 1
        assert value("load_seconds_bucket", load="sync", le="0.025") == 1
        assert value("store_seconds_count") == 2 and value("lookup_seconds_count") == 3
        assert value("objects_stored_total") == 2 and value("objects_dropped_total") == 3
        assert value("integrity_failures_total") == 1 and value("failed_loads_total") == 0
        assert value("redis_bypassed") == 1

        lines = []
        logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert lines == ["KV Transfer metrics: lookups=2, hit_tokens=2816, hit_rate_pct=70.4, loads=1, "
                         "loaded_tokens=2816, loaded_tokens_cpu=2816, loaded_MB_full_attention=0.0, loaded_MB_sliding_window=0.0, "
                         "load_ms_avg=10.0, load_ms_max=10.0, stored_objects=2, stored_MB=0.0, "
                         "store_ms_avg=2.0, objects_dropped=3, integrity_failures=1, redis_bypassed=1"]
    finally:
        unregister_vllm_metrics()


# ======================================================================================
# Part 2: one `lmcache-hma serve` process, /metrics over HTTP
# ======================================================================================

PROMPT = "Hello, how are you?" * 500 + "Tell me a story"
HIT_TOKENS = 11 * 256  # full chunks of 256 before the prompt's last token
LOGGED = re.compile(r"LMCache hit tokens: (\d+), need to load: (\d+), bytes to load: "
                    r"full_attention=(\d+) sliding_window=(\d+)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``python -m lmcache_hma.tools.serve`` (= ``lmcache-hma serve``) of the tiny Gemma-3, CPU tier."""
    from lmcache_hma.testing.tiny_model import build_tiny_model

    work = tmp_path_factory.mktemp("metrics_e2e")
    yaml_path = write_yaml(work / "cpu.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.5)
    proc = ServeProcess("server", build_tiny_model("tiny-gemma3"), yaml_path, work,
                        ["--served-model-name", "tiny", "--max-model-len", "8192"],
                        {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "1"})
    try:
        proc.wait_ready(time.monotonic() + 240)
        yield proc.base, proc.log
    finally:
        # Nothing is read from the server once its test ended: its whole process group is
        # killed at once instead of waiting for vLLM's 5 s shutdown.
        proc.stop(timeout=0)


def _complete(base: str, prompt: str = PROMPT, max_tokens: int = 5) -> dict:
    import requests

    r = requests.post(f"{base}/v1/completions", timeout=180,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def _scrape(base: str, keep: Path) -> dict[tuple[str, frozenset], float]:
    """Every ``vllm:lmcache_hma_*`` and ``vllm:prompt_tokens_*`` sample of /metrics: (name, labels) ->
    value; the text goes to ``keep``."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base}/metrics", timeout=10).text
    keep.write_text(text)
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text)
            if fam.name.startswith(("vllm:lmcache_hma_", "vllm:prompt_tokens_"))
            for s in fam.samples}


def _value(samples, name, **labels):
    """The sum of the samples ``name`` with ``labels`` (and model_name tiny); None if there are none."""
    want = {"model_name": "tiny", **labels}
    found = [v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items()]
    return sum(found) if found else None


def test_metrics_endpoint_shows_hits_bytes_and_load_latency(server):
    import requests

    base, log = server
    first = _complete(base)
    assert first["usage"]["prompt_tokens"] > HIT_TOKENS + 1
    assert requests.post(f"{base}/reset_prefix_cache", timeout=30).status_code == 200
    mark = len(log.read_text(errors="replace"))
    _complete(base)
    logged = [tuple(map(int, m)) for m in LOGGED.findall(log.read_text(errors="replace")[mark:])]
    hit, need, full_bytes, sliding_bytes = logged[-1]
    assert hit == need == HIT_TOKENS and full_bytes > 0 and sliding_bytes > 0

    # Store figures arrive with a step after the writer stored: the second request's turn end is
    # stored after its last step (the engine steps once more to gather it, then idles), so a
    # short third request (one token, nothing to store) brings them.
    short = _complete(base, prompt="Hi there", max_tokens=1)

    extra = []  # short requests sent while waiting

    def scraped_all_stores():
        m = _scrape(base, log.parent / "metrics.txt")
        if (_value(m, "vllm:lmcache_hma_objects_stored_total") or 0) >= 26:
            return m
        # on a loaded machine the writer may store after the short request's last step: another
        # short request brings the figures (an idle engine runs no step that would)
        extra.append(_complete(base, prompt="Hi there", max_tokens=1))
        return None

    m = wait_for(scraped_all_stores, timeout=60, what="26 stored objects in /metrics", interval=0.5)
    assert {dict(ls)["engine"] for (_, ls) in m} == {"0"}
    assert _value(m, "vllm:lmcache_hma_lookups_total") == 3 + len(extra)
    assert _value(m, "vllm:lmcache_hma_lookup_tokens_total") == (2 * first["usage"]["prompt_tokens"]
                                                                 + (1 + len(extra)) * short["usage"]["prompt_tokens"])
    assert _value(m, "vllm:lmcache_hma_hit_tokens_total") == HIT_TOKENS
    assert _value(m, "vllm:lmcache_hma_loaded_tokens_total", tier="cpu") == HIT_TOKENS
    # vLLM's own series by source: every connector hit token under the tier it came from
    assert _value(m, "vllm:prompt_tokens_cached_by_source_total", source="host") == HIT_TOKENS
    assert _value(m, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") in (None, 0)
    assert _value(m, "vllm:lmcache_hma_loaded_bytes_total", kind="full_attention") == full_bytes
    assert _value(m, "vllm:lmcache_hma_loaded_bytes_total", kind="sliding_window") == sliding_bytes
    assert _value(m, "vllm:lmcache_hma_load_seconds_count") >= 1
    assert 0 < _value(m, "vllm:lmcache_hma_load_seconds_sum") < 10
    assert _value(m, "vllm:lmcache_hma_lookup_seconds_count") >= 2
    # 11 full-attention chunks and 11 sliding-window tails stored by the first request, and each
    # request's turn end (its last partial chunk past the prompt's 11 chunks) with its marker
    assert _value(m, "vllm:lmcache_hma_objects_stored_total") == 22 + 2 * 2
    assert _value(m, "vllm:lmcache_hma_stored_bytes_total", kind="turn_end") > 0
    # the hit loaded every full-attention chunk and one tail (all tails have the same size)
    assert _value(m, "vllm:lmcache_hma_stored_bytes_total", kind="full_attention") == full_bytes
    assert _value(m, "vllm:lmcache_hma_stored_bytes_total", kind="sliding_window") == 11 * sliding_bytes
    assert _value(m, "vllm:lmcache_hma_store_seconds_count") == 26
    for name in ("failed_loads_total", "integrity_failures_total", "objects_dropped_total",
                 "objects_not_stored_total"):
        assert _value(m, "vllm:lmcache_hma_" + name) in (None, 0), name
    # The hma_stats_file still has the worker's counters.
    stats = json.loads((log.parent / "server-stats.json").read_text())
    assert stats["loaded_bytes_full_attention"] == full_bytes and stats["objects_stored"] == 26
    # vLLM's periodic stats line (VLLM_LOG_STATS_INTERVAL=1) carries the connector's summary.
    summary = "KV Transfer metrics: lookups="
    wait_for(lambda: f"hit_tokens={HIT_TOKENS}" in log.read_text(errors="replace"), timeout=15,
             what="the stats log line of the hit", interval=0.5)
    lines = [line for line in log.read_text(errors="replace").splitlines() if summary in line]
    assert any(f"hit_tokens={HIT_TOKENS}" in line for line in lines), lines
    assert any("loaded_MB_full_attention=" in line and "load_ms_avg=" in line for line in lines), lines
