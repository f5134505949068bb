"""The worker half: registers vLLM's KV tensors, loads and saves objects.

This class runs in each vLLM worker process. Per step, in vLLM's order:

* ``start_load_kv``: every ``LoadSpec`` of the step (recurrent states go into the
  block vLLM allocated at the hit's boundary, ``state_kv``). A synchronous load scatters
  the objects the lookup already fetched (from any tier), verified and held
  (``held``): it cannot fail, and the request computes in this very step. An
  asynchronous load (more than fit the holding budget; tensor or pipeline
  parallelism; recurrent states) fetches and verifies all of a request's objects first, then scatters; any
  miss or failed check makes the whole request a failed receive (vLLM
  recomputes it).
* ``wait_for_save``: every ``SaveSpec``: objects are allocated and the blocks the
  step computed are gathered into them on the gather thread, which the next step
  waits for (``before_step``) before vLLM writes a block they read (sliding-window
  blocks that leave the window are freed and reused); recurrent states
  (from the blocks vLLM handed off, ``SaveSpec.state_blocks``) are gathered in the
  step. Sealing and putting them into the tiers happens on the writer thread
  (``writer.StoreWriter``).
* ``get_transfer_results``: the requests whose asynchronous load finished (or failed).

The worker that serves lookups (tensor- and pipeline-parallel rank 0) answers
the scheduler's lookups (``lookup.LookupServer``) on a thread.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, deque
from typing import Optional
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lmcache_hma.copy import copy_ops

from lmcache_hma.worker import cpu_placement
from lmcache_hma.config.settings import HMAConfig
from lmcache_hma.worker.held import Hold, HeldObjects, release_all
from lmcache_hma.core.keys import Namespace
from lmcache_hma.core.kinds import GroupKind, ObjectKind, slowest_tier
from lmcache_hma.core.layout import NULL_BLOCK_ID, HybridLayout, LayoutError, Rows, plan_rows
from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.lookup_wire import socket_address
from lmcache_hma.worker.lookup_server import LookupServer
from lmcache_hma.core.metadata import HMAConnectorMetadata, LoadSpec, SaveSpec, hit_objects
from lmcache_hma.core.objects import payload_of
from lmcache_hma.copy.paged_kv import PagedKV
from lmcache_hma.copy.state_kv import StateKV
from lmcache_hma.store.chunk_store import ChunkStore, flat, release
from lmcache_hma.vllm_compat import recomputes_failed_blocks
from lmcache_hma.worker.store_writer import StoreWriter
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

_CLOSE_TIMEOUT_S = 10.0


class WorkerHalf:
    # a lookup answered closer than this (at most a quarter of the timeout) to the scheduler's
    # deadline holds nothing
    LATE_S = 0.5

    def __init__(self, config: HMAConfig, layout: HybridLayout, namespace: Namespace,
                 engine_id: str, num_blocks: int, serves_lookups: bool, defer_gathers: bool = False):
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.serves_lookups = serves_lookups
        self.paged: PagedKV | None = None
        self.store: ChunkStore | None = None
        self.writer: StoreWriter | None = None
        self.held: HeldObjects | None = None
        self.server: LookupServer | None = None
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._failed_blocks: set[int] = set()  # of failed synchronous loads (one KV cache group)
        self.recomputes_failed_blocks = recomputes_failed_blocks(len(layout.groups))
        self.faults = None  # TEST ONLY (hma_test_* keys): lmcache_hma.testing.faults
        if config.faults:
            from lmcache_hma.testing.faults import FaultInjector

            self.faults = FaultInjector(config.faults)
        self.disabled: Optional[str] = None  # why the copy path cannot run (then: no hits, no stores)
        self.stats: Counter = Counter()
        self._stats_written: dict = {}
        self.load_seconds: list = []  # (sync, seconds) per load; taken each step by lmcache_hma.metrics
        self._kind_of_layer = [g.kind.value for g in layout.group_of_layer]
        self.state: StateKV | None = None  # recurrent-state layers (gated delta net), if any
        # background threads off the forward's cores (cpu_placement.py); the lookup server's stays
        self._background_cpus = cpu_placement.unbound_cpus()
        self._gatherer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-hma-gather",
                                            initializer=cpu_placement.move_here, initargs=(self._background_cpus,))
        self._gathering: Future | None = None  # the gather thread's run over the last wait_for_save's jobs
        self._gathering_jobs: deque = deque()  # its jobs not started yet (either thread takes them)
        self._gather_round: list[_GatherJob] = []  # all of them
        self._marker = None  # on a GPU: the forward's stream at the last wait_for_save (copy_ops.ready_marker)
        self._step_began = False  # before_step ran in this step (the barrier is in place)
        self.gather_wait_seconds = 0.0  # time steps waited for them (benchmarks)
        self.defer_gathers = defer_gathers and not layout.has_state  # see wait_for_save
        self.tier_events = None  # KV cache events on: worker.tier_events.TierEventCollector (the connector sets it)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.paged = PagedKV(kv_caches, self.layout, self.num_blocks)
        if self.layout.has_state:
            self.state = StateKV(kv_caches, self.layout, self.num_blocks)
        for g in self.layout.paged_groups:
            if g.page_bytes != self.paged.page_bytes:
                raise LayoutError(
                    f"KV cache group {g.index}: vLLM's spec says {g.page_bytes} bytes per "
                    f"block and layer, the registered tensors hold {self.paged.page_bytes}"
                )
        lm = self.config.lmcache
        with cpu_placement.threads_started_on(self._background_cpus):  # LMCache's threads and the writer's
            self.store = ChunkStore(lm, self.namespace, self.config.verify_checksums)
            self.writer = StoreWriter(self.store, self.config.store_queue_objects)
        if self.tier_events is not None:
            self.tier_events.watch(self.store, self.writer, lambda: self._gathering is not None)
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
                self.held = HeldObjects(int(lm.max_local_cpu_size * 2**30 / 2))
            self.server = LookupServer(socket_address(self.engine_id), self._answer_lookup, self.reset)
        logger.info(
            "LMCacheHMA worker: %d layers in %d groups (%s), page %d bytes, tiers %s, loads from "
            "CPU memory %s", len(self.layout.layer_names) + len(self.layout.state_layer_names),
            len(self.layout.groups),
            ", ".join(g.kind.value for g in self.layout.groups), self.paged.page_bytes,
            ", ".join(self.store.tiers), "synchronous" if self.held else "asynchronous",
        )

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

    # lookups (the lookup server's thread) ------------------------------------------
    def _answer_lookup(self, req_id: str, lookup: int, first: int, hashes: list[bytes],
                       deadline: Optional[float] = None) -> tuple[int, bool, tuple[str, ...]]:
        """(chunks of ``hashes`` (chunks ``first, ...``) that can be restored, whether their
        objects are now held for ``req_id`` under ``lookup``, the tier each of them is in).

        Wherever they are (CPU memory, disk, Redis), a hit's objects are fetched and verified
        here and held, so the scheduler can promise a synchronous load: no engine step waits
        for the fetch, and a damaged object shortens the hit instead of failing the load.
        Not past the budget (then an asynchronous load), nor when the answer would come
        within ``LATE_S`` (or a quarter of the timeout) of the scheduler's ``deadline``
        (``time.monotonic``; it may have given up on the answer, and nobody would take what
        is held).
        """
        answer = self._find_hit(req_id, lookup, first, hashes, deadline)
        if self.faults:  # TEST ONLY: the answer reaches the scheduler late
            self.faults.delay_answer()
        return answer

    def _find_hit(self, req_id: str, lookup: int, first: int, hashes: list[bytes],
                  deadline: Optional[float]) -> tuple[int, bool, tuple[str, ...]]:
        if self.disabled:
            return 0, False, ()
        if self.held is not None:
            hold = self.held.reuse(req_id, lookup, first, hashes)
            if hold is not None:  # vLLM asks again (it could not allocate): what is held still serves
                return len(hold.hashes), True, hold.tiers
            self.held.release(req_id, lookup - 1)  # a new lookup supersedes the earlier ones
        for _ in range(2):  # a damaged object is dropped by the fetch: look again once
            tiers = self._stored_prefix(hashes)
            chunks = len(tiers)
            if chunks == 0 or self.held is None or (self.faults and self.faults.forces_async):
                return chunks, False, tiers
            refs = hit_objects(first, hashes[:chunks], self.layout.has_sliding, self.layout.has_state)
            sizes = [self._payload_bytes(r.kind, r.chunk) for r in refs]
            if not self.held.room_for(sum(sizes)):
                return chunks, False, tiers
            got = self.store.get_many([(r.kind, r.chunk_hash, size) for r, size in zip(refs, sizes)])
            objects = {(r.kind, r.chunk_hash): pair for r, pair in zip(refs, got) if pair[0] is not None}
            if len(objects) < len(refs):
                release_all(objects)
                continue
            late = min(self.LATE_S, self.config.lookup_timeout_s / 4)
            if deadline is not None and time.monotonic() > deadline - late:
                logger.warning("LMCacheHMA: fetching the hit of %s took until %.2f s before the "
                               "lookup's deadline; not held", req_id, deadline - time.monotonic())
                release_all(objects)
                return chunks, False, tiers
            hold = Hold(lookup, first, tuple(hashes[:chunks]), objects, sum(sizes), tiers)
            return chunks, self.held.hold(req_id, hold), tiers
        return 0, False, ()

    def _stored_prefix(self, hashes: list[bytes]) -> tuple[str, ...]:
        """The tier of each chunk of the longest restorable prefix of ``hashes`` (``longest_hit``):
        where its full-attention object is, or, for the hit's last chunk, the slowest tier of it
        and the boundary objects (sliding tail, recurrent states) a hit there loads. Every kind
        of every chunk is asked in one pass (one round trip to Redis)."""
        boundary_kinds = [k for k, needed in ((ObjectKind.TAIL, self.layout.has_sliding),
                                              (ObjectKind.STATE, self.layout.has_state)) if needed]
        found = self.store.present_kinds((ObjectKind.FULL, *boundary_kinds), hashes)
        boundaries = [all(flags) for flags in zip(*(found[k] for k in boundary_kinds))] if boundary_kinds else None
        chunks = longest_hit(found[ObjectKind.FULL], boundaries)
        tiers = list(found[ObjectKind.FULL][:chunks])
        if chunks:
            tiers[-1] = slowest_tier(tiers[-1], *(found[k][chunks - 1] for k in boundary_kinds))
        return tuple(tiers)

    def reset(self) -> bool:
        """Empty this worker's CPU and disk tiers of this namespace (vLLM's ``reset_prefix_cache``
        with the connector, through the lookup server's thread): held hits first. Stores under
        way (gathered, queued for the writer) may still land after it."""
        if self.held is not None:
            self.held.release_everything()
        if self.tier_events is not None:
            self.tier_events.cleared()
        removed = self.store.clear_local()
        logger.info("LMCacheHMA: cache reset: %d objects removed from CPU memory and disk", removed)
        return True

    def _payload_bytes(self, kind: ObjectKind, chunk: int) -> int:
        return self.layout.payload_bytes(kind, chunk, self.paged.page_bytes)

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
        if meta.reset and not self.serves_lookups:  # rank 0 reset when the scheduler asked
            self.reset()
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

    # loads ------------------------------------------------------------------
    def start_load_kv(self, meta: HMAConnectorMetadata) -> None:
        if meta.loads:  # loads write blocks the last step's gathers may read
            self.finish_gathers()
        if self.held is not None:
            for req_id, up_to in meta.released:
                self.held.release(req_id, up_to)
        for spec in meta.loads:
            if spec.sync:
                self._load_sync(spec)
                continue
            self._finished_loads.add(spec.req_id)
            if not self._try_load(spec):
                self._failed_loads.add(spec.req_id)
                self.stats["loads_failed"] += 1

    def _try_load(self, spec: LoadSpec) -> bool:
        try:
            return self._load(spec)
        except Exception:  # never crash the engine over a cache: recompute instead
            logger.exception("LMCacheHMA: loading %s failed", spec.req_id)
            return False

    def _load_sync(self, spec: LoadSpec) -> None:
        """A synchronous load: vLLM computes the request in this very step, over these blocks.

        A failed attempt is tried once more (the objects fetched again from the store). If
        that fails too, the blocks must not be computed over: for a model with one KV cache
        group they are reported (``failed_blocks``) and vLLM recomputes them; vLLM 0.32 cannot
        recompute blocks of a model with several groups, nor a running request's failed
        receive, so the step is stopped with an error rather than compute tokens from KV
        nothing wrote. The lookup holds only verified objects and the copy path is probed
        at start, so this is the last line of defence, not a path a working store takes.
        """
        if self._try_load(spec):
            return
        self.stats["sync_load_retries"] += 1
        logger.warning("LMCacheHMA: a synchronous load of %s failed; trying once more", spec.req_id)
        if self._try_load(spec):
            return
        self.stats["sync_loads_failed"] += 1
        if self.recomputes_failed_blocks:
            size = self.layout.groups[0].block_size
            blocks = {b for b in spec.block_table[0][spec.start // size: spec.end // size] if b != NULL_BLOCK_ID}
            self._failed_blocks |= blocks
            logger.error("LMCacheHMA: a synchronous load of %s failed twice; its %d blocks are "
                         "reported to vLLM, which recomputes them", spec.req_id, len(blocks))
            return
        raise SyncLoadError(
            f"LMCacheHMA: a synchronous load of request {spec.req_id} (tokens {spec.start}-{spec.end}) "
            f"failed twice; vLLM 0.32 cannot recompute a running request of a model with several KV "
            f"cache groups, so the step stops here instead of computing tokens from unwritten KV"
        )

    def take_failed_blocks(self) -> set[int]:
        """Blocks of failed synchronous loads since the last call (``get_block_ids_with_load_errors``)."""
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def _load(self, spec: LoadSpec) -> bool:
        t0 = time.perf_counter()
        held = (self.held.take(spec.req_id, spec.lookup) if self.held is not None else None) or {}  # key -> (obj, tier)
        fetched, missing, tiers, from_store = [], [], set(), {}
        try:
            if self.faults:
                self.faults.fail_load(spec.sync)
            todo = [ref for ref in spec.objects if (ref.kind, ref.chunk_hash) not in held]
            got = self.store.get_many([(r.kind, r.chunk_hash, self._payload_bytes(r.kind, r.chunk))
                                       for r in todo]) if todo else []
            from_store = {(r.kind, r.chunk_hash): pair for r, pair in zip(todo, got)}
            for ref in spec.objects:
                k = (ref.kind, ref.chunk_hash)
                obj, tier = held.pop(k) if k in held else from_store.pop(k, (None, None))
                if obj is None:
                    missing.append(ref)  # keep going: every damaged object is dropped now
                else:
                    fetched.append((ref, obj))
                    tiers.add(tier)
            if missing:
                logger.warning(
                    "LMCacheHMA: %d of %d objects for %s are gone or damaged (first: %s of chunk "
                    "%d); the request is recomputed", len(missing), len(spec.objects), spec.req_id,
                    missing[0].kind.name, missing[0].chunk,
                )
                return False
            moved = Counter()
            corrupt = self.faults.corruption() if self.faults else None
            copies = []
            for ref, obj in fetched:
                if ref.kind is ObjectKind.STATE:
                    moved[GroupKind.STATE.value] += self._load_state(spec, obj, corrupt)
                    continue
                segments = self.layout.segments(ref.kind, ref.chunk)
                rows = plan_rows(self.layout, segments, spec.block_table, spec.start)
                copies.append((rows, payload_of(flat(obj))))
                for layer in rows.layer_indices:
                    moved[self._kind_of_layer[layer]] += self.paged.page_bytes
            self._scatter(copies)
            if corrupt:
                for rows, _ in copies:
                    self._corrupt(rows, corrupt)
        finally:
            for _, obj in fetched:
                release(obj)
            for obj, _ in [*held.values(), *from_store.values()]:
                if obj is not None:
                    release(obj)  # held or fetched for objects this load did not use
        for kind, n in moved.items():
            self.stats[f"loaded_bytes_{kind}"] += n
        self.stats["loads_ok"] += 1
        self.stats["loads_sync" if spec.sync else "loads_async"] += 1
        self.stats["loaded_tokens"] += spec.end - spec.start
        # the hit's tier: the slowest that served any of its objects
        if tiers:
            self.stats[f"loaded_tokens_{slowest_tier(*tiers)}"] += spec.end - spec.start
        seconds = time.perf_counter() - t0
        self.load_seconds.append((spec.sync, seconds))
        logger.debug("LMCacheHMA: loaded %s tokens [%d, %d) %s in %.1f ms: %s", spec.req_id,
                     spec.start, spec.end, "synchronously" if spec.sync else "asynchronously",
                     1e3 * seconds, dict(moved))
        return True

    # a load of at least this many bytes is scattered by two threads (see _scatter)
    SPLIT_SCATTER_BYTES = 4 << 20

    def _scatter(self, copies: list) -> None:
        """``copy_ops.scatter`` of every ``(rows, payload)``. On the CPU, with CPUs the worker
        is not bound to (``cpus``), a large load is split by bytes between this thread and
        the gather thread, which runs there and is idle during a load (``start_load_kv``
        waited for it): one core moved ~5.5 GB/s here, two ~9 GB/s (numpy's row copies
        release the GIL)."""
        total = sum(len(rows) for rows, _ in copies) * self.paged.page_bytes
        if self.paged.device.type != "cpu":  # one launch for all
            copy_ops.scatter_many(self.paged, copies)
            return
        if not self._background_cpus or total < self.SPLIT_SCATTER_BYTES or len(copies) < 2:
            for rows, payload in copies:
                copy_ops.scatter(self.paged, rows, payload)
            return
        mine, theirs, mine_rows, their_rows = [], [], 0, 0  # rows: pages of page_bytes each
        for rows, payload in sorted(copies, key=lambda c: -len(c[0])):  # largest first, to the lighter side
            if mine_rows <= their_rows:
                mine.append((rows, payload))
                mine_rows += len(rows)
            else:
                theirs.append((rows, payload))
                their_rows += len(rows)
        helper = self._gatherer.submit(lambda: [copy_ops.scatter(self.paged, r, p) for r, p in theirs])
        try:
            for rows, payload in mine:
                copy_ops.scatter(self.paged, rows, payload)
        finally:
            helper.result()

    def _load_state(self, spec: LoadSpec, obj, corrupt) -> int:
        """Scatter a state object into the block vLLM allocated for the hit's boundary in each
        recurrent-state group (``(end - 1) // block_size``; a null block there raises: the
        load fails and vLLM recomputes). Returns the bytes loaded."""
        blocks = [spec.block_table[g.index][g.state_block(spec.end)] for g in self.layout.state_groups]
        self.state.scatter(blocks, payload_of(flat(obj)))
        if corrupt in ("all", GroupKind.STATE.value):  # TEST ONLY, see _corrupt
            from lmcache_hma.testing.faults import state_noise

            self.state.scatter(blocks, state_noise(self.layout))
        return self.layout.state_bytes

    def _corrupt(self, rows, kind: str) -> None:
        """TEST ONLY: overwrite just-loaded blocks of ``kind`` ("all" or a group kind) with noise."""
        from lmcache_hma.testing.faults import corrupt_rows

        corrupt_rows(self.paged, rows, [i for i, layer in enumerate(rows.layer_indices)
                                        if kind in ("all", self._kind_of_layer[layer])])

    # saves ------------------------------------------------------------------
    def wait_for_save(self, meta: HMAConnectorMetadata) -> None:
        """Plan this step's objects and start allocating and gathering them on the gather thread.

        The gather reads blocks vLLM may reuse in the next step (a sliding-window block
        that left the window, a finished or preempted request's blocks), so it must end
        before vLLM writes one of them: the next step's ``before_step`` waits for the
        objects that read a block that step allocated (gathering those not started yet
        itself), and loads wait for all (``start_load_kv``). The others overlap what the
        worker does next (sampling, the next forward) instead of blocking the step.

        Not when vLLM also writes blocks the step's metadata does not name
        (``defer_gathers`` False): it zeroes every newly allocated block, those of requests
        waiting for a load too, for models with recurrent-state layers or KV of mixed
        precision (``KVCacheConfig.needs_kv_cache_zeroing``), and copies recurrent states
        between blocks. Then the gather ends in this call.
        """
        began, self._step_began = self._step_began, False
        if self.disabled:
            return
        jobs = []
        for spec in meta.saves:
            try:
                jobs += self._plan_save(spec)
            except Exception:  # a lost save is only a future miss
                logger.exception("LMCacheHMA: storing KV of %s failed", spec.req_id)
                self.stats["saves_failed"] += 1
        if not jobs:
            return
        self.finish_gathers()  # the last step's, normally done: they had this step's forward
        if self.defer_gathers and not began:  # no barrier before the next step: never defer
            self.defer_gathers = False
            logger.warning("LMCacheHMA: vLLM did not call handle_preemptions before this step's "
                           "forward; stores are gathered in the step from now on")
        if self.defer_gathers:
            # sliding-window tails first, oldest first: their blocks leave the window first
            jobs.sort(key=lambda job: (job.ref.kind is ObjectKind.FULL, job.ref.chunk))
            self._gather_round = jobs
            self._marker = copy_ops.ready_marker(self.paged)  # what the forward queued on its stream
            self._gathering_jobs = deque(jobs)
            self._gathering = self._gatherer.submit(self._gather, self._gathering_jobs)
        else:
            self._marker = None  # gathered on this thread: after what its own stream queued
            self._gather(deque(jobs))
            self._count_outcomes(jobs)

    def finish_gathers(self) -> None:
        """Wait until every object a deferred ``wait_for_save`` planned is gathered (and queued to
        store), gathering those the gather thread has not started meanwhile: the step waits
        anyway, and two cores copy faster than one (see ``_scatter``)."""
        if self._gathering is None:
            return
        t0 = time.perf_counter()
        self._gather(self._gathering_jobs)
        self._gathering.result()
        self._gathering = None
        self.gather_wait_seconds += time.perf_counter() - t0
        self._count_outcomes(self._gather_round)
        self._gather_round = []

    def _count_outcomes(self, jobs: list) -> None:
        for job in jobs:
            if job.outcome is not None:
                self.stats[job.outcome] += 1

    def drain(self) -> None:
        """Wait until everything saved so far is stored (tests, benchmarks)."""
        self.finish_gathers()
        self.writer.drain()

    def _plan_save(self, spec: SaveSpec) -> list:
        """The save's objects to allocate and gather (``_GatherJob``); recurrent states are
        gathered here (vLLM copies states between blocks before the next start_load_kv)."""
        jobs = []
        for ref in spec.objects:
            if ref.kind is ObjectKind.STATE:
                self._save_state(spec, ref)
                continue
            segments = self.layout.segments(ref.kind, ref.chunk)
            rows = plan_rows(self.layout, segments, spec.block_table)
            if len(rows) != self.layout.num_rows(segments):
                logger.debug("LMCacheHMA: %s chunk %d of %s has null blocks; not stored",
                             ref.kind.name, ref.chunk, spec.req_id)
                continue
            kind = GroupKind.FULL if ref.kind is ObjectKind.FULL else GroupKind.SLIDING
            jobs.append(_GatherJob(ref, rows, kind.value, len(rows) * self.paged.page_bytes))
        return jobs

    def _gather(self, jobs: deque) -> None:
        """Run planned gather jobs, taken from ``jobs`` until none is left (the gather thread and
        a step waiting for it take from the same deque). On a GPU all jobs taken are copied in
        one launch (``copy_ops.gather_many``)."""
        while True:
            batch = []
            try:
                batch.append(jobs.popleft())  # atomic: each job runs once
                while self.paged.device.type != "cpu":
                    batch.append(jobs.popleft())
            except IndexError:
                pass
            if not batch:
                return
            self._run_gathers(batch)

    def _run_gathers(self, jobs: list) -> None:
        """Allocate the jobs' objects, gather them and hand them to the writer; ``job.outcome``
        says where not (no room, or it failed: a future miss). Allocation (~40 us an object in
        LMCache) is here, off the step, too. On a GPU the copy waits for the forward's stream
        (``_marker``), not this thread's."""
        objects = []
        try:
            for job in jobs:
                obj = self.store.allocate(job.nbytes)
                if obj is None:
                    job.outcome = "objects_not_stored"
                objects.append(obj)
            copy_ops.gather_many(self.paged, [(job.rows, payload_of(flat(obj)))
                                              for job, obj in zip(jobs, objects) if obj is not None],
                                 after=self._marker)
        except BaseException:
            logger.exception("LMCacheHMA: gathering %d objects (first: %s chunk %d) failed", len(jobs),
                             jobs[0].ref.kind.name, jobs[0].ref.chunk)
            for job, obj in zip(jobs, objects):
                if obj is not None:
                    release(obj)
                    job.outcome = "saves_failed"
        else:
            for job, obj in zip(jobs, objects):
                if obj is not None:
                    self.writer.submit(job.ref.kind, job.ref.chunk_hash, obj, job.label, job.nbytes)
        finally:
            for job in jobs:
                job.done.set()

    def _save_state(self, spec: SaveSpec, ref) -> None:
        """Gather the states vLLM handed off for the boundary at the end of ``ref.chunk``."""
        blocks = spec.state_blocks.get(ref.chunk)
        if blocks is None:
            return
        obj = self.store.allocate(self._payload_bytes(ref.kind, ref.chunk))
        if obj is None:
            self.stats["objects_not_stored"] += 1
            return
        try:
            self.state.gather(blocks, payload_of(flat(obj)))
        except BaseException:
            release(obj)
            raise
        self.writer.submit(ref.kind, ref.chunk_hash, obj, GroupKind.STATE.value, self.layout.state_bytes)

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
        redis = self.store.redis if self.store else None
        if redis is not None:
            for key, n in (("objects_not_shared", redis.not_written), ("redis_protocol_errors", redis.protocol_errors),
                           ("redis_health_errors", redis.health_errors)):
                if n:
                    out[key] = n
        return out

    def _write_stats(self) -> None:
        stats = self.counters()
        if stats == self._stats_written:
            return
        tmp = f"{self.config.stats_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, self.config.stats_file)
        self._stats_written = stats

    def shutdown(self) -> None:
        self.finish_gathers()
        self._gatherer.shutdown(wait=False)
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.held is not None:
            self.held.release_everything()
        if self.writer is not None:
            self.writer.close(_CLOSE_TIMEOUT_S / 2)
        if self.store is not None:
            if self.config.stats_file:
                self._write_stats()
            self.store.close()
            self.store = None


class _GatherJob:
    """One object to allocate and gather: its rows of the paged KV (``plan_rows``), the blocks
    they are in, ``done`` once it is gathered (or not: ``outcome`` names the counter then)."""

    __slots__ = ("ref", "rows", "label", "nbytes", "blocks", "done", "outcome")

    def __init__(self, ref, rows, label: str, nbytes: int) -> None:
        self.ref, self.rows, self.label, self.nbytes = ref, rows, label, nbytes
        self.blocks = frozenset(rows.block_ids)
        self.done = threading.Event()
        self.outcome: Optional[str] = None


class SyncLoadError(RuntimeError):
    """A synchronous load failed and vLLM cannot recompute its blocks (see ``_load_sync``)."""
