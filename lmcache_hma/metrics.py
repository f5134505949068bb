"""The connector's figures in vLLM's ``/metrics`` and periodic stats log.

vLLM 0.32 moves connector stats this way, once per engine step:

* each worker's connector: ``get_kv_connector_stats()`` -> ``HMAConnectorStats``
  (``WorkerStats.collect``: what the worker's counters gained since the last step,
  and the latencies observed in it); vLLM sums every worker's (all tensor- and
  pipeline-parallel ranks) with ``aggregate`` (``KVOutputAggregator``), so a figure
  per request is reported by the first worker only (``PER_REQUEST_COUNTERS``);
* the scheduler's connector: ``get_kv_connector_stats()`` (``SchedulerStats.collect``:
  lookups, hit tokens, failed loads, promises not kept), aggregated into the same object;
* the engine sends ``to_dict()`` (plain dicts, lists and numbers) to the API server,
  where ``HMAPromMetrics.observe`` adds it to Prometheus metrics labelled like
  vLLM's own (``model_name``, ``engine``), and vLLM's ``KVConnectorLogging`` sums the
  interval's objects and prints ``reduce()`` as ``KV Transfer metrics: ...``.

Cost per step: one copy of the worker's counter dict (about a dozen entries) and the
swap of two short lists; nothing per token, no lock held while KV is copied.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from lmcache_hma.core.kinds import TIERS

PREFIX = "vllm:lmcache_hma_"

_COUNTERS, _HISTOGRAMS, _GAUGES = "counters", "histograms", "gauges"

# Stats counter key -> (metric, extra label values). Worker keys are WorkerHalf.counters()'s.
_COUNTER_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookups": ("lookups", ()),
    "lookup_tokens": ("lookup_tokens", ()),
    "hit_tokens_sync": ("hit_tokens", ("sync",)),
    "hit_tokens_async": ("hit_tokens", ("async",)),
    "loads_sync": ("loads", ("sync",)),
    "loads_async": ("loads", ("async",)),
    "loads_failed": ("failed_loads", ()),
    "promises_not_kept": ("promises_not_kept", ()),
    "objects_stored": ("objects_stored", ()),
    "objects_dropped": ("objects_dropped", ()),
    "objects_not_stored": ("objects_not_stored", ()),
    "objects_not_shared": ("objects_not_shared", ()),
    "objects_not_on_disk": ("objects_not_on_disk", ()),
    "objects_not_read_no_memory": ("objects_not_read_no_memory", ()),
    "saves_failed": ("store_failures", ()),
    "integrity_failures": ("integrity_failures", ()),
    "lookups_not_held_in_time": ("hits_not_held_in_time", ()),
    "sync_load_retries": ("sync_load_retries", ()),
    "sync_loads_failed": ("failed_sync_loads", ()),
    "writer_errors": ("thread_errors", ("writer",)),
    "lookup_errors": ("thread_errors", ("lookup",)),
    "redis_protocol_errors": ("redis_protocol_errors", ()),
    "redis_health_errors": ("redis_health_errors", ()),
    "redis_room_deletes": ("redis_room_deletes", ()),
}
# Counter keys "<prefix><label value>" -> metric labelled by kind (group kind) or tier.
_LABELLED_COUNTER_PREFIXES = {"loaded_bytes_": "loaded_bytes", "stored_bytes_": "stored_bytes",
                              "loaded_tokens_": "loaded_tokens"}

# A request's load, counted once: by the first worker (tensor- and pipeline-parallel rank 0, the
# one that answers lookups), with its load_seconds. Every worker loads every request (its own
# heads or layers) and vLLM sums the workers' figures: counted by each, loads and tokens would
# be multiplied by the number of ranks. Bytes, objects and each rank's own events (a retry, a
# damaged object) are per rank and rightly summed. A failed asynchronous load is counted by the
# scheduler from vLLM's failed_recving (the ranks' union), once per request: not by the workers.
PER_REQUEST_COUNTERS = frozenset({"loads_sync", "loads_async", "loaded_tokens"})
PER_REQUEST_COUNTER_PREFIXES = ("loaded_tokens_",)  # by tier
_WORKER_ONLY = frozenset({"loads_ok", "loads_failed"})  # loads_sync + loads_async; the scheduler's


def is_per_request(counter: str) -> bool:
    return counter in PER_REQUEST_COUNTERS or counter.startswith(PER_REQUEST_COUNTER_PREFIXES)


_HISTOGRAM_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookup_seconds": ("lookup_seconds", ()),
    "load_seconds_sync": ("load_seconds", ("sync",)),
    "load_seconds_async": ("load_seconds", ("async",)),
    "store_seconds": ("store_seconds", ()),
}
_GAUGE_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "redis_bypassed": ("redis_bypassed", ()),
}

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# name -> (type, documentation, extra label names). Counters are exposed as <name>_total.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "lookups": ("counter", "Requests the connector looked up when vLLM admitted them.", ()),
    "lookup_tokens": ("counter", "Prompt tokens of the requests looked up.", ()),
    "hit_tokens": ("counter", "Prompt tokens the connector supplied (external hits vLLM took); "
                   "load=sync: held in CPU memory at lookup, loaded in the same step; "
                   "load=async: fetched from a tier (CPU, disk, Redis) a step later.", ("load",)),
    "lookup_seconds": ("histogram", "Time the scheduler spent in one connector lookup "
                       "(hashing and the round trip to the worker).", ()),
    "loads": ("counter", "Loads into vLLM's KV cache that succeeded (requests: once however "
              "many ranks load).", ("load",)),
    "failed_loads": ("counter", "Asynchronous loads that failed after the hit was promised (on any "
                     "rank); vLLM recomputed the request.", ()),
    "promises_not_kept": ("counter", "Decode instances (kv_consumer): requests whose prefill instance "
                          "promised more tokens than the store held when the wait for them ended.", ()),
    "loaded_tokens": ("counter", "Tokens whose KV was loaded, by the tier that served the load "
                      "(the slowest any of its objects came from: cpu, disk, redis).", ("tier",)),
    "loaded_bytes": ("counter", "Bytes of KV loaded, by KV cache group kind.", ("kind",)),
    "load_seconds": ("histogram", "Time of one request's load (fetch, verify, scatter).", ("load",)),
    "objects_stored": ("counter", "Objects (full-attention chunks, sliding-window tails, recurrent states) stored.", ()),
    "stored_bytes": ("counter", "Bytes of KV stored, by KV cache group kind.", ("kind",)),
    "store_seconds": ("histogram", "Time to seal and put one object (off the step, on the "
                      "store thread).", ()),
    "objects_dropped": ("counter", "Objects not stored because the store queue was full.", ()),
    "objects_not_stored": ("counter", "Objects not stored because the tier had no room (none "
                           "could allocate them, or no tier took them).", ()),
    "objects_not_shared": ("counter", "Objects not written to Redis (a shard not answering, a write "
                           "error): misses for the rest of the fleet.", ()),
    "objects_not_on_disk": ("counter", "Objects the disk tier did not write (no room it could "
                            "make, a failed write, the tier bypassed).", ()),
    "objects_not_read_no_memory": ("counter", "Objects on disk or in Redis not read for a lookup or "
                                   "load: no CPU memory to read them into (a miss; the object is "
                                   "kept).", ()),
    "store_failures": ("counter", "Stores that raised an error (a future miss).", ()),
    "integrity_failures": ("counter", "Objects that failed their integrity check on load, or whose "
                           "value in Redis is longer than any object's (removed; a miss).", ()),
    "hits_not_held_in_time": ("counter", "Hits whose objects the lookup could not fetch within its "
                              "time (hma_lookup_timeout_s): loaded asynchronously, a step later.", ()),
    "sync_load_retries": ("counter", "Synchronous loads whose first attempt failed and were tried "
                          "again in the same step.", ()),
    "failed_sync_loads": ("counter", "Synchronous loads that failed twice: their blocks were "
                          "reported to vLLM (one KV cache group) or the step was stopped.", ()),
    "thread_errors": ("counter", "Failures a background thread survived (the lookup server "
                      "answered a miss, the store writer lost a batch).", ("thread",)),
    "redis_protocol_errors": ("counter", "Redis replies that broke the protocol or their length limits "
                              "(a lying or broken server or proxy): the connection was dropped and the "
                              "call's objects were misses or not written.", ()),
    "redis_health_errors": ("counter", "Redis health checks that raised an error (logged with its "
                            "traceback; the next check runs).", ()),
    "redis_room_deletes": ("counter", "Objects this instance deleted from Redis to make room for its "
                           "writes under maxmemory (hma_eviction: value; docs/redis.md).", ()),
    "redis_bypassed": ("gauge", "1 while the Redis tier does not answer and is bypassed, "
                       "else 0 (only with a Redis tier).", ()),
}


@dataclass
class HMAConnectorStats(KVConnectorStats):
    """One interval's figures: counter increments, latency observations, gauge values.

    ``data`` = {"counters": {key: n}, "histograms": {key: [seconds, ...]},
    "gauges": {key: value}}; plain types only (it crosses processes).
    """

    def __post_init__(self):
        for part in (_COUNTERS, _HISTOGRAMS, _GAUGES):
            self.data.setdefault(part, {})

    def reset(self):
        self.data = {_COUNTERS: {}, _HISTOGRAMS: {}, _GAUGES: {}}

    @property
    def counters(self) -> dict[str, int]:
        return self.data[_COUNTERS]

    @property
    def histograms(self) -> dict[str, list[float]]:
        return self.data[_HISTOGRAMS]

    @property
    def gauges(self) -> dict[str, float]:
        return self.data[_GAUGES]

    def is_empty(self) -> bool:
        return not (self.counters or self.histograms or self.gauges)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other`` (another worker's, the scheduler's, or a later step's) into this one."""
        if other.is_empty():
            return self
        assert isinstance(other, HMAConnectorStats), type(other)
        for key, n in other.counters.items():
            self.counters[key] = self.counters.get(key, 0) + n
        for key, values in other.histograms.items():
            self.histograms.setdefault(key, []).extend(values)
        self.gauges.update(other.gauges)  # the latest value wins
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few figures, for vLLM's ``KV Transfer metrics: ...`` log line."""
        c, h = self.counters, self.histograms
        out: dict[str, int | float] = {}
        if c.get("lookups"):
            hits = c.get("hit_tokens_sync", 0) + c.get("hit_tokens_async", 0)
            out["lookups"] = c["lookups"]
            out["hit_tokens"] = hits
            out["hit_rate_pct"] = round(100 * hits / max(1, c.get("lookup_tokens", 0)), 1)
        loads = c.get("loads_sync", 0) + c.get("loads_async", 0)
        if loads:
            load_s = h.get("load_seconds_sync", []) + h.get("load_seconds_async", [])
            out["loads"] = loads
            out["loaded_tokens"] = c.get("loaded_tokens", 0)
            for tier in TIERS:
                if c.get(f"loaded_tokens_{tier}"):
                    out[f"loaded_tokens_{tier}"] = c[f"loaded_tokens_{tier}"]
            for key, n in sorted(c.items()):
                if key.startswith("loaded_bytes_"):
                    out[f"loaded_MB_{key[len('loaded_bytes_'):]}"] = round(n / 1e6, 2)
            if load_s:
                out["load_ms_avg"] = round(1e3 * sum(load_s) / len(load_s), 2)
                out["load_ms_max"] = round(1e3 * max(load_s), 2)
        if c.get("objects_stored"):
            out["stored_objects"] = c["objects_stored"]
            out["stored_MB"] = round(sum(n for k, n in c.items() if k.startswith("stored_bytes_")) / 1e6, 2)
            if h.get("store_seconds"):
                out["store_ms_avg"] = round(1e3 * sum(h["store_seconds"]) / len(h["store_seconds"]), 2)
        for key in ("loads_failed", "objects_dropped", "objects_not_stored", "objects_not_shared",
                    "objects_not_on_disk", "objects_not_read_no_memory", "saves_failed", "integrity_failures",
                    "sync_load_retries",
                    "sync_loads_failed", "writer_errors", "lookup_errors", "redis_protocol_errors",
                    "redis_health_errors", "redis_room_deletes"):
            if c.get(key):
                out[_COUNTER_KEYS[key][0]] = c[key]
        if "redis_bypassed" in self.gauges:
            out["redis_bypassed"] = int(self.gauges["redis_bypassed"])
        return out


class SchedulerStats:
    """The scheduler's figures: lookups and the hits vLLM took (scheduler process)."""

    def __init__(self):
        self._stats = HMAConnectorStats()
        self._load_async: dict[str, bool] = {}  # request -> its last lookup's hit loads async

    def on_lookup(self, req_id: str, matched: tuple[int, bool], started: float) -> None:
        """After ``get_num_new_matched_tokens`` returned ``matched``; ``started``: perf_counter."""
        self._stats.histograms.setdefault("lookup_seconds", []).append(time.perf_counter() - started)
        self._load_async[req_id] = matched[1]

    def on_alloc(self, request, num_external_tokens: int) -> None:
        """vLLM admitted ``request`` with ``num_external_tokens`` from the connector."""
        c = self._stats.counters
        c["lookups"] = c.get("lookups", 0) + 1
        c["lookup_tokens"] = c.get("lookup_tokens", 0) + request.num_tokens
        load_async = self._load_async.pop(request.request_id, True)
        if num_external_tokens > 0:
            key = "hit_tokens_async" if load_async else "hit_tokens_sync"
            c[key] = c.get(key, 0) + num_external_tokens

    def on_finished(self, req_id: str) -> None:
        self._load_async.pop(req_id, None)

    def on_failed_loads(self, req_ids) -> None:
        """vLLM's ``failed_recving``: requests whose asynchronous load failed on any worker."""
        if req_ids:
            c = self._stats.counters
            c["loads_failed"] = c.get("loads_failed", 0) + len(req_ids)

    def on_promises_not_kept(self, n: int) -> None:
        """``n`` disaggregated-prefill promises not kept (``scheduler.promises``)."""
        if n:
            c = self._stats.counters
            c["promises_not_kept"] = c.get("promises_not_kept", 0) + n

    def collect(self) -> Optional[HMAConnectorStats]:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, HMAConnectorStats()
        return stats


class WorkerStats:
    """A worker's figures: what its counters gained since the last step, and latencies.

    Reads ``WorkerHalf.counters()``, ``WorkerHalf.load_seconds`` (``(sync, seconds)``
    per load), ``StoreWriter.take_store_seconds()`` and the Redis tier's health. Only the
    first worker (``serves_lookups``) reports the per-request figures: ``is_per_request``
    counters and load latencies.
    """

    def __init__(self, worker):
        self._worker = worker
        self._counts_requests = worker.serves_lookups  # the first worker: see PER_REQUEST_COUNTERS
        self._reported: dict[str, int] = {}
        self._tier_gauges: Optional[dict] = None

    def collect(self) -> Optional[HMAConnectorStats]:
        worker = self._worker
        counters = worker.counters()
        reported = self._reported
        deltas = {k: v - reported.get(k, 0) for k, v in counters.items()
                  if v != reported.get(k, 0) and k not in _WORKER_ONLY
                  and (self._counts_requests or not is_per_request(k))}
        self._reported = counters
        stats = HMAConnectorStats(data={_COUNTERS: deltas})
        if worker.load_seconds:
            loads, worker.load_seconds = worker.load_seconds, []
            for sync, seconds in loads if self._counts_requests else ():
                stats.histograms.setdefault("load_seconds_sync" if sync else "load_seconds_async",
                                            []).append(seconds)
        if worker.writer is not None:
            store_seconds = worker.writer.take_store_seconds()
            if store_seconds:
                stats.histograms["store_seconds"] = store_seconds
        gauges = worker.store.gauges() if worker.store is not None else {}
        if gauges and (gauges != self._tier_gauges or not stats.is_empty()):  # changed, or with other news
            stats.gauges.update(gauges)
            self._tier_gauges = gauges
        return None if stats.is_empty() else stats


def _metric_key(key: str, table: dict) -> Optional[tuple[str, tuple[str, ...]]]:
    if key in table:
        return table[key]
    if table is _COUNTER_KEYS:
        for prefix, name in _LABELLED_COUNTER_PREFIXES.items():
            if key.startswith(prefix):
                return name, (key[len(prefix):],)
    return None


class HMAPromMetrics(KVConnectorPromMetrics):
    """``vllm:lmcache_hma_*`` metrics, labelled ``model_name``, ``engine`` (and ``load``, ``kind``,
    ``tier`` or ``thread`` where the metric says so); updated from each step's ``to_dict()``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics: dict[str, Any] = {}
        for name, (kind, doc, extra) in METRICS.items():
            kwargs = dict(name=PREFIX + name, documentation=doc, labelnames=list(labelnames) + list(extra))
            if kind == "counter":
                self.metrics[name] = self._counter_cls(**kwargs)
            elif kind == "histogram":
                self.metrics[name] = self._histogram_cls(buckets=list(_LATENCY_BUCKETS), **kwargs)
            else:
                self.metrics[name] = self._gauge_cls(multiprocess_mode="mostrecent", **kwargs)
        self._bound: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        # Series exist from the start (at 0), as vLLM's own do; except the Redis gauge (only
        # with a Redis tier) and the per-kind bytes (the model's group kinds are not known here).
        values = {"load": ("sync", "async"), "tier": TIERS, "thread": ("lookup", "writer")}
        for engine_idx in per_engine_labelvalues:
            for name, (kind, _, extra) in METRICS.items():
                if kind != "gauge" and "kind" not in extra:
                    for combo in itertools.product(*(values[label] for label in extra)):
                        self._child(engine_idx, name, combo)

    def _child(self, engine_idx: int, name: str, extra: tuple[str, ...]):
        bound = self._bound.get((engine_idx, name, extra))
        if bound is None:
            labels = list(self.per_engine_labelvalues[engine_idx]) + list(extra)
            bound = self._bound[engine_idx, name, extra] = self.metrics[name].labels(*labels)
        return bound

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        if not transfer_stats_data:
            return
        for key, n in transfer_stats_data.get(_COUNTERS, {}).items():
            target = _metric_key(key, _COUNTER_KEYS)
            if target is not None and n > 0:
                self._child(engine_idx, *target).inc(n)
        for key, values in transfer_stats_data.get(_HISTOGRAMS, {}).items():
            target = _metric_key(key, _HISTOGRAM_KEYS)
            if target is not None:
                child = self._child(engine_idx, *target)
                for v in values:
                    child.observe(v)
        for key, value in transfer_stats_data.get(_GAUGES, {}).items():
            target = _metric_key(key, _GAUGE_KEYS)
            if target is not None:
                self._child(engine_idx, *target).set(value)
