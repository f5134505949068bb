"""After a cache reset (a weight update) no tier serves KV computed before it: the real worker half
and chunk store over LMCache's CPU tier and a real ``redis-server`` (no engine).

A reset names objects in the next weights generation (``Namespace.generation``): every key
changes, in the local tiers and in Redis alike, so an object stored before the reset, or gathered
before it and written after, is never found again; instances that reset together keep sharing
one Redis, and one that resets alone leaves the others' generation. The end-to-end counterpart
(a weight change in a real engine) is ``test_e2e_weights_update.py``."""

import pytest

from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.store.lmcache_storage import release
from tests.redis_server import MISSING, redis_server, redis_server_binary  # noqa: F401 - the fixture
from tests.test_worker import make_worker, save_one_chunk_slowly


@pytest.fixture(autouse=True, scope="module")
def _need_redis_server():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


def worker_on(tmp_path, server, **keys):
    """A worker whose store is the CPU tier and the fixture's Redis."""
    return make_worker(tmp_path, remote_url=server.plain_url, remote_serde="naive", **keys)


def store_chunk(worker, ns, tokens=range(8)):
    """A chunk's FULL and TAIL objects, written to every tier (Redis synchronously); its digests."""
    hashes = ChunkHasher(ns).chunk_hashes(list(tokens), 1)
    for kind in (ObjectKind.FULL, ObjectKind.TAIL):
        assert worker.store.put(kind, hashes[0], worker._payload_bytes(kind, 0), lambda p: p.fill_(1.0))
    return hashes


def served_from(worker, hashes) -> tuple:
    """(the tier that served the chunk's FULL object or None, whether the CPU tier holds it after)."""
    [(obj, tier)] = worker.store.get_many([(ObjectKind.FULL, hashes[0], worker._payload_bytes(ObjectKind.FULL, 0))])
    if obj is not None:
        release(obj)
    return tier, worker.store.in_memory(ObjectKind.FULL, hashes[0])


def test_objects_in_redis_before_a_reset_are_not_served_after_it(tmp_path, redis_server):
    """On 4d9fc3d: "served after the reset from: redis", "kept in the cleared CPU tier: True"
    (Redis kept the old weights' objects under the same keys, and a read copied them back)."""
    worker, lay, ns, caches = worker_on(tmp_path, redis_server)
    try:
        hashes = store_chunk(worker, ns)
        assert worker._answer_lookup("r", 1, 0, hashes)[0] == 1  # a hit before the reset
        assert worker.reset()
        tier, kept = served_from(worker, hashes)
        assert (tier, kept) == (None, False), f"served after the reset from: {tier}; kept in the cleared CPU tier: {kept}"
        assert worker._answer_lookup("r", 2, 0, hashes)[0] == 0
        assert worker.counters().get("objects_loaded_redis", 0) == 0
        # the objects stay in Redis under the old generation's names (other instances may use them)
        assert len(redis_server.client().keys("*")) == 4

        hashes_after = store_chunk(worker, ns, range(100, 108))  # what is stored after the reset is served
        worker.store.tier("cpu").clear(lambda k: True)
        assert served_from(worker, hashes_after)[0] == "redis"
    finally:
        worker.shutdown()


def test_kv_gathered_before_a_reset_is_written_to_no_tier_after_it(tmp_path, redis_server, monkeypatch):
    """A store the reset stops waiting for (a slow put) lands after it: on 4d9fc3d it went to
    Redis, named as after the reset, and the first lookup after the reset hit it there."""
    worker, lay, ns, caches = worker_on(tmp_path, redis_server, hma_lookup_timeout_s=0.2)
    try:
        hashes = save_one_chunk_slowly(worker, ns, monkeypatch, 0.5)  # past the reset's wait (0.1 s)
        assert worker.reset()
        worker.drain()  # the slow put runs now
        assert redis_server.client().keys("*") == [], "written to Redis after the reset"
        assert served_from(worker, hashes) == (None, False)
        assert worker._answer_lookup("r", 1, 0, hashes)[0] == 0
        assert worker.counters().get("objects_not_stored", 0) >= 1
    finally:
        worker.shutdown()


def test_instances_that_reset_together_keep_sharing_and_one_that_resets_alone_leaves(tmp_path, redis_server):
    a, lay, ns, _ = worker_on(tmp_path, redis_server)
    b, *_ = worker_on(tmp_path, redis_server)
    try:
        before = store_chunk(a, ns)
        assert a.reset() and b.reset()  # a weight update of the fleet
        assert b._answer_lookup("r", 1, 0, before)[0] == 0  # the old weights' KV: no instance's
        after = store_chunk(a, ns, range(50, 58))
        assert b._answer_lookup("r", 2, 0, after)[0] == 1  # the same generation: shared
        assert b.store.generation == a.store.generation == 1

        assert b.reset()  # b alone: it no longer meets a's objects, nor a its own
        assert b._answer_lookup("r", 3, 0, after)[0] == 0
        mine = store_chunk(b, ns, range(70, 78))
        assert a._answer_lookup("r", 4, 0, mine)[0] == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_a_rank_whose_reset_message_was_lost_follows_the_epoch(tmp_path, redis_server):
    """A rank names objects in the generation of the scheduler's resets (``meta.epoch``), also
    when it applied fewer of them: ranks of one instance, and instances, agree on it."""
    from lmcache_hma.core.metadata import HMAConnectorMetadata

    worker, lay, ns, caches = worker_on(tmp_path, redis_server)
    try:
        hashes = store_chunk(worker, ns)
        meta = HMAConnectorMetadata()
        meta.epoch = 2
        worker.before_step(meta)
        assert worker.store.generation == 2
        assert worker._answer_lookup("r", 1, 0, hashes)[0] == 0
    finally:
        worker.shutdown()
