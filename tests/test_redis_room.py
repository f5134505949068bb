"""``hma_eviction: value`` on a Redis under ``maxmemory`` (``store.redis.room``), against a real
``redis-server``: the writer makes room before each write, prefix-closed and by value.

A RAG-shaped load at store level through a ``ChunkStore`` whose only tier is Redis: a shared
prefix (2 chunks and the tail at its end), 12 documents of 4 chunks and a tail each by Zipf
popularity, and per request a unique leaf as big as a tail (a turn end nobody extends). A request
whose document is whole in Redis reads it (a use); otherwise it writes what it computed, from the
first missing chunk on, each object with its parent (``ObjectRef.parent``). Redis runs
``allkeys-lru``, the policy worst at keeping prefixes (``test_redis_capacity``): with the room made
by the writer it never has to evict, the popular documents stay whole and no object is kept
whose parent is gone; without it (``hma_eviction: lru``) Redis evicts on its own.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from lmcache_hma.config.settings import load_config
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import release
from lmcache_hma.store.redis.node_tier import RedisTier
from lmcache_hma.store.redis.room import memory_info, short_of
from lmcache_hma.store.value_policy import Line
from tests.redis_server import RedisServer, write_redis_yaml
from tests.test_redis_capacity import _need_redis_server, namespace  # noqa: F401 (a fixture: fails without redis-server)

CHUNK, TAIL = 32 << 10, 320 << 10
SHARED, DOCS, DOC_CHUNKS, REQUESTS, POPULAR = 2, 12, 4, 160, 3
BUDGET = 6 << 20  # over the empty Redis: about half the documents, few leaves


def digest(*parts) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def path(doc: int) -> list[bytes]:
    return [digest("shared", c) for c in range(SHARED)] + [digest(doc, c) for c in range(DOC_CHUNKS)]


def wanted(doc: int) -> list[tuple]:
    """(kind, chunk hash, bytes, parent) of what a hit on ``doc`` reads: its chunks, its tail."""
    chunks = path(doc)
    out = [(ObjectKind.FULL, h, CHUNK, chunks[i - 1] if i else b"") for i, h in enumerate(chunks)]
    return out + [(ObjectKind.TAIL, chunks[-1], TAIL, b"")]


def play(store: ChunkStore, seed: int = 0, stale_at: int = -1) -> int:
    """The load; returns the documents read whole. ``stale_at``: before that request, the
    store's Redis tier is told of objects that are not in Redis (as after Redis evicted them or
    another instance deleted them), the least worth of all: its room picks them first."""
    rng = random.Random(seed)
    weights = [1 / (d + 1) for d in range(DOCS)]
    hits = 0
    for n in range(REQUESTS):
        if n == stale_at:
            room = next(t for t in store.tiers if not t.local)._room
            stale = [store.key(ObjectKind.TAIL, digest("stale", i)) for i in range(16)]
            for key in stale:
                store.lineage.record(key, Line(None, 1, ObjectKind.TAIL, TAIL))
            room.written(stale)
        doc = rng.choices(range(DOCS), weights)[0]
        objs = wanted(doc)
        found = store.present_pairs([(k, h) for k, h, _, _ in objs])
        if all(f is not None for f in found):
            got = store.get_many([(k, h, size) for k, h, size, _ in objs])
            for obj, _ in got:
                if obj is not None:
                    release(obj)
            hits += all(obj is not None for obj, _ in got)
            writes = []
        else:
            first = next(i for i, f in enumerate(found[:-1] + [None]) if f is None)
            writes = objs[first:-1] + [objs[-1]] * (found[-1] is None)
        writes = writes + [(ObjectKind.TAIL, digest("leaf", n), TAIL, b"")]  # a leaf nobody reads again
        items = []
        for kind, h, size, _ in writes:
            obj = store.allocate(size)
            assert obj is not None
            items.append((kind, h, obj))
        store.commit_many(items, refs=[ObjectRef(kind, 0, h, parent=parent) for kind, h, _, parent in writes])
    return hits


def run(tmp_path: Path, eviction: str, stale_at: int = -1):
    server = RedisServer(workdir=tmp_path / eviction, extra_args=["--maxmemory-policy", "allkeys-lru"]).start()
    try:
        client = server.client()
        baseline = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", baseline + BUDGET)
        cfg = load_config({"lmcache_config_file": str(write_redis_yaml(tmp_path / f"{eviction}.yaml", server.url))})
        store = ChunkStore(cfg.lmcache, namespace(), eviction=eviction)
        try:
            hits = play(store, stale_at=stale_at)
            tier = next(t for t in store.tiers if not t.local)
            held = {}
            for doc in range(DOCS):
                for kind, h, _, parent in wanted(doc):
                    k = store.key(kind, h).to_string()
                    held[(kind, h)] = (client.exists(k + "metadata", k + "kv_bytes") == 2, parent)
            return dict(hits=hits, held=held, evicted=int(client.info("stats")["evicted_keys"]),
                        deletes=tier.counters().get("redis_room_deletes", 0), read_cap=tier._read_cap,
                        maxmemory=baseline + BUDGET)
        finally:
            store.close()
    finally:
        server.stop()


def whole(held: dict, doc: int) -> bool:
    return all(held[(k, h)][0] for k, h, _, _ in wanted(doc))


def orphans(held: dict) -> int:
    """Chunks and tails held whose parent chunk is gone (no hit can reach them)."""
    out = 0
    for (kind, h), (there, parent) in held.items():
        up = parent if kind is ObjectKind.FULL else h  # a tail's parent is the chunk it ends
        if there and up and not held[(ObjectKind.FULL, up)][0]:
            out += 1
    return out


def keeps_prefixes(got: dict) -> bool:
    """The popular documents whole (every chunk and the tail), no orphan, and at least half of
    the requests read their document whole."""
    return (all(whole(got["held"], d) for d in range(POPULAR)) and orphans(got["held"]) == 0
            and 2 * got["hits"] >= REQUESTS)


def test_the_writer_makes_room_by_value_and_redis_never_evicts(tmp_path):
    got = run(tmp_path, "value")
    assert got["deletes"] > 50, f"the Redis never filled: the test shows nothing ({got['deletes']} deletes)"
    assert got["evicted"] == 0, got["evicted"]  # room was made before every write
    # and kept for Redis's client buffers: the spare query buffer of a write's largest value, the
    # reads' output buffers (reads fitted to 1/64 of maxmemory: a tail in 3 pieces)
    assert got["read_cap"] == got["maxmemory"] // RedisTier.READ_SHARE < TAIL, got["read_cap"]
    assert keeps_prefixes(got), (got["hits"], orphans(got["held"]), [whole(got["held"], d) for d in range(DOCS)])


def test_objects_that_left_redis_behind_its_back_cost_the_room_no_try(tmp_path):
    """Midway the room believes 16 objects are in Redis that are not (Redis evicted them, another
    instance deleted them), ranked below everything else: its deletes of them free nothing, and
    it goes on to objects that are there instead of writing short of room. (Counted as tries, the
    stale ones used up all four and Redis evicted for the write: checked.)"""
    got = run(tmp_path, "value", stale_at=REQUESTS // 2)
    assert got["deletes"] > 50 and got["evicted"] == 0, (got["deletes"], got["evicted"])
    assert keeps_prefixes(got)


def test_without_it_redis_evicts_and_the_same_check_fails(tmp_path):
    """The same load under ``hma_eviction: lru``: Redis evicts keys itself (allkeys-lru), and the
    check above fails (measured: 13 of 160 requests read their document whole, against 109 with
    the room made; orphans kept)."""
    got = run(tmp_path, "lru")
    assert got["evicted"] > 50 and got["deletes"] == 0, (got["evicted"], got["deletes"])
    assert not keeps_prefixes(got)


def test_info_memory_and_the_shortfall():
    text = b"# Memory\r\nused_memory:1000\r\nused_memory_human:1000B\r\nmaxmemory:3000\r\nmaxmemory_human:x\r\n"
    assert memory_info(text) == (1000, 3000)
    assert short_of(1000, 3000, 500) == -1500 and short_of(1000, 3000, 2500) == 500
    assert short_of(1000, 0, 10 ** 9) is None  # no limit: nothing to make room for
    assert memory_info(b"garbage") == (0, 0)


def test_what_an_object_takes_in_redis_is_its_bytes_and_what_the_room_counts(tmp_path):
    """``wire.redis_bytes`` (what the room counts an object as) against ``MEMORY USAGE`` of both
    keys on a real Redis, objects written as ``wire.set_commands`` writes them: the model is
    never short by more than the keys it leaves to ``KEY_BYTES``, never over by more than a few
    hundred bytes, and an object of KV's power-of-two sizes with its trailer takes its own bytes,
    not the next size class (1.20x-1.25x before its values were fitted)."""
    from lmcache_hma.core.objects import TRAILER_BYTES
    from lmcache_hma.store.redis.room import KEY_BYTES
    from lmcache_hma.store.redis.wire import redis_bytes, value_bytes

    server = RedisServer(workdir=tmp_path / "sizes").start()
    try:
        client = server.client()
        key = "m" * 120  # as long as the connector's keys
        for payload in (4 << 10, 32 << 10, 128 << 10, 384 << 10, 1280 << 10, (1280 << 10) + 5000, 3 << 20):
            n = payload + TRAILER_BYTES
            value = value_bytes(n)
            client.set(key + "kv_bytes", b"\1" * value)
            client.set(key + "metadata", b"\2" * (100 + n - value))
            held = sum(int(client.memory_usage(key + part, samples=0)) for part in ("kv_bytes", "metadata"))
            assert redis_bytes(n) <= held <= redis_bytes(n) + KEY_BYTES, (n, held, redis_bytes(n))
            if payload in (128 << 10, 384 << 10, 1280 << 10, 3 << 20):
                assert held < n * 1.01, (n, held)
            client.delete(key + "kv_bytes", key + "metadata")
    finally:
        server.stop()
