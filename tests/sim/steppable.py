"""The worker's threads, made steppable so that one seed decides every interleaving.

* The gather thread (``WorkerHalf._gatherer``) becomes a ``LazyExecutor``: a deferred round
  runs only when the simulator says the thread got the CPU (``run_pending``), or when the
  worker itself waits for it (``finish_gathers``, the next step's barrier taking the jobs it
  needs). Both orders the real thread can produce are drawn; neither depends on the machine.
* The lookup fetch thread (``_lookup_fetcher``) becomes an ``ImmediateExecutor``: a lookup's
  fetch ends before its deadline (the simulated clock has no slow disk; Redis slowness is
  injected at the Redis server instead).
* The store writer thread and LMCache's disk writes are let finish at the end of every step
  (``quiesce``): a store lands before the next step's lookups, which is what a lightly loaded
  engine sees; the "settle" path of a turn end's lookup still runs (the scheduler cannot know).
* The lookup server's thread answers the scheduler while the scheduler waits: its order is the
  scheduler's.
"""

from __future__ import annotations

import time
from concurrent.futures import Future


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


def make_steppable(worker) -> LazyExecutor:
    worker._gatherer.shutdown(wait=True)
    worker._lookup_fetcher.shutdown(wait=True)
    lazy = LazyExecutor()
    worker._gatherer = lazy
    worker._lookup_fetcher = ImmediateExecutor()
    return lazy


def quiesce(worker, timeout_s: float = 30.0) -> None:
    """The store writer has stored what it was given, and LMCache's disk writes have landed."""
    worker.writer.drain()
    deadline = time.monotonic() + timeout_s
    while worker.store.writes_pending():
        if time.monotonic() > deadline:
            raise TimeoutError("disk writes still pending after %.0f s" % timeout_s)
        time.sleep(0.002)
