"""Every part of a turn end expires together in Redis (``hma_redis_turn_end_ttl_s``): its turn
object, its recurrent states (a ``STATE`` object under the turn end's digest) and the marker that
lists it, both Redis keys of each, written with the TTL and renewed together by a read; nothing
else gets one. Against a real ``redis-server``, through the real store writer and chunk store."""

import time

import pytest

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.turn_ends import MARK_BYTES
from lmcache_hma.store.lmcache_storage import release
from lmcache_hma.worker.gathers import _LABELS
from lmcache_hma.worker.store_writer import StoreWriter
from tests.redis_server import MISSING, redis_server, redis_server_binary, redis_yaml  # noqa: F401 - fixtures
from tests.test_redis_capacity import STORE_KEYS, digest, open_store, pttls

TTL_S = 30
TURN_END_LABEL = _LABELS[ObjectKind.TURN]  # what the gathers label every part of a turn end with
TURN_PARTS = {ObjectKind.TURN: 65536, ObjectKind.STATE: 8192}  # under the turn end's digest
OTHERS = {ObjectKind.FULL: 4096, ObjectKind.TAIL: 4096, ObjectKind.STATE: 8192}  # under a chunk's


@pytest.fixture(autouse=True, scope="module")
def _need_redis_server():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


def submit(writer, store, kind, name, payload, label):
    obj = store.allocate(payload)
    assert obj is not None
    assert writer.submit(kind, digest(name), obj, label, payload)


def test_every_part_of_a_turn_end_expires_and_is_renewed_together(redis_server, redis_yaml):
    """On 4d9fc3d the turn end's states and its marker had no TTL ([-1, -1]): once the turn object
    expired they stayed in Redis for good, unreachable (tens of MB per turn on gated-delta-net
    models with answers stored)."""
    store = open_store(redis_yaml(redis_server.url, **STORE_KEYS), ttl_s=TTL_S)
    writer = StoreWriter(store, 64)
    client = redis_server.client()
    try:
        for kind, size in TURN_PARTS.items():  # as the worker's gathers queue a turn end's parts
            submit(writer, store, kind, "turn", size, TURN_END_LABEL)
        submit(writer, store, ObjectKind.TURNMARK, "prefix", MARK_BYTES, TURN_END_LABEL)
        for kind, size in OTHERS.items():
            submit(writer, store, kind, "chunk", size, kind.name.lower())
        writer.drain()
        parts = [(kind, "turn") for kind in TURN_PARTS] + [(ObjectKind.TURNMARK, "prefix")]
        for kind, name in parts:
            assert all(0 < t <= TTL_S * 1000 for t in pttls(client, store, kind, name)), (kind, name)
        for kind in OTHERS:
            assert pttls(client, store, kind, "chunk") == [-1, -1], kind
        keys = [k.decode() for k in client.keys("*")]
        assert len(keys) == 2 * (len(parts) + len(OTHERS))  # metadata and bytes: nothing else written

        # aged to 2 s left; a hit reads the marker, then the turn object and its states: all renewed
        for kind, name in parts:
            key = store.key(kind, digest(name)).to_string()
            for suffix in ("metadata", "kv_bytes"):
                client.pexpire(key + suffix, 2000)
        [(mark, _)] = store.get_many([(ObjectKind.TURNMARK, digest("prefix"), MARK_BYTES)])
        [(turn, _)] = store.get_many([(ObjectKind.TURN, digest("turn"), TURN_PARTS[ObjectKind.TURN])])
        release(mark)
        release(turn)
        for kind, name in parts:
            assert all(TTL_S * 1000 - 2000 < t <= TTL_S * 1000 for t in pttls(client, store, kind, name)), (kind, name)
        for kind in OTHERS:
            assert pttls(client, store, kind, "chunk") == [-1, -1], kind

        # once the turn end expires, nothing of it is left
        for kind, name in parts:
            key = store.key(kind, digest(name)).to_string()
            for suffix in ("metadata", "kv_bytes"):
                client.pexpire(key + suffix, 1)
        time.sleep(0.05)
        left = {k.decode() for k in client.keys("*")}
        assert len(left) == 2 * len(OTHERS) and all("turn" not in k.split("@")[0] for k in left), left
    finally:
        writer.close(5)
        store.close()
