"""The worker half: registers vLLM's KV tensors and runs the step protocol.

This class runs in each vLLM worker process. Per step, in vLLM's order:

* ``before_step``: the gathers of the last step end before vLLM writes a block they read.
* ``start_load_kv``: every ``LoadSpec`` of the step (``worker.loads``).
* ``wait_for_save``: every ``SaveSpec`` (``worker.gathers``); the store writer
  (``worker.store_writer``) seals the objects and puts them into the tiers.
* ``get_transfer_results``: the requests whose asynchronous load finished (or failed).

The worker that serves lookups (tensor- and pipeline-parallel rank 0) answers the
scheduler's lookups on a thread (``worker.lookup_server``, ``worker.lookups``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, deque
from dataclasses import replace
from typing import Optional
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lmcache_hma.kv_copy import copy_ops

from lmcache_hma.worker import cpu_placement
from lmcache_hma.config.settings import HMAConfig
from lmcache_hma.worker.held import HeldObjects
from lmcache_hma.core.keys import Namespace
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.layout import NULL_BLOCK_ID, HybridLayout, LayoutError, Rows
from lmcache_hma.core.lookup_wire import socket_address
from lmcache_hma.worker.lookup_server import LookupServer
from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef
from lmcache_hma.core.objects import payload_of
from lmcache_hma.core.turn_ends import TurnMarks
from lmcache_hma.kv_copy.canonical_kv import RankHeads
from lmcache_hma.kv_copy.canonical_objects import CanonicalObjects, CanonicalStates
from lmcache_hma.kv_copy.paged_kv import PagedKV
from lmcache_hma.kv_copy.state_kv import StateKV
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import flat, release
from lmcache_hma.vllm_compat import recomputes_failed_blocks
from lmcache_hma.worker.store_writer import StoreWriter
from lmcache_hma.log import get_logger
from lmcache_hma.worker.gathers import Gathers
from lmcache_hma.worker.loads import Loads
from lmcache_hma.worker.lookups import LookupAnswers

logger = get_logger(__name__)

_CLOSE_TIMEOUT_S = 10.0


class WorkerHalf(LookupAnswers, Loads, Gathers):
    # a lookup answered closer than this (at most a quarter of the timeout) to the scheduler's
    # deadline holds nothing
    LATE_S = 0.5

    def __init__(self, config: HMAConfig, layout: HybridLayout, namespace: Namespace,
                 engine_id: str, num_blocks: int, serves_lookups: bool, defer_gathers: bool = False,
                 rank_heads: Optional[RankHeads] = None, tp: tuple[int, int] = (1, 0),
                 page_formats: Optional[dict] = None):
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.serves_lookups = serves_lookups
        self.paged: PagedKV | None = None
        # hma_share_parallel_shapes: the KV heads this rank holds, and its parts of objects
        self.rank_heads = rank_heads
        self.tp = tp  # (TP size, TP rank)
        self.page_formats = page_formats or {}  # vLLM CPU's page format per attention group index
        self.canonical: CanonicalObjects | None = None
        self.store: ChunkStore | None = None
        self.writer: StoreWriter | None = None
        self.held: HeldObjects | None = None
        self.server: LookupServer | None = None
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._failed_blocks: set[int] = set()  # of failed synchronous loads (one KV cache group)
        self.recomputes_failed_blocks = recomputes_failed_blocks(len(layout.groups))
        self.faults = None  # TEST ONLY (hma_test_* keys): lmcache_hma.worker.faults
        if config.faults:
            from lmcache_hma.worker.faults import FaultInjector

            self.faults = FaultInjector(config.faults)
        self.disabled: Optional[str] = None  # why the copy path cannot run (then: no hits, no stores)
        self.stats: Counter = Counter()
        self._stats_written: dict = {}
        self._stats_lock = threading.Lock()  # the step's thread and the store writer's write the file
        self._stats_failed = False  # hma_stats_file could not be written (said once)
        self.load_seconds: list = []  # (sync, seconds) per load; taken each step by lmcache_hma.metrics
        self._kind_of_layer = [g.kind.value for g in layout.group_of_layer]
        self.state: StateKV | None = None  # recurrent-state layers (gated delta net), if any
        # background threads off the forward's cores (cpu_placement.py); the lookup server's stays
        self._background_cpus = cpu_placement.unbound_cpus()
        self._gatherer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-hma-gather",
                                            initializer=cpu_placement.move_here, initargs=(self._background_cpus,))
        # a lookup's fetch, waited for only until the lookup's deadline (worker.lookups)
        self._lookup_fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-hma-lookup-fetch")
        self._gathering: Future | None = None  # the gather thread's run over the last wait_for_save's jobs
        self._gathering_jobs: deque = deque()  # its jobs not started yet (either thread takes them)
        self._gather_round: list = []  # all of them
        self._marker = None  # on a GPU: the forward's stream at the last wait_for_save (copy_ops.ready_marker)
        self._step_began = False  # before_step ran in this step (the barrier is in place)
        self.gather_wait_seconds = 0.0  # time steps waited for them (benchmarks)
        self.defer_gathers = defer_gathers and not layout.has_state  # see wait_for_save
        self.tier_events = None  # KV cache events on: worker.tier_events.TierEventCollector (the connector sets it)
        self.asleep = False  # vLLM unmapped KV memory (sleep mode) and has not mapped it again
        self.saves_due = False  # the step's metadata has saves and its wait_for_save has not run
        self._sending: set[str] = set()  # finished requests whose kept blocks are gathered (worker.gathers)
        self._turn_ends_of = None  # the metadata whose turn ends were gathered (once per step)
        self.turn_marks = TurnMarks()  # the turn ends this worker stored, per chunk prefix
        # Cache resets this worker applied (HMAConnectorMetadata.epoch), and the lock that makes
        # "a save planned before the reset is not started after it" hold: a reset bumps ``resets``
        # under it, and a step's saves are checked and set under way under it (worker.gathers)
        self.resets = 0
        self.reset_fence = threading.RLock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.paged = PagedKV(kv_caches, self.layout, self.num_blocks)
        if self.layout.has_state:
            self.state = StateKV(kv_caches, self.layout, self.num_blocks)
        if self.namespace.shares_parallel_shapes:
            states = CanonicalStates(self.layout, self.state, *self.tp, self.namespace.secret) \
                if self.layout.has_state else None
            self.canonical = CanonicalObjects(self.layout, kv_caches, self.num_blocks, self.rank_heads,
                                              self.namespace.secret, states, self.page_formats)
        for g in self.layout.paged_groups:
            if g.page_bytes != self.paged.page_bytes:
                raise LayoutError(
                    f"KV cache group {g.index}: vLLM's spec says {g.page_bytes} bytes per "
                    f"block and layer, the registered tensors hold {self.paged.page_bytes}"
                )
        lm = self.config.lmcache
        with cpu_placement.threads_started_on(self._background_cpus):  # LMCache's threads and the writer's
            self.store = ChunkStore(lm, self.namespace, self.config.verify_checksums, self.config.eviction)
            self.writer = StoreWriter(self.store, self.config.store_queue_objects,
                                      on_committed=self._write_stats if self.config.stats_file else None,
                                      shared=self.canonical is None or self.canonical.writes_shared)
        if self.tier_events is not None:
            self.tier_events.watch(self.store, self.writer, lambda: self.gathers_under_way() or self.saves_due)
        self.disabled = copy_ops.probe(self.paged) or self._probe_copy_path()
        if self.disabled:
            logger.warning("LMCacheHMA: KV cannot be copied on this worker (%s); the connector "
                           "serves no hits and stores nothing", self.disabled)
        if self.serves_lookups:
            # Objects held for a synchronous load must be the only copy every rank needs:
            # with one worker that is this one. They live in LMCache's CPU buffer (the CPU
            # tier, or with local_cpu: false its staging buffer), so half of it may be held.
            # Never with recurrent states: vLLM copies the hit's state into the running slot
            # before start_load_kv in the same step, so those loads must be asynchronous.
            if self.namespace.world_size == 1 and not self.layout.has_state and not self.disabled:
                self.held = HeldObjects(int(lm.max_local_cpu_size * 2**30 / 2),
                                        void_keep_s=self.config.lookup_timeout_s + 1.0)
            self.server = LookupServer(socket_address(self.engine_id), self._answer_lookup, self.reset)
        logger.info(
            "LMCacheHMA worker: %d layers in %d groups (%s), page %d bytes, tiers %s, hits loaded "
            "%s", len(self.layout.layer_names) + len(self.layout.state_layer_names),
            len(self.layout.groups),
            ", ".join(g.kind.value for g in self.layout.groups), self.paged.page_bytes,
            ", ".join(self.store.tier_labels), "synchronously when held" if self.held else "asynchronously",
        )

    # sleep mode (vLLM 0.33+: unregister_kv_caches / restore_kv_caches) -------------
    def before_sleep(self) -> None:
        """vLLM is about to unmap KV memory (sleep mode, a discard, a weight update borrowing the
        KV cache's memory): no copy may touch it from now on. Loads end in ``start_load_kv`` and
        state gathers in ``wait_for_save``; only deferred gathers may still be reading KV, on
        the gather thread and the copy stream (each launch is waited for), so they end here.
        The store writer is left alone: it seals and puts objects that live in LMCache's host
        memory, which sleep mode does not unmap. Idempotent."""
        self.finish_gathers()
        self.asleep = True

    def after_wake(self) -> None:
        """vLLM mapped KV memory again (at the same addresses: ``CuMemAllocator`` keeps a sleeping
        allocation's virtual range; the extensible KV cache recommits in place). Its contents
        are gone, which the connector does not mind (vLLM cleared its prefix cache before
        sleeping); the copy path is probed again before anything is copied. Idempotent."""
        if not self.asleep:
            return
        self.asleep = False
        if self.disabled or self.paged is None:
            return
        self.disabled = copy_ops.probe(self.paged) or self._probe_copy_path()
        if self.disabled:
            logger.warning("LMCacheHMA: KV cannot be copied on this worker after sleep mode woke it "
                           "(%s); the connector serves no hits and stores nothing", self.disabled)

    def _probe_copy_path(self) -> Optional[str]:
        """Why objects from the store cannot be copied here, or None: one page of the null
        block (which holds nothing) gathered into an object from the store's allocator
        (LMCache's pinned memory on a GPU) and scattered back. ``copy_ops.probe`` has checked
        the copy path itself (CuPy, the kernels, pinned memory, the bytes)."""
        obj = None
        try:
            obj = self.store.allocate(self.paged.page_bytes)
            if obj is None:
                return "the store could not allocate a page"
            rows = Rows([0], [0], [NULL_BLOCK_ID])  # the first layer's null block
            copy_ops.gather(self.paged, rows, payload_of(flat(obj)))
            copy_ops.scatter(self.paged, rows, payload_of(flat(obj)))
            return None
        except Exception as exc:
            logger.debug("LMCacheHMA: copy path probe failed", exc_info=True)
            return f"{type(exc).__name__}: {exc}"
        finally:
            if obj is not None:
                release(obj)

    def _payload_bytes(self, kind: ObjectKind, chunk: int, end: int = 0, on_tail: bool = False) -> int:
        if self.canonical is not None and self.canonical.splits(kind):
            return self.canonical.payload_bytes(kind, chunk, end)  # (no turn object on_tail: lookups)
        return self.layout.payload_bytes(kind, chunk, self.paged.page_bytes, end, on_tail)

    def _stored_keys(self, kind: ObjectKind, chunk_hash: bytes) -> list[tuple[Optional[int], bytes]]:
        """``(index, key)`` of what the store holds for object ``kind`` named ``chunk_hash``: the
        object itself (index None), or with hma_share_parallel_shapes this rank's parts of it:
        one per KV head of attention objects, per shard of states (``canonical_objects``)."""
        parts = self.canonical.parts(kind, chunk_hash) if self.canonical is not None else None
        return parts if parts is not None else [(None, chunk_hash)]

    def _stored_refs(self, refs) -> list[tuple[ObjectRef, Optional[int]]]:
        """``(ref, index)`` of what the store holds for ``refs`` (``_stored_keys``)."""
        return [(replace(ref, chunk_hash=key) if index is not None else ref, index)
                for ref in refs for index, key in self._stored_keys(ref.kind, ref.chunk_hash)]

    def event_name(self, key: bytes) -> Optional[bytes]:
        """KV cache events with hma_share_parallel_shapes: the object a stored part stands for
        (rank 0's part of its first KV head or shard), None for any other part."""
        if self.canonical is None or self.tp[1] != 0:
            return None
        return self.canonical.object_of(key)

    # the step ---------------------------------------------------------------
    def before_step(self, meta: HMAConnectorMetadata) -> None:
        """The first call of a step (``handle_preemptions``), before vLLM writes any KV: the
        barrier for the last step's deferred gathers, when this step writes a block they read.

        vLLM writes only the blocks it allocated in this step (``meta.new_blocks``: new
        tokens' blocks, copy-on-write copies); a block the gathers read is among them only if
        it was freed and reused (a sliding-window block that left the window, a finished or
        preempted request's block). Not in ``start_load_kv``: vLLM 0.32 calls that after the
        forward in a step without a synchronous load (``SchedulerOutput.has_sync_kv_loads``).
        """
        self._step_began = True
        self.gather_turn_ends(meta)  # before vLLM writes a block their requests gave back
        # KV cache events: this step's stores are on their way from now on. vLLM 0.33+'s V2 runner
        # with a speculator takes the step's events before wait_for_save (moved to finalize_step),
        # when neither a gather nor the writer has them yet: without this, no BUSY would keep an
        # engine that goes idle stepping, and the last stores' events would wait for a request.
        self.saves_due = bool(meta.saves)
        if meta.reset and not self.serves_lookups:  # rank 0 reset when the scheduler asked
            self.reset()
        with self.reset_fence:  # a reset whose message did not reach this worker still fences
            self.resets = max(self.resets, meta.epoch)
            if self.store is not None and self.store.generation != self.resets:  # and names
                self.store.new_generation(weights=self.resets)
        if self._gathering is None:
            return
        if meta.new_blocks is None:
            self.finish_gathers()
            return
        needed = [job for job in self._gather_round
                  if not job.done.is_set() and not meta.new_blocks.isdisjoint(job.blocks)]
        if needed:
            self._finish_jobs(needed)

    def _finish_jobs(self, needed: list) -> None:
        """Wait until the ``needed`` gather jobs are done, running those not started yet here;
        the others go on on the gather thread, beside the step (they read no block it writes)."""
        t0 = time.perf_counter()
        for job in needed:
            try:
                self._gathering_jobs.remove(job)  # atomic: either thread runs a job, once
            except ValueError:
                continue  # taken by the gather thread
            self._run_gathers([job])
        for job in needed:
            job.done.wait()
        self.gather_wait_seconds += time.perf_counter() - t0

    # results ----------------------------------------------------------------
    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished receives, failed receives) since the last call."""
        done, failed = self._finished_loads, self._failed_loads
        self._finished_loads, self._failed_loads = set(), set()
        if self.config.stats_file:
            self._write_stats()
        return done, failed

    def counters(self) -> dict:
        """Every counter of this worker: loads, stores (from the writer), integrity failures."""
        out = dict(self.stats)
        if self.writer is not None:
            for k, v in self.writer.counts().items():
                out[k] = out.get(k, 0) + v
        out["integrity_failures"] = self.store.integrity_failures if self.store else 0
        if self.server is not None and self.server.errors:
            out["lookup_errors"] = self.server.errors
        if self.store is not None:
            out.update(self.store.counters())  # the tiers' (e.g. objects not shared)
        return out

    def _write_stats(self) -> None:
        """Rewrite ``hma_stats_file`` if the counters changed: each step, and after each batch the
        store writer committed (from its thread)."""
        with self._stats_lock:
            stats = self.counters()
            if stats == self._stats_written:
                return
            tmp = f"{self.config.stats_file}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(stats, f)
                os.replace(tmp, self.config.stats_file)
            except OSError as exc:  # a diagnostic file: never a failed step or a lost store
                if not self._stats_failed:
                    logger.warning("LMCacheHMA: cannot write hma_stats_file %s (%s); the counters are "
                                   "still in /metrics", self.config.stats_file, exc)
                self._stats_failed = True
                return
            self._stats_written = stats

    def shutdown(self) -> None:
        self.finish_gathers()
        self._gatherer.shutdown(wait=False)
        if self.server is not None:
            self.server.close()
            self.server = None
        self._lookup_fetcher.shutdown(wait=True, cancel_futures=True)  # its late fetches give back what they hold
        if self.held is not None:
            self.held.release_everything()
        if self.writer is not None:
            self.writer.close(_CLOSE_TIMEOUT_S / 2)
        if self.store is not None:
            if self.config.stats_file:
                self._write_stats()
            self.store.close()
            self.store = None

