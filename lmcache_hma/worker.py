"""The worker half: registers vLLM's KV tensors, loads and saves objects.

This class runs in each vLLM worker process. Per step, in vLLM's order:

* ``start_load_kv``: every ``LoadSpec`` of the step. All of a request's objects
  are fetched and verified first, then scattered into its blocks; any miss or
  failed check makes the whole request a failed receive (vLLM recomputes it).
* ``wait_for_save``: every ``SaveSpec``: blocks are gathered into new objects
  and stored. This must happen in the step that computed them: sliding-window
  blocks that leave the window are reused by other groups in the next step.
* ``get_transfer_results``: the requests whose load finished (or failed).

Rank 0 also answers the scheduler's lookups (``lookup.LookupServer``).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import torch

from lmcache_hma import copy_ops
from lmcache_hma.config import HMAConfig
from lmcache_hma.keys import Namespace
from lmcache_hma.layout import GroupKind, HybridLayout, LayoutError, plan_rows
from lmcache_hma.lookup import LookupServer, longest_hit, socket_address
from lmcache_hma.metadata import HMAConnectorMetadata, LoadSpec, SaveSpec
from lmcache_hma.objects import ObjectKind, payload_of
from lmcache_hma.paged_kv import PagedKV
from lmcache_hma.store import ChunkStore, flat, release
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


class WorkerHalf:
    def __init__(self, config: HMAConfig, layout: HybridLayout, namespace: Namespace,
                 engine_id: str, num_blocks: int):
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.paged: PagedKV | None = None
        self.store: ChunkStore | None = None
        self.server: LookupServer | None = None
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._fail_budget = config.test_fail_loads
        self.stats: Counter = Counter()
        self._stats_written: Counter = Counter()
        self._kind_of_layer = [g.kind.value for g in layout.groups for _ in g.layer_names]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.paged = PagedKV(kv_caches, self.layout, self.num_blocks)
        for g in self.layout.groups:
            if g.page_bytes != self.paged.page_bytes:
                raise LayoutError(
                    f"KV cache group {g.index}: vLLM's spec says {g.page_bytes} bytes per "
                    f"block and layer, the registered tensors hold {self.paged.page_bytes}"
                )
        self.store = ChunkStore(self.config.lmcache, self.namespace, self.config.verify_checksums)
        if self.namespace.rank == 0:
            self.server = LookupServer(socket_address(self.engine_id), self._answer_lookup)
        logger.info(
            "LMCacheHMA worker: %d layers in %d groups (%s), page %d bytes, tiers %s",
            len(self.layout.layer_names), len(self.layout.groups),
            ", ".join(g.kind.value for g in self.layout.groups), self.paged.page_bytes,
            ", ".join(self.store.tiers),
        )

    def _answer_lookup(self, hashes: list[bytes]) -> int:
        store = self.store
        has_tail = (lambda h: store.has(ObjectKind.TAIL, h)) if self.layout.has_sliding else None
        return longest_hit(hashes, store.count_full_prefix, has_tail)

    def _payload_bytes(self, kind: ObjectKind, chunk: int) -> int:
        return self.layout.num_rows(self.layout.segments(kind, chunk)) * self.paged.page_bytes

    # loads ------------------------------------------------------------------
    def start_load_kv(self, meta: HMAConnectorMetadata) -> None:
        for spec in meta.loads:
            try:
                ok = self._load(spec)
            except Exception:  # never crash the engine over a cache: recompute instead
                logger.exception("LMCacheHMA: loading %s failed; the request is recomputed", spec.req_id)
                ok = False
            self._finished_loads.add(spec.req_id)
            if not ok:
                self._failed_loads.add(spec.req_id)
                self.stats["loads_failed"] += 1

    def _load(self, spec: LoadSpec) -> bool:
        t0 = time.perf_counter()
        if self._fail_budget > 0:
            self._fail_budget -= 1
            logger.warning("LMCacheHMA: failing load of %s (hma_test_fail_loads)", spec.req_id)
            return False
        fetched, missing = [], []
        try:
            for ref in spec.objects:
                obj = self.store.get(ref.kind, ref.chunk_hash, self._payload_bytes(ref.kind, ref.chunk))
                if obj is None:
                    missing.append(ref)  # keep going: every damaged object is dropped now
                else:
                    fetched.append((ref, obj))
            if missing:
                logger.warning(
                    "LMCacheHMA: %d of %d objects for %s are gone or damaged (first: %s of chunk "
                    "%d); the request is recomputed", len(missing), len(spec.objects), spec.req_id,
                    missing[0].kind.name, missing[0].chunk,
                )
                return False
            moved = Counter()
            for ref, obj in fetched:
                segments = self.layout.segments(ref.kind, ref.chunk)
                rows = plan_rows(self.layout, segments, spec.block_table, spec.start)
                copy_ops.scatter(self.paged, rows, payload_of(flat(obj)))
                for layer in rows.layer_indices:
                    moved[self._kind_of_layer[layer]] += self.paged.page_bytes
                if self.config.test_corrupt_loads:
                    self._corrupt(rows)
        finally:
            for _, obj in fetched:
                release(obj)
        for kind, n in moved.items():
            self.stats[f"loaded_bytes_{kind}"] += n
        self.stats["loads_ok"] += 1
        self.stats["loaded_tokens"] += spec.end - spec.start
        logger.debug("LMCacheHMA: loaded %s tokens [%d, %d) in %.1f ms: %s", spec.req_id,
                     spec.start, spec.end, 1e3 * (time.perf_counter() - t0), dict(moved))
        return True

    def _corrupt(self, rows) -> None:
        """TEST ONLY: overwrite just-loaded blocks with noise (hma_test_corrupt_loads)."""
        noise = torch.randn(len(rows), self.paged.planes * self.paged.unit_elems).to(self.paged.dtype)
        copy_ops.scatter(self.paged, type(rows)(list(range(len(rows))), rows.layer_indices,
                                                rows.block_ids), noise.reshape(-1))

    # saves ------------------------------------------------------------------
    def wait_for_save(self, meta: HMAConnectorMetadata) -> None:
        for spec in meta.saves:
            try:
                self._save(spec)
            except Exception:  # a lost save is only a future miss
                logger.exception("LMCacheHMA: storing KV of %s failed", spec.req_id)
                self.stats["saves_failed"] += 1

    def _save(self, spec: SaveSpec) -> None:
        for ref in spec.objects:
            segments = self.layout.segments(ref.kind, ref.chunk)
            rows = plan_rows(self.layout, segments, spec.block_table)
            if len(rows) != self.layout.num_rows(segments):
                logger.debug("LMCacheHMA: %s chunk %d of %s has null blocks; not stored",
                             ref.kind.name, ref.chunk, spec.req_id)
                continue
            nbytes = len(rows) * self.paged.page_bytes
            if self.store.put(ref.kind, ref.chunk_hash, nbytes,
                              lambda payload: copy_ops.gather(self.paged, rows, payload)):
                kind = GroupKind.FULL if ref.kind is ObjectKind.FULL else GroupKind.SLIDING
                self.stats[f"stored_bytes_{kind.value}"] += nbytes
                self.stats["objects_stored"] += 1
            else:
                self.stats["objects_not_stored"] += 1

    # results ----------------------------------------------------------------
    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished receives, failed receives) since the last call."""
        done, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        if self._stats_written != self.stats and self.config.stats_file:
            self._write_stats()
        return done, failed

    def _write_stats(self) -> None:
        stats = dict(self.stats, integrity_failures=self.store.integrity_failures if self.store else 0)
        tmp = f"{self.config.stats_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, self.config.stats_file)
        self._stats_written = Counter(self.stats)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.store is not None:
            if self.config.stats_file:
                self._write_stats()
            self.store.close()
            self.store = None
