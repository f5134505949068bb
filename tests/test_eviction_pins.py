"""Value eviction never pins (store.value_policy): after any sequence of puts, marker rewrites
with either parent, removals and evictions, every object's recorded children are objects still
in the tier, and a tier can be emptied by value alone (no object is kept because a child that
left, or one rewritten under another parent, still counts).

Random sequences, seeded, on LMCache's real CPU tier through a ``ChunkStore`` (``commit_many``
as the writer calls it: a marker's line recorded, then the old marker removed, then the new one
put) and on the Redis room's ranking (``store.redis.room``: no delete of its own, so a pin there
is for good). A turn-end marker's parent is the tail before its chunk when its turn ends are
``on_tail``, else that chunk: two requests on the same chunk, one whose prefix came from vLLM's
own prefix cache, rewrite it under each in turn. The lineage keeps few lines (``Lineage.KEPT``),
so lines of objects still in the tier are dropped too.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef
from lmcache_hma.store import lmcache_compat
from lmcache_hma.store.redis.room import RedisRoom
from lmcache_hma.store.value_policy import Line, Lineage, ValuePolicy
from tests.test_store import namespace, open_store
from tests.test_value_policy import Clock

SIZES = {ObjectKind.FULL: 16 << 10, ObjectKind.TAIL: 64 << 10, ObjectKind.TURN: 32 << 10, ObjectKind.TURNMARK: 64}


def chunk_hashes(path) -> list[bytes]:
    return [hashlib.sha256(repr(path[:i + 1]).encode()).digest() for i in range(len(path))]


def request_refs(rng: random.Random) -> list[ObjectRef]:
    """A request's objects: its chunks (a prefix from a small tree, so requests share and rewrite),
    maybe the tail at its end, maybe a turn end after it with its marker, ``on_tail`` or not."""
    path = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 5)))
    hashes = chunk_hashes(path)
    last = len(hashes) - 1
    refs = [ObjectRef(ObjectKind.FULL, c, hashes[c], parent=hashes[c - 1] if c else b"") for c in range(len(hashes))]
    if rng.random() < 0.6:
        refs.append(ObjectRef(ObjectKind.TAIL, last, hashes[last]))
    if rng.random() < 0.6:
        on_tail, end = rng.random() < 0.5, (last + 1) * 8 + rng.randrange(1, 8)
        turn = hashlib.sha256(repr((path, end, on_tail)).encode()).digest()
        refs += [ObjectRef(ObjectKind.TURN, last + 1, turn, end, on_tail=on_tail, parent=hashes[last]),
                 ObjectRef(ObjectKind.TURNMARK, last + 1, hashes[last], end, on_tail)]
    return refs


def kids_in_tier(policy: ValuePolicy, held) -> list:
    """(parent, child) pairs the policy records whose child is not held (each one pins its parent)."""
    return [(parent, kid) for parent, kids in policy._kids.items() for kid in kids if kid not in held]


@pytest.mark.parametrize("seed", range(3))
def test_no_object_of_the_cpu_tier_is_pinned_by_a_child_it_no_longer_has(tmp_path, seed):
    rng = random.Random(seed)
    store = open_store(tmp_path, namespace(), "value", max_local_cpu_size=0.001)  # ~ a dozen requests
    store.lineage.KEPT = 40
    tier = store.tier("cpu")
    policy, clock = tier.backend.cache_policy, Clock()
    policy.clock = clock
    try:
        for step in range(300):
            clock.now += rng.choice((1, ValuePolicy.GRACE + 1))
            if rng.random() < 0.15:  # a removal (a damaged object, a reset of one key)
                keys = lmcache_compat.local_keys(tier.backend)
                if keys:
                    tier.remove(rng.choice(keys))
                continue
            refs = [r for r in request_refs(rng) if rng.random() < 0.9 or r.kind is ObjectKind.TURNMARK]
            items = [(r.kind, r.chunk_hash, store.allocate(SIZES[r.kind])) for r in refs]
            kept = [(item, r) for item, r in zip(items, refs) if item[2] is not None]
            store.commit_many([item for item, _ in kept], refs=[r for _, r in kept])
            with lmcache_compat.backend_lock(tier.backend):
                held = set(lmcache_compat.backend_index(tier.backend))
                assert kids_in_tier(policy, held) == [], f"step {step}"
        assert policy.evicted.get("value", 0) > 20, "the tier must fill and evict (else this proves nothing)"
        clock.now += ValuePolicy.GRACE + 1
        policy.fallback = False  # only what no other object needs
        while True:
            with lmcache_compat.backend_lock(tier.backend):
                picked = policy.get_evict_candidates(lmcache_compat.backend_index(tier.backend), 1)
            if not picked:
                break
            tier.remove(picked[0])
        left = lmcache_compat.local_keys(tier.backend)
        assert left == [], f"{len(left)} objects pinned: {[store.keys.kind_of(k) for k in left]}"
    finally:
        store.close()


@pytest.mark.parametrize("seed", range(3))
def test_no_object_of_the_redis_room_is_pinned_by_a_child_it_no_longer_has(seed):
    rng = random.Random(seed)
    lineage = Lineage()
    lineage.KEPT = 40
    room = RedisRoom(lineage, boundary_hits=True)
    clock = Clock()
    room.policy.clock = clock
    key = lambda kind, h: (kind, h)  # noqa: E731  (any hashable key does for the room)
    for step in range(300):
        clock.now += rng.choice((1, ValuePolicy.GRACE + 1))
        roll = rng.random()
        if roll < 0.1 and room._known:  # a delete, or a miss: not in Redis
            room.gone([rng.choice(list(room._known))])
        elif roll < 0.2 and room._known:  # room made by value
            for k in room.choose(rng.randrange(1, 200 << 10)):
                room.gone([k])
        else:
            refs = request_refs(rng)
            keys = []
            for r in refs:  # each line as ChunkStore._line makes it
                if r.kind is ObjectKind.FULL:
                    parent = key(ObjectKind.FULL, r.parent) if r.parent else None
                elif r.kind is ObjectKind.TURN:
                    parent = key(ObjectKind.TURNMARK, r.parent)
                elif r.kind is ObjectKind.TURNMARK and r.on_tail:
                    parent = key(ObjectKind.TAIL, r.chunk_hash)
                else:
                    parent = key(ObjectKind.FULL, r.chunk_hash)
                lineage.record(key(r.kind, r.chunk_hash), Line(parent, 8, r.kind, SIZES[r.kind]))
                keys.append(key(r.kind, r.chunk_hash))
            room.choose(0, coming=keys)
            room.written(keys)
        assert kids_in_tier(room.policy, set(room._known)) == [], f"step {step}"
    clock.now += ValuePolicy.GRACE + 1
    room.choose(1 << 60)
    assert list(room._known) == [], f"{len(room._known)} objects pinned"
