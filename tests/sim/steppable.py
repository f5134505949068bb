"""The worker's threads, made steppable so that one seed decides every interleaving.

* The gather thread (``WorkerHalf._gatherer``) becomes a ``LazyExecutor``: a deferred round
  runs only when the simulator says the thread got the CPU (``run_pending``), or when the
  worker itself waits for it (``finish_gathers``, the next step's barrier taking the jobs it
  needs). Both orders the real thread can produce are drawn; neither depends on the machine.
* The lookup fetch thread (``_lookup_fetcher``) becomes a ``LateExecutor``: a lookup's fetch
  ends before its deadline, or, where the seed says the fetch is slow, the lookup's wait for it
  times out at once (the hit is loaded asynchronously) and the fetch itself runs later, when
  the simulator lets it (``run_late``): after the step, or after a reset that came meanwhile.
* The store writer's thread is stopped (``WriterSteps``): what is queued lands a batch at a
  time when the simulator lets it (at the end of a step: all, one batch or none, drawn), when a
  lookup waits for objects (``wait_stored`` lands what is queued up to the numbers waited for,
  as the thread would while the lookup waits), and when a reset polls ``pending``. So lookups
  meet a backlog, and every wait is recorded with what it made land (invariant (c)).
  LMCache's disk writes land after each batch and at the end of every step (``quiesce``).
* The lookup server's thread answers the scheduler while the scheduler waits: its order is the
  scheduler's. Where the seed says an answer comes late (``LateAnswers``), the worker answers
  and the scheduler's client takes its path for a reply past the deadline.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout


class LazyFuture(Future):
    def __init__(self, fn, args, kwargs):
        super().__init__()
        self._call = (fn, args, kwargs)

    def run_now(self) -> None:
        if self._call is None:
            return
        fn, args, kwargs = self._call
        self._call = None
        try:
            self.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # surfaced where the worker reads the result
            self.set_exception(exc)

    def result(self, timeout=None):
        self.run_now()
        return super().result(timeout)


class LazyExecutor:
    def __init__(self):
        self.pending: list[LazyFuture] = []

    def submit(self, fn, *args, **kwargs):
        f = LazyFuture(fn, args, kwargs)
        self.pending.append(f)
        return f

    def run_pending(self) -> int:
        n = 0
        while self.pending:
            self.pending.pop(0).run_now()
            n += 1
        return n

    def shutdown(self, wait=True, cancel_futures=False):
        self.run_pending()


class ImmediateExecutor:
    def submit(self, fn, *args, **kwargs):
        f = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            f.set_exception(exc)
        return f

    def shutdown(self, wait=True, cancel_futures=False):
        pass


class LateFuture(LazyFuture):
    """A fetch the lookup stopped waiting for: it runs when the simulator says (``run_now``)."""

    def result(self, timeout=None):
        if self._call is not None and timeout is not None:
            raise FutureTimeout()
        return super().result(timeout)


class ReadFirstFuture(LateFuture):
    """A late fetch whose reads ran when it was made; only keeping what it read from disk or
    Redis in CPU memory (``ChunkStore._keep_in_memory``) and its end come late, when the
    simulator says: a read that a cache reset overtakes between the two."""

    def __init__(self, fn, args, kwargs, store):
        super().__init__(fn, args, kwargs)
        from lmcache_hma.store.lmcache_storage import retain

        kept = []

        def record(key, obj, clears):
            retain(obj)  # (the caller releases its own reference meanwhile)
            kept.append((key, obj, clears))
        store._keep_in_memory = record
        try:
            self._outcome = (fn(*args, **kwargs), None)
        except BaseException as exc:  # surfaced where the worker reads the result
            self._outcome = (None, exc)
        finally:
            del store._keep_in_memory
        self._store, self._kept = store, kept

    def run_now(self) -> None:
        if self._call is None:
            return
        from lmcache_hma.store.lmcache_storage import release

        self._call = None
        for key, obj, clears in self._kept:
            try:
                self._store._keep_in_memory(key, obj, clears)
            finally:
                release(obj)
        value, exc = self._outcome
        if exc is not None:
            self.set_exception(exc)
        else:
            self.set_result(value)


class LateExecutor:
    """The lookup fetch thread: a fetch ends at once, or (``late_next`` set by the simulator for
    the next fetch) after the lookup stopped waiting for it: all of it late, or (``read_first``)
    its reads at once and the rest late."""

    def __init__(self, store=None):
        self.store = store
        self.late_next = False
        self.read_first = False
        self.fired = 0  # fetches made late so far
        self.late: list[LateFuture] = []

    def submit(self, fn, *args, **kwargs):
        if not self.late_next:
            return ImmediateExecutor().submit(fn, *args, **kwargs)
        self.late_next = False
        self.fired += 1
        if self.read_first and self.store is not None:
            f = ReadFirstFuture(fn, args, kwargs, self.store)
        else:
            f = LateFuture(fn, args, kwargs)
        self.late.append(f)
        return f

    def run_late(self) -> int:
        n = 0
        while self.late:
            self.late.pop(0).run_now()
            n += 1
        return n

    def shutdown(self, wait=True, cancel_futures=False):
        self.run_late()


class WriterSteps:
    """The store writer without its thread: the simulator (``land``), a lookup's wait
    (``wait_stored``) and a reset's poll (``pending``) make its queue land, in queue order, a
    batch at a time, as the thread would. ``waits``: per ``wait_stored`` call, (the highest
    number it waited for, the highest number landed because of it, the highest number among the
    objects then queued under ``own_hashes``: the asking lookup's chunks, set by the simulator,
    queued before the lookup or by its own gathers, ``Gathers.gather_for_lookup``)."""

    def __init__(self, writer):
        from lmcache_hma.worker import store_writer

        self.w = writer
        writer._queue.put(store_writer._STOP)
        writer._thread.join(30)
        assert not writer._thread.is_alive(), "the store writer's thread did not stop"
        self.waits: list[tuple[int, int, int]] = []
        self.own_hashes: set = set()
        self.polls = 0
        self.on_land = None  # called with each batch before it is put (the simulator's check)
        self._wait_stored = writer.wait_stored
        self._close = writer.close
        self._pending = writer.pending
        writer.wait_stored = self.wait_stored
        writer.pending = self.pending
        writer.drain = self.land_all
        writer.close = self.close

    def queued(self) -> list:
        """What is queued, in order (``store_writer._Queued``)."""
        return list(self.w._queue.queue)

    def land_batch(self) -> int:
        """One batch (the writer's ``BATCH_OBJECTS`` at most) stored; the number of objects."""
        w = self.w
        items = []
        while len(items) < w.BATCH_OBJECTS:
            try:
                items.append(w._queue.get_nowait())
            except Exception:  # queue.Empty
                break
        if not items:
            return 0
        try:
            if self.on_land is not None:
                self.on_land(items)
            w._commit(items)
            _disk_writes_landed(w._store)  # LMCache writes files on its own threads: let them land
        finally:
            w._landed_up_to(items[-1].number)
            for _ in items:
                w._queue.task_done()
        return len(items)

    def land_all(self) -> None:
        while self.land_batch():
            pass

    def land_up_to(self, number: int) -> None:
        while self.w._landed < number and self.land_batch():
            pass

    def wait_stored(self, by, objects=None) -> bool:
        w = self.w
        with w._landed_cv:
            if objects is None:
                wanted = w._queued
            else:
                wanted = max((w._numbers.get(key, 0) for key in objects), default=0)
        own = max((q.number for q in self.queued() if q is not None and getattr(q, "chunk_hash", None)
                   in self.own_hashes), default=0)
        before = w._landed
        self.land_up_to(wanted)
        self.waits.append((wanted, w._landed if w._landed > before else 0, own))
        return self._wait_stored(by, objects)

    def pending(self) -> int:
        """A reset polls this while it waits for stores under way: the thread runs meanwhile."""
        if self._pending():
            self.polls += 1
            self.land_batch()
        return self._pending()

    def close(self, timeout_s: float) -> None:
        self.land_all()
        self._close(timeout_s)


class _LateReply:
    """A lookup socket whose reply reaches the scheduler after the lookup's deadline."""

    def __init__(self, sock, zmq):
        self.sock, self.zmq = sock, zmq

    def send(self, *args, **kwargs):
        return self.sock.send(*args, **kwargs)

    def setsockopt(self, *args):
        return self.sock.setsockopt(*args)

    def recv(self, *args, **kwargs):
        self.sock.recv(*args, **kwargs)  # the worker answered (and holds what it fetched)
        raise self.zmq.Again("the answer came after the lookup's deadline (simulated)")

    def close(self, *args):
        return self.sock.close(*args)


class LateAnswers:
    """The scheduler's lookup client, whose next answer the simulator may make come late
    (``late_next``): the worker answers and holds what it fetched for the lookup, the scheduler
    takes the client's own path for a reply past its deadline (the socket closed, a miss, a
    back-off), and the back-off's time is taken as passed (the simulated clock: ``passed``)."""

    def __init__(self, client):
        self.client = client
        self.late_next = False
        self.fired = 0  # answers made late so far
        real_socket = client._socket

        def socket():
            sock = real_socket()
            if not self.late_next:
                return sock
            self.late_next = False
            self.fired += 1
            return _LateReply(sock, client._zmq)
        client._socket = socket

    def passed(self) -> None:
        self.client._quiet_until = time.monotonic()


def make_steppable(worker) -> tuple[LazyExecutor, LateExecutor, WriterSteps]:
    worker._gatherer.shutdown(wait=True)
    worker._lookup_fetcher.shutdown(wait=True)
    lazy, late = LazyExecutor(), LateExecutor(worker.store)
    worker._gatherer = lazy
    worker._lookup_fetcher = late
    return lazy, late, WriterSteps(worker.writer)


def quiesce(worker, timeout_s: float = 30.0) -> None:
    """LMCache's disk writes have landed."""
    _disk_writes_landed(worker.store, timeout_s)


def _disk_writes_landed(store, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while store.writes_pending():
        if time.monotonic() > deadline:
            raise TimeoutError("disk writes still pending after %.0f s" % timeout_s)
        time.sleep(0.002)
