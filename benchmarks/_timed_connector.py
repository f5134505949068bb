"""Benchmark-only: ``LMCacheHMAConnector`` plus wall-time totals of its hooks.

The connector's own code runs unchanged (every hook calls ``super()``); this
subclass adds a ``perf_counter`` around the hooks where its work happens and
writes the totals as JSON, so bench_ttft can say where a hit's and a store's
time goes without relying on noisy end-to-end differences:

* worker: ``handle_preemptions`` (turn ends gathered, the wait for the last step's deferred
  gathers), ``start_load_kv`` (scatter what the lookup holds; an asynchronous load fetches
  and verifies first), ``wait_for_save`` (allocate, start the gathers), and ``gather_wait``:
  what steps waited for the last step's deferred gathers;
* scheduler: ``get_num_new_matched_tokens`` (hashing + lookup round trip to the
  worker, which fetches and holds the hit), ``build_connector_meta``.

Totals go to ``$BENCH_CONNECTOR_TIMES.<role>.json`` (role: worker/scheduler; the worker's
also has its counters, as ``hma_stats_file`` would, without that file's writes in the
step), written by a daemon thread ``WRITE_DELAY_S`` after they change, so that the file writes stay out of the
step being measured (readers wait ``SETTLE_S`` before reading). Loaded by vLLM as
``kv_connector="TimedLMCacheHMAConnector"``, ``kv_connector_module_path="_timed_connector"``
(the benchmarks directory is on the engine processes' ``sys.path``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict

from lmcache_hma.connector import LMCacheHMAConnector

ENV = "BENCH_CONNECTOR_TIMES"
WRITE_DELAY_S = 0.05  # after a change: the step that made it has ended by then
SETTLE_S = 0.15  # what a reader waits after a request before reading the totals


class TimedLMCacheHMAConnector(LMCacheHMAConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        base = os.environ.get(ENV, "")
        role_name = "worker" if self._worker is not None else "scheduler"
        self._times_path = f"{base}.{role_name}.json" if base else ""
        self._times = defaultdict(float)
        self._calls = defaultdict(int)
        self._changed = threading.Event()
        if self._times_path:
            threading.Thread(target=self._write_loop, name="bench-times", daemon=True).start()

    def _add(self, name: str, t0: float, write: bool = True) -> None:
        self._times[name] += time.perf_counter() - t0
        self._calls[name] += 1
        if self._worker is not None:  # what steps waited for the last step's gathers
            self._times["gather_wait"] = self._worker.gather_wait_seconds
        if write and self._times_path:
            self._changed.set()

    def _write_loop(self) -> None:
        while True:
            self._changed.wait()
            time.sleep(WRITE_DELAY_S)
            self._changed.clear()
            tmp = f"{self._times_path}.{os.getpid()}.tmp"
            try:  # the step's thread may add a key meanwhile: then again
                out = {"seconds": dict(self._times), "calls": dict(self._calls)}
                if self._worker is not None:
                    out["counters"] = self._worker.counters()
            except RuntimeError:
                self._changed.set()
                continue
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, self._times_path)


def _timed(name: str, write: bool):
    def hook(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = getattr(super(TimedLMCacheHMAConnector, self), name)(*args, **kwargs)
        self._add(name, t0, write)
        return out

    hook.__name__ = name
    return hook


# (hook, write the totals after each call): the worker's, then the scheduler's
for _name, _write in (("handle_preemptions", False), ("start_load_kv", False), ("wait_for_save", True),
                      ("get_num_new_matched_tokens", True), ("build_connector_meta", False)):
    setattr(TimedLMCacheHMAConnector, _name, _timed(_name, _write))
