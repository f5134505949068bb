"""What a full Redis keeps (docs/redis.md#eviction-policy), against a real ``redis-server``.

Part 1, turn ends' TTL (``hma_redis_turn_end_ttl_s``): a ``ChunkStore`` over one Redis (and a
Redis Cluster) writes turn ends (``ObjectKind.TURN``) with a TTL on both keys, a read renews it
(whole or in ranges), every other kind has none, and 0 means none.

Part 2, capacity: a fleet replayed at store level (``rag_run``): a few instances, each with a
local cache in front of the connector's Redis tier (what vLLM's prefix cache and the CPU tier
serve without asking Redis), a RAG-shaped trace (a shared prefix of 2 chunks, 12 documents of 6
chunks and a tail each, picked by Zipf popularity, a unique turn end per request; an instance
restarted now and then) against a Redis whose ``--maxmemory`` makes it evict. A request hits when
every chunk of its prefix and the document's tail are somewhere (its instance or Redis), loads
from Redis what its instance lacks and touches in Redis what its instance served
(``RedisTier.touch``, called here as ``ChunkStore.get_many`` is to call it for the objects another
tier served); otherwise it stores what it computed from the first missing chunk on. Under the recommended policy (with
``maxmemory-samples 10``) the shared prefix and the popular documents are whole at the end; under
``allkeys-lru`` they are not (the same check, expected to fail there).

The figures of docs/redis.md come from ``python -m tests.test_redis_capacity`` (every policy,
with and without the touch, and an unbounded Redis for reference).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import Namespace
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.turn_ends import MARK_BYTES
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import release
from lmcache_hma.store.redis import attach_turn_end_ttl, turn_end_ttl_s
from tests.fakes import layout
from tests.redis_server import (MISSING, LocalRedisCluster, RedisServer, redis_server,  # noqa: F401
                                redis_server_binary, redis_yaml, write_redis_yaml)

RECOMMENDED_POLICY = "allkeys-lfu"  # what docs/redis.md and `lmcache-hma check` recommend (the measurement below)


@pytest.fixture(autouse=True, scope="module")
def _need_redis_server():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


def namespace() -> Namespace:
    return Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=layout("SSF"), kv_layout="LBHNC/test",
                     world_size=1, rank=0)


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def open_store(yaml_path: Path, ttl_s=None) -> ChunkStore:
    """A ``ChunkStore`` over the YAML's Redis; ``ttl_s``: its ``hma_redis_turn_end_ttl_s`` (None: the
    default), attached as ``load_config`` attaches it."""
    cfg = load_config({"lmcache_config_file": str(yaml_path)})
    if ttl_s is not None:
        attach_turn_end_ttl(cfg.lmcache, ttl_s)
    return ChunkStore(cfg.lmcache, namespace())


def redis_tier(store: ChunkStore):
    return next(t for t in store.tiers if not t.local)


def put(store: ChunkStore, kind: ObjectKind, name: str, payload: int) -> None:
    assert store.put(kind, digest(name), payload, lambda p: p.fill_(1.0))


def get(store: ChunkStore, kind: ObjectKind, name: str, payload: int) -> bool:
    obj = store.get(kind, digest(name), payload)
    if obj is not None:
        release(obj)
    return obj is not None


def pttls(client, store: ChunkStore, kind: ObjectKind, name: str) -> list[int]:
    """PTTL of the object's two Redis keys (-1: no TTL, -2: not there)."""
    k = store.key(kind, digest(name)).to_string()
    return [client.pttl(k + "metadata"), client.pttl(k + "kv_bytes")]


STORE_KEYS = dict(chunk_size=8, max_local_cpu_size=0.1)  # the fake layout's chunk; a staging buffer
KINDS = {ObjectKind.FULL: 4096, ObjectKind.TAIL: 40960, ObjectKind.STATE: 4096, ObjectKind.TURNMARK: MARK_BYTES}
BIG_TURN = (3 << 20) // 2  # read in GETRANGEs of at most RedisTier.RANGE_BYTES


# ======================================================================================
# Part 1: turn ends' TTL
# ======================================================================================

def test_default_ttl_is_the_keys_default(tmp_path):
    cfg = load_config({"lmcache_config_file": str(write_redis_yaml(tmp_path / "r.yaml", "redis://127.0.0.1:1"))})
    assert turn_end_ttl_s(cfg.lmcache) == cfg.redis_turn_end_ttl_s == 1800.0


@pytest.mark.parametrize("payload", [65536, BIG_TURN], ids=["get", "getrange"])
def test_turn_ends_expire_and_a_read_renews_only_theirs(redis_server, redis_yaml, payload):
    store = open_store(redis_yaml(redis_server.url, **STORE_KEYS), ttl_s=30)
    client = redis_server.client()
    try:
        put(store, ObjectKind.TURN, "turn", payload)
        for kind, size in KINDS.items():
            put(store, kind, "other", size)
        ttl = pttls(client, store, ObjectKind.TURN, "turn")
        assert all(0 < t <= 30_000 for t in ttl), ttl
        for kind in KINDS:  # nothing else expires, but markers (they list turn ends: test_turn_end_expiry)
            assert (pttls(client, store, kind, "other") == [-1, -1]) == (kind is not ObjectKind.TURNMARK), kind

        # aged to 2 s left; a hit renews both keys to the whole TTL, in the read's round trip
        key = store.key(ObjectKind.TURN, digest("turn")).to_string()
        for suffix in ("metadata", "kv_bytes"):
            client.pexpire(key + suffix, 2000)
        assert get(store, ObjectKind.TURN, "turn", payload)
        ttl = pttls(client, store, ObjectKind.TURN, "turn")
        assert all(28_000 < t <= 30_000 for t in ttl), ttl
        for kind, size in KINDS.items():  # reads of the others give them none
            assert get(store, kind, "other", size)
            assert (pttls(client, store, kind, "other") == [-1, -1]) == (kind is not ObjectKind.TURNMARK), kind

        # a turn end that expired is a miss, both keys gone
        for suffix in ("metadata", "kv_bytes"):
            client.pexpire(key + suffix, 1)
        time.sleep(0.05)
        assert not get(store, ObjectKind.TURN, "turn", payload)
        assert pttls(client, store, ObjectKind.TURN, "turn") == [-2, -2]
        assert store.counters().get("redis_protocol_errors", 0) == 0
    finally:
        store.close()


def test_zero_ttl_means_turn_ends_never_expire(redis_server, redis_yaml):
    store = open_store(redis_yaml(redis_server.url, **STORE_KEYS), ttl_s=0)
    client = redis_server.client()
    try:
        put(store, ObjectKind.TURN, "turn", 65536)
        assert pttls(client, store, ObjectKind.TURN, "turn") == [-1, -1]
        assert get(store, ObjectKind.TURN, "turn", 65536)
        assert pttls(client, store, ObjectKind.TURN, "turn") == [-1, -1]
    finally:
        store.close()


def test_redis_cluster_turn_ends_expire_and_a_read_renews(redis_yaml, tmp_path):
    cluster = LocalRedisCluster(tmp_path / "cluster", masters=3, replicas=0).start()
    store = open_store(redis_yaml(cluster.url, **STORE_KEYS), ttl_s=30)
    try:
        client = cluster.client()
        names = [f"turn{i}" for i in range(8)]  # spread over the shards
        for name in names:
            put(store, ObjectKind.TURN, name, 65536)
            put(store, ObjectKind.FULL, name, 4096)
        for name in names:
            assert all(0 < t <= 30_000 for t in pttls(client, store, ObjectKind.TURN, name)), name
            assert pttls(client, store, ObjectKind.FULL, name) == [-1, -1], name
            key = store.key(ObjectKind.TURN, digest(name)).to_string()
            for suffix in ("metadata", "kv_bytes"):
                client.pexpire(key + suffix, 2000)
        wanted = [(ObjectKind.TURN, digest(name), 65536) for name in names]
        got = store.get_many(wanted)
        assert all(obj is not None for obj, _ in got)
        for obj, _ in got:
            release(obj)
        for name in names:
            assert all(28_000 < t <= 30_000 for t in pttls(client, store, ObjectKind.TURN, name)), name
    finally:
        store.close()
        cluster.stop()


def test_touch_counts_as_a_use_for_the_eviction(tmp_path, redis_yaml):
    server = RedisServer(workdir=tmp_path / "lfu", extra_args=["--maxmemory-policy", "allkeys-lfu"]).start()
    store = open_store(redis_yaml(server.url, **STORE_KEYS))
    try:
        client = server.client()
        put(store, ObjectKind.FULL, "a", 4096)
        put(store, ObjectKind.FULL, "b", 4096)
        keys = {n: store.key(ObjectKind.FULL, digest(n)).to_string() for n in "ab"}
        # a new key's LFU counter is 5 (LFU_INIT_VAL); the first use always raises it
        assert [client.object("freq", keys[n] + s) for n in "ab" for s in ("metadata", "kv_bytes")] == [5] * 4
        tier = redis_tier(store)
        tier.touch([store.key(ObjectKind.FULL, digest("a"))])
        assert tier.wait_touched(5.0)
        assert [client.object("freq", keys["a"] + s) for s in ("metadata", "kv_bytes")] == [6, 6]
        assert [client.object("freq", keys["b"] + s) for s in ("metadata", "kv_bytes")] == [5, 5]
    finally:
        store.close()
        server.stop()


@pytest.mark.parametrize("policy, limit, verdict", [
    ("allkeys-lfu", 64 << 20, "OK"), ("allkeys-lru", 64 << 20, "WARN"), ("noeviction", 64 << 20, "WARN"),
    ("volatile-lru", 64 << 20, "WARN"), ("allkeys-lfu", 0, "WARN")])
def test_check_warns_about_another_policy_or_no_limit(policy, limit, verdict):
    from lmcache_hma.tools import redis_probe

    assert redis_probe.RECOMMENDED_POLICY == RECOMMENDED_POLICY
    line = redis_probe._memory_line([{"maxmemory": limit, "maxmemory-policy": policy}])
    assert line.verdict == verdict, str(line)
    if policy != RECOMMENDED_POLICY:
        assert "CONFIG SET maxmemory-policy allkeys-lfu" in line.fix and "\n" not in str(line), str(line)
    if not limit:
        assert "set maxmemory" in line.fix
    cluster = redis_probe._memory_line([{"maxmemory": limit, "maxmemory-policy": policy},
                                        {"maxmemory": limit, "maxmemory-policy": RECOMMENDED_POLICY}])
    assert cluster.verdict == ("OK" if verdict == "OK" else "WARN") and "on each master" in cluster.reason


# ======================================================================================
# Part 2: a full Redis under a RAG-shaped load
# ======================================================================================

CHUNK_TOKENS = 256  # what a hit's chunk stands for (hit tokens are counted in these)
SIZES = {ObjectKind.FULL: 8 << 10, ObjectKind.TAIL: 80 << 10,  # a tail ~10x a chunk (Gemma-3 shapes)
         ObjectKind.TURN: 84 << 10, ObjectKind.TURNMARK: MARK_BYTES}  # a turn end: a tail and a partial chunk


@dataclass
class RagShape:
    requests: int = 300
    documents: int = 12
    doc_chunks: int = 6
    shared_chunks: int = 2
    zipf: float = 1.0
    instances: int = 4
    local_bytes: int = 320 << 10  # each instance's local cache (vLLM's prefix cache and CPU tier)
    seed: int = 0
    rate: float = 0.0  # requests per second (0: as fast as they go)
    restart_every: int = 50  # requests between two restarts (of the instances in turn): an empty local cache

    def trace(self) -> list[int]:
        """The document of each request (0: the most popular)."""
        rng = random.Random(self.seed)
        weights = [1 / (d + 1) ** self.zipf for d in range(self.documents)]
        return rng.choices(range(self.documents), weights, k=self.requests)

    def chunks(self, doc: int) -> list[str]:
        return ([f"shared{c}" for c in range(self.shared_chunks)]
                + [f"doc{doc}/chunk{c}" for c in range(self.doc_chunks)])

    def prefix(self, doc: int) -> list[tuple]:
        """(kind, name) of what a hit on document ``doc`` needs: every chunk from the first, the tail."""
        chunks = self.chunks(doc)
        return [(ObjectKind.FULL, c) for c in chunks] + [(ObjectKind.TAIL, chunks[-1])]


class LocalCache:
    """An instance's own copies (by bytes, least recently used first): what it serves without Redis."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used, self.items = capacity, 0, OrderedDict()

    def __contains__(self, item) -> bool:
        return item in self.items

    def use(self, item) -> None:
        if item in self.items:
            self.items.move_to_end(item)
            return
        self.items[item] = SIZES[item[0]]
        self.used += SIZES[item[0]]
        while self.used > self.capacity:
            _, size = self.items.popitem(last=False)
            self.used -= size


@dataclass
class RagResult:
    hit_tokens: int = 0
    requests: int = 0
    whole_documents: list = field(default_factory=list)  # documents whose prefix is whole in Redis at the end
    requests_whole: int = 0  # requests of the trace whose prefix is whole in Redis at the end
    shared_whole: bool = False
    orphans: int = 0  # chunks and tails in Redis that no hit can reach (a chunk before them is gone)
    evicted_keys: int = 0
    seconds: float = 0.0


def rag_run(store: ChunkStore, client, shape: RagShape, touch: bool = True) -> RagResult:
    """Replay ``shape``'s trace through ``store`` (whose only tier is Redis) and look at Redis after."""
    tier = redis_tier(store)
    caches = [LocalCache(shape.local_bytes) for _ in range(shape.instances)]
    trace = shape.trace()
    out = RagResult(requests=len(trace))
    t0 = time.monotonic()
    for n, doc in enumerate(trace):
        if shape.rate:  # Redis's LRU clock counts seconds: at full speed every key is as recent as the next
            time.sleep(max(0.0, t0 + n / shape.rate - time.monotonic()))
        if n and shape.restart_every and n % shape.restart_every == 0:  # restarted (or replaced): Redis only
            caches[n // shape.restart_every % shape.instances] = LocalCache(shape.local_bytes)
        cache = caches[n % shape.instances]
        wanted = shape.prefix(doc)
        remote = [item for item in wanted if item not in cache]
        found = dict(zip(remote, store.present_pairs([(k, digest(name)) for k, name in remote])))
        there = [item in cache or found[item] is not None for item in wanted]
        run = next((i for i, f in enumerate(there[:-1]) if not f), len(there) - 1)  # chunks from the first
        hit = all(there)
        if hit:  # load what the instance lacks from Redis; touch there what it served itself
            fetch = [item for item in wanted if item not in cache]
            got = store.get_many([(k, digest(name), SIZES[k]) for k, name in fetch])
            for obj, _ in got:
                if obj is not None:
                    release(obj)
            lost = [item for item, (obj, _) in zip(fetch, got) if obj is None]  # evicted since the lookup
            if lost:
                hit, run = False, min(run, *(wanted.index(item) for item in lost if item[0] is ObjectKind.FULL),
                                      len(wanted) - 1)
            elif touch:
                tier.touch([store.key(k, digest(name)) for k, name in wanted if (k, name) in cache])
        if hit:
            out.hit_tokens += (len(wanted) - 1) * CHUNK_TOKENS
            writes = []
        else:  # computed from the first missing chunk on: stored from there (and the tail if missing)
            writes = [item for item in wanted[run:-1]] + [wanted[-1]] * (found.get(wanted[-1]) is None)
        chunks = shape.chunks(doc)
        writes += [(ObjectKind.TURN, f"turn{n}"), (ObjectKind.TURNMARK, chunks[-1])]
        items = []
        for kind, name in writes:
            obj = store.allocate(SIZES[kind])
            assert obj is not None, "no room in the staging buffer"
            items.append((kind, digest(name), obj))
        store.commit_many(items)
        for item in wanted + writes:
            cache.use(item)
        if touch:
            tier.wait_touched(5.0)
    out.seconds = time.monotonic() - t0
    tier.wait_touched(5.0)

    def whole(kind, name) -> bool:
        k = store.key(kind, digest(name)).to_string()
        return client.exists(k + "metadata", k + "kv_bytes") == 2

    def orphans(flags: list) -> int:  # held after something before it is gone
        return sum(held and not all(flags[:i]) for i, held in enumerate(flags))

    shared = [whole(ObjectKind.FULL, name) for name in shape.chunks(0)[:shape.shared_chunks]]
    out.shared_whole = all(shared)
    out.orphans = orphans(shared)
    for doc in range(shape.documents):
        flags = shared + [whole(*item) for item in shape.prefix(doc)[shape.shared_chunks:]]
        out.orphans += orphans(flags) - orphans(shared)
        if all(flags):
            out.whole_documents.append(doc)
    out.requests_whole = sum(doc in out.whole_documents for doc in trace)
    out.evicted_keys = int(client.info("stats")["evicted_keys"])
    return out


def run_policy(workdir: Path, shape: RagShape, policy: str, maxmemory: str, touch: bool = True,
               samples: int = 10) -> RagResult:
    """``rag_run`` against a fresh Redis (``maxmemory`` "0": unbounded)."""
    args = ["--maxmemory", maxmemory, "--maxmemory-policy", policy, "--maxmemory-samples", str(samples)]
    server = RedisServer(workdir=workdir, extra_args=args).start()
    try:
        store = open_store(write_redis_yaml(workdir / "r.yaml", server.url, **STORE_KEYS))
        try:
            return rag_run(store, server.client(), shape, touch)
        finally:
            store.close()
    finally:
        server.stop()


MAXMEMORY = "5mb"  # ~4 MB of objects: every document fits, with room for ~25 turn ends
POPULAR = 3  # the most popular documents (57% of the requests), which a full Redis must keep whole


def keeps_prefixes(got: RagResult) -> bool:
    """The shared prefix and the popular documents whole (every chunk and the tail), and at least
    half of the trace's requests would hit Redis alone (a restarted or new instance)."""
    popular = set(range(POPULAR)) <= set(got.whole_documents)
    return got.shared_whole and popular and 2 * got.requests_whole >= got.requests


def test_full_redis_keeps_the_shared_prefix_and_popular_documents_whole(tmp_path):
    got = run_policy(tmp_path / "lfu", RagShape(), RECOMMENDED_POLICY, MAXMEMORY)
    assert got.evicted_keys > 500, f"Redis hardly evicted: the test shows nothing ({got})"
    assert keeps_prefixes(got), got


def test_under_lru_the_same_load_loses_them(tmp_path):
    """The check above can fail: allkeys-lru evicts the shared prefix and chunks of the popular
    documents. (Without the touch it fails too, most of the time: ``python -m tests.test_redis_capacity``.)"""
    got = run_policy(tmp_path / "lru", RagShape(), "allkeys-lru", MAXMEMORY)
    assert got.evicted_keys > 500, got
    assert not keeps_prefixes(got), got


def main() -> None:
    parser = argparse.ArgumentParser(description="A RAG-shaped load against a full Redis, per eviction policy, "
                                                 "with and without the touch (docs/redis.md#eviction-policy)")
    parser.add_argument("--requests", type=int, default=RagShape.requests)
    parser.add_argument("--maxmemory", default=MAXMEMORY)
    parser.add_argument("--seeds", type=int, default=3, help="traces (each against a fresh Redis)")
    parser.add_argument("--samples", type=int, default=10, help="maxmemory-samples")
    parser.add_argument("--rate", type=float, default=0.0, help="requests per second (0: as fast as they go)")
    parser.add_argument("--policies", default="allkeys-lru,allkeys-lfu")
    parser.add_argument("--touch", default="on,off")
    args = parser.parse_args()
    import logging
    import tempfile

    logging.disable(logging.WARNING)  # LMCache logs lines per store opened
    print(f"maxmemory {args.maxmemory}, maxmemory-samples {args.samples}, {args.requests} requests, "
          f"{RagShape.instances} instances, {f'{args.rate:g} requests/s' if args.rate else 'full speed'}, "
          f"seeds 0..{args.seeds - 1} (means)", flush=True)
    print("| policy | touch | hit tokens vs unbounded | requests whole in Redis | shared prefix whole | "
          f"top {POPULAR} whole | orphans | evicted keys |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    refs: dict = {}
    for policy in args.policies.split(","):
        for touch in args.touch.split(","):
            rows = []
            for seed in range(args.seeds):
                with tempfile.TemporaryDirectory() as tmp:
                    if seed not in refs:
                        refs[seed] = run_policy(Path(tmp) / "ref", RagShape(requests=args.requests, seed=seed),
                                                "noeviction", "0").hit_tokens
                    shape = RagShape(requests=args.requests, seed=seed, rate=args.rate)
                    rows.append(run_policy(Path(tmp) / "run", shape, policy, args.maxmemory, touch == "on",
                                           args.samples))
            k = len(rows)
            print(f"| {policy} | {touch} | {sum(r.hit_tokens / refs[i] for i, r in enumerate(rows)) / k:.3f}x | "
                  f"{sum(r.requests_whole / r.requests for r in rows) / k:.2f} | "
                  f"{sum(r.shared_whole for r in rows)}/{k} | "
                  f"{sum(set(range(POPULAR)) <= set(r.whole_documents) for r in rows)}/{k} | "
                  f"{sum(r.orphans for r in rows) / k:.1f} | {sum(r.evicted_keys for r in rows) / k:.0f} |", flush=True)


if __name__ == "__main__":
    main()
