"""vLLM's own device-cache events, one announcement per block hash (full-attention groups).

vLLM does not de-duplicate its prefix cache: two physical blocks can hold the same block hash
(a prompt recomputed from a point where vLLM's own hit stopped short of blocks it still
caches: on a sliding-window model, the window behind them was evicted; a block recomputed for
the last token's logits; two requests computing one prefix at once). Its block pool announces
every copy: ``BlockStored`` when a copy is cached, ``BlockRemoved`` when a copy is evicted,
**even while another copy of the hash stays cached** (``BlockPool._remove_cached_block_hashes``
then ``_emit_block_removed_events``, ``v1/core/block_pool.py`` ~590-624). An index that keeps
a set of hashes per instance and tier, as Dynamo's standalone indexer and llm-d's do, drops the
hash at the first copy's eviction, and the stores vLLM then announces after it are refused for
want of their parent (``Failed to find parent block``): the index credits the instance less
than vLLM's own cache serves it. Measured on a sliding-window model behind Dynamo's indexer: a
request served 1,408 tokens from vLLM's device cache was credited 384 of them there (the
issue is known upstream: vllm-project/vllm#55092 emits ``BlockRemoved`` only after the last
copy; Dynamo's own worker-side pipeline counts copies, ai-dynamo/dynamo#8012, its standalone
indexer does not).

``DeviceEventDedup``, bound to the scheduler's block pool, makes the announcements of the
full-attention groups set-like at their source: ``BlockStored`` for a hash only when it enters
the cache (a copy cached while another one is held is left out of its event, which is split
around it), ``BlockRemoved`` only when its last copy leaves. Indexes that keep sets and those
that count copies both stay true. Other groups (sliding windows, recurrent states) keep vLLM's
per-copy events: their events skip null and masked blocks, so copies cannot be cut out by
position, and Dynamo and llm-d do not index them. Copies announced through vLLM's opt-in
``kv_cache_report_mode: full`` (stores of reused blocks) are vLLM's and pass as they are.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

from vllm.distributed.kv_events import BlockStored

from lmcache_hma.core.kinds import GroupKind
from lmcache_hma.log import get_logger
from lmcache_hma.scheduler.device_restorable import DeviceRestorable, cut_event

logger = get_logger(__name__)

# the block pool's methods this wraps, on the pool instance (vllm_compat: 0.32-0.34 alike)
WRAPPED = ("cache_full_blocks", "cache_partial_block", "_insert_block_hash", "_emit_block_removed_events",
           "take_events", "reset_prefix_cache")


class DeviceEventDedup:
    """Set-like ``BlockStored`` / ``BlockRemoved`` for ``groups`` (vLLM's group ids) of one
    block pool's events. ``bind(pool)`` wraps the pool instance's methods."""

    def __init__(self, groups: Iterable[int], gate: Optional[DeviceRestorable] = None) -> None:
        self.groups = frozenset(groups)
        self.gate = gate  # then: announced only where vLLM's hit can reach them (device_restorable)
        self._copies: Counter = Counter()  # (group, event hash) -> copies cached this step beside a held one
        self._storing = 0  # inside a call that caches blocks and announces them
        self.left_out = Counter(stored=0, removed=0)  # copies not announced (counters for tests and logs)

    # the pool's side -----------------------------------------------------------------------
    def bind(self, pool) -> bool:
        """Wrap ``pool``'s methods; False (and nothing wrapped) where one is missing."""
        missing = [m for m in WRAPPED if not callable(getattr(pool, m, None))]
        if missing or not hasattr(getattr(pool, "cached_block_hash_to_block", None), "get_one_block"):
            logger.warning("LMCacheHMA: vLLM's block pool lacks %s: its device events keep one "
                           "announcement per copy of a block", ", ".join(missing) or "get_one_block")
            return False
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        from lmcache_hma.vllm_compat import event_block_hash_converter

        event_hash = event_block_hash_converter()

        if self.gate is not None and not callable(getattr(pool, "get_cached_block", None)):
            logger.warning("LMCacheHMA: vLLM's block pool lacks get_cached_block: its device events announce "
                           "full-attention blocks past the last recurrent state it keeps")
            self.gate = None
        if self.gate is not None:
            self.gate.bind(pool)

        def storing(call):
            def wrapped(*args, **kwargs):
                self._storing += 1
                try:
                    return call(*args, **kwargs)
                finally:
                    self._storing -= 1
            return wrapped

        insert = pool._insert_block_hash

        def _insert_block_hash(key, block, num_tokens):
            group, held = get_group_id(key), pool.cached_block_hash_to_block  # a reset replaces the map
            copy = (self._storing and group in self.groups and block.block_hash != key
                    and not held.contain(key, block.block_id) and self._another_copy(held, key))
            insert(key, block, num_tokens)
            if group in self.groups and (copy or self.gate is not None):
                block_hash = get_block_hash(key)
                if copy:
                    self._copies[(group, event_hash(block_hash))] += 1
                if self.gate is not None:
                    self.gate.note_cached(event_hash(block_hash), block_hash)

        emit_removed = pool._emit_block_removed_events

        def _emit_block_removed_events(keys):
            # called once the copy left the map (``_remove_cached_block_hashes``): another may stay
            held = pool.cached_block_hash_to_block
            kept = [k for k in keys if get_group_id(k) not in self.groups or not self._another_copy(held, k)]
            self.left_out["removed"] += len(keys) - len(kept)
            if self.gate is not None:
                for k in keys:
                    if get_group_id(k) in self.groups and held.get_one_block(k) is None:
                        self.gate.note_gone(event_hash(get_block_hash(k)))
            emit_removed(kept)

        reset = pool.reset_prefix_cache

        def reset_prefix_cache(*args, **kwargs):
            done = reset(*args, **kwargs)
            if done and self.gate is not None:
                self.gate.note_reset()
            return done

        take = pool.take_events

        def take_events():
            events = take()
            try:
                out = self.rewrite(events)
                return self.gate.rewrite(out) if self.gate is not None else out
            except Exception:  # never fail vLLM's step for an index's sake: its own events from here on
                logger.exception("LMCacheHMA: rewriting vLLM's device events failed; they are published as "
                                 "vLLM makes them from now on (an index may hold copies' removals and blocks "
                                 "it cannot be served)")
                pool.take_events = take
                pool.reset_prefix_cache = reset
                pool._emit_block_removed_events = emit_removed
                pool._insert_block_hash = insert
                self.gate, self._copies = None, Counter()
                return events

        pool.cache_full_blocks = storing(pool.cache_full_blocks)
        pool.cache_partial_block = storing(pool.cache_partial_block)
        pool._insert_block_hash = _insert_block_hash
        pool._emit_block_removed_events = _emit_block_removed_events
        pool.take_events = take_events
        pool.reset_prefix_cache = reset_prefix_cache
        return True

    def _another_copy(self, held, key) -> bool:
        """The pool's map ``held`` caches a copy of ``key`` (another one than a copy being
        cached, or the one just evicted)."""
        return held.get_one_block(key) is not None

    # the events' side ------------------------------------------------------------------------
    def rewrite(self, events: list) -> list:
        """``events`` with the copies cached beside a held one left out of their ``BlockStored``
        (split into runs around them: each run's parent is the block before it)."""
        if not self._copies:
            return events
        out = []
        for e in events:
            if not (isinstance(e, BlockStored) and e.group_idx in self.groups):
                out.append(e)
                continue
            n = len(e.block_hashes)
            if n == 0 or len(e.token_ids) != n * e.block_size:  # not one block per hash: as it is
                out.append(e)
                continue
            keep = []
            for h in e.block_hashes:
                key = (e.group_idx, h)
                copy = self._copies[key] > 0
                if copy:
                    self._copies[key] -= 1
                keep.append(not copy)
            if all(keep):
                out.append(e)
                continue
            self.left_out["stored"] += keep.count(False)
            out.extend(_runs(e, keep))
        self._copies.clear()  # every copy's store is in the batch it was cached in
        return out


def device_events(layout, use_eagle: bool = False) -> DeviceEventDedup:
    """The rewriting of vLLM's device events for ``layout`` (``core.layout.HybridLayout``): one
    per hash in the full-attention groups and, on a hybrid whose other groups share the
    full-attention block size, announced only where vLLM's hit can reach (``device_restorable``):
    a state cached at or after the block (recurrent-state groups), the window before it
    (sliding-window groups). Not gated under EAGLE (vLLM's hit then drops its last block)."""
    full = [g for g in layout.groups if g.kind is GroupKind.FULL]
    others = [g for g in layout.groups if g.kind is not GroupKind.FULL]
    gate = None
    if full and others and not use_eagle:
        if {g.block_size for g in layout.groups} == {full[0].block_size}:
            windows: dict = {}  # blocks a sliding-window hit needs -> its groups (vLLM's cdiv(window - 1, block))
            for g in others:
                if g.kind is GroupKind.SLIDING:
                    windows.setdefault(-(-(g.sliding_window - 1) // g.block_size), []).append(g.index)
            gate = DeviceRestorable([g.index for g in full], [g.index for g in others if g.kind is GroupKind.STATE],
                                    [(groups, n) for n, groups in windows.items()])
        else:
            logger.warning("LMCacheHMA: KV cache groups of several block sizes (%s): vLLM's device events "
                           "announce full-attention blocks past where its hit can reach",
                           sorted({g.block_size for g in layout.groups}))
    return DeviceEventDedup([g.index for g in full], gate)


def _runs(e: BlockStored, keep: list[bool]) -> list[BlockStored]:
    """``e`` cut to its runs of kept blocks."""
    out, i, n = [], 0, len(keep)
    while i < n:
        if not keep[i]:
            i += 1
            continue
        j = i
        while j < n and keep[j]:
            j += 1
        out.append(cut_event(e, i, j - 1))
        i = j
    return out
