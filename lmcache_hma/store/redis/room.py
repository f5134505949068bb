"""Room in a Redis under ``maxmemory``, made by the writer: prefix-closed, by value per byte.

Redis evicts keys one at a time, by its own sampled LRU or LFU: neither knows that a hit needs
every chunk of a prefix and the tail it ends at (dropping a middle chunk leaves the rest kept
but unreachable), nor what an object is worth per byte (a tail read by every request and a turn
end nobody extends count alike), and it can drop one key of an object's two. Measured on the
RAG trace of ``benchmarks/bench_capacity.py`` with Redis at the goal's size, ``allkeys-lfu``
served 0.63-0.71x the hit tokens of an unbounded tier where the CPU tier's value policy served
0.88x: its counters barely move (``lfu-log-factor`` 10: 5-7 for every key of the run; 0 or 1
did no better), so it picks among near equals, and the most read document missed 4 times.

So before a write would take Redis past its ``maxmemory`` (``INFO memory``, asked before each
write batch), the writer deletes objects first, both keys of each, chosen by the local tiers'
policy (``value_policy.ValuePolicy``) over the objects this instance knows are in Redis: those
it wrote and those its hits read or touched, each with its place in its prefix (``Lineage``).
Leaves go first, by value per byte, and with them the chain of chunks only a dropped tail
needed. Redis's own eviction stays as the backstop: for what other instances wrote and this one
never read, and for an estimate that fell short.

In a fleet each instance makes room for its own writes from what it knows: a chunk another
instance extended with objects this one never saw may look like a leaf here. Such a delete costs
the other's next hit through it a recompute (which writes it again), never a wrong token; an
object whose parent this instance does not know of is never judged an orphan (another instance
may hold the parent).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

from lmcache_hma.store.redis.wire import redis_bytes
from lmcache_hma.store.value_policy import Lineage, ValuePolicy

KEY_BYTES = 512  # per object: two keys, their dict entries and Redis objects
# What writing takes beyond ``wire.redis_bytes`` (jemalloc's classes, which the values are fitted
# to): a Redis on another allocator (libc's rounds a large allocation up to its pages and a header)
FOOTPRINT_MARGIN = 1 / 32


class RedisRoom:
    """The objects this instance knows are in one Redis, ranked by ``ValuePolicy``; thread-safe
    (the store's writer makes room, its lookups and loads report reads)."""

    KNOWN = 1 << 18  # objects remembered (the least recently used go first: then unknown here)

    def __init__(self, lineage: Lineage, boundary_hits: bool) -> None:
        self.lineage = lineage
        # a parent it does not know of may be there (elsewhere); never an object others need (no
        # fallback): Redis's own eviction is behind it
        self.policy = ValuePolicy(lineage, kind_of=lambda key: None, boundary_hits=boundary_hits,
                                  elsewhere=lambda key: True, fallback=False)
        self._known: OrderedDict = OrderedDict()  # key -> None, in LRU order
        self._lock = threading.Lock()
        self.deleted = 0  # objects deleted to make room

    def written(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
                self.policy.update_on_put(key)
            self._bound()

    def used(self, keys, read: bool = True) -> None:
        """Objects a hit used: read from Redis (``read``: known from now on, if another instance
        wrote them), or served by another tier and touched in Redis (only those known to be
        there count)."""
        with self._lock:
            for key in keys:
                if key in self._known:
                    self.policy.update_on_hit(key, self._known)
                elif read:
                    self._known[key] = None
                    self.policy.update_on_put(key)
            self._bound()

    def gone(self, keys) -> None:
        """Objects not in Redis (a lookup's miss, a delete, a damaged object dropped)."""
        with self._lock:
            for key in keys:
                if key in self._known:
                    del self._known[key]
                    self.policy.update_on_force_evict(key)

    def _bound(self) -> None:
        while len(self._known) > self.KNOWN:
            key, _ = self._known.popitem(last=False)
            self.policy.update_on_force_evict(key)

    @staticmethod
    def footprint(sizes) -> int:
        """What writing objects of ``sizes`` bytes each (payload and trailer) may take in Redis."""
        return sum(int(redis_bytes(n) * (1 + FOOTPRINT_MARGIN)) + KEY_BYTES for n in sizes)

    def unexpect(self, keys) -> None:
        """The write of ``keys`` (``choose``'s ``coming``) failed."""
        with self._lock:
            for key in keys:
                self.policy.unexpect(key)

    def choose(self, short: int, coming=()) -> list:
        """Objects to delete so that about ``short`` bytes come free, least worth first; fewer
        (or none) when this instance knows of no more. ``coming``: the keys about to be written
        (their parents are no leaves: deleting one would write an orphan); ``written`` or
        ``unexpect`` them after."""
        out, freed = [], 0
        with self._lock:
            for key in coming:
                self.policy.expect(key)
            while freed < short:
                picked = self.policy.get_evict_candidates(self._known, 1)
                if not picked:
                    break
                key = picked[0]
                self._known.pop(key, None)
                line = self.lineage.get(key)
                freed += (redis_bytes(line.nbytes) if line is not None and line.nbytes else 0) + KEY_BYTES
                out.append(key)
        return out


def memory_info(text: bytes) -> tuple[int, int]:
    """(``used_memory``, ``maxmemory``) of an ``INFO memory`` reply (0: not there, or no limit)."""
    found = {}
    for line in text.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name in (b"used_memory", b"maxmemory"):
            try:
                found[name] = int(value)
            except ValueError:
                pass
    return found.get(b"used_memory", 0), found.get(b"maxmemory", 0)


def short_of(used: int, maxmemory: int, need: int) -> Optional[int]:
    """Bytes to free before writing ``need`` more into a Redis using ``used`` of ``maxmemory``
    (None: no limit, nothing to do; 0 or less: it fits)."""
    if maxmemory <= 0:
        return None
    return used + need - maxmemory
