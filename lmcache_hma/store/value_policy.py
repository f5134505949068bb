"""Eviction for the CPU and disk tiers: prefix-closed, by value per byte (``hma_eviction: value``).

A hit needs every object on its path: the full-attention objects of all chunks from the first,
then the boundary object it ends at (a sliding tail, recurrent states, a turn end found
through its marker). Stored objects form a forest: a chunk's parent is the chunk before it, a
boundary object's parent is the chunk it ends, a turn end's is its marker, a marker's the chunk
before it (``Lineage`` records each object's parent when it is stored). LMCache's LRU over
objects knows none of this: dropping chunk 0 leaves every chunk after it unreachable but kept,
and a 2.5 MB turn end nobody extends counts as much as a chunk every request reads.

This policy (LMCache's ``BaseCachePolicy``, so both local backends call it where they call their
LRU) drops, in order:

1. **unreachable or useless objects**: one whose parent is gone (an orphan), a chunk with nothing
   after it on a model whose hits end at boundary objects (no hit can end there), a turn-end
   marker with no turn end left; oldest first. Objects stored or read in the last ``GRACE_S``
   are not counted as such: a request's chunks land a step before the tail that ends them;
2. then, among **leaves** only (objects no other stored object needs), the least value per byte,
   GreedyDual-Size-Frequency style: ``H = L + uses * tokens / bytes``, ``uses`` the times it was
   stored or read, ``tokens`` what a hit through it restores beyond the boundary the request that
   stored it could already restore (``ObjectRef.gain``: a document's tail, the document; a turn
   end, the question and answer; a chunk, its own tokens), ``bytes`` its
   size, and ``L`` (aging) the ``H`` of the last object dropped, taken by every object when it is
   used, so what was used long ago loses to what is used now. A tail read by many requests stays;
   a turn end never extended, big and used once, goes first.

An object is never dropped while another object in the same tier needs it (it is not a leaf),
so what a tier keeps is prefix-closed across the local tiers: a chunk stored on disk after its
parent left the disk tier but not CPU memory is reachable (lookups look in every tier), and is
dropped first once the parent is gone from both. Objects
whose parent is unknown (found on disk at start, parts of the parallelism-free format) count as
roots: never orphans. If only objects other objects need are evictable (the leaves are pinned by
loads), the lowest-valued of those goes, rather than a put failing.

LMCache calls ``get_evict_candidates`` for one candidate at a time under its tier's lock; each
call walks the tier's index once (thousands of objects: well under a millisecond each).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from lmcache.v1.storage_backend.cache_policy.base_policy import BaseCachePolicy

from lmcache_hma.core.kinds import ObjectKind


@dataclass
class Line:
    """What the policy knows of a stored object: its parent's key (None: a root or unknown), the
    tokens a hit through it restores, and its kind."""

    parent: object
    tokens: int
    kind: ObjectKind


class Lineage:
    """Each object's ``Line``, recorded by the store before it puts the object; shared by the
    tiers (an object read from disk into memory keeps its line). Bounded: the oldest lines go
    first (their objects then count as roots)."""

    KEPT = 1 << 20

    def __init__(self) -> None:
        self._lines: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def record(self, key, line: Line) -> None:
        with self._lock:
            self._lines[key] = line
            self._lines.move_to_end(key)
            while len(self._lines) > self.KEPT:
                self._lines.popitem(last=False)

    def get(self, key) -> Optional[Line]:
        return self._lines.get(key)


@dataclass
class _Use:
    uses: int
    base: float  # the aging value L when it was last used
    at: float  # time.monotonic() of that use


class ValuePolicy(BaseCachePolicy):
    """Prefix-closed, value-per-byte eviction of one local tier (see the module's docstring).

    ``kind_of(key)``: the object kind of a key of this namespace, else None (another namespace's
    objects in a shared directory: judged by recency and size alone). ``boundary_hits``: the
    model has sliding or recurrent-state groups, so a hit ends at a boundary object, never at a
    bare chunk. ``elsewhere(key)``: another local tier holds it (a lookup finds a prefix across
    the tiers: a chunk on disk whose parent is in CPU memory is reachable)."""

    GRACE_S = 5.0

    def __init__(self, lineage: Lineage, kind_of: Callable[[object], Optional[ObjectKind]], boundary_hits: bool,
                 elsewhere: Callable[[object], bool] = lambda key: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lineage, self.kind_of, self.boundary_hits, self.clock = lineage, kind_of, boundary_hits, clock
        self.elsewhere = elsewhere  # whether another local tier holds a key (lookups look in every tier)
        self.aging = 0.0  # L
        self._uses: dict = {}
        self.evicted: dict = {}  # reason -> count (tests, benchmarks)

    # LMCache's interface ------------------------------------------------------------
    def init_mutable_mapping(self) -> OrderedDict:
        return OrderedDict()

    def update_on_put(self, key) -> None:
        self._use(key)

    def update_on_hit(self, key, cache_dict) -> None:
        self._use(key)
        if key in cache_dict:  # LRU order among equals, and for a tier that falls back to it
            cache_dict.move_to_end(key)

    def update_on_force_evict(self, key) -> None:
        self._uses.pop(key, None)

    def get_evict_candidates(self, cache_dict, num_candidates: int = 1) -> list:
        now = self.clock()
        needed = set()  # keys another stored object needs
        for key in cache_dict:
            line = self.lineage.get(key)
            if line is not None and line.parent is not None:
                needed.add(line.parent)
        ranked = []
        fallback = []
        for key, entry in cache_dict.items():
            if not getattr(entry, "can_evict", True):
                continue
            rank = self._rank(key, entry, cache_dict, needed, now)
            (fallback if key in needed else ranked).append((rank, key))
        pool = ranked or fallback
        chosen = sorted(pool, key=lambda r: r[0])[:num_candidates]
        out = []
        for (ranked_by_value, value, *_), key in chosen:
            if ranked_by_value:
                self.aging = max(self.aging, value)
            reason = ("value" if ranked_by_value else "useless") if pool is ranked else "needed"
            self.evicted[reason] = self.evicted.get(reason, 0) + 1
            self._uses.pop(key, None)
            out.append(key)
        return out

    # ranking -------------------------------------------------------------------------
    def _use(self, key) -> None:
        use = self._uses.get(key)
        if use is None:
            self._uses[key] = _Use(1, self.aging, self.clock())
        else:
            use.uses, use.base, use.at = use.uses + 1, self.aging, self.clock()

    def _rank(self, key, entry, cache_dict, needed: set, now: float) -> tuple:
        """``(0, when last used)`` for an unreachable or useless object past its grace, else
        ``(1, H)``: the smaller goes first."""
        use = self._uses.get(key) or _Use(1, 0.0, 0.0)
        line = self.lineage.get(key)
        if now - use.at >= self.GRACE_S and self._useless(key, line, cache_dict, needed):
            return (0, use.at)
        size = max(1, _size(entry))
        tokens = line.tokens if line is not None and line.tokens else 1
        return (1, use.base + use.uses * tokens / size, use.at)  # equal value: the older first

    def _useless(self, key, line: Optional[Line], cache_dict, needed: set) -> bool:
        if line is None:
            return False
        if line.parent is not None and line.parent not in cache_dict and not self.elsewhere(line.parent):
            return True  # an orphan: no lookup reaches it
        if key in needed:
            return False
        # a leaf: a bare chunk where hits end at boundary objects, a marker with no turn end
        return (line.kind is ObjectKind.FULL and self.boundary_hits) or line.kind is ObjectKind.TURNMARK


def _size(entry) -> int:
    """Bytes of an entry of LMCache's CPU tier (a ``MemoryObj``) or disk tier (``DiskCacheMetadata``)."""
    size = getattr(entry, "size", None)
    return size if isinstance(size, int) else entry.get_physical_size()
