"""Saves: the blocks a step computed gathered into objects (``wait_for_save``).

Gathers run on the gather thread and end before vLLM writes a block they read (the next
step's ``before_step``, or within the step where vLLM's runner order requires it); the
store writer seals and puts them into the tiers."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional


from lmcache_hma.kv_copy import copy_ops

from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import plan_rows
from lmcache_hma.core.metadata import HMAConnectorMetadata, SaveSpec
from lmcache_hma.core.objects import payload_of
from lmcache_hma.core.turn_ends import MARK_BYTES, encode_marks
from lmcache_hma.store.lmcache_storage import flat, release
from lmcache_hma.log import get_logger


logger = get_logger(__name__)

_LAST_FORWARD = object()  # _run_gathers: after what the last wait_for_save's forward queued

# stored_bytes_<label>: by the group kind an object holds; turn ends (several kinds) apart
_LABELS = {ObjectKind.FULL: GroupKind.FULL.value, ObjectKind.TAIL: GroupKind.SLIDING.value,
           ObjectKind.TURN: "turn_end"}


class _GatherJob:
    """One object to allocate and gather: its rows of the paged KV (``plan_rows``; with
    hma_share_parallel_shapes a part's ``PartCopy``), the blocks they are in, ``done`` once it
    is gathered (or not: ``outcome`` names the counter then)."""

    __slots__ = ("ref", "rows", "label", "nbytes", "blocks", "done", "outcome", "mark", "clears")

    def __init__(self, ref, rows, label: str, nbytes: int) -> None:
        self.ref, self.rows, self.label, self.nbytes = ref, rows, label, nbytes
        self.blocks = frozenset(rows.block_ids)
        self.done = threading.Event()
        self.outcome: Optional[str] = None
        self.clears = None  # the store's generation when planned (ChunkStore.clears): see _planned
        self.mark = None  # a turn end's TURNMARK ref: the marker is written once the turn object is

class Gathers:
    """The ``WorkerHalf`` part that gathers saves.

    Uses the worker's ``layout``, ``paged``, ``state``, ``store``, ``writer`` and ``stats``;
    owns the gather thread's state (``_gatherer``, ``_gathering``, ``_gathering_jobs``,
    ``_gather_round``, ``_marker``, ``_step_began``; set up by ``WorkerHalf.__init__``)."""

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
        self.saves_due = False  # planned now: the gathers and the writer say whether stores are coming
        self.gather_turn_ends(meta)  # a step without a forward calls no handle_preemptions
        if self.disabled:
            return
        with self.reset_fence:  # a reset waits until what this plans is under way (reset_fence)
            if self.built_before_reset(meta, [spec for spec in meta.saves if not spec.finished]):
                return
            self._start_saves(meta, began)

    def _start_saves(self, meta: HMAConnectorMetadata, began: bool) -> None:
        jobs = []
        spare = self._spare_room(meta)
        for spec in meta.saves:
            if spec.finished:
                continue  # gather_turn_ends
            try:
                jobs += self._plan_save(spec, spare)
            except Exception:  # a lost save is only a future miss
                logger.exception("LMCacheHMA: storing KV of %s failed", spec.req_id)
                self.stats["saves_failed"] += 1
        self._planned(jobs)
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

    def gathers_under_way(self) -> bool:
        """Whether the gather thread is still copying a deferred round (a finished round stays
        in ``_gathering`` until the next step's barrier: that is not work under way)."""
        gathering = self._gathering
        return gathering is not None and not gathering.done()

    def gather_for_lookup(self, by: float, objects) -> bool:
        """Gather on the calling thread (a lookup's) the objects among ``objects`` (``(kind,
        digest)`` pairs: the lookup's own) that the deferred round has not started, and wait for
        those another thread is gathering, at most until ``by`` (``time.monotonic()``); whether
        they are all gathered. A prompt repeated right after the step that computed it asks for
        objects that may be neither stored nor queued for the writer yet, only planned on a
        gather thread that has not had the CPU (the eagle3 flake's second path: 0 of 1,792
        tokens cached on a loaded machine, no store wait logged); once gathered they are queued,
        and the lookup's wait on the writer (``_let_land``) finds them. The round's other jobs
        are left to the gather thread: a lookup waits for nothing of other requests'. Any thread
        may run a planned job (the step does for the blocks it reuses: ``_finish_jobs``)."""
        if not self.gathers_under_way():
            return True
        wanted = set(objects)
        own = [job for job in self._gather_round if (job.ref.kind, job.ref.chunk_hash) in wanted]
        for job in own:
            try:
                self._gathering_jobs.remove(job)  # atomic: either thread runs a job, once
            except ValueError:
                continue  # taken by another thread (or of a round before this one)
            self._run_gathers([job])
        for job in own:
            left = by - time.monotonic()
            if left <= 0 or not job.done.wait(left):
                return False
        return True

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

    def gather_turn_ends(self, meta: HMAConnectorMetadata) -> None:
        """Gather the step's turn ends (``SaveSpec.finished``: finished requests' last partial
        chunks, ``scheduler.turn_ends``), in the step's first call to the connector, once.

        vLLM freed those requests' blocks after the last step (unless ``blocks_kept``): this step
        may have given them to other requests, and writes them after its ``handle_preemptions``,
        the first call (``vllm_compat.first_call_before_kv_writes`` says where it is; a step without a
        forward writes nothing). So they are gathered here, on this thread, before anything
        else. Where vLLM keeps the blocks instead, the request is reported in
        ``finished_sending`` once gathered (``take_finished_sending``), at once if it cannot be."""
        if meta is self._turn_ends_of:
            return
        self._turn_ends_of = meta
        specs = [spec for spec in meta.saves if spec.finished]
        self._sending |= {spec.req_id for spec in specs if spec.blocks_kept}
        if not specs or self.disabled:
            return
        with self.reset_fence:
            if not self.built_before_reset(meta, specs):
                self._gather_turn_ends(specs)

    def built_before_reset(self, meta: HMAConnectorMetadata, saves: list) -> bool:
        """Whether ``meta`` was built before a cache reset this worker applied: its ``saves`` hold
        KV computed before it (old weights', or blocks an in-process sleep discarded) and are not
        stored (a turn end's kept blocks are still reported free). Call under ``reset_fence``."""
        if meta.epoch >= self.resets:
            return False
        if saves:
            self.stats["saves_after_reset_dropped"] += len(saves)
            logger.info("LMCacheHMA: %d saves planned before a cache reset are not stored", len(saves))
        return True

    def _gather_turn_ends(self, specs: list) -> None:
        jobs = []
        for spec in specs:
            try:
                jobs += self._plan_save(spec)
            except Exception:  # a lost save is only a future miss
                logger.exception("LMCacheHMA: storing the turn end of %s failed", spec.req_id)
                self.stats["saves_failed"] += 1
        self._planned(jobs)
        if jobs:
            self._run_gathers(jobs, after=None)
            self._count_outcomes(jobs)

    def take_finished_sending(self) -> set[str]:
        """Finished requests whose blocks vLLM kept for their turn end, gathered now (or not to
        be): vLLM may free them (``finished_sending``)."""
        done, self._sending = self._sending, set()
        return done

    def _count_outcomes(self, jobs: list) -> None:
        for job in jobs:
            if job.outcome is not None:
                self.stats[job.outcome] += 1

    def drain(self) -> None:
        """Wait until everything saved so far is stored (tests, benchmarks)."""
        self.finish_gathers()
        self.writer.drain()

    def _spare_room(self, meta: HMAConnectorMetadata) -> bool:
        """Whether this step's tails on speculation (``ObjectRef.spare``) are stored: while every
        local tier is below ``hma_spare_tail_fill`` (``ChunkStore.has_room``: never into a Redis
        alone). Asked once a step, and only when the step has one."""
        if not any(ref.spare for spec in meta.saves for ref in spec.objects):
            return False
        fill = self.config.spare_tail_fill
        return fill > 0 and self.store.has_room(fill)

    def _plan_save(self, spec: SaveSpec, spare: bool = False) -> list:
        """The save's objects to allocate and gather (``_GatherJob``); recurrent states are
        gathered here (vLLM copies states between blocks before the next start_load_kv).
        ``spare``: the tails on speculation too (``_spare_room``), else they are skipped."""
        jobs = []
        for ref in spec.objects:
            if ref.spare and not spare:
                self.stats["spare_tails_skipped"] += 1
                continue
            if ref.kind is ObjectKind.STATE:
                self._save_state(spec, ref)
                continue
            if ref.kind is ObjectKind.TURNMARK:  # after its turn object (turn_ends.turn_end_save)
                # with hma_share_parallel_shapes every rank's marker has the same key: rank 0's serves
                if jobs and jobs[-1].ref.kind is ObjectKind.TURN and (self.canonical is None or self.serves_lookups):
                    jobs[-1].mark = ref
                continue
            if self.canonical is not None:
                jobs += self._plan_parts(spec, ref)
                continue
            segments = self.layout.segments(ref.kind, ref.chunk, ref.end, ref.on_tail)
            rows = plan_rows(self.layout, segments, spec.block_table)
            if len(rows) != self.layout.num_rows(segments):
                logger.debug("LMCacheHMA: %s chunk %d of %s has null blocks; not stored",
                             ref.kind.name, ref.chunk, spec.req_id)
                continue
            jobs.append(_GatherJob(ref, rows, _LABELS[ref.kind], len(rows) * self.paged.page_bytes))
        return jobs

    def _plan_parts(self, spec: SaveSpec, ref) -> list:
        """hma_share_parallel_shapes: the jobs of this rank's parts of ``ref`` (one per KV head,
        ``canonical_objects``), none if a block one needs is null."""
        jobs, nbytes = [], self._payload_bytes(ref.kind, ref.chunk, ref.end)
        for part, head in self._stored_refs([ref]):
            copy = self.canonical.plan(ref.kind, ref.chunk, ref.end, head, spec.block_table)
            if copy is None:
                logger.debug("LMCacheHMA: %s chunk %d of %s has null blocks; not stored",
                             ref.kind.name, ref.chunk, spec.req_id)
                return []
            jobs.append(_GatherJob(part, copy, _LABELS[ref.kind], nbytes))
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

    def _run_gathers(self, jobs: list, after=_LAST_FORWARD) -> None:
        """Allocate the jobs' objects, gather them and hand them to the writer; ``job.outcome``
        says where not (no room, or it failed: a future miss). Allocation (~40 us an object in
        LMCache) is here, off the step, too. On a GPU the copy waits for the forward's stream
        (``_marker``, or ``after``), not this thread's."""
        objects = []
        try:
            for job in jobs:
                obj = self.store.allocate(job.nbytes)
                if obj is None:
                    job.outcome = "objects_not_stored"
                objects.append(obj)
            copies = [(job.rows, payload_of(flat(obj))) for job, obj in zip(jobs, objects) if obj is not None]
            if self.canonical is not None:  # hma_share_parallel_shapes: every job is a part's
                for copy, payload in copies:
                    self.canonical.gather(copy, payload, after=self._marker if after is _LAST_FORWARD else after)
            else:
                copy_ops.gather_many(self.paged, copies, after=self._marker if after is _LAST_FORWARD else after)
        except BaseException:
            logger.exception("LMCacheHMA: gathering %d objects (first: %s chunk %d) failed", len(jobs),
                             jobs[0].ref.kind.name, jobs[0].ref.chunk)
            for job, obj in zip(jobs, objects):
                if obj is not None:
                    release(obj)
                    job.outcome = "saves_failed"
        else:
            # A marker names only a turn object on its way to the store: every part of it queued
            # (hma_share_parallel_shapes: one job a part, consecutive, the marker on the last).
            parts_queued = True
            for job, obj in zip(jobs, objects):
                queued = obj is not None and self.writer.submit(job.ref.kind, job.ref.chunk_hash, obj,
                                                                job.label, job.nbytes, job.clears,
                                                                ref=job.ref if self.canonical is None else None)
                if job.ref.kind is not ObjectKind.TURN:
                    continue
                parts_queued = parts_queued and queued
                if job.mark is not None:
                    if parts_queued:
                        self._write_mark(job.mark, job.clears)
                    parts_queued = True  # the next turn object's parts
        finally:
            for job in jobs:
                job.done.set()

    def _planned(self, jobs: list) -> None:
        """Stamp the jobs planned now (under ``reset_fence``) with the store's generation: KV read
        before a cache reset goes to no local tier, whenever the writer puts it
        (``ChunkStore.commit_many``; the reset moves the generation under the same lock)."""
        for job in jobs:
            job.clears = self.store.clears

    def _write_mark(self, ref, clears: Optional[int] = None) -> None:
        """Rewrite the marker after chunk ``ref.chunk - 1`` with the turn end at ``ref.end``
        added (``core.turn_ends``); queued after the turn object it names, and only once that
        was queued: a turn object the writer dropped is named by no marker, this one nor a later
        rewrite after the same chunk (its offset is never recorded)."""
        offset = ref.end - ref.chunk * self.layout.chunk_size
        offsets = self.turn_marks.add(ref.chunk_hash, -offset if ref.on_tail else offset)
        obj = self.store.allocate(MARK_BYTES)
        if obj is None:
            self.stats["objects_not_stored"] += 1
            return
        encode_marks(offsets, payload_of(flat(obj)))
        self.writer.submit(ObjectKind.TURNMARK, ref.chunk_hash, obj, _LABELS[ObjectKind.TURN], MARK_BYTES, clears,
                           ref=ref)

    def _save_state(self, spec: SaveSpec, ref) -> None:
        """Gather the states vLLM handed off for the boundary at the end of ``ref.chunk`` (or a
        finished request's running states at its turn end, ``ref.end``)."""
        blocks = spec.state_blocks.get(ref.chunk)
        if blocks is None:
            return
        label = _LABELS[ObjectKind.TURN] if ref.end else GroupKind.STATE.value  # a turn end's states
        nbytes = self._payload_bytes(ref.kind, ref.chunk)
        for part, shard in self._stored_refs([ref]):  # the object, or this rank's shards of it
            obj = self.store.allocate(nbytes)
            if obj is None:
                self.stats["objects_not_stored"] += 1
                return
            try:
                if shard is None:
                    self.state.gather(blocks, payload_of(flat(obj)))
                else:  # hma_share_parallel_shapes
                    self.canonical.states.gather(blocks, shard, payload_of(flat(obj)))
            except BaseException:
                release(obj)
                raise
            self.writer.submit(ref.kind, part.chunk_hash, obj, label,
                               self.layout.state_bytes if shard is None else nbytes, ref=ref if shard is None else None)
