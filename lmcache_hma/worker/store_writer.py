"""Stores off the engine's step: seal (CRC32/MAC) and put on a background thread.

Runs in the worker. The step only gathers KV into newly allocated objects (it
must: sliding-window blocks are reused right after it); ``StoreWriter`` then
seals each object and hands it to LMCache's tiers on its own thread, what queued
together in one put (one pipelined round trip to Redis). The queue
is bounded: when it is full the object is dropped (a future miss, counted),
never waited for. ``close`` drains what is queued within a timeout, then drops
the rest.

Every object queued gets the next number (1, 2, ...); the writer takes them in that order and
counts, after each batch, the objects up to its last number as landed (stored, or lost: a
failed put, a shutdown). ``wait_stored`` waits for the objects it names (a turn end's marker:
the number it was queued under), or without names for those queued before it, never for the
queue to empty: on a busy server it rarely does.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from typing import Callable, Iterable, NamedTuple, Optional

from lmcache_hma.log import get_logger
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import release

logger = get_logger(__name__)

_STOP = object()
TURN_END_LABEL = "turn_end"  # gathers._LABELS[TURN]: the label of every part of a turn end (object, states, marker)


class _Queued(NamedTuple):
    number: int  # its place in the order objects were queued (1, 2, ...)
    clears: int  # the store's generation when its KV was read: ChunkStore.commit_many
    kind: ObjectKind
    chunk_hash: bytes
    obj: object
    label: str
    nbytes: int
    ref: object  # its ObjectRef (its lineage for the store's eviction), None for a part of one


class StoreWriter:
    BATCH_OBJECTS = 64  # objects per put at most

    def __init__(self, store: ChunkStore, max_queued: int, on_committed: Optional[Callable[[], None]] = None,
                 shared: bool = True):
        """``on_committed`` runs on the writer's thread after each batch is counted (the worker
        rewrites its stats file then: an engine gone idle runs no step that would). Not
        ``shared``: objects go to the local tiers only (``ChunkStore.commit_many``)."""
        self._store = store
        self.shared = shared
        self._on_committed = on_committed
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._counts: Counter = Counter()  # objects_stored, stored_bytes_<kind>, objects_dropped,
        # objects_not_stored (no tier took them), saves_failed
        self._lock = threading.Lock()
        # objects 1.._queued were queued, 1.._landed are stored or lost; _landed_cv guards both
        self._landed_cv = threading.Condition()
        self._queued = 0
        self._landed = 0
        # (kind, digest) -> the number of the last object queued under it, while not landed;
        # _numbered: those entries in queue order, to forget them as they land
        self._numbers: dict[tuple[ObjectKind, bytes], int] = {}
        self._numbered: deque = deque()
        self._store_seconds: list = []  # seal + put per stored object; taken by lmcache_hma.metrics
        self._thread = threading.Thread(target=self._run, name="lmcache-hma-writer", daemon=True)
        self._thread.start()

    def counts(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def take_store_seconds(self) -> list:
        """Seconds each object's seal and put took, since the last call."""
        with self._lock:
            taken, self._store_seconds = self._store_seconds, []
        return taken

    def _count(self, **increments: int) -> None:
        with self._lock:
            self._counts.update(increments)

    def submit(self, kind: ObjectKind, chunk_hash: bytes, obj, label: str, nbytes: int,
               clears: Optional[int] = None, ref=None) -> bool:
        """Queue a filled object for sealing and storing; takes the reference. False: dropped.

        ``label`` and ``nbytes`` feed the ``stored_bytes_<label>`` counter once it is stored.
        ``clears``: the store's generation when its KV was read (``ChunkStore.clears``; None: now):
        after a later cache reset it goes to no local tier. ``ref``: the object's ``ObjectRef``
        (where it sits in its prefix: ``ChunkStore.commit_many``), if it is one.
        """
        clears = self._store.clears if clears is None else clears
        with self._landed_cv:  # numbered and queued at once: the numbers follow the queue's order
            try:
                self._queue.put_nowait(_Queued(self._queued + 1, clears, kind, chunk_hash, obj, label,
                                               nbytes, ref))
                self._queued += 1
                self._numbers[(kind, chunk_hash)] = self._queued
                self._numbered.append((self._queued, (kind, chunk_hash)))
                return True
            except queue.Full:
                pass
        release(obj)
        self._count(objects_dropped=1)
        if self.counts()["objects_dropped"] == 1:
            logger.warning("LMCacheHMA: the store queue is full; objects are dropped (future "
                           "misses) rather than wait. Raise hma_store_queue_objects if it recurs")
        return False

    def _run(self) -> None:
        while True:
            try:
                if self._run_once():
                    return
            except Exception:  # never lose the thread: what failed is only future misses
                logger.exception("LMCacheHMA: the store writer failed on a batch; it goes on")
                self._count(writer_errors=1)

    def _run_once(self) -> bool:
        """Store one batch of what is queued; True once asked to stop."""
        batch = [self._queue.get()]
        while len(batch) < self.BATCH_OBJECTS:  # what queued meanwhile goes in the same put
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        stop = any(item is _STOP for item in batch)
        items = [item for item in batch if item is not _STOP]
        try:
            if items:
                self._commit(items)
        except Exception:
            # Not released here: _commit hands the references to the store, which gives them
            # back itself (ChunkStore.commit_many); a second release would free live objects.
            self._count(saves_failed=len(items))
            raise
        finally:
            if items:  # taken in queue order: the last has the highest number
                self._landed_up_to(items[-1].number)
            for _ in batch:
                self._queue.task_done()
        return stop

    def _landed_up_to(self, number: int) -> None:
        """Objects up to ``number`` are stored or lost: wake the ``wait_stored`` calls."""
        with self._landed_cv:
            self._landed = max(self._landed, number)
            while self._numbered and self._numbered[0][0] <= self._landed:
                n, key = self._numbered.popleft()
                if self._numbers.get(key) == n:
                    del self._numbers[key]
            self._landed_cv.notify_all()

    def _commit(self, items: list) -> None:
        """Seal and put a batch (one pipelined round trip to Redis); a failure loses only it."""
        try:
            t0 = time.perf_counter()
            taken = self._store.commit_many([(item.kind, item.chunk_hash, item.obj) for item in items], self.shared,
                                            clears=[item.clears for item in items], refs=[item.ref for item in items],
                                            expires=[item.label == TURN_END_LABEL for item in items])
            per_object = (time.perf_counter() - t0) / len(items)
        except Exception:  # a lost store is only a future miss
            logger.exception("LMCacheHMA: storing %d objects (first: %s chunk %s) failed", len(items),
                             items[0].kind.name, items[0].chunk_hash.hex()[:16])
            self._count(saves_failed=len(items))
            return
        stored: Counter = Counter()
        for item, took in zip(items, taken):
            if took:
                stored["objects_stored"] += 1
                stored[f"stored_bytes_{item.label}"] += item.nbytes
            else:  # no tier took it (a disk-only store whose tier refused it): never stored
                stored["objects_not_stored"] += 1
        with self._lock:
            self._counts.update(stored)
            self._store_seconds.extend([per_object] * len(items))
        if self._on_committed is not None:
            try:
                self._on_committed()
            except Exception:  # the batch is stored; a failing listener (e.g. an unwritable stats file) is not the writer's
                logger.warning("LMCacheHMA: after storing a batch, its listener failed", exc_info=True)

    def pending(self) -> int:
        """Objects queued or being stored (not yet in the tiers, nor dropped)."""
        return self._queue.unfinished_tasks

    def drain(self) -> None:
        """Wait until everything queued so far is stored (tests, benchmarks)."""
        self._queue.join()

    def wait_stored(self, by: Optional[float], objects: Optional[Iterable[tuple[ObjectKind, bytes]]] = None) -> bool:
        """Wait until the objects queued under ``objects`` (``(kind, digest)`` pairs: a turn end's
        marker) before this call are stored (or lost: a failed put, a shutdown), at most until
        ``by`` (``time.monotonic()``; None: no limit); whether they are. Pairs with nothing
        queued (landed already, never queued) need no wait. ``objects`` None: every object
        queued before this call.

        Objects queued meanwhile are not waited for, nor, with ``objects``, any other object
        queued before: a lookup that lets a turn end land first waits for that turn end's own
        put (and the puts queued ahead of it), not for the writer's backlog behind it."""
        with self._landed_cv:
            if objects is None:
                wanted = self._queued
            else:
                wanted = max((self._numbers.get(key, 0) for key in objects), default=0)
            while self._landed < wanted:
                left = None if by is None else by - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._landed_cv.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Store what is queued within ``timeout_s``, drop the rest, stop the thread."""
        finished = threading.Event()
        waiter = threading.Thread(target=lambda: (self._queue.join(), finished.set()), daemon=True)
        waiter.start()
        if not finished.wait(timeout_s):
            dropped = 0
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    release(item.obj)
                    dropped += 1
                    self._count(objects_dropped=1)
                    self._landed_up_to(item.number)
                self._queue.task_done()
            logger.warning("LMCacheHMA: %d queued stores dropped at shutdown", dropped)
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
