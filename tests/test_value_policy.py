"""``hma_eviction: value`` (store.value_policy) on LMCache's real CPU and disk tiers, no engine.

A RAG-shaped trace is played against a ``ChunkStore`` as the connector plays it: each request
looks up the longest restorable prefix (``core.hit_rule``), reads its objects, then stores what it
computed (its chunks, the tail at its prompt's end, a turn end and its marker), each object with
its parent (``ObjectRef.parent``). The tier holds about a third of the trace. The policy's clock
is the test's: each request is ``GRACE`` after the last, so nothing is spared as just stored.
"""

import hashlib
import random
from collections import OrderedDict

import pytest

from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef
from lmcache_hma.store import lmcache_compat
from lmcache_hma.store.lmcache_storage import release
from lmcache_hma.store.value_policy import Line, Lineage, ValuePolicy
from tests.test_store import namespace, open_store

FULL_BYTES, TAIL_BYTES, TURN_BYTES = 16 << 10, 128 << 10, 160 << 10
SHARED, DOCS, DOC_CHUNKS = 2, 12, 6


def digests(path: tuple) -> list[bytes]:
    return [hashlib.sha256(repr(path[:i + 1]).encode()).digest() for i in range(len(path))]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Player:
    """Plays requests against a store the way the connector's halves use it."""

    def __init__(self, store, clock):
        self.store, self.clock, self.hit_chunks = store, clock, 0

    def serve(self, path: tuple, turn: int) -> int:
        """One request whose chunks are ``path`` (then a partial chunk, a turn end): its hit, in chunks."""
        self.clock.now += ValuePolicy.GRACE + 1
        store, hashes = self.store, digests(path)
        full, tail = store.present(ObjectKind.FULL, hashes), store.present(ObjectKind.TAIL, hashes)
        hit = longest_hit(full, tail)
        if hit:
            wanted = [(ObjectKind.FULL, h, FULL_BYTES) for h in hashes[:hit]] + [(ObjectKind.TAIL, hashes[hit - 1], TAIL_BYTES)]
            got = store.get_many(wanted)
            for obj, _ in got:
                if obj is not None:
                    release(obj)
        self.hit_chunks += hit
        run = longest_hit(full, None)  # chunks found stored are not stored again (scheduler_half)
        refs = [(ObjectRef(ObjectKind.FULL, c, hashes[c], parent=hashes[c - 1] if c else b""), FULL_BYTES)
                for c in range(run, len(hashes))]
        last = len(hashes) - 1
        refs.append((ObjectRef(ObjectKind.TAIL, last, hashes[last]), TAIL_BYTES))
        turn_key = hashlib.sha256(b"turn %d" % turn).digest()
        refs.append((ObjectRef(ObjectKind.TURN, last + 1, turn_key, (last + 1) * 8 + 5, parent=hashes[last]), TURN_BYTES))
        refs.append((ObjectRef(ObjectKind.TURNMARK, last + 1, hashes[last], (last + 1) * 8 + 5), 64))
        items, kept = [], []
        for ref, size in refs:
            obj = store.allocate(size)
            if obj is not None:
                items.append((ref.kind, ref.chunk_hash, obj))
                kept.append(ref)
        store.commit_many(items, refs=kept)
        return hit


def rag_paths(n: int, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    weights = [1 / (d + 1) for d in range(DOCS)]
    out = []
    for _ in range(n):
        doc = rng.choices(range(DOCS), weights)[0]
        out.append(tuple(range(SHARED)) + tuple(1000 * (doc + 1) + i for i in range(DOC_CHUNKS)))
    return out


def orphans(store, tier_label: str) -> list:
    """Keys the tier holds whose parent no local tier holds (no lookup reaches them)."""
    backend = store.tier(tier_label).backend
    out = []
    for key in lmcache_compat.local_keys(backend):
        line = store.lineage.get(key)
        if line is not None and line.parent is not None and not any(t.holds(line.parent) for t in store.tiers if t.local):
            out.append(key)
    return out


def play(tmp_path, eviction: str, tier: str = "cpu", n: int = 120, keep_open: bool = False):
    """(hit chunks, orphans left, the store) of the RAG trace on a tier of ~1/3 of it (the store
    closed, unless ``keep_open``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    keys = dict(max_local_cpu_size=0.004)
    if tier == "disk":
        keys = dict(max_local_cpu_size=0.004, local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.004)
    store = open_store(tmp_path, namespace(), eviction, **keys)
    clock = Clock()
    for t in store.tiers:
        if isinstance(t.backend.cache_policy, ValuePolicy):
            t.backend.cache_policy.clock = clock
    try:
        player = Player(store, clock)
        for i, path in enumerate(rag_paths(n)):
            player.serve(path, i)
        if tier == "disk":
            from tests.waiting import wait_for
            wait_for(lambda: not store.writes_pending(), what="disk writes")
        left = orphans(store, tier)
    except BaseException:
        store.close()
        raise
    if not keep_open:
        store.close()
    return player.hit_chunks, left, store


def test_value_eviction_keeps_every_tier_prefix_closed_where_lru_leaves_orphans(tmp_path):
    """The same trace, the same tier size: LRU keeps chunks whose earlier chunk it dropped (no
    lookup can reach them); value eviction drops only what nothing else needs, and serves more."""
    lru_hits, lru_orphans, _ = play(tmp_path / "lru", "lru")
    value_hits, value_orphans, _ = play(tmp_path / "value", "value")
    assert lru_orphans, "the trace should make LRU orphan chunks (else this test proves nothing)"
    assert value_orphans == []
    assert value_hits > lru_hits, (value_hits, lru_hits)


def useless_first(store, tier_label: str) -> list:
    """The keys the tier's policy would drop first as useless (orphans, a bare chunk, a marker
    with no turn end), before any object a lookup can use. Asks its choice (``_pick``) for one
    key at a time, not ``get_evict_candidates``: that forgets each key it gives, and forgetting
    a leaf it would drop by value changes what the next choice sees."""
    tier = store.tier(tier_label)
    policy, out = tier.backend.cache_policy, []
    with lmcache_compat.backend_lock(tier.backend):
        index = lmcache_compat.backend_index(tier.backend)
        while True:
            picked = policy._pick(index, set(out))
            if picked is None or picked[1] != "useless":
                return out
            out.append(picked[0])


def test_the_disk_tier_is_kept_prefix_closed_too(tmp_path):
    """No chunk, tail or turn end without its prefix, but for a moment: what two tiers hold is
    prefix-closed across them, so a chunk on disk whose parent was in CPU memory only is an
    orphan once CPU memory drops the parent; the disk tier is told, and drops it first when it
    next needs room. (How many are left at the end depends on when the disk writes landed.)"""
    hits, left, store = play(tmp_path, "value", tier="disk", keep_open=True)
    try:
        first = useless_first(store, "disk")
        assert set(left) <= set(first) and hits > 0, [(store.keys.kind_of(k), k in first) for k in left]
    finally:
        store.close()


def test_a_chunk_whose_parent_left_both_tiers_goes_first_from_disk(tmp_path):
    """Chunk ``a`` leaves the disk tier first (still in CPU memory: ``b`` after it on disk is
    reachable, kept), then CPU memory: the disk tier is told, and drops ``b`` first."""
    store = open_store(tmp_path, namespace(), "value", local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.004)
    try:
        a, b = digests((1, 2))
        refs = [ObjectRef(ObjectKind.FULL, 0, a), ObjectRef(ObjectKind.FULL, 1, b, parent=a),
                ObjectRef(ObjectKind.TAIL, 1, b)]  # a hit ends at the tail
        store.commit_many([(r.kind, r.chunk_hash, store.allocate(FULL_BYTES)) for r in refs], refs=refs)
        from tests.waiting import wait_for
        wait_for(lambda: not store.writes_pending(), what="disk writes")
        key_a, key_b = store.key(ObjectKind.FULL, a), store.key(ObjectKind.FULL, b)
        store.tier("disk").remove(key_a)
        assert useless_first(store, "disk") == []  # its parent is in CPU memory: reachable
        store.tier("cpu").remove(key_a)
        assert useless_first(store, "disk") == [key_b]  # (its tail: once CPU memory drops b too)
    finally:
        store.close()


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_a_document_read_again_and_again_outlives_objects_used_once(tmp_path, eviction):
    """Value per byte with frequency: a document read every 12th request (more bytes than the
    tier holds are stored in between, mostly unique documents and turn ends used once) stays
    under value eviction; LRU drops it each time before it is read again."""
    store = open_store(tmp_path, namespace(), eviction, max_local_cpu_size=0.004)
    clock = Clock()
    if eviction == "value":
        store.tier("cpu").backend.cache_policy.clock = clock
    try:
        player = Player(store, clock)
        popular = tuple(range(SHARED)) + tuple(1000 + i for i in range(DOC_CHUNKS))
        hits = []
        for i in range(72):
            if i % 12 == 0:
                hits.append(player.serve(popular, i))
            else:
                player.serve(tuple(range(SHARED)) + tuple(5000 * (i + 1) + j for j in range(DOC_CHUNKS)), i)
        # the first read stores it; value eviction serves every later one whole, LRU none
        assert hits[1:] == ([SHARED + DOC_CHUNKS] * 5 if eviction == "value" else [0] * 5), hits
    finally:
        store.close()


def test_the_last_chunk_a_request_stored_is_kept_until_its_grace_ends(tmp_path):
    """A request's chunks land before the next ones and the tail that end them: within
    ``GRACE`` its last bare chunk is neither dropped as useless (no hit can end at it) nor by
    value (dropping it would orphan what follows); past it, it is useless."""
    store = open_store(tmp_path, namespace(), "value", max_local_cpu_size=0.004)
    clock = Clock()
    policy = store.tier("cpu").backend.cache_policy
    policy.clock = clock
    try:
        hashes = digests((1, 2))
        items = [(ObjectKind.FULL, h, store.allocate(FULL_BYTES)) for h in hashes]
        store.commit_many(items, refs=[ObjectRef(ObjectKind.FULL, 0, hashes[0]),
                                       ObjectRef(ObjectKind.FULL, 1, hashes[1], parent=hashes[0])])
        index = lmcache_compat.backend_index(store.tier("cpu").backend)
        key = store.key(ObjectKind.FULL, hashes[1])
        from tests.waiting import wait_for
        wait_for(lambda: key in index, what="the put")
        policy.get_evict_candidates(index)  # the frontier chunk is kept: only the walk of the tier
        assert policy.evicted == {"needed": 1}
        for k in list(index):
            policy.update_on_put(k)  # (taken above only on paper: back in the books)
        clock.now += 2 * ValuePolicy.GRACE
        assert policy.get_evict_candidates(index) == [key] and policy.evicted.get("useless") == 1
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["value", "lru"])
def test_hma_eviction_reaches_the_tiers(tmp_path, mode):
    from lmcache_hma.store.chunk_store import ChunkStore
    from lmcache_hma.config.settings import load_config
    from tests.engines import write_yaml

    cfg = load_config({"lmcache_config_file": str(write_yaml(tmp_path / "c.yaml", chunk_size=8, local_cpu=True,
                                                             max_local_cpu_size=0.01,
                                                             extra_config={"hma_eviction": mode}))})
    assert cfg.eviction == mode
    store = ChunkStore(cfg.lmcache, namespace(), eviction=cfg.eviction)
    try:
        assert isinstance(store.tier("cpu").backend.cache_policy, ValuePolicy) == (mode == "value")
    finally:
        store.close()


def test_a_turn_end_on_tail_keeps_the_tail_it_reads(tmp_path):
    """A marker written for a turn end ``on_tail`` (its window before its chunk is the tail there)
    hangs off that tail, so the tail is no leaf while the turn end is kept: value eviction never
    drops it first. A marker of whole-window turn ends hangs off the chunk."""
    store = open_store(tmp_path, namespace(), "value")
    try:
        h = digests((1, 2))
        refs = [ObjectRef(ObjectKind.FULL, 0, h[0]), ObjectRef(ObjectKind.FULL, 1, h[1], parent=h[0]),
                ObjectRef(ObjectKind.TAIL, 1, h[1]),
                ObjectRef(ObjectKind.TURN, 2, b"t" * 32, 21, on_tail=True, parent=h[1]),
                ObjectRef(ObjectKind.TURNMARK, 2, h[1], 21, on_tail=True)]
        items = [(r.kind, r.chunk_hash, store.allocate(64)) for r in refs]
        store.commit_many(items, refs=refs)
        line = store.lineage.get(store.key(ObjectKind.TURNMARK, h[1]))
        assert line.parent == store.key(ObjectKind.TAIL, h[1])
        assert store.lineage.get(store.key(ObjectKind.TURN, b"t" * 32)).parent == store.key(ObjectKind.TURNMARK, h[1])
        whole = ObjectRef(ObjectKind.TURNMARK, 2, h[1], 22)
        store.commit_many([(whole.kind, whole.chunk_hash, store.allocate(64))], refs=[whole])
        assert store.lineage.get(store.key(ObjectKind.TURNMARK, h[1])).parent == store.key(ObjectKind.FULL, h[1])
    finally:
        store.close()


def test_a_disk_write_in_flight_keeps_its_parent_and_is_a_candidate_once_it_lands():
    """LMCache's disk tier evicts for a put before it tells the policy of it, and tells it
    (``update_on_put``) before the write lands in its index. The parent of a write in flight is no
    leaf (``expect``: else the room made for a turn end could be its own tail, and an orphan
    lands); a write met by a pick while in flight is chosen by value once it lands (``landed``),
    not left to the fallback that drops what others need."""
    from collections import OrderedDict

    from lmcache_hma.store.value_policy import Line, Lineage

    lineage, clock = Lineage(), Clock()
    policy = ValuePolicy(lineage, kind_of=lambda key: None, boundary_hits=True, clock=clock)
    lineage.record("tail", Line(None, 8, ObjectKind.TAIL, TAIL_BYTES))
    lineage.record("turn", Line("tail", 40, ObjectKind.TURN, TURN_BYTES))
    lineage.record("other", Line(None, 1, ObjectKind.TAIL, TAIL_BYTES))
    disk = OrderedDict(tail=object())
    policy.update_on_put("tail")
    policy.expect("turn")  # the put of the turn end is being admitted
    assert policy.get_evict_candidates(disk) == ["tail"] and policy.evicted == {"needed": 1}  # only by fallback
    policy.update_on_put("tail")  # (back in the books)
    policy.update_on_put("turn")  # admitted: told before the write lands
    clock.now += 2 * ValuePolicy.GRACE
    assert policy.get_evict_candidates(disk) == ["tail"] and policy.evicted == {"needed": 2}  # the turn end is not in yet
    policy.update_on_put("tail")
    disk["turn"] = object()
    policy.landed("turn")
    assert policy.get_evict_candidates(disk) == ["turn"] and policy.evicted == {"needed": 2, "value": 1}
    policy.update_on_put("other")
    policy.unexpect("other")  # a write not made: no child of anything, nothing changes
    policy.expect("turn")
    policy.unexpect("turn")  # (not in the books any more: detached from its parent)
    assert policy.get_evict_candidates(disk) == ["tail"] and policy.evicted["value"] == 2


def test_what_an_eviction_leaves_useless_goes_next_grace_or_not():
    """A document's tail is dropped by value: its last chunk, a bare chunk no hit can end at
    (``boundary_hits``), goes next, although it was read just now and is worth more per byte
    than the other document's tail (nothing is on its way to it: its tail was dropped, not not
    yet stored); then the chunk before it, down to the branch point (the system prompt's chunk,
    which the other document still needs). Without that, the chain would wait out its grace while
    the other document's tail went."""
    from collections import OrderedDict

    from lmcache_hma.store.value_policy import Line, Lineage

    lineage, clock = Lineage(), Clock()
    policy = ValuePolicy(lineage, kind_of=lambda key: None, boundary_hits=True, clock=clock)
    lines = {"sys": Line(None, 256, ObjectKind.FULL, FULL_BYTES),
             "a1": Line("sys", 256, ObjectKind.FULL, FULL_BYTES), "a2": Line("a1", 256, ObjectKind.FULL, FULL_BYTES),
             "a.tail": Line("a2", 512, ObjectKind.TAIL, TAIL_BYTES),
             "b1": Line("sys", 256, ObjectKind.FULL, FULL_BYTES), "b.tail": Line("b1", 256, ObjectKind.TAIL, TAIL_BYTES)}
    tier = OrderedDict()
    for key, line in lines.items():
        lineage.record(key, line)
        tier[key] = object()
        policy.update_on_put(key)
    clock.now += 2 * ValuePolicy.GRACE
    for key in ("sys", "a1", "a2", "a1", "a2", "b1", "b.tail"):  # read now: within the grace again
        policy.update_on_hit(key, tier)
    picked = [policy.get_evict_candidates(tier)[0] for _ in range(3)]
    assert picked == ["a.tail", "a2", "a1"] and policy.evicted == {"value": 1, "useless": 2}, (picked, policy.evicted)
    assert policy.get_evict_candidates(tier) == ["b.tail"]  # then by value again; "sys" is b1's parent


def test_the_grace_is_counted_in_puts():
    """By default the policy's clock is the puts into its tier: a bare chunk is the frontier of a
    request in progress for ``GRACE`` puts, however long they take."""
    from collections import OrderedDict

    from lmcache_hma.store.value_policy import Line, Lineage

    lineage = Lineage()
    policy = ValuePolicy(lineage, kind_of=lambda key: None, boundary_hits=True)
    lineage.record("c0", Line(None, 256, ObjectKind.FULL, FULL_BYTES))
    tier = OrderedDict(c0=object())
    policy.update_on_put("c0")
    assert policy.get_evict_candidates(tier) == ["c0"] and policy.evicted == {"needed": 1}  # only by the fallback
    policy.update_on_put("c0")
    for i in range(ValuePolicy.GRACE):
        lineage.record(i, Line(None, 1, ObjectKind.TAIL, TAIL_BYTES))
        policy.update_on_put(i)
    assert policy.get_evict_candidates(tier) == ["c0"] and policy.evicted == {"needed": 1, "useless": 1}


def test_an_object_stored_again_counts_the_uses_it_had():
    """An object that left the tier and is stored again (the next request that needed it
    recomputed it) keeps the uses it had: a document read five times, evicted once, is worth more
    than one read once when both are stored again (else every return starts from one use and a
    document that comes back often is dropped before each next read)."""
    from collections import OrderedDict

    from lmcache_hma.store.value_policy import Line, Lineage

    lineage, clock = Lineage(), Clock()
    policy = ValuePolicy(lineage, kind_of=lambda key: None, boundary_hits=True, clock=clock)
    for key in ("often", "once"):
        lineage.record(key, Line(None, 512, ObjectKind.TAIL, TAIL_BYTES))
    tier = OrderedDict(often=object())
    policy.update_on_put("often")
    for _ in range(4):
        policy.update_on_hit("often", tier)
    clock.now += 2 * ValuePolicy.GRACE
    assert policy.get_evict_candidates(tier) == ["often"]
    del tier["often"]
    tier["often"], tier["once"] = object(), object()
    policy.update_on_put("often")  # the older of the two: alike, it would go first
    policy.update_on_put("once")
    clock.now += 2 * ValuePolicy.GRACE
    assert policy.get_evict_candidates(tier) == ["once"]


def test_the_heaps_stay_bounded_in_a_tier_that_never_evicts():
    """Every use pushes heap entries; they are rebuilt when mostly stale on a push, not only when
    the tier evicts (a tier that never fills, a Redis never near its limit, makes no choice)."""
    from lmcache_hma.store.value_policy import Line, Lineage

    lineage = Lineage()
    policy = ValuePolicy(lineage, kind_of=lambda key: None, boundary_hits=True)
    lineage.record("c", Line(None, 256, ObjectKind.FULL, FULL_BYTES))
    policy.update_on_put("c")
    for _ in range(10_000):
        policy.update_on_hit("c", {})
    assert len(policy._by_value) + len(policy._by_age) <= 8 + 1024 + 2


def test_redis_room_never_deletes_the_parent_of_a_write_it_makes_room_for():
    """``RedisRoom.choose(short, coming)``: the parent of an object about to be written is no
    leaf, so the room made for a tail is never its own chunk's (an orphan would land)."""
    from lmcache_hma.store.redis.room import RedisRoom
    from lmcache_hma.store.value_policy import Line, Lineage

    lineage, clock = Lineage(), Clock()
    room = RedisRoom(lineage, boundary_hits=True)
    room.policy.clock = clock
    lineage.record("chunk", Line(None, 256, ObjectKind.FULL, FULL_BYTES))
    lineage.record("tail", Line("chunk", 512, ObjectKind.TAIL, TAIL_BYTES))
    room.written(["chunk"])
    clock.now += 2 * ValuePolicy.GRACE  # a bare chunk past its grace: useless, unless its tail is coming
    assert room.choose(1 << 30, coming=["tail"]) == []
    room.unexpect(["tail"])  # that write failed
    assert room.choose(1 << 30) == ["chunk"]



def test_a_turn_end_its_conversation_went_on_from_goes_first(tmp_path):
    """Conversation A's turn 2 read its turn 1's turn end and stored its own, naming turn 1's as
    superseded (``ObjectRef.supersedes``, through the store's ``Line``): turn 1's goes before
    conversation B's turn end, although it was used later and more often (read once); only a
    request that diverges exactly there (a retry of that turn) reads it again. Without it, B's
    turn end, which B's next turn reads, goes first."""
    store = open_store(tmp_path, namespace(), "value")
    clock = Clock()
    policy = store.tier("cpu").backend.cache_policy
    policy.clock = clock
    index = lmcache_compat.backend_index(store.tier("cpu").backend)

    def turn(chunk, chunk_hash, before, end, gain, supersedes=()):
        return [ObjectRef(ObjectKind.TURN, chunk, chunk_hash, end, parent=before, gain=gain, supersedes=supersedes),
                ObjectRef(ObjectKind.TURNMARK, chunk, before, end)]

    def commit(refs):
        clock.now += 1
        store.commit_many([(r.kind, r.chunk_hash, store.allocate(TURN_BYTES if r.kind is ObjectKind.TURN else FULL_BYTES))
                           for r in refs], refs=refs)

    try:
        a, b = digests(("a", 1)), digests(("b",))
        a1 = turn(1, b"A turn 1".ljust(32), a[0], 300, 44)
        commit([ObjectRef(ObjectKind.FULL, 0, a[0])] + a1)
        commit([ObjectRef(ObjectKind.FULL, 0, b[0])] + turn(1, b"B turn 1".ljust(32), b[0], 290, 34))
        clock.now += 2 * ValuePolicy.GRACE
        for obj, _ in store.get_many([(ObjectKind.FULL, a[0], FULL_BYTES), (ObjectKind.TURN, a1[0].chunk_hash, TURN_BYTES)]):
            release(obj)  # A's turn 2 hits turn 1's turn end
        commit([ObjectRef(ObjectKind.FULL, 1, a[1], parent=a[0])]
               + turn(2, b"A turn 2".ljust(32), a[1], 600, 60, supersedes=(a1[0],)))
        from tests.waiting import wait_for
        wait_for(lambda: len(index) == 9, what="the puts")
        clock.now += 2 * ValuePolicy.GRACE
        assert policy.get_evict_candidates(index) == [store.key(ObjectKind.TURN, a1[0].chunk_hash)]
    finally:
        store.close()


@pytest.mark.parametrize("others", [20, 0])
def test_a_conversation_going_on_demotes_a_tail_only_if_only_it_read_it(others):
    """A conversation's turn end hangs off a document's prompt-end tail (``on_tail``); its next
    turn reads both and names them superseded. The tail loses that conversation's uses only: read
    by ``others`` other questions on the document too, it outlasts another document's tail read
    once; read by this conversation alone, it goes before that one (after the turn end and its
    marker, which nothing reaches then)."""
    lineage, clock, held = Lineage(), Clock(), OrderedDict()
    policy = ValuePolicy(lineage, lambda key: None, boundary_hits=True, clock=clock)

    def put(key, parent, kind, nbytes, tokens=256, supersedes=()):
        clock.now += 1
        lineage.record(key, Line(parent, tokens, kind, nbytes, supersedes))
        held[key] = None
        policy.update_on_put(key)

    def read(*keys):
        clock.now += 1
        for key in keys:
            policy.update_on_hit(key, held)

    put("doc", None, ObjectKind.FULL, FULL_BYTES)
    put("doc tail", "doc", ObjectKind.TAIL, TAIL_BYTES, tokens=512)
    for _ in range(others):
        read("doc", "doc tail")
    put("other", None, ObjectKind.FULL, FULL_BYTES)
    put("other tail", "other", ObjectKind.TAIL, TAIL_BYTES, tokens=512)
    put("mark", "doc tail", ObjectKind.TURNMARK, 64, tokens=0)
    put("turn 1", "mark", ObjectKind.TURN, TURN_BYTES, tokens=40)
    clock.now += ValuePolicy.GRACE + 1
    read("doc", "doc tail", "turn 1")  # turn 2's hit
    put("chunk 2", "doc", ObjectKind.FULL, FULL_BYTES)
    put("mark 2", "chunk 2", ObjectKind.TURNMARK, 64, tokens=0)
    put("turn 2", "mark 2", ObjectKind.TURN, TURN_BYTES, tokens=60, supersedes=("doc tail", "turn 1"))
    clock.now += ValuePolicy.GRACE + 1
    order = []
    while True:
        picked = policy.get_evict_candidates(held, 1)
        if not picked:
            break
        order += picked
        del held[picked[0]]
    assert order[:2] == ["turn 1", "mark"], order
    first, then = ("other tail", "doc tail") if others else ("doc tail", "other tail")
    assert order.index(first) < order.index(then), order


def test_a_tail_stored_on_speculation_goes_first_until_read():
    """A tail stored only while the tier had room (``Line.spare``: an interval boundary no hit is
    known to land at) is worth nothing until read: it goes before a tail stored and never read;
    once read it counts that read like any object."""
    lineage, clock, held = Lineage(), Clock(), OrderedDict()
    policy = ValuePolicy(lineage, lambda key: None, boundary_hits=True, clock=clock)

    def put(key, parent, kind, nbytes, spare=False):
        clock.now += 1
        lineage.record(key, Line(parent, 256, kind, nbytes, spare=spare))
        held[key] = None
        policy.update_on_put(key)

    put("a", None, ObjectKind.FULL, FULL_BYTES)
    put("a tail", "a", ObjectKind.TAIL, TAIL_BYTES, spare=True)
    put("b", None, ObjectKind.FULL, FULL_BYTES)
    put("b tail", "b", ObjectKind.TAIL, TAIL_BYTES)
    clock.now += ValuePolicy.GRACE + 1
    assert policy._pick(held, set())[0] == "a tail"
    policy.update_on_hit("a tail", held)
    clock.now += ValuePolicy.GRACE + 1
    assert policy._pick(held, set())[0] == "b tail"
