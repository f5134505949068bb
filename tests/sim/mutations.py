"""Defects from the project's history, re-introduced one at a time by a switch (a monkeypatch of
the product for the duration of a run; nothing of it is left in the product), to show that the
simulator finds each class of defect. ``applied(name)`` is the switch; ``MUTATIONS`` names them
with the commit that fixed each (docs/testing.md has the table of schedules until found)."""

from __future__ import annotations

import contextlib
import time

MUTATIONS: dict = {}


def mutation(name: str, fixed_by: str, what: str):
    def register(fn):
        MUTATIONS[name] = (fn, fixed_by, what)
        return fn
    return register


@contextlib.contextmanager
def applied(name):
    if not name:
        yield
        return
    fn, _, _ = MUTATIONS[name]
    undo = []

    def patch(obj, attr, value):
        undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    fn(patch)
    try:
        yield
    finally:
        for obj, attr, value in reversed(undo):
            setattr(obj, attr, value)


@contextlib.contextmanager
def redis_for_sim(wanted: bool):
    """A real redis-server on loopback for the run (None when not wanted)."""
    if not wanted:
        yield None
        return
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


# -- the defects ---------------------------------------------------------------------------------

@mutation("turn-end-queued-before-reset", "8c79212 review / test_resets",
          "a turn end queued before a reset is sent after it (its KV: the older weights')")
def _turn_end_queued_before_reset(patch):
    from lmcache_hma.scheduler.scheduler_half import SchedulerHalf

    def keep_them(self, req_ids=None):
        self._turn_saves = list(self._turn_saves)
    patch(SchedulerHalf, "_drop_turn_saves", keep_them)


@mutation("saves-planned-before-reset-stored", "0b032c7 (reset fence)",
          "a step built before a reset stores its KV after it")
def _saves_before_reset(patch):
    from lmcache_hma.worker.gathers import Gathers

    patch(Gathers, "built_before_reset", lambda self, meta, saves: False)


@mutation("reset-keeps-local-tiers", "reset (local tiers)",
          "a reset leaves the CPU and disk tiers as they were (stale KV after a weight update)")
def _reset_keeps_local(patch):
    from lmcache_hma.store.chunk_store import ChunkStore

    patch(ChunkStore, "clear_local", lambda self: 0)
    # since issue 58 objects are named by weights generation too: the older weights' objects
    # left in the tiers are unreachable; the defect was both gone
    _keep_names(patch)


@mutation("redis-keeps-older-weights", "issue 58 (weights generation in object names)",
          "a weight update leaves object names as they were: Redis serves the older weights' KV")
def _redis_weights(patch):
    _keep_names(patch)


def _keep_names(patch):
    """A reset fences the store but names objects in the weights generation they had."""
    from lmcache_hma.store.chunk_store import ChunkStore

    new_generation = ChunkStore.new_generation
    patch(ChunkStore, "new_generation", lambda self, weights=None: new_generation(self))


@mutation("kept-blocks-not-given-back", "2a2f467 / bind_kv_cache_manager",
          "vLLM's own reset finds blocks kept for turn ends in use and fails")
def _kept_blocks(patch):
    from lmcache_hma.scheduler.scheduler_half import SchedulerHalf

    patch(SchedulerHalf, "bind_kv_cache_manager", lambda self, manager: setattr(self, "_kv_cache_manager", manager))


@mutation("turn-end-sliding-block-unwritten", "97dbedf class (shared-shape turn ends)",
          "a turn end's object leaves the first sliding block of the window out: a load leaves it unwritten")
def _sliding_block(patch):
    from lmcache_hma.core.kinds import GroupKind
    from lmcache_hma.core.layout import HybridLayout, Segment

    turn_segments = HybridLayout.turn_segments

    def short(self, chunk, end, on_tail=False):
        out = []
        for seg in turn_segments(self, chunk, end, on_tail):
            g = self.groups[seg.group]
            if g.kind is GroupKind.SLIDING and seg.num_blocks > 1:
                seg = Segment(seg.group, seg.first_block + 1, seg.num_blocks - 1)
            out.append(seg)
        return out
    patch(HybridLayout, "turn_segments", short)


@mutation("read-put-back-after-reset", "0b032c7 / 8c79212 review",
          "an object a read brought in is kept in CPU memory whatever reset came meanwhile")
def _put_back(patch):
    from lmcache_hma.store.chunk_store import ChunkStore

    def keep(self, key, obj, clears):
        self._memory.keep(key, obj, self._on_stored(self._memory))
    patch(ChunkStore, "_keep_in_memory", keep)
    # since issue 58 a reset renames every object (weights generation): a read named before it
    # is unreachable after it; the defect was both gone
    _keep_names(patch)


@mutation("next-turn-does-not-wait", "c55bebf",
          "a next turn arriving before the previous turn end is stored is looked up at once (misses it)")
def _no_wait(patch):
    from lmcache_hma.scheduler.turn_end_landing import TurnEndLanding

    patch(TurnEndLanding, "decide", lambda self, state, chunks, limit, unsent: None)


@mutation("turn-end-key-ignores-last-token", "turn end keys",
          "a turn end's key covers one token fewer: a next turn that differs there hits it")
def _turn_key(patch):
    from lmcache_hma.core.keys import ChunkHasher

    digest = ChunkHasher.turn_digest

    def shorter(self, previous, token_ids, start, end, extra_keys, lookahead=0, on_tail=False):
        ids = list(token_ids)
        if end - 1 > start:
            ids[end - 1] = 0
        return digest(self, previous, ids, start, end, extra_keys, lookahead, on_tail)
    patch(ChunkHasher, "turn_digest", shorter)


@mutation("marker-rewrite-stale-child", "9e12d10",
          "a marker rewritten with the other on_tail stays a child of its first parent too (pins it)")
def _marker_rewrite(patch):
    from lmcache_hma.store.value_policy import ValuePolicy

    def attach(self, key, line):
        self._lines[key] = line  # the old parent's record of it is left
        if line.parent is not None:
            self._kids.setdefault(line.parent, set()).add(key)
    patch(ValuePolicy, "_attach", attach)


@mutation("supersession-zeroes-shared-tail", "35046ad",
          "what a conversation went on from loses every use, a shared document's tail too")
def _supersession(patch):
    from lmcache_hma.store.value_policy import ValuePolicy

    superseded = ValuePolicy._superseded

    def zero(self, key, uses=0):
        use = self._uses.get(key)
        superseded(self, key, uses=(use.uses if use is not None else 0) or uses or self.CONVERSATION_USES)
    patch(ValuePolicy, "_superseded", zero)


@mutation("settle-waits-on-backlog", "a4b7441",
          "a lookup's wait for the store writer is for everything queued before it, not its own objects")
def _settle_backlog(patch):
    from lmcache_hma.worker.lookups import LookupAnswers

    def whole_queue(self, req_id, hold_by, hashes, settle):
        self.writer.wait_stored(None if hold_by is None else hold_by, None)
    patch(LookupAnswers, "_let_land", whole_queue)


@mutation("lookup-ignores-queued-chunks", "the eagle3 CI flake (lookups.py _let_land)",
          "a lookup does not let its own chunks still queued for the writer land: a repeated prompt misses")
def _ignores_queued(patch):
    from lmcache_hma.worker.lookups import LookupAnswers

    let_land = LookupAnswers._let_land
    patch(LookupAnswers, "_let_land", lambda self, req_id, hold_by, hashes, settle: let_land(self, req_id, hold_by, (), settle))


@mutation("lookup-claims-unstored-chunk", "longest_hit (the lookup rule)",
          "a lookup answers one chunk more than the tiers hold (its load finds nothing: recomputed)")
def _one_more(patch):
    from lmcache_hma.worker import lookups

    rule = lookups.longest_hit

    def one_more(flags, boundaries):
        n = rule(flags, boundaries)
        return n + 1 if 0 < n < len(flags) else n
    patch(lookups, "longest_hit", one_more)


@mutation("disk-read-waits-for-memory", "4cbad17 (lmcache_compat.keep_disk_room)",
          "a disk read waits for CPU memory to read into (LMCache's busy loop): a step that never ends")
def _disk_read_waits(patch):
    from lmcache_hma.store import lmcache_compat

    keep = lmcache_compat.keep_disk_room

    def waiting(disk_backend):
        room = keep(disk_backend)
        read = disk_backend.load_bytes_from_disk

        def load_bytes_from_disk(key, path, dtype, shape, fmt):
            while True:  # LMCache's allocate(busy_loop=True): retried every 0.1 s until room comes
                try:
                    return read(key, path, dtype, shape, fmt)
                except lmcache_compat.NoMemoryForRead:
                    if lmcache_compat.keep_disk_room is not waiting:
                        raise  # the mutation is undone: a thread the watchdog left stops spinning
                    time.sleep(0.1)
        disk_backend.load_bytes_from_disk = load_bytes_from_disk
        return room
    patch(lmcache_compat, "keep_disk_room", waiting)


# The first schedule (seed, with Redis) that found each mutation, searching seeds 0, 1, ... without
# Redis (``python -m tests.sim --mutation NAME --stop``); tests/test_sim.py replays each. A
# mutation missing here was not found: docs/testing.md says why.
@mutation("device-events-per-copy", "130b216 / scheduler.device_events",
          "vLLM's device events announce every copy of a block hash (as vLLM makes them)")
def _device_events_per_copy(patch):
    from lmcache_hma.scheduler.device_events import DeviceEventDedup

    patch(DeviceEventDedup, "_another_copy", lambda self, held, key: False)


@mutation("device-events-ungated", "2ae1d41 / scheduler.device_restorable",
          "vLLM's device events announce full-attention blocks its hit cannot reach (the window evicted)")
def _device_events_ungated(patch):
    from lmcache_hma.scheduler.device_restorable import DeviceRestorable

    patch(DeviceRestorable, "rewrite", lambda self, events: events)


@mutation("lookup-ignores-gathers", "b89ce6a / Gathers.gather_for_lookup",
          "a lookup does not gather its chunks planned on a gather thread that has not run")
def _lookup_ignores_gathers(patch):
    from lmcache_hma.worker.gathers import Gathers

    patch(Gathers, "gather_for_lookup", lambda self, by, objects: True)


FOUND_BY = {
    "device-events-ungated": (0, False),
    "lookup-ignores-gathers": (2, False),
    "device-events-per-copy": (0, False),
    "saves-planned-before-reset-stored": (1, False),
    "reset-keeps-local-tiers": (1, False),
    "kept-blocks-not-given-back": (0, False),
    "turn-end-queued-before-reset": (0, False),
    "turn-end-key-ignores-last-token": (12, False),
    "turn-end-sliding-block-unwritten": (0, False),
    "settle-waits-on-backlog": (0, False),
    "lookup-ignores-queued-chunks": (2, False),
    "lookup-claims-unstored-chunk": (0, False),
    "read-put-back-after-reset": (1, False),
    "next-turn-does-not-wait": (113, False),
    "disk-read-waits-for-memory": (266, False),  # with a 10 s step limit (tests/test_sim.py)
    "redis-keeps-older-weights": (10000, True),  # searched from seed 10000 with --redis
    "marker-rewrite-stale-child": (10019, True),  # the Redis room's policy (a marker rewritten in place)
}
