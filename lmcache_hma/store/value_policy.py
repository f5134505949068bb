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
   marker with no turn end left: first those an eviction just left so (the chain of chunks
   only a dropped tail needed, the orphans of a dropped chunk: nothing is on its way to them),
   then the others oldest first, past a grace: objects stored or read in the tier's last
   ``GRACE`` puts are not counted as such, since a request's chunks land a step before the tail
   that ends them;
2. then, among **leaves** only (objects no other stored object needs), the least value per byte,
   GreedyDual-Size-Frequency style: ``H = L + uses * tokens / bytes``, ``uses`` the times it was
   stored or read (an object stored again after it left the tier keeps the uses it had,
   ``GHOSTS_KEPT`` of them remembered: else a document that returns often starts from one use at
   each return and goes again before its next read), ``tokens`` what a hit through it restores beyond the boundary the request that
   stored it could already restore (``ObjectRef.gain``: a document's tail, the document; a turn
   end, the question and answer; a chunk, its own tokens), ``bytes`` its
   size, and ``L`` (aging) the ``H`` of the last object dropped, taken by every object when it is
   used, so what was used long ago loses to what is used now. A tail read by many requests stays;
   a turn end never extended, big and used once, goes first. A bare chunk stored in the last
   ``GRACE`` puts is not dropped here: it is the frontier of a request still being stored.
   A turn end the conversation went on from (the next turn read it and stored its own, whose line
   names it: ``Line.supersedes``), and the tail it loaded with it, lose the uses that conversation
   gave them: one only it used counts as never used from then on (``H = L``); a shared
   document's tail keeps the reads of every other question on it.

The grace is counted in puts, not seconds: what a step stores is bounded by the tokens a step
computes, and a tier only evicts to make room for a put, so the same trace is judged alike on a
fast or a slow machine (with a grace in seconds a slow one spared ten times as many objects).

An object is never dropped while another object in the same tier needs it (it is not a leaf),
so what a tier keeps is prefix-closed across the local tiers: a chunk stored on disk after its
parent left the disk tier but not CPU memory is reachable (lookups look in every tier); once the
parent is gone from both it is an orphan, dropped first (the store tells each local tier's policy
what the others dropped: ``left_elsewhere``). Objects
whose parent is unknown (found on disk at start, parts of the parallelism-free format) count as
roots: never orphans. If only objects other objects need are evictable (the leaves are pinned by
loads), the lowest-valued of those goes, rather than a put failing.

LMCache calls ``get_evict_candidates`` for one candidate at a time under its tier's lock; the
policy keeps its order incrementally (two heaps), so a choice does not walk the tier.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional

from lmcache.v1.storage_backend.cache_policy.base_policy import BaseCachePolicy

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.log import get_logger

logger = get_logger(__name__)


@dataclass
class Line:
    """What the policy knows of a stored object: its parent's key (None: a root or unknown), the
    tokens a hit through it restores, its kind, its size in bytes, and the keys of the objects it
    supersedes (a turn end: the one its request read and extended, ``ObjectRef.supersedes``)."""

    parent: object
    tokens: int
    kind: ObjectKind
    nbytes: int = 0
    supersedes: tuple = ()
    spare: bool = False  # stored on speculation while the tier had room: worth nothing until read


class Lineage:
    """Each object's ``Line``, recorded by the store before it puts the object; shared by the
    tiers (an object read from disk into memory keeps its line). Bounded: the oldest lines go
    first (an object stored again without one counts as a root; a tier's policy keeps the line
    of each object it holds, so one still in a tier stays where it hangs)."""

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
    at: float  # the policy's clock at that use (puts into the tier)
    value: float = 0.0  # H, as of that use
    lost_kids: bool = False  # what followed it in the tier left: nothing more is on its way


_UNKNOWN_BYTES = 1 << 20  # the size of an object the policy has no line of (found on disk at start)


class ValuePolicy(BaseCachePolicy):
    """Prefix-closed, value-per-byte eviction of one local tier (see the module's docstring).

    ``kind_of(key)``: the object kind of a key of this namespace, else None (another namespace's
    objects in a shared directory: judged by recency and size alone). ``boundary_hits``: the
    model has sliding or recurrent-state groups, so a hit ends at a boundary object, never at a
    bare chunk. ``elsewhere(key)``: another local tier holds it (a lookup finds a prefix across
    the tiers: a chunk on disk whose parent is in CPU memory is reachable).

    Kept incrementally, so a choice costs O(log n), not a walk of the tier: each object's uses,
    the children each object has in the tier, a heap of objects by value and one by last use (the
    candidates for useless). Heap entries go stale as objects are used again, gain children or
    leave; they are checked when they reach the top, and the heaps are rebuilt when mostly stale
    (on a push: a tier that never fills, or a Redis never near its limit, makes no choice).
    LMCache calls every method under the tier's lock."""

    GHOSTS_KEPT = 1 << 16  # objects that left the tier whose uses are remembered
    CONVERSATION_USES = 2  # the uses a conversation gives what it goes on from (``_superseded``)
    GRACE = 256  # puts into the tier: many steps' worth of chunks and tails (a step of 8192 tokens: 32 chunks)

    def __init__(self, lineage: Lineage, kind_of: Callable[[object], Optional[ObjectKind]], boundary_hits: bool,
                 elsewhere: Callable[[object], bool] = lambda key: False,
                 clock: Optional[Callable[[], float]] = None, fallback: bool = True) -> None:
        """``clock``: what ages an object (default: the puts into the tier so far; ``GRACE`` of it
        is the grace). ``fallback``: with no leaf to give, drop an object others need rather than
        none (a local tier's put must find room; a Redis has its own eviction behind it)."""
        self.fallback = fallback
        self.lineage, self.kind_of, self.boundary_hits = lineage, kind_of, boundary_hits
        self._puts = 0
        self.clock = clock if clock is not None else self._put_count
        self.elsewhere = elsewhere  # whether another local tier holds a key (lookups look in every tier)
        self.aging = 0.0  # L
        self._uses: dict = {}  # key -> _Use, for every object of the tier
        self._kids: dict = {}  # parent key -> the keys in the tier whose parent it is
        self._lines: dict = {}  # key -> the Line it is held under (in the tier, or a put on its way)
        self._by_value: list = []  # (H, last use, n, key)
        self._by_age: list = []  # (last use, n, key): useless once past GRACE
        self._doomed: list = []  # keys made useless by an eviction: nothing is on its way to them
        self._ghosts: OrderedDict = OrderedDict()  # key -> uses, of objects that left the tier (GHOSTS_KEPT)
        self._left_elsewhere: deque = deque()  # keys another local tier dropped (``left_elsewhere``)
        self._pushed = 0
        self.evicted: dict = {}  # reason -> count (tests, benchmarks)

    # LMCache's interface ------------------------------------------------------------
    def init_mutable_mapping(self) -> OrderedDict:
        return OrderedDict()

    def update_on_put(self, key) -> None:
        self._puts += 1
        self._orphans_of_left()  # bounded by the puts, whether or not the tier ever evicts
        line = self.lineage.get(key)
        if line is not None:  # a rewrite under another parent (a marker's) moves it there
            self._attach(key, line)
        new = key not in self._uses
        self._use(key)
        if new and line is not None and line.spare:  # goes first, among leaves, until read
            self._superseded(key, uses=1)
        for old in line.supersedes if line is not None else ():
            self._superseded(old)

    def update_on_hit(self, key, cache_dict) -> None:
        if key in self._uses:
            self._use(key)
        if key in cache_dict:  # LRU order among equals, and for a tier that falls back to it
            cache_dict.move_to_end(key)

    def update_on_force_evict(self, key) -> None:
        self._forget(key)

    def expect(self, key) -> None:
        """A put of ``key`` is on its way (a disk write in flight, not in the tier's index until it
        lands): its parent is no leaf meanwhile. Else the room made for the write itself could be
        its parent's (a turn end's tail dropped to make room for the turn end: an orphan lands)."""
        line = self.lineage.get(key)
        if line is not None:
            self._attach(key, line)

    def landed(self, key) -> None:
        """A disk write is in the tier's index now. LMCache's disk tier tells the policy of a put
        when it admits it (``update_on_put``), before the write: heap entries met meanwhile were
        dropped as gone, so it is a candidate again from here (else only ``_fallback`` would
        ever reach it, regardless of what needs it)."""
        use = self._uses.get(key)
        if use is not None:
            self._push(key, use)

    def unexpect(self, key) -> None:
        """The put ``expect`` announced was not made (no room, a failed write)."""
        if key not in self._uses:
            self._detach(key)

    def left_elsewhere(self, key) -> None:
        """Another local tier dropped ``key``. Where this tier does not hold it either, the
        objects here whose parent it is are orphans now: dropped first at this tier's next
        eviction (else, each tier judging its own children, a chunk on disk whose parent left
        CPU memory and disk went only by value, like any leaf). Called with the other tier's
        lock held: it only records (a deque's append is atomic); this tier's next put or eviction
        looks, under its own lock."""
        self._left_elsewhere.append(key)

    def adopt(self, keys) -> None:
        """Objects already in the tier when the policy was installed (found on disk at start):
        known, as used once long ago."""
        for key in keys:
            if key not in self._uses:
                self.update_on_put(key)
                use = self._uses[key]
                use.at, use.value = 0.0, self.aging
                self._push(key, use)

    def _orphans_of_left(self) -> None:
        """What another tier dropped and this one does not hold: its children here are orphans."""
        while self._left_elsewhere:
            key = self._left_elsewhere.popleft()
            if key not in self._uses and not self.elsewhere(key):
                self._doomed.extend(self._kids.get(key, ()))

    def _put_count(self) -> float:
        return self._puts

    def get_evict_candidates(self, cache_dict, num_candidates: int = 1) -> list:
        out: list = []
        while len(out) < num_candidates:
            picked = self._pick(cache_dict, set(out))
            if picked is None:
                break
            key, reason = picked
            self.evicted[reason] = self.evicted.get(reason, 0) + 1
            if logger.isEnabledFor(logging.DEBUG):
                line, use = self._line(key), self._uses.get(key)
                logger.debug("LMCacheHMA: evicting %s %s (%s, value %.3g, aging %.3g)", line.kind.name if line else "?",
                             getattr(key, "chunk_hash", b"").hex()[:12], reason, use.value if use else -1, self.aging)
            self._forget(key)  # LMCache removes what it is given without telling the policy
            out.append(key)
        return out

    # choosing ------------------------------------------------------------------------
    def _pick(self, cache_dict, taken: set) -> Optional[tuple]:
        now = self.clock()
        self._orphans_of_left()
        aside: list = []
        try:
            while self._doomed:  # what an eviction left useless goes first, grace or not
                key = self._doomed.pop()
                if key in taken or key not in cache_dict or key not in self._uses:
                    continue
                if self._useless(key, cache_dict):
                    if getattr(cache_dict[key], "can_evict", True):
                        return key, "useless"
                    aside.append((self._doomed, key))
            while self._by_age:  # unreachable or useless objects, oldest first
                at, _, key = self._by_age[0]
                if now - at < self.GRACE:
                    break  # every other one was used later
                heapq.heappop(self._by_age)
                use = self._uses.get(key)
                if use is None or use.at != at or key in taken or key not in cache_dict:
                    continue  # stale: used since, or gone
                if self._useless(key, cache_dict):
                    if getattr(cache_dict[key], "can_evict", True):
                        return key, "useless"
                    aside.append((self._by_age, (at, self._n(), key)))
            while self._by_value:  # then the leaf worth least per byte
                value, at, _, key = heapq.heappop(self._by_value)
                use = self._uses.get(key)
                if use is None or use.at != at or key in taken or key not in cache_dict or self._kids.get(key):
                    continue  # stale, or others need it (re-pushed when its last child leaves)
                if not getattr(cache_dict[key], "can_evict", True) or self._frontier(key, use, now - at):
                    aside.append((self._by_value, (value, at, self._n(), key)))
                    continue
                self.aging = max(self.aging, value)
                return key, "value"
            return self._fallback(cache_dict, taken) if self.fallback else None
        finally:
            for heap, entry in aside:
                if heap is self._doomed:
                    heap.insert(0, entry)  # pinned (a load or a write): after the others
                else:
                    heapq.heappush(heap, entry)

    def _fallback(self, cache_dict, taken: set) -> Optional[tuple]:
        """Nothing but objects others need (or the policy knows nothing of) can go: the lowest
        valued evictable one, by a walk of the tier (rare: its leaves are pinned by loads)."""
        best = None
        for key, entry in cache_dict.items():
            if key in taken or not getattr(entry, "can_evict", True):
                continue
            use = self._uses.get(key)
            rank = (use.value, use.at) if use is not None else (-1.0, 0.0)
            if best is None or rank < best[0]:
                best = (rank, key)
        return (best[1], "needed") if best is not None else None

    def _frontier(self, key, use: _Use, age: float) -> bool:
        """A bare chunk stored in the last ``GRACE`` puts on a model whose hits end at boundary
        objects, that never had anything after it in the tier: the last chunk a request in
        progress stored so far, whose next chunk or tail lands a step later; dropping it would
        orphan them. (One whose followers were dropped is no frontier: nothing is coming.)"""
        line = self._line(key)
        return (age < self.GRACE and self.boundary_hits and not use.lost_kids and line is not None
                and line.kind is ObjectKind.FULL)

    def _useless(self, key, cache_dict) -> bool:
        """No lookup can reach or end at it: an orphan, a bare chunk with nothing after it where
        hits end at boundary objects, a marker with no turn end left."""
        line = self._line(key)
        if line is None:
            return False
        if line.parent is not None and line.parent not in cache_dict and not self.elsewhere(line.parent):
            return True
        if self._kids.get(key):
            return False
        return (line.kind is ObjectKind.FULL and self.boundary_hits) or line.kind is ObjectKind.TURNMARK

    # bookkeeping ---------------------------------------------------------------------
    def _use(self, key) -> None:
        use = self._uses.get(key)
        if use is None:  # stored again after it left: it counts the uses it had
            use = self._uses[key] = _Use(self._ghosts.pop(key, 0), 0.0, 0.0)
        use.uses, use.base, use.at = use.uses + 1, self.aging, self.clock()
        self._revalue(key, use)

    def _revalue(self, key, use: _Use) -> None:
        """``use.value`` from its uses, the tokens a hit through ``key`` restores and its bytes."""
        line = self._line(key)
        tokens = line.tokens if line is not None else 1  # a marker: 0, its turn ends carry the value
        size = line.nbytes if line is not None and line.nbytes else _UNKNOWN_BYTES
        use.value = use.base + use.uses * tokens / size
        self._push(key, use)

    def _superseded(self, key, uses: int = 0) -> None:
        """An object its conversation went on from (``Line.supersedes``: the turn end the next
        turn read, the tail and states it loaded with it) loses the uses that conversation gave
        it, ``CONVERSATION_USES`` (its store or the hit that read it, and the next turn's read):
        a turn end or a tail only that conversation used counts as never used, so among leaves
        it goes first; a tail others read too (a shared document's or system prompt's end, read
        by every question on it) keeps their reads. Measured on the chat trace of
        ``benchmarks/bench_capacity.py``: every turn end is read once, by the next turn, and
        kept after it at that use's value, the old turns of the open conversations filled the tier
        and their newest turn ends went instead."""
        uses = uses or self.CONVERSATION_USES
        use = self._uses.get(key)
        if use is None:
            if key in self._ghosts:
                self._ghosts[key] = max(self._ghosts[key] - uses, 0)
            return
        use.uses = max(use.uses - uses, 0)
        self._revalue(key, use)

    def _push(self, key, use: _Use) -> None:
        heapq.heappush(self._by_value, (use.value, use.at, self._n(), key))
        heapq.heappush(self._by_age, (use.at, self._n(), key))
        # every use pushes: rebuilt when mostly stale, whether or not the tier ever evicts
        if len(self._by_value) + len(self._by_age) + len(self._doomed) > 8 * len(self._uses) + 1024:
            self._rebuild()

    def _n(self) -> int:
        self._pushed += 1
        return self._pushed

    def _forget(self, key) -> None:
        """``key`` left the tier: its parent may become a leaf, its children orphans."""
        use = self._uses.pop(key, None)
        if use is None:
            return
        self._ghosts[key] = use.uses
        self._ghosts.move_to_end(key)
        while len(self._ghosts) > self.GHOSTS_KEPT:
            self._ghosts.popitem(last=False)
        self._detach(key)
        for kid in self._kids.get(key, ()):  # orphans now (unless another tier holds the key)
            use = self._uses.get(kid)
            if use is not None:
                heapq.heappush(self._by_age, (use.at, self._n(), kid))
                self._doomed.append(kid)

    def _line(self, key) -> Optional[Line]:
        """The line ``key`` is held under (the lineage's until it is put or expected)."""
        line = self._lines.get(key)
        return line if line is not None else self.lineage.get(key)

    def _attach(self, key, line: Line) -> None:
        """``key`` is held under ``line`` from now on: a child of ``line.parent``, and of no parent
        an earlier line of the same key named (a marker rewritten with the other ``on_tail``
        hangs off the tail or the chunk; left in the old parent's children, it would keep that
        parent from ever being a leaf). The line is the policy's own from here, so the lineage
        dropping it (``Lineage.KEPT``) leaves the object where it hangs."""
        old = self._lines.get(key)
        if old is not None and old.parent != line.parent:
            self._detach(key)
        self._lines[key] = line
        if line.parent is not None:
            self._kids.setdefault(line.parent, set()).add(key)

    def _detach(self, key) -> None:
        """``key`` is no child of its parent in the tier any more: the parent may be a leaf now."""
        line = self._lines.pop(key, None)
        if line is not None and line.parent is not None:
            kids = self._kids.get(line.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._kids[line.parent]
                    parent = self._uses.get(line.parent)
                    if parent is not None:  # a leaf now: a candidate again
                        parent.lost_kids = True
                        self._push(line.parent, parent)
                        self._doomed.append(line.parent)  # useless now, if it is a bare chunk or a marker

    def _rebuild(self) -> None:
        self._doomed = [k for k in dict.fromkeys(self._doomed) if k in self._uses]
        self._by_value = [(u.value, u.at, self._n(), k) for k, u in self._uses.items()]
        self._by_age = [(u.at, self._n(), k) for k, u in self._uses.items()]
        heapq.heapify(self._by_value)
        heapq.heapify(self._by_age)


def _size(entry) -> int:
    """Bytes of an entry of LMCache's CPU tier (a ``MemoryObj``) or disk tier (``DiskCacheMetadata``)."""
    size = getattr(entry, "size", None)
    return size if isinstance(size, int) else entry.get_physical_size()
