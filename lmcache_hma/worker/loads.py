"""Loads: the objects of a hit scattered into vLLM's blocks (``start_load_kv``).

A synchronous load scatters the objects the lookup already fetched, verified and held; a
failed one is retried once, then its blocks are recomputed (one group) or the step stops
(``SyncLoadError``). An asynchronous load fetches and verifies every object of a request
first, then scatters; any miss or failed check makes the request a failed receive."""

from __future__ import annotations

import time
from collections import Counter
from typing import Optional


from lmcache_hma.kv_copy import copy_ops

from lmcache_hma.core.kinds import GroupKind, ObjectKind, slowest_tier
from lmcache_hma.core.layout import NULL_BLOCK_ID, LayoutError, plan_rows
from lmcache_hma.core.metadata import HMAConnectorMetadata, LoadSpec
from lmcache_hma.core.objects import payload_of
from lmcache_hma.store.lmcache_storage import flat, release, retain
from lmcache_hma.log import get_logger


logger = get_logger(__name__)


class SyncLoadError(RuntimeError):
    """A synchronous load failed and vLLM cannot recompute its blocks (see ``_load_sync``)."""

class Loads:
    """The ``WorkerHalf`` part that loads hits.

    Uses the worker's ``layout``, ``paged``, ``state``, ``store``, ``held``, ``stats`` and
    ``faults``; owns ``_finished_loads``, ``_failed_loads`` and ``_failed_blocks`` (set up by
    ``WorkerHalf.__init__``)."""

    def start_load_kv(self, meta: HMAConnectorMetadata) -> None:
        self.gather_turn_ends(meta)  # before a load writes a block their requests gave back
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

    def _take_held(self, spec: LoadSpec) -> dict:
        """The objects the lookup of ``spec`` holds for it, ``{(kind, digest): (obj, tier)}``
        (the caller releases them)."""
        return (self.held.take(spec.req_id, spec.lookup) if self.held is not None else None) or {}

    def _try_load(self, spec: LoadSpec, held: Optional[dict] = None) -> bool:
        try:
            return self._load(spec, held)
        except Exception:  # never crash the engine over a cache: recompute instead
            logger.exception("LMCacheHMA: loading %s failed", spec.req_id)
            return False

    def _load_sync(self, spec: LoadSpec) -> None:
        """A synchronous load: vLLM computes the request in this very step, over these blocks.

        A failed attempt is tried once more, with the objects the lookup held (each attempt has
        a reference of its own: a cache reset between the step's scheduling and this load keeps
        them for it, while the store may no longer have them) and the rest fetched from the
        store again. If that fails too, the blocks must not be computed over: for a model with
        one KV cache group they are reported (``failed_blocks``) and vLLM recomputes them; vLLM
        0.32 cannot recompute blocks of a model with several groups, nor a running request's
        failed receive, so the step is stopped with an error rather than compute tokens from KV
        nothing wrote. The lookup holds only verified objects and the copy path is probed at
        start, so this is the last line of defence, not a path a working store takes.
        """
        held = self._take_held(spec)
        for obj, _ in held.values():
            retain(obj)  # the retry's reference
        if self._try_load(spec, dict(held)):
            for obj, _ in held.values():
                release(obj)  # no retry
            return
        self.stats["sync_load_retries"] += 1
        logger.warning("LMCacheHMA: a synchronous load of %s failed; trying once more", spec.req_id)
        if self._try_load(spec, held):
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

    def _load(self, spec: LoadSpec, held: Optional[dict] = None) -> bool:
        """Scatter ``spec``'s objects: those of ``held`` (default: what its lookup holds), the rest
        fetched from the store. Releases every object it is given or fetches, whatever happens."""
        t0 = time.perf_counter()
        held = self._take_held(spec) if held is None else held  # key -> (obj, tier)
        fetched, missing, tiers, from_store = [], [], set(), {}
        try:
            if self.faults:
                self.faults.fail_load(spec.sync)
            objects = self._stored_refs(spec.objects)  # (ref, KV head of a part, or None)
            todo = [ref for ref, _ in objects if (ref.kind, ref.chunk_hash) not in held]
            got = self.store.get_many([(r.kind, r.chunk_hash, self._payload_bytes(r.kind, r.chunk, r.end, r.on_tail))
                                       for r in todo]) if todo else []
            from_store = {(r.kind, r.chunk_hash): pair for r, pair in zip(todo, got)}
            for ref, head in objects:
                k = (ref.kind, ref.chunk_hash)
                obj, tier = held.pop(k) if k in held else from_store.pop(k, (None, None))
                if obj is None:
                    missing.append(ref)  # keep going: every damaged object is dropped now
                else:
                    fetched.append((ref, obj, head))
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
            for ref, obj, head in fetched:
                if ref.kind is ObjectKind.STATE:
                    moved[GroupKind.STATE.value] += self._load_state(spec, obj, corrupt, head)
                    continue
                if head is not None:  # hma_share_parallel_shapes: a KV head's part
                    copies.append(self._plan_part(spec, ref, head, payload_of(flat(obj)), moved))
                    continue
                segments = self.layout.segments(ref.kind, ref.chunk, ref.end, ref.on_tail)
                rows = plan_rows(self.layout, segments, spec.block_table, spec.start)
                copies.append((rows, payload_of(flat(obj))))
                for layer in rows.layer_indices:
                    moved[self._kind_of_layer[layer]] += self.paged.page_bytes
            self._scatter(copies)
            if corrupt:
                for rows, payload in copies:
                    self._corrupt(rows, corrupt, payload)
        finally:
            for _, obj, _ in fetched:
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

    def _plan_part(self, spec: LoadSpec, ref, head: int, payload, moved: Counter) -> tuple:
        """``(canonical_objects.PartCopy, payload)`` of KV head ``head``'s part of ``ref`` into the hit's blocks (a
        null block where it needs one raises: the load fails and vLLM recomputes)."""
        copy = self.canonical.plan_load(ref.kind, ref.chunk, ref.end, head, spec.block_table, spec.start)
        if copy is None:
            raise LayoutError(f"{ref.kind.name} chunk {ref.chunk}: a block the load needs is null")
        for seg in copy.segments:
            moved[self.layout.groups[seg.group].kind.value] += seg.nbytes
        return copy, payload

    # a load of at least this many bytes is scattered by two threads (see _scatter)
    SPLIT_SCATTER_BYTES = 4 << 20

    def _scatter(self, copies: list) -> None:
        """``copy_ops.scatter`` of every ``(rows, payload)``. On the CPU, with CPUs the worker
        is not bound to (``cpu_placement``), a large load is split by bytes between this
        thread and the gather thread, which runs there and is idle during a load
        (``start_load_kv`` waited for it): numpy's row copies release the GIL, so two cores
        copy nearly twice as fast as one."""
        if self.canonical is not None:  # hma_share_parallel_shapes: every copy is a part's
            for copy, payload in copies:
                self.canonical.scatter(copy, payload)
            return
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

    def _load_state(self, spec: LoadSpec, obj, corrupt, shard=None) -> int:
        """Scatter a state object (with hma_share_parallel_shapes: this rank's part ``shard`` of it)
        into the block vLLM allocated for the hit's boundary in each recurrent-state group
        (``(end - 1) // block_size``; a null block there raises: the load fails and vLLM
        recomputes). Returns the bytes loaded."""
        blocks = [spec.block_table[g.index][g.state_block(spec.end)] for g in self.layout.state_groups]
        if shard is not None:
            payload = payload_of(flat(obj))
            self.canonical.states.scatter(blocks, shard, payload)
            if corrupt in ("all", GroupKind.STATE.value):  # TEST ONLY, see _corrupt
                from lmcache_hma.worker.faults import noise_like

                self.canonical.states.scatter(blocks, shard, noise_like(payload))
            return payload.numel() * payload.element_size()
        self.state.scatter(blocks, payload_of(flat(obj)))
        if corrupt in ("all", GroupKind.STATE.value):  # TEST ONLY, see _corrupt
            from lmcache_hma.worker.faults import state_noise

            self.state.scatter(blocks, state_noise(self.layout))
        return self.layout.state_bytes

    def _corrupt(self, rows, kind: str, payload) -> None:
        """TEST ONLY: overwrite just-loaded blocks of ``kind`` ("all" or a group kind) with noise."""
        from lmcache_hma.worker.faults import corrupt_part, corrupt_rows

        if self.canonical is not None:  # hma_share_parallel_shapes: a part's copy
            corrupt_part(self.canonical, rows, self.layout, kind, payload)
            return
        corrupt_rows(self.paged, rows, [i for i, layer in enumerate(rows.layer_indices)
                                        if kind in ("all", self._kind_of_layer[layer])])
