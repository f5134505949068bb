"""The Redis tier: one Redis shared by several vLLM instances (issue 4).

Part 1, store level (no engine): ``ChunkStore`` over a real ``redis-server`` with
a Redis-only YAML (configs/redis.yaml): round trip, damaged objects, namespaces,
process-independent keys, no unpickling, passwords, and faults (Redis down at
start, killed, hung, restarted), each with a bounded cost.

Part 2, end to end: two ``vllm serve`` processes (OpenAI-compatible servers on
loopback) on the tiny Gemma-3 share one password-protected Redis. They start
while Redis is down (fault: unreachable at start), then Redis comes up; B hits
what A stored, with A's tokens; Redis is killed mid-run (B still answers,
exactly, in bounded time) and restarted (sharing resumes); the password is in
no log; both servers shut down promptly. Two engine starts in all.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import secrets
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from lmcache_hma.config.remote_url import remote_auth
from lmcache_hma.config.settings import ConfigError, load_config
from lmcache_hma.core.keys import Namespace
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.objects import TRAILER_BYTES, payload_of
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import flat, release
from tests.engines import same_answer
from tests.servers import ServeProcess
from tests.fakes import digest, layout
from tests.redis_server import (MISSING, REPO, RedisServer, free_port, redis_server,  # noqa: F401
                                redis_server_binary, redis_yaml, write_redis_yaml)

PAYLOAD = 4096
OBJECT_BYTES = PAYLOAD + TRAILER_BYTES
STORE_KEYS = dict(chunk_size=8, max_local_cpu_size=0.05)  # small staging buffer, fake layout's chunk


@pytest.fixture(autouse=True, scope="module")
def _need_redis_server():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


def namespace(model="tiny", rank=0, kinds="SSF", dtype=torch.bfloat16, secret=None):
    return Namespace(model=model, kv_dtype=dtype, layout=layout(kinds), kv_layout="LBHNC/test",
                     world_size=1, rank=rank, secret=secret)


@pytest.fixture
def stores():
    """``open(yaml, ns=None)`` -> ChunkStore; all closed after the test."""
    opened = []

    def open_(yaml_path, ns=None):
        cfg = load_config({"lmcache_config_file": str(yaml_path)})
        store = ChunkStore(cfg.lmcache, ns or namespace())
        opened.append(store)
        return store

    yield open_
    for store in opened:
        if not store.closed:
            store.close()


def spy_allocations(store, monkeypatch) -> list:
    """Every memory object ``store`` allocates from now on, kept (LMCache frees an object that is
    garbage collected, so a leaked reference would go unseen)."""
    seen = []
    batched, single = store._allocate_free, store.allocate
    monkeypatch.setattr(store, "_allocate_free", lambda sizes: [seen.append(o) or o for o in batched(sizes)])
    monkeypatch.setattr(store, "allocate", lambda size: [seen.append(o) or o for o in [single(size)]][0])
    return seen


def put(store, h, value, kind=ObjectKind.FULL):
    return store.put(kind, digest(h), PAYLOAD, lambda p: p.fill_(value))


def get(store, h, kind=ObjectKind.FULL):
    obj = store.get(kind, digest(h), PAYLOAD)
    if obj is None:
        return None
    value = float(flat(obj)[0])
    release(obj)
    return value


def wait_until(predicate, timeout=10.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def redis_keys(server, chunk_hash=None):
    keys = sorted(k.decode() for k in server.client().keys("*"))
    # LMCache key: model@world_size@rank@chunk_hash(hex)@dtype, then "kv_bytes" or "metadata"
    return [k for k in keys if chunk_hash is None or k.split("@")[3] == digest(chunk_hash).hex()]


# ======================================================================================
# Part 1: store level
# ======================================================================================

def test_config_takes_credentials_out_and_bounds_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHMA_TEST_PW", "p@ss:w/rd")
    path = write_redis_yaml(tmp_path / "a.yaml", "redis://:${LMHMA_TEST_PW}@127.0.0.1:6390/0")
    cfg = load_config({"lmcache_config_file": str(path)})
    url = cfg.lmcache.remote_url  # what LMCache sees and logs
    assert url.startswith("redis://127.0.0.1:6390/0?") and "p@ss" not in url
    assert "socket_timeout=2" in url and "socket_connect_timeout=2" in url
    auth = remote_auth(cfg.lmcache)
    assert auth.password == "p@ss:w/rd" and auth.username is None and "p@ss" not in repr(auth)
    literal = write_redis_yaml(tmp_path / "b.yaml", "redis://bob:s3cret@h:1",
                               extra_config={"hma_remote_timeout_s": 0.5})
    cfg = load_config({"lmcache_config_file": str(literal)})
    assert "s3cret" not in cfg.lmcache.remote_url and "socket_timeout=0.5" in cfg.lmcache.remote_url
    assert (remote_auth(cfg.lmcache).username, remote_auth(cfg.lmcache).password) == ("bob", "s3cret")
    monkeypatch.delenv("LMHMA_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match="environment variable LMHMA_TEST_UNSET, which is not set"):
        load_config({"lmcache_config_file": str(write_redis_yaml(
            tmp_path / "c.yaml", "redis://:${LMHMA_TEST_UNSET}@h:1"))})
    with pytest.raises(ConfigError, match="remote_serde 'cachegen' is not supported"):
        load_config({"lmcache_config_file": str(write_redis_yaml(
            tmp_path / "d.yaml", "redis://h:1", remote_serde="cachegen"))})
    with pytest.raises(ConfigError, match=r"'http://u:\*\*\*@h' must start with") as err:
        load_config({"lmcache_config_file": str(write_redis_yaml(tmp_path / "e.yaml", "http://u:hunter2zz@h"))})
    assert "hunter2zz" not in str(err.value)


def test_roundtrip_through_redis_only(redis_server, redis_yaml, stores):
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    assert a.tier_labels == ("redis",)  # local_cpu: false: only a staging buffer
    for h in (1, 2, 3):
        assert put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 6)  # metadata + bytes per object
    assert all(redis_server.client().strlen(k) == OBJECT_BYTES for k in redis_keys(redis_server)
               if k.endswith("kv_bytes"))
    b = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))  # another instance, same Redis
    assert b.count_full_prefix([digest(1), digest(2), digest(3), digest(4)]) == 3 and b.has(ObjectKind.FULL, digest(2))
    assert not b.has(ObjectKind.TAIL, digest(2))
    assert [get(b, h) for h in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, None]
    assert b.integrity_failures == 0
    assert len(redis_keys(redis_server)) == 6  # a miss removes nothing


def test_cpu_disk_redis_tiers(redis_server, redis_yaml, stores, tmp_path):
    """configs/cpu_disk_redis.yaml: CPU -> disk -> Redis; an instance with empty local tiers reads Redis."""
    def open_(name):
        return stores(redis_yaml(redis_server.plain_url, "cpu_disk_redis.yaml", **STORE_KEYS,
                                 local_disk=f"file://{tmp_path / name}/", max_local_disk_size=0.01))
    a = open_("disk-a")
    assert a.tier_labels == ("cpu", "disk", "redis")
    put(a, 1, 1.0)
    assert get(a, 1) == 1.0  # from its CPU tier
    assert wait_until(lambda: len(redis_keys(redis_server)) == 2)
    b = open_("disk-b")  # nothing in its CPU or disk tier
    assert b.has(ObjectKind.FULL, digest(1)) and get(b, 1) == 1.0


def test_an_object_not_shared_stays_in_the_local_tiers(redis_server, redis_yaml, stores, tmp_path):
    """``commit_many(..., shared=False)`` (a replica rank's part, hma_share_parallel_shapes): the
    CPU and disk tiers take it, Redis does not; with ``shared`` Redis does too."""
    store = stores(redis_yaml(redis_server.plain_url, "cpu_disk_redis.yaml", **STORE_KEYS,
                              local_disk=f"file://{tmp_path / 'disk'}/", max_local_disk_size=0.01))
    objs = []
    for value in (1.0, 2.0):
        obj = store.allocate(PAYLOAD)
        payload_of(flat(obj)).fill_(value)
        objs.append(obj)
    assert store.commit_many([(ObjectKind.FULL, digest(1), objs[0])], shared=False) == [True]
    assert get(store, 1) == 1.0
    store.commit_many([(ObjectKind.FULL, digest(2), objs[1])])
    assert wait_until(lambda: len(redis_keys(redis_server, 2)) == 2)
    assert redis_keys(redis_server, 1) == []


def test_damaged_objects_are_misses_and_removed(redis_server, redis_yaml, stores):
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in (1, 2, 3, 4):
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 8)
    r = redis_server.client()
    flipped = redis_keys(redis_server, 2)[0]
    assert flipped.endswith("kv_bytes")
    value = bytearray(r.get(flipped))
    value[100] ^= 0xFF  # same length, one bit pattern changed
    r.set(flipped, bytes(value))
    truncated = redis_keys(redis_server, 3)[0]
    r.set(truncated, r.get(truncated)[:-64])
    r.set(redis_keys(redis_server, 4)[1], b"\x00" * 3)  # metadata garbage
    b = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))  # a fresh reader
    assert get(b, 1) == 1.0
    assert get(b, 2) is None  # checksum
    assert get(b, 3) is None  # truncated
    assert get(b, 4) is None  # unreadable metadata
    assert b.integrity_failures == 3
    assert redis_keys(redis_server, 2) == redis_keys(redis_server, 3) == redis_keys(redis_server, 4) == []
    assert len(redis_keys(redis_server, 1)) == 2
    assert not b.has(ObjectKind.FULL, digest(2)) and b.count_full_prefix([digest(1), digest(2)]) == 1


def test_a_redis_read_with_no_cpu_memory_to_read_into_is_a_counted_miss(redis_server, redis_yaml, stores):
    """A fetch from Redis reads into new CPU memory; where there is none it can free (what fills
    it is held: here the fetch's own objects), an object is a miss, kept in Redis, and counted
    as ``objects_not_read_no_memory`` like one on disk. Uncounted, a lookup's marker read that
    found no room looked like a lost turn-end hit (make sim seeds 2239, 3024, 4471, 6645)."""
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in range(6):
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 12)
    b = stores(redis_yaml(redis_server.plain_url, chunk_size=8, max_local_cpu_size=2.5 * OBJECT_BYTES / 2**30))
    pairs = b.get_many([(ObjectKind.FULL, digest(h), PAYLOAD) for h in range(6)])
    read = [obj for obj, _ in pairs if obj is not None]
    try:
        assert 0 < len(read) < 6 and pairs[-1][0] is None
        assert b.counters()["objects_not_read_no_memory"] == 6 - len(read)
        assert b.integrity_failures == 0 and len(redis_keys(redis_server)) == 12  # not damage: kept
    finally:
        for obj in read:
            release(obj)
    assert [get(b, h) for h in range(6)] == [float(h) for h in range(6)]  # room again: read as before


@pytest.mark.parametrize("ranged", [False, True], ids=["get", "getrange"])
def test_one_fetch_over_many_batches_with_damage_and_misses_between(redis_server, redis_yaml, stores, monkeypatch,
                                                                    ranged):
    """A hit's objects come in batches read straight into their objects (``resp``), the next
    batch in flight: misses, damaged values and unreadable metadata anywhere in the run cost
    only their own objects, and the connection stays in step for the next fetch. ``getrange``:
    every object is read in 3 ranges (as objects over ``RANGE_BYTES`` are), 4 ranges per batch
    (objects straddle batches); the truncated value is then one whose last range comes back
    short."""
    from lmcache_hma.store.redis.node_tier import RedisTier

    monkeypatch.setattr(RedisTier, "READ_BATCH_BYTES", 2 * OBJECT_BYTES)  # 2 objects per batch
    if ranged:
        monkeypatch.setattr(RedisTier, "RANGE_BYTES", OBJECT_BYTES // 3 + 8)
        monkeypatch.setattr(RedisTier, "READ_BATCH_BYTES", 4 * (OBJECT_BYTES // 3 + 8))
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in range(1, 12):
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 22)
    r = redis_server.client()
    r.delete(*redis_keys(redis_server, 3))  # a miss
    value = bytearray(r.get(redis_keys(redis_server, 5)[0]))
    value[7] ^= 0x01
    r.set(redis_keys(redis_server, 5)[0], bytes(value))  # fails its checksum
    r.set(redis_keys(redis_server, 8)[0], r.get(redis_keys(redis_server, 8)[0])[:-1])  # truncated
    r.delete(redis_keys(redis_server, 10)[0])  # metadata without its bytes
    b = stores(redis_yaml(redis_server.plain_url, local_cpu=False, **STORE_KEYS))
    wanted = [(ObjectKind.FULL, digest(h), PAYLOAD) for h in range(1, 13)]
    allocated = spy_allocations(b, monkeypatch)
    got = b.get_many(wanted)
    values = [None if obj is None else float(flat(obj)[0]) for obj, _ in got]
    for obj, _ in got:
        if obj is not None:
            release(obj)
    assert values == [1.0, 2.0, None, 4.0, None, 6.0, 7.0, None, 9.0, None, 11.0, None]
    assert len(allocated) == 12 and [o.get_ref_count() for o in allocated] == [0] * 12  # all given back
    assert {tier for obj, tier in got if obj is not None} == {"redis"}
    assert b.integrity_failures == 3
    assert [get(b, h) for h in (1, 11, 2)] == [1.0, 11.0, 2.0]  # the pooled connection is in step


@pytest.mark.parametrize("ranged", [False, True], ids=["get", "getrange"])
def test_an_error_reply_for_a_value_is_a_miss_not_damage(redis_server, redis_yaml, stores, monkeypatch, ranged):
    """An error reply where a value should be (a cluster's MOVED while it fails over; here a
    real WRONGTYPE) is a miss for that object alone: it is not counted as damaged nor removed,
    and the connection stays in step."""
    from lmcache_hma.store.redis.node_tier import RedisTier

    if ranged:
        monkeypatch.setattr(RedisTier, "RANGE_BYTES", OBJECT_BYTES // 3 + 8)
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in (1, 2, 3):
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 6)
    r = redis_server.client()
    data = redis_keys(redis_server, 2)[0]
    r.delete(data)
    r.hset(data, "not", "a string")  # every GET/GETRANGE of it: -WRONGTYPE
    b = stores(redis_yaml(redis_server.plain_url, local_cpu=False, **STORE_KEYS))
    got = b.get_many([(ObjectKind.FULL, digest(h), PAYLOAD) for h in (1, 2, 3)])
    values = [None if obj is None else float(flat(obj)[0]) for obj, _ in got]
    for obj, _ in got:
        if obj is not None:
            release(obj)
    assert values == [1.0, None, 3.0]
    assert b.integrity_failures == 0 and len(redis_keys(redis_server, 2)) == 2
    assert [get(b, h) for h in (3, 1)] == [3.0, 1.0]  # the pooled connection is in step


BIG_PAYLOAD = 128 << 10  # a power of two, as KV objects are: with its trailer just over a size class


def pattern(h: int, n: int) -> torch.Tensor:
    return (torch.arange(n) % 251 + h).to(torch.bfloat16)  # exact in bfloat16


@pytest.mark.parametrize("ranged", [False, True], ids=["get", "getrange"])
def test_values_fit_redis_allocator_and_their_last_bytes_ride_in_the_metadata(redis_server, redis_yaml, stores,
                                                                               monkeypatch, ranged):
    """An object of 128 KiB and its trailer takes a 128 KiB allocation in Redis, not 160 KiB: its
    value is a size class less Redis's overhead (``wire.value_bytes``), its last bytes follow its
    metadata. They are read back into the object (whole or in ranges); one of them changed fails
    the object's check (a miss, removed), and metadata without them is unreadable (a miss, removed)."""
    from lmcache.v1 import protocol

    from lmcache_hma.store.redis.node_tier import RedisTier
    from lmcache_hma.store.redis.wire import value_bytes

    if ranged:
        monkeypatch.setattr(RedisTier, "RANGE_BYTES", 40 << 10)
        monkeypatch.setattr(RedisTier, "READ_BATCH_BYTES", 100 << 10)
    n = BIG_PAYLOAD + TRAILER_BYTES
    value = value_bytes(n)
    assert value < n - TRAILER_BYTES  # the trailer and a few payload bytes move
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in (1, 2, 3, 4):
        assert a.put(ObjectKind.FULL, digest(h), BIG_PAYLOAD, lambda p, h=h: p.copy_(pattern(h, p.numel())))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 8)
    r = redis_server.client()
    struct_bytes = len(r.get(next(k for k in redis_keys(redis_server, 1) if k.endswith("metadata")))) - (n - value)
    assert protocol.REMOTE_METADATA_FMT is None or struct_bytes == __import__("struct").calcsize(
        protocol.REMOTE_METADATA_FMT)
    for h in (1, 2, 3, 4):
        data, meta = redis_keys(redis_server, h)  # sorted: <key>kv_bytes, <key>metadata
        assert r.strlen(data) == value and r.strlen(meta) == struct_bytes + n - value
        assert r.memory_usage(data, samples=0) < (128 << 10) + 256  # was 160 KiB and more
    meta3 = next(k for k in redis_keys(redis_server, 3) if k.endswith("metadata"))
    spilled = bytearray(r.get(meta3))
    spilled[-TRAILER_BYTES - 3] ^= 0x10  # a payload byte that rides in the metadata
    r.set(meta3, bytes(spilled))
    meta4 = next(k for k in redis_keys(redis_server, 4) if k.endswith("metadata"))
    r.set(meta4, r.get(meta4)[:struct_bytes])  # the metadata alone, as LMCache writes it
    b = stores(redis_yaml(redis_server.plain_url, local_cpu=False, **STORE_KEYS))
    got = b.get_many([(ObjectKind.FULL, digest(h), BIG_PAYLOAD) for h in (1, 2, 3, 4)])
    for h, (obj, _) in zip((1, 2), got):
        assert obj is not None
        assert torch.equal(payload_of(flat(obj)), pattern(h, BIG_PAYLOAD // 2))  # bfloat16
    assert [obj is None for obj, _ in got] == [False, False, True, True]
    for obj, _ in got[:2]:
        release(obj)
    assert b.integrity_failures == 2
    assert redis_keys(redis_server, 3) == redis_keys(redis_server, 4) == []


def test_metadata_declaring_a_huge_object_allocates_nothing_of_it(redis_server, redis_yaml, stores):
    """LMCache's reader would allocate what the metadata declares, busy-waiting on its event
    loop; reads here allocate only the size this namespace's object must have."""
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import RemoteMetadata

    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in (1, 2, 3):
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 6)
    r = redis_server.client()
    huge_shape = RemoteMetadata(OBJECT_BYTES, [torch.Size([1, 1, 2**30])], [torch.bfloat16], MemoryFormat.KV_2LTD)
    r.set(next(k for k in redis_keys(redis_server, 1) if k.endswith("metadata")), huge_shape.serialize())
    huge_length = RemoteMetadata(2**31 - 1, [torch.Size([1, 1, 2**30])], [torch.bfloat16], MemoryFormat.KV_2LTD)
    r.set(next(k for k in redis_keys(redis_server, 2) if k.endswith("metadata")), huge_length.serialize())
    b = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    t0 = time.monotonic()
    assert get(b, 1) == 1.0  # the shape it declares is never used: the bytes verify
    assert get(b, 2) is None and b.integrity_failures == 1 and redis_keys(redis_server, 2) == []
    assert get(b, 3) == 3.0  # and Redis still serves
    assert time.monotonic() - t0 < 5


def test_namespaces_sharing_one_redis_never_see_each_other(redis_server, redis_yaml, stores):
    secret = b"fleet-secret-0123456789"
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS), namespace("model-a", secret=secret))
    put(a, 7, 1.0)
    put(a, 7, 2.0, kind=ObjectKind.TAIL)
    assert wait_until(lambda: len(redis_keys(redis_server)) == 4)
    before = redis_keys(redis_server)
    others = (namespace("model-b", secret=secret), namespace("model-a", kinds="SFS", secret=secret),
              namespace("model-a", rank=1, secret=secret), namespace("model-a", dtype=torch.float16, secret=secret),
              namespace("model-a"), namespace("model-a", secret=b"another-secret-0123456789"))
    for ns in others:
        b = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS), ns)
        assert not b.has(ObjectKind.FULL, digest(7)) and not b.has(ObjectKind.TAIL, digest(7))
        assert b.count_full_prefix([digest(7)]) == 0
        assert get(b, 7) is None and get(b, 7, ObjectKind.TAIL) is None
        assert b.integrity_failures == 0
    assert redis_keys(redis_server) == before  # nobody removed a's objects
    assert get(a, 7) == 1.0 and get(a, 7, ObjectKind.TAIL) == 2.0


_PROCESS_SCRIPT = r"""
import json, sys, torch
from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.objects import TRAILER_BYTES
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import flat, release
from tests.fakes import layout
mode, yaml_path = sys.argv[1], sys.argv[2]
cfg = load_config({"lmcache_config_file": yaml_path})
ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=layout(), kv_layout="LBHNC/test",
               world_size=1, rank=0)
hashes = ChunkHasher(ns).chunk_hashes(list(range(100, 140)), 5)
store = ChunkStore(cfg.lmcache, ns)
got = []
for i, h in enumerate(hashes):
    if mode == "put":
        store.put(ObjectKind.FULL, h, 4096, lambda p, i=i: p.fill_(i))
    else:
        obj = store.get(ObjectKind.FULL, h, 4096)
        got.append(None if obj is None else float(flat(obj)[0]))
        obj is not None and release(obj)
keys = [store.key(ObjectKind.FULL, h).to_string() for h in hashes]
store.close()  # writes reached Redis in put (the store writes Redis on the caller's thread)
print("RESULT " + json.dumps({"hashes": [h.hex() for h in hashes], "keys": keys, "got": got,
                              "str_hash": hash("lmcache_hma")}))
"""


def _run_store_process(mode, yaml_path, seed, extra_env=None):
    env = {**os.environ, "PYTHONHASHSEED": seed, **(extra_env or {})}
    out = subprocess.run([sys.executable, "-c", _PROCESS_SCRIPT, mode, str(yaml_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), out.stdout + out.stderr


def test_keys_do_not_depend_on_pythonhashseed(redis_server, redis_yaml, stores):
    """A process with another PYTHONHASHSEED writes; this one computes the same keys and reads them."""
    from lmcache_hma.core.keys import ChunkHasher

    yaml_path = redis_yaml(redis_server.plain_url, **STORE_KEYS)
    for seed in ("1", "2"):  # whichever differs from this process's seed
        wrote, _ = _run_store_process("put", yaml_path, seed)
        if wrote["str_hash"] != hash("lmcache_hma"):
            break
    assert wrote["str_hash"] != hash("lmcache_hma")  # Python's own hash differs between the two ...
    store = stores(yaml_path)
    hashes = ChunkHasher(namespace()).chunk_hashes(list(range(100, 140)), 5)
    assert [h.hex() for h in hashes] == wrote["hashes"]  # ... chunk hashes and keys do not
    assert [store.key(ObjectKind.FULL, h).to_string() for h in hashes] == wrote["keys"]
    assert [get(store, h) for h in hashes] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sorted(k.decode() for k in redis_server.client().keys("*")) == sorted(
        [k + "kv_bytes" for k in wrote["keys"]] + [k + "metadata" for k in wrote["keys"]])


def test_nothing_read_from_redis_is_unpickled(redis_server, redis_yaml, stores, tmp_path, monkeypatch):
    """LMCache's naive serde passes bytes through; its metadata is a struct; our trailer checks the rest."""
    import inspect

    from lmcache.v1.protocol import RemoteMetadata
    from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector
    from lmcache.v1.storage_backend.naive_serde.naive_serde import NaiveDeserializer
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    for fn in (RedisConnector._get, RemoteMetadata.deserialize, NaiveDeserializer.deserialize,
               RemoteBackend.get_blocking):
        source = inspect.getsource(fn)
        assert not re.search(r"pickle|torch\.load|loads\(|eval\(", source), fn.__qualname__

    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bomb = pickle.dumps(Bomb())

    def refuse(*args, **kwargs):
        raise AssertionError("something read from Redis was unpickled")

    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    put(a, 5, 5.0)
    put(a, 6, 6.0)
    assert wait_until(lambda: len(redis_keys(redis_server)) == 4)
    r = redis_server.client()
    kv5 = redis_keys(redis_server, 5)[0]
    r.set(kv5, bomb.ljust(OBJECT_BYTES, b"."))  # right length, pickle inside
    r.set(redis_keys(redis_server, 6)[1], bomb)  # the metadata key holds a pickle
    for mod, name in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    b = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    assert get(b, 5) is None and get(b, 6) is None
    assert b.integrity_failures == 2 and not marker.exists()


_PASSWORD_SCRIPT = r"""
import sys, torch
from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import Namespace
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.objects import TRAILER_BYTES
from lmcache_hma.store.chunk_store import ChunkStore
from lmcache_hma.store.lmcache_storage import flat, release
from tests.engines import same_answer
from tests.fakes import digest, layout
ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=layout(), kv_layout="LBHNC/test",
               world_size=1, rank=0)
for i, path in enumerate(sys.argv[1:]):
    store = ChunkStore(load_config({"lmcache_config_file": path}).lmcache, ns)
    store.put(ObjectKind.FULL, digest(10 + i), 4096, lambda p: p.fill_(10 + i))  # Redis written on return
    obj = store.get(ObjectKind.FULL, digest(10 + i), 4096)
    print(f"RESULT {i} {None if obj is None else float(flat(obj)[0])}", flush=True)
    obj is not None and release(obj)
    store.close()
"""


def test_password_protected_redis_and_password_never_logged(tmp_path):
    password = "pw-" + secrets.token_hex(12)
    with RedisServer(password=password, workdir=tmp_path / "redis") as server:
        env_url = f"redis://:${{LMHMA_TEST_REDIS_PW}}@127.0.0.1:{server.port}"
        yamls = [write_redis_yaml(tmp_path / "env.yaml", env_url, **STORE_KEYS),  # password from env
                 write_redis_yaml(tmp_path / "literal.yaml", server.url, **STORE_KEYS),  # in the URL
                 write_redis_yaml(tmp_path / "wrong.yaml", f"redis://:not-the-password@127.0.0.1:{server.port}",
                                  **STORE_KEYS),
                 write_redis_yaml(tmp_path / "none.yaml", server.plain_url, **STORE_KEYS)]
        env = {**os.environ, "LMHMA_TEST_REDIS_PW": password}
        out = subprocess.run([sys.executable, "-c", _PASSWORD_SCRIPT, *map(str, yamls)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-3000:]
        results = dict(re.findall(r"RESULT (\d) (\S+)", log))
        assert results == {"0": "10.0", "1": "11.0", "2": "None", "3": "None"}, log[-3000:]
        assert len(server.client().keys("*")) == 4  # two objects, both stored with the password
    # a wrong or missing password: a clear warning each, then misses
    assert log.count("is unreachable at start (AuthenticationError") == 2, log[-3000:]
    assert password not in log


def test_redis_down_at_start_then_up(tmp_path, redis_yaml, stores):
    server = RedisServer(workdir=tmp_path / "redis")  # not started
    store = stores(redis_yaml(server.plain_url, **STORE_KEYS, extra_config={"hma_remote_timeout_s": 0.5}))
    t0 = time.monotonic()
    assert not store.has(ObjectKind.FULL, digest(1)) and store.count_full_prefix([digest(1), digest(2)]) == 0
    assert put(store, 1, 1.0)  # skipped, not an error
    assert get(store, 1) is None
    assert time.monotonic() - t0 < 1.0
    server.start()
    try:
        def shared():
            put(store, 2, 2.0)
            return len(redis_keys(server, 2)) == 2
        assert wait_until(shared, timeout=10, step=0.3)  # the health check noticed; writes go through
        other = stores(redis_yaml(server.plain_url, **STORE_KEYS))
        assert get(other, 2) == 2.0
    finally:
        server.stop()


def test_killed_hung_and_restarted_redis_costs_bounded_time(redis_server, redis_yaml, stores):
    store = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS, extra_config={"hma_remote_timeout_s": 0.5}))
    put(store, 1, 1.0)
    assert wait_until(lambda: len(redis_keys(redis_server)) == 2)

    def timed(fn):
        t0 = time.monotonic()
        result = fn()
        return result, time.monotonic() - t0

    # hung (SIGSTOP): one call waits a socket timeout, then the tier is bypassed
    redis_server.pause()
    try:
        hit, seconds = timed(lambda: store.has(ObjectKind.FULL, digest(1)))
        assert not hit and seconds < 2.0
        assert wait_until(lambda: timed(lambda: store.has(ObjectKind.FULL, digest(1)))[1] < 0.05, timeout=5)
        # bypassed: no socket wait (0.5 s); the bound leaves room for a loaded machine's scheduling
        for fn in (lambda: get(store, 1), lambda: put(store, 3, 3.0), lambda: store.count_full_prefix([digest(1)])):
            assert timed(fn)[1] < 0.25
    finally:
        redis_server.resume()
    assert wait_until(lambda: store.has(ObjectKind.FULL, digest(1)), timeout=5)  # back
    # killed: calls fail at once
    redis_server.kill()
    (hit, seconds) = timed(lambda: store.has(ObjectKind.FULL, digest(1)))
    assert not hit and seconds < 0.5
    # restarted (empty): the tier is used again
    redis_server.start()

    def resumed():
        put(store, 4, 4.0)
        return len(redis_keys(redis_server, 4)) == 2
    assert wait_until(resumed, timeout=10, step=0.3)
    assert stores(redis_yaml(redis_server.plain_url, **STORE_KEYS)).has(ObjectKind.FULL, digest(4))
    # close never hangs, even with Redis gone, and LMCache's (non-daemon) loop thread ends
    redis_server.kill()
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 5.0 and not store._manager.thread.is_alive()


# ======================================================================================
# Part 2: two `vllm serve` processes sharing one Redis
# ======================================================================================

HELLO = "Hello, how are you?"
PROMPT = HELLO * 500 + "Tell me a very long story"  # 3007 tokens: 11 full chunks of 256
EXPECTED_HIT = 11 * 256
# (a full object and a tail per chunk: tiny-gemma3's tail interval is one chunk, HybridLayout.tail_interval)
# x (metadata + bytes); the turn end and its marker land after them (one store writer, in order)
KEYS_PER_PROMPT = (11 + 11) * 2
PW_ENV = "LMHMA_TEST_REDIS_PW"
SECRET_ENV = "LMHMA_TEST_SECRET"
HIT = re.compile(r"Reqid: (\S+), Total tokens (\d+), LMCache hit tokens: (\d+), need to load: (\d+)")


def other_prompt(tag: str) -> str:
    """A prompt of the same shape whose every chunk hash differs (the first chunk differs)."""
    return f"{tag}: " + PROMPT


class Server(ServeProcess):
    """One `vllm serve` process with the connector, queried through the OpenAI client."""

    def __init__(self, name, model, yaml_path, workdir: Path, env_extra=None, extra_args=(), **serve):
        super().__init__(name, model, yaml_path, workdir, ["--max-model-len", "8192", *extra_args], env_extra,
                         drop_env=[PW_ENV], **serve)
        self.client = None

    def wait_ready(self, deadline: float) -> None:
        import openai

        super().wait_ready(deadline)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", timeout=180, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def complete(self, prompt, salt: str = ""):
        """(text, token ids, this request's logged hit tokens, seconds). ``prompt``: text or token
        ids; ``salt``: a ``cache_salt`` (keys nothing was stored under: a cold run)."""
        mark = len(self.text())
        t0 = time.monotonic()
        body = {"return_tokens_as_token_ids": True, **({"cache_salt": salt} if salt else {})}
        out = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=10, temperature=0,
                                             logprobs=2, extra_body=body)
        seconds = time.monotonic() - t0
        choice = out.choices[0]
        ids = [int(t.split(":")[-1]) for t in choice.logprobs.tokens]
        # top-1 minus top-2 log-probability per position (tests.engines.same_greedy's margins)
        self.last_margins = [
            (lambda top: top[0] - top[1] if len(top) > 1 else float("inf"))(sorted(d.values(), reverse=True))
            for d in choice.logprobs.top_logprobs]
        hits = [(int(total), int(hit)) for _, total, hit, _ in HIT.findall(self.text()[mark:])]
        assert hits, f"{self.name}: no 'LMCache hit tokens' line for the request"
        assert len(ids) == 10 and out.usage.prompt_tokens == hits[-1][0]
        return choice.text, ids, hits[-1][1], seconds


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Two servers (A: password from ${ENV} in the YAML, B: password in the URL) and their Redis.

    Redis is NOT running when the servers start: the first test checks that fault.
    """
    from lmcache_hma.testing.tiny_model import build_tiny_model

    if redis_server_binary() is None:
        pytest.fail(MISSING)
    work = tmp_path_factory.mktemp("redis_e2e")
    password = "pw-" + secrets.token_hex(12)
    secret = secrets.token_hex(16)  # the fleet's shared secret: keys and trailers are HMACs under it
    redis = RedisServer(password=password, workdir=work / "redis")
    model = build_tiny_model("tiny-gemma3")
    # the fleet's shared secret; and a longer deadline than the 2 s default, as tests.servers.
    # serve_fleet says why: a write batch past it under load is lost or half made (misses)
    keyed = {"extra_config": {"hma_shared_secret": f"${{{SECRET_ENV}}}", "hma_remote_timeout_s": 15.0}}
    yaml_a = write_redis_yaml(work / "a.yaml", f"redis://:${{{PW_ENV}}}@127.0.0.1:{redis.port}", **keyed)
    yaml_b = write_redis_yaml(work / "b.yaml", redis.url, **keyed)
    servers = {}
    try:
        servers["a"] = Server("a", model, yaml_a, work, {PW_ENV: password, SECRET_ENV: secret})
        servers["b"] = Server("b", model, yaml_b, work, {SECRET_ENV: secret})
        deadline = time.monotonic() + 300
        for s in servers.values():
            s.wait_ready(deadline)
        yield {"a": servers["a"], "b": servers["b"], "redis": redis, "password": password, "secret": secret,
               "work": work, "model": model}
    finally:
        for s in servers.values():
            s.stop()
        redis.stop()


def turn_marks(redis) -> int:
    return len(redis.client().keys("*.turnmark*"))


def complete_and_share(server, redis, prompt):
    """``server.complete(prompt)`` for a prompt new to Redis, and wait until its objects are all
    there: its turn end's marker is the last its writer stores (objects land in order)."""
    before = turn_marks(redis)
    out = server.complete(prompt)
    assert wait_until(lambda: turn_marks(redis) > before), why_missed(redis, server)
    return out


def why_missed(redis, *servers) -> str:
    """What a hit short of the expected one had to go on: the objects in Redis by kind, and each
    server's counters and warnings (a write that failed, an object dropped)."""
    from collections import Counter

    kinds = Counter(k.split(b".")[2].split(b"@")[0].decode() for k in redis.client().keys("*"))
    out = [f"keys in Redis by kind: {dict(kinds)}"]
    for s in servers:
        warned = [line for line in s.text().splitlines() if "WARN" in line or "ERROR" in line]
        out += [f"{s.name}: {s.counters()}", *warned[-20:]]
    return "\n".join(out)


def wait_for_log(server, text, count=1, timeout=15.0) -> bool:
    return wait_until(lambda: server.text().count(text) >= count, timeout=timeout, step=0.2)


def test_e2e_serves_while_redis_is_unreachable_at_start(shared):
    a, b, redis = shared["a"], shared["b"], shared["redis"]
    for s in (a, b):
        assert "is unreachable at start" in s.text(), f"{s.name}: no warning about the missing Redis"
    prompt = other_prompt("Down at start")
    text_a, ids_a, hit_a, _ = a.complete(prompt)
    text_b, ids_b, hit_b, _ = b.complete(prompt)
    assert hit_a == hit_b == 0 and ids_a == ids_b and text_a == text_b
    redis.start()
    for s in (a, b):  # the health check notices within about a second
        assert wait_for_log(s, "answers again; sharing resumes"), f"{s.name} did not reconnect"


def test_e2e_second_server_hits_what_the_first_stored(shared):
    a, b, redis = shared["a"], shared["b"], shared["redis"]
    # Reference: A's answer, computed cold (nothing of this prompt in A's vLLM prefix cache nor in
    # Redis), i.e. what a no-connector run gives with the same thread settings (a cold run with the
    # connector only copies KV out; test_e2e_exact compares against a no-connector engine). This
    # saves a third engine start.
    text_a, ids_a, hit_a, _ = complete_and_share(a, redis, PROMPT)
    ref = (text_a, ids_a, a.last_margins)
    assert hit_a == 0
    text_b, ids_b, hit_b, _ = b.complete(PROMPT)  # fresh process, nothing local
    assert hit_b == EXPECTED_HIT, why_missed(redis, a, b)
    # B computes only the prompt's tail: another split than A's cold run (tests.engines.same_greedy)
    assert same_answer(ref, (text_b, ids_b)), (ref, ids_b)
    stats = json.loads(b.stats.read_text())
    assert stats.get("loads_ok", 0) >= 1 and stats.get("loads_failed", 0) == 0
    assert stats.get("integrity_failures", 0) == 0 and stats.get("loaded_bytes_full_attention", 0) > 0


def test_e2e_next_turn_at_another_server_hits_the_turn_end(shared):
    """A conversation whose next turn goes to another instance: A answers, and keeps its turn
    end (every token whose KV it computed, past the last chunk boundary) in Redis; B gets A's
    prompt and answer and hits all of it. B's tokens equal B's own cold run (a cache salt)."""
    from transformers import AutoTokenizer

    a, b, redis = shared["a"], shared["b"], shared["redis"]
    prompt = other_prompt("Turns")
    _, ids_a, hit_a, _ = complete_and_share(a, redis, prompt)
    assert hit_a == 0
    ids = AutoTokenizer.from_pretrained(shared["model"])(prompt)["input_ids"] + ids_a
    turn_end = len(ids) - 1  # A computed all but its last answer token
    assert turn_end % 256
    cold = b.complete(ids, salt="cold")
    ref = (cold[0], cold[1], b.last_margins)
    assert cold[2] == 0
    text_b, ids_b, hit_b, _ = b.complete(ids)
    assert hit_b == turn_end, b.text()[-3000:]
    assert same_answer(ref, (text_b, ids_b)), (ref, ids_b)


def test_e2e_redis_killed_mid_run(shared):
    a, b, redis = shared["a"], shared["b"], shared["redis"]
    prompt = other_prompt("Killed")
    text_a, ids_a, hit_a, _ = complete_and_share(a, redis, prompt)  # stored in Redis by A ...
    ref = (text_a, ids_a, a.last_margins)
    assert hit_a == 0
    redis.kill()  # ... which then dies
    text_b, ids_b, hit_b, seconds = b.complete(prompt)
    assert ids_b == ids_a and text_b == text_a  # both cold: the same split, exact
    assert hit_b == 0 and seconds < 30, (hit_b, seconds)
    # both keep serving: a prompt A has in its own prefix cache, and a new one on B
    assert same_answer(ref, a.complete(prompt)[:2])
    assert b.complete(other_prompt("After the kill"))[2] == 0
    assert a.healthy() and b.healthy() and a.proc.poll() is None and b.proc.poll() is None
    for s in (a, b):
        assert wait_for_log(s, "stopped answering"), f"{s.name}: no warning about the lost Redis"


def test_e2e_sharing_resumes_after_redis_restarts(shared):
    a, b, redis = shared["a"], shared["b"], shared["redis"]
    redis.start()  # same port and password, empty
    for s in (a, b):
        assert wait_for_log(s, "answers again; sharing resumes", count=2), f"{s.name} did not reconnect"
    prompt = other_prompt("Restarted")
    text_a, ids_a, hit_a, _ = complete_and_share(a, redis, prompt)
    ref = (text_a, ids_a, a.last_margins)
    assert hit_a == 0
    text_b, ids_b, hit_b, _ = b.complete(prompt)
    assert hit_b == EXPECTED_HIT, why_missed(redis, a, b)
    assert same_answer(ref, (text_b, ids_b)), (ref, ids_b)


def forge_in_redis(client, key: bytes) -> None:
    """Overwrite a stored object the way a writer without the secret could: new payload, valid CRC32."""
    from lmcache_hma.core.objects import TRAILER_BYTES

    raw = bytearray(client.get(key))
    payload_end = len(raw) - TRAILER_BYTES
    raw[:payload_end] = os.urandom(payload_end)
    crc_at = payload_end + 4 + 4 + 16 + 32 + 4 + 8  # magic, format, fingerprint, key, kind, length
    raw[crc_at:crc_at + 4] = zlib.crc32(raw[:payload_end]).to_bytes(4, "little")
    client.set(key, bytes(raw))


def test_e2e_forged_object_without_the_secret_is_a_miss(shared):
    """Someone who can write Redis but has no secret replaces A's objects: B never loads them."""
    a, b, redis = shared["a"], shared["b"], shared["redis"]
    client = redis.client()
    prompt = other_prompt("Forged")
    before = set(client.keys("*"))
    text_a, ids_a, hit_a, _ = complete_and_share(a, redis, prompt)
    assert hit_a == 0 and len(set(client.keys("*")) - before) >= KEYS_PER_PROMPT
    for key in set(client.keys("*")) - before:
        if key.endswith(b"kv_bytes"):
            forge_in_redis(client, key)
    failures = json.loads(b.stats.read_text()).get("integrity_failures", 0) if b.stats.exists() else 0
    mark = len(b.text())
    text_b, ids_b, _, _ = b.complete(prompt)
    assert ids_b == ids_a and text_b == text_a  # recomputed: exact
    assert "not signed with this deployment's shared secret" in b.text()[mark:]
    assert json.loads(b.stats.read_text())["integrity_failures"] > failures


def test_e2e_password_and_secret_never_in_logs(shared):
    for s in (shared["a"], shared["b"]):
        log = s.text()
        assert "LMCache hit tokens" in log and "RemoteBackend" in log
        assert shared["password"] not in log, f"{s.name}'s log shows the Redis password"
        assert shared["secret"] not in log, f"{s.name}'s log shows the shared secret"


def test_e2e_servers_shut_down_promptly(shared):
    """Last: SIGTERM both servers; each exits within 30 s (LMCache's Redis close hang is avoided)."""
    seconds = {name: shared[name].stop(timeout=30) for name in ("a", "b")}
    assert all(s < 30 for s in seconds.values()), seconds
    assert shared["a"].proc.returncode is not None and shared["b"].proc.returncode is not None


def test_an_object_redis_kept_one_key_of_is_a_miss_at_lookup(redis_server, redis_yaml, stores):
    """A full Redis evicts keys one at a time: an object whose bytes went while its metadata
    stayed (or the other way round) is not present to a lookup, which then hits the prefix
    before it, rather than a fetch that fails on it."""
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in (1, 2, 3):
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 6)
    r = redis_server.client()
    r.delete(next(k for k in redis_keys(redis_server, 2) if k.endswith("kv_bytes")))
    r.delete(next(k for k in redis_keys(redis_server, 3) if k.endswith("metadata")))
    b = stores(redis_yaml(redis_server.plain_url, local_cpu=False, **STORE_KEYS))
    assert b.present(ObjectKind.FULL, [digest(h) for h in (1, 2, 3)]) == [True, False, False]
    assert b.count_full_prefix([digest(1), digest(2), digest(3)]) == 1 and b.integrity_failures == 0
