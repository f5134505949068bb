"""vLLM's device announcements on a hybrid model, held back until vLLM's hit can reach them.

vLLM's prefix cache serves a hybrid prompt up to the last block where its hit can end, not up
to its last cached full-attention block: on a gated-delta-net model a block whose recurrent
state every state group caches (``MambaManager.find_longest_cache_hit``; a state is kept only
where a prefill step ended and at shared-prefix junctions), on a sliding-window model a block
whose window every sliding group caches (``SlidingWindowManager``: the ``cdiv(window - 1,
block)`` blocks ending at it, or all of them from the first block; vLLM frees a request's
sliding blocks as it moves past them and evicts them before the full-attention blocks behind).
Its events announce every full-attention block it caches, so an index of full-attention blocks
(Dynamo's, llm-d's) credits an instance blocks that vLLM then recomputes: on a RAG trace of a
gated-delta-net model, a document's second question was credited the document's 1,280 tokens
and served none (7 of 37 requests).

``DeviceRestorable`` rewrites the full-attention groups' events of one block pool (after
``DeviceEventDedup`` made them one per hash) so that an index holds exactly the blocks vLLM's
own lookup serves some prompt through: a block is announced while it is cached in every
full-attention group, so is the chain before it (its parents up to the first block), and a
block at it or after it on a cached chain is one where the hit can end. Where that stops being
true (a state, a window or a block of the chain evicted) it is announced removed, the blocks
after a block first; where it becomes true again (a later request's prefill step ended there,
the connector loaded a state, the chain was cached again) it is announced again, parents first,
cut from vLLM's own events. A prompt that parts from a cached chain past its last such block is
then credited up to where it parts (docs/fleet.md: what an index of full-attention blocks
cannot represent).

Not gated, announced as vLLM does: groups of several block sizes (their hashes do not name the
same blocks), partial-block entries (vLLM's fine-grained tails), and EAGLE (``device_events``).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


class _Block:
    """A full-attention block hash vLLM caches (in some full-attention group)."""

    __slots__ = ("parent", "pieces", "rooted", "vouched", "shown")

    def __init__(self, parent, groups: int) -> None:
        self.parent = parent  # the block hash before it on its chain (None: the first block)
        # per full-attention group: (vLLM's BlockStored naming it, its index there) while cached, or None
        self.pieces: list = [None] * groups
        self.rooted = False  # cached in every group, and so is every block before it
        self.vouched = False  # cached in every group, a state at it or at a cached block after it
        self.shown = False  # announced (in every full-attention group)


class DeviceRestorable:
    """Gate ``full`` groups' device events (vLLM's group ids) by where vLLM's hit can end: a
    block whose state every ``states`` group caches, and whose window every ``windows`` entry
    ``(groups, n)`` caches (the ``n`` blocks ending at it, or all from the first block)."""

    KIDS_LIST = 8

    def __init__(self, full: Iterable[int], states: Iterable[int] = (), windows: Iterable[tuple] = ()) -> None:
        self.full = tuple(full)
        self.states = tuple(states)
        self.windows = tuple((tuple(groups), n) for groups, n in windows)
        self._reach = max((n for _, n in self.windows), default=1) - 1  # blocks after one its change reaches
        self._others = frozenset(self.states).union(*(groups for groups, _ in self.windows))
        self._blocks: dict = {}  # event block hash -> _Block
        # event block hash -> the hashes of the blocks after it: a list, a set past KIDS_LIST (a
        # shared prompt's block may have thousands); the first blocks' (no parent) are not kept
        self._kids: dict = {}
        self._slot = {g: i for i, g in enumerate(self.full)}  # group -> its place in a block's pieces
        self._hashes: dict = {}  # event block hash -> vLLM's BlockHash (to ask the pool), as the pool caches them
        self._pool = None
        self._medium = None  # vLLM's medium for its device blocks (its events')
        self.counters = Counter(shown=0, withdrawn=0)  # blocks announced, withdrawn by the gate

    def bind(self, pool) -> None:
        self._pool = pool

    def note_cached(self, event_hash, block_hash) -> None:
        """vLLM cached ``block_hash`` in a full-attention group (its events name it ``event_hash``)."""
        self._hashes[event_hash] = block_hash

    def note_reset(self) -> None:
        """vLLM emptied its prefix cache (its ``AllBlocksCleared`` comes with the step's events,
        after which blocks cached in the same step are noted again)."""
        self._hashes.clear()

    def note_gone(self, event_hash) -> None:
        """vLLM's last copy of ``event_hash`` left its full-attention group's cache."""
        self._hashes.pop(event_hash, None)

    # the events --------------------------------------------------------------------------------
    def rewrite(self, events: list) -> list:
        """A step's events with the full-attention groups' replaced by what an index should hold."""
        out, moved, touched = [], set(), set()
        for e in events:
            if isinstance(e, AllBlocksCleared):
                out.extend(self._settle(moved, touched))
                moved, touched = set(), set()
                self._blocks.clear()
                self._kids.clear()
                out.append(e)
            elif isinstance(e, BlockStored) and e.group_idx in self.full and \
                    len(e.token_ids) == len(e.block_hashes) * e.block_size:
                self._stored(e, moved)
            elif isinstance(e, BlockRemoved) and e.group_idx in self.full:
                kept = [h for h in e.block_hashes if h not in self._blocks]  # not ours (a partial entry)
                for h in e.block_hashes:
                    b = self._blocks.get(h)
                    if b is not None:
                        b.pieces[self._slot[e.group_idx]] = None
                        moved.add(h)
                if kept:
                    out.append(msgspec.structs.replace(e, block_hashes=kept))
            else:
                if isinstance(e, (BlockStored, BlockRemoved)) and e.group_idx in self._others:
                    touched.update(h for h in e.block_hashes if h in self._blocks)
                out.append(e)
        out.extend(self._settle(moved, touched))
        return out

    def _stored(self, e: BlockStored, moved: set) -> None:
        parent = e.parent_block_hash
        self._medium = e.medium
        for i, h in enumerate(e.block_hashes):
            b = self._blocks.get(h)
            if b is None:
                b = self._blocks[h] = _Block(parent, len(self.full))
                self._add_kid(parent, h)
            b.pieces[self._slot[e.group_idx]] = (e, i)
            moved.add(h)
            parent = h

    # what an index should hold ---------------------------------------------------------------
    def _cached(self, b: Optional[_Block]) -> bool:
        return b is not None and None not in b.pieces

    def _ends_hit(self, h, runs: dict) -> bool:
        """vLLM's hit can end after block ``h``: a state there, its window cached."""
        block_hash = self._hashes.get(h)
        if block_hash is None:
            return False
        if self.states and self._pool.get_cached_block(block_hash, list(self.states)) is None:
            return False
        return all(self._run(h, groups, n, runs) >= n for groups, n in self.windows)

    def _run(self, h, groups: tuple, n: int, runs: dict) -> int:
        """How many blocks ending at ``h`` ``groups`` cache, at most ``n`` (``n`` where they go back
        to the first block): vLLM's sliding-window hit (``SlidingWindowManager``). ``runs`` keeps
        the exact ones (asked parents first, each walk stops at its parent's)."""
        path, x, run = [], h, None
        while len(path) < n:
            run = runs.get((groups, x))
            if run is not None:
                break
            b, block_hash = self._blocks.get(x), self._hashes.get(x)
            if b is None or block_hash is None or self._pool.get_cached_block(block_hash, list(groups)) is None:
                run = runs[(groups, x)] = 0
                break
            path.append(x)
            if b.parent is None:
                run = n - 1  # back to the first block: as good as a whole window
                break
            x = b.parent
        if run is None:  # n blocks cached: exact for ``h`` alone
            runs[(groups, h)] = n
            return n
        for x in reversed(path):
            run = runs[(groups, x)] = min(n, run + 1)
        return runs[(groups, h)]

    def _settle(self, moved: set, touched: set) -> list:
        """Recompute the blocks whose caching (``moved``) or state (``touched``) changed, and
        what follows from it; the events that bring the index there."""
        if not moved and not touched:
            return []
        changed = set(moved)
        # rooted: down from each block whose caching changed
        for h in moved:
            b = self._blocks[h]
            parent = self._blocks.get(b.parent) if b.parent is not None else None
            self._reroot(h, self._cached(b) and (b.parent is None or (parent is not None and parent.rooted)), changed)
        # a window ending after a block whose caching or window changed may have changed
        if self.windows:
            touched = self._after(moved | touched)
        # vouched: up from each block whose caching, state or window changed
        runs: dict = {}
        for h in self._order({h for h in moved | touched if h in self._blocks}):  # parents first: walks stay short
            for groups, n in self.windows:
                self._run(h, groups, n, runs)
        for h in moved | touched:
            while h is not None:
                b = self._blocks.get(h)
                if b is None:
                    break
                v = self._cached(b) and (self._ends_hit(h, runs) or any(
                    k.vouched for k in map(self._blocks.get, self._kids.get(h, ())) if k is not None))
                if v == b.vouched:
                    break
                b.vouched = v
                changed.add(h)
                h = b.parent
        show = {h for h in changed if self._want(h) and not self._blocks[h].shown}
        hide = [h for h in changed if self._blocks[h].shown and not self._want(h)]
        events = self._removals(hide) + self._stores(show)
        for h in moved:  # forget blocks no group caches any more
            b = self._blocks[h]
            if b.pieces.count(None) == len(b.pieces):
                del self._blocks[h]
                self._drop_kid(b.parent, h)
        return events

    def _add_kid(self, parent, h) -> None:
        if parent is None:
            return
        kids = self._kids.get(parent)
        if kids is None:
            self._kids[parent] = [h]
        elif isinstance(kids, set):
            kids.add(h)
        elif len(kids) < self.KIDS_LIST:
            kids.append(h)
        else:
            self._kids[parent] = set(kids) | {h}

    def _drop_kid(self, parent, h) -> None:
        kids = self._kids.get(parent)
        if kids is None:
            return
        kids.remove(h)
        if not kids:
            del self._kids[parent]

    def _after(self, hashes: set) -> set:
        """``hashes`` and the blocks up to ``_reach`` after them on cached chains."""
        out, frontier = set(hashes), set(hashes)
        for _ in range(self._reach):
            frontier = {k for h in frontier for k in self._kids.get(h, ()) if k in self._blocks} - out
            if not frontier:
                break
            out |= frontier
        return out

    def _want(self, h) -> bool:
        b = self._blocks[h]
        return b.rooted and b.vouched

    def _reroot(self, h, rooted: bool, changed: set) -> None:
        stack = [(h, rooted)]
        while stack:
            h, rooted = stack.pop()
            b = self._blocks[h]
            if b.rooted == rooted:
                continue
            b.rooted = rooted
            changed.add(h)
            for k in self._kids.get(h, ()):
                kid = self._blocks.get(k)
                if kid is not None:
                    stack.append((k, rooted and self._cached(kid)))

    def _order(self, hashes: set) -> list:
        """``hashes`` parents first, each chain's blocks one after the other."""
        out, stack = [], [h for h in hashes if self._blocks[h].parent not in hashes]
        while stack:
            h = stack.pop()
            out.append(h)
            stack.extend(k for k in self._kids.get(h, ()) if k in hashes)
        return out

    def _stores(self, show: set) -> list:
        """``BlockStored`` for ``show``, parents first: per group, each run of blocks that follow one
        another in one of vLLM's events is one event (vLLM's own where it is the whole event)."""
        events: list = []
        runs: dict = {}  # group -> [vLLM's event, first index, last index] being extended
        for h in self._order(show):
            b = self._blocks[h]
            b.shown = True
            for g, piece in enumerate(b.pieces):
                e, i = piece
                run = runs.get(g)
                if run is not None and run[0] is e and run[2] == i - 1:
                    run[2] = i
                    continue
                if run is not None:
                    events.append(cut_event(*run))
                runs[g] = [e, i, i]
        events.extend(cut_event(*run) for run in runs.values())
        self.counters["shown"] += len(show)
        return events

    def _removals(self, hide: list) -> list:
        if not hide:
            return []
        hashes = list(reversed(self._order(set(hide))))  # the blocks after a block first
        for h in hashes:
            self._blocks[h].shown = False
        self.counters["withdrawn"] += len(hashes)
        return [BlockRemoved(block_hashes=list(hashes), medium=self._medium, group_idx=g) for g in self.full]


def cut_event(e: BlockStored, first: int, last: int) -> BlockStored:
    """vLLM's event ``e`` cut to its blocks ``first`` to ``last`` (``e`` itself where whole): the
    parent the block before ``first``, its tokens and extra keys."""
    if first == 0 and last == len(e.block_hashes) - 1:
        return e
    size = e.block_size
    return msgspec.structs.replace(
        e, block_hashes=e.block_hashes[first:last + 1],
        parent_block_hash=e.parent_block_hash if first == 0 else e.block_hashes[first - 1],
        token_ids=e.token_ids[first * size:(last + 1) * size],
        extra_keys=e.extra_keys[first:last + 1] if e.extra_keys is not None else None)
