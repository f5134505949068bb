"""The Redis tier over a Redis Cluster (``redis-cluster://``), and failover (issue 12).

Part 1, store level (no engine): ``ChunkStore`` over real ``redis-server --cluster-enabled
yes`` nodes on loopback (``tests/redis_server.LocalRedisCluster``): credentials, both keys
of every object in one slot on one node (inspected), objects spread over the shards,
damaged objects removed (both keys), the disk tier re-indexed with hash-tagged names;
faults, each with a bounded cost: cluster unreachable at start, one master paused
(only its objects miss, the other shards serve), every node killed (bypass), a cluster
that refuses every command (``cluster_state:fail``: bypass), close with the cluster gone.

Part 2, end to end: two ``lmcache-hma serve`` processes (tiny Gemma-3) share a password-
protected cluster of 3 masters and 3 replicas: B hits what A stored, same tokens; a master
paused (SIGSTOP) costs bounded time; a master killed (SIGKILL) while B is serving:
requests complete with A's tokens, no errors; once its replica has taken over, B again
hits what A stores. Two engine starts in all.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import pytest

from lmcache_hma.config.remote_url import remote_auth, remote_timeout_s
from lmcache_hma.config.settings import load_config
from lmcache_hma.core.kinds import ObjectKind
from tests.engines import same_answer
from tests.fakes import digest
from tests.redis_server import MISSING, LocalRedisCluster, redis_server_binary, write_redis_yaml
from tests.test_redis import (EXPECTED_HIT, KEYS_PER_PROMPT, OBJECT_BYTES, PAYLOAD, PROMPT, PW_ENV, STORE_KEYS, Server,
                              get, namespace, other_prompt, put, spy_allocations,
                              stores, wait_until)  # noqa: F401 (fixture)

TIMEOUT = 0.5  # hma_remote_timeout_s of the store-level tests


@pytest.fixture(autouse=True, scope="module")
def _need_redis_server():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


def timed(fn):
    t0 = time.monotonic()
    result = fn()
    return result, time.monotonic() - t0


def object_keys(store, h, kind=ObjectKind.FULL) -> tuple[bytes, bytes]:
    k = store.key(kind, digest(h)).to_string()
    return (k + "metadata").encode(), (k + "kv_bytes").encode()


def where(cluster: LocalRedisCluster, key: bytes):
    """Port of the master holding ``key`` (None: nowhere)."""
    return next((port for port, keys in cluster.keys_by_node().items() if key in keys), None)


# ======================================================================================
# Part 1: store level
# ======================================================================================

def test_config_takes_credentials_out_of_a_cluster_url(tmp_path, monkeypatch):
    monkeypatch.setenv("LMHMA_TEST_PW", "p@ss,w:rd")
    cfg = load_config({"lmcache_config_file": str(write_redis_yaml(
        tmp_path / "a.yaml", "redis-cluster://:${LMHMA_TEST_PW}@10.0.0.1:7000,10.0.0.2:7001",
        extra_config={"hma_remote_timeout_s": 0.7}))})
    assert cfg.lmcache.remote_url == "redis-cluster://10.0.0.1:7000,10.0.0.2:7001"  # what LMCache sees and logs
    auth = remote_auth(cfg.lmcache)
    assert auth.password == "p@ss,w:rd" and auth.username is None and remote_timeout_s(cfg.lmcache) == 0.7
    cfg = load_config({"lmcache_config_file": str(write_redis_yaml(
        tmp_path / "b.yaml", "redis-cluster://h1:1,h2:2?username=bob&password=s3cret"))})
    assert cfg.lmcache.remote_url == "redis-cluster://h1:1,h2:2"
    assert (remote_auth(cfg.lmcache).username, remote_auth(cfg.lmcache).password) == ("bob", "s3cret")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """3 masters and 3 replicas with a password, shared by part 1's non-destructive tests and part 2."""
    if redis_server_binary() is None:
        pytest.fail(MISSING)
    c = LocalRedisCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1,
                          password="pw-" + secrets.token_hex(12)).start()
    yield c
    c.stop()


def test_both_keys_of_every_object_share_one_slot_and_node(cluster, stores, tmp_path):
    a = stores(write_redis_yaml(tmp_path / "a.yaml", cluster.url, **STORE_KEYS))
    assert a.tier_labels == ("redis",) and type(a.tier("redis")).__name__ == "RedisClusterTier"
    assert a.tier("redis").up
    hashes = range(1, 25)
    for h in hashes:
        assert put(a, h, float(h))
        assert put(a, h, -float(h), kind=ObjectKind.TAIL)
    assert wait_until(lambda: cluster.dbsize() >= 4 * len(hashes))
    holders = set()
    for h in hashes:
        for kind in (ObjectKind.FULL, ObjectKind.TAIL):
            meta, data = object_keys(a, h, kind)
            assert b"{" in meta and cluster.keyslot(meta) == cluster.keyslot(data)
            port = where(cluster, meta)
            assert port is not None and port == where(cluster, data)
            assert cluster.node_for_slot(cluster.keyslot(meta)).port == port
            holders.add(port)
    assert len(holders) == 3  # spread over every shard
    assert all(cluster.client().strlen(object_keys(a, h)[1]) == OBJECT_BYTES for h in hashes)
    b = stores(write_redis_yaml(tmp_path / "b.yaml", cluster.url, **STORE_KEYS))  # another instance
    assert b.count_full_prefix([digest(h) for h in [*hashes, 99]]) == len(hashes)
    assert [get(b, h) for h in hashes] == [float(h) for h in hashes]
    assert [get(b, h, ObjectKind.TAIL) for h in (1, 2)] == [-1.0, -2.0] and get(b, 99) is None
    assert b.integrity_failures == 0
    # without the password: one warning, misses, nothing hangs
    c = stores(write_redis_yaml(tmp_path / "c.yaml", cluster.plain_url, **STORE_KEYS,
                                extra_config={"hma_remote_timeout_s": TIMEOUT}))
    assert not c.tier("redis").up and timed(lambda: get(c, 1))[1] < 0.2


def test_a_lookup_asks_every_shard_at_once_in_one_round_trip(cluster, stores, tmp_path, monkeypatch):
    """Every kind of every chunk in one pipelined send per shard, all sent before any reply is read."""
    from lmcache_hma.store.redis import resp

    a = stores(write_redis_yaml(tmp_path / "a.yaml", cluster.url, **STORE_KEYS))
    hashes = range(201, 213)
    for h in hashes:
        assert put(a, h, float(h))
    for h in (202, 205):
        assert put(a, h, -float(h), kind=ObjectKind.TAIL)
    b = stores(write_redis_yaml(tmp_path / "b.yaml", cluster.url, **STORE_KEYS))  # nothing in its memory
    assert wait_until(lambda: b.count_full_prefix([digest(h) for h in hashes]) == len(hashes))
    me, events = threading.get_ident(), []

    real_send, real_integer = resp.send, resp.BulkReader.integer

    def send(sock, pieces, deadline):
        if threading.get_ident() == me:  # not the health check's pings
            events.append(("send", sock.getpeername()[1]))
        return real_send(sock, pieces, deadline)

    def integer(self):
        if threading.get_ident() == me:
            events.append(("read", self._sock.getpeername()[1]))
        return real_integer(self)

    monkeypatch.setattr(resp, "send", send)
    monkeypatch.setattr(resp.BulkReader, "integer", integer)
    found = b.present_kinds((ObjectKind.FULL, ObjectKind.TAIL), [digest(h) for h in [*hashes, 99]])
    assert found[ObjectKind.FULL] == ["redis"] * len(hashes) + [None]
    assert found[ObjectKind.TAIL] == ["redis" if h in (202, 205) else None for h in [*hashes, 99]]
    sends = [port for name, port in events if name == "send"]
    assert sorted(sends) == sorted({port for name, port in events}) and len(sends) == 3  # one per shard
    assert [name for name, _ in events][:3] == ["send"] * 3  # every shard asked first
    assert len(events) == 3 + 2 * (len(hashes) + 1)  # then one reply per key


def test_damaged_objects_are_misses_and_both_keys_removed(cluster, stores, tmp_path):
    a = stores(write_redis_yaml(tmp_path / "a.yaml", cluster.url, **STORE_KEYS))
    for h in (101, 102, 103, 104):
        put(a, h, float(h))
    r = cluster.client()
    assert wait_until(lambda: all(r.exists(*object_keys(a, h)) == 2 for h in (101, 102, 103, 104)))
    data = object_keys(a, 102)[1]
    value = bytearray(r.get(data))
    value[100] ^= 0xFF  # same length, one bit pattern changed
    r.set(data, bytes(value))
    data = object_keys(a, 103)[1]
    r.set(data, r.get(data)[:-64])  # truncated
    r.set(object_keys(a, 104)[0], b"\x00" * 3)  # metadata garbage
    b = stores(write_redis_yaml(tmp_path / "b.yaml", cluster.url, **STORE_KEYS))
    assert [get(b, h) for h in (101, 102, 103, 104)] == [101.0, None, None, None]
    assert b.integrity_failures == 3
    assert [r.exists(*object_keys(a, h)) for h in (101, 102, 103, 104)] == [2, 0, 0, 0]


def test_over_long_objects_on_two_shards_cost_only_themselves(cluster, stores, tmp_path):
    """A value longer than its object (drained) and metadata longer than ``META_BYTES`` and
    ``SKIP_BYTES`` (its connection dropped, its length confirmed by its master) on two shards:
    each is a damaged object, counted and deleted (both keys); every other object of the hit,
    on every shard, is served; no protocol error; the connections are in step afterwards."""
    from lmcache_hma.store.lmcache_storage import flat, release
    from lmcache_hma.store.redis.pipelined_reads import SKIP_BYTES
    from lmcache_hma.store.redis.wire import META_BYTES

    a = stores(write_redis_yaml(tmp_path / "a.yaml", cluster.url, **STORE_KEYS))
    hashes = list(range(401, 413))
    for h in hashes:
        put(a, h, float(h - 400))
    r = cluster.client()
    assert wait_until(lambda: all(r.exists(*object_keys(a, h)) == 2 for h in hashes))
    long_value = 403
    shard_of = {h: where(cluster, object_keys(a, h)[0]) for h in hashes}
    long_meta = next(h for h in hashes if shard_of[h] != shard_of[long_value])
    r.append(object_keys(a, long_value)[1], b"x" * 100)
    r.append(object_keys(a, long_meta)[0], b"\0" * (META_BYTES + SKIP_BYTES))
    b = stores(write_redis_yaml(tmp_path / "b.yaml", cluster.url, **STORE_KEYS, local_cpu=False))
    wanted = [(ObjectKind.FULL, digest(h), PAYLOAD) for h in hashes]
    for attempt in range(2):  # the second time: both are gone, and every connection is in step
        got = b.get_many(wanted)
        values = [None if obj is None else float(flat(obj)[0]) for obj, _ in got]
        for obj, _ in got:
            if obj is not None:
                release(obj)
        assert values == [None if h in (long_value, long_meta) else float(h - 400) for h in hashes]
    assert b.integrity_failures == 2 and b.tier("redis").protocol_errors == 0
    assert r.exists(*object_keys(a, long_value), *object_keys(a, long_meta)) == 0


def test_a_hit_reads_the_shards_in_turn_and_survives_damage_and_a_broken_connection(cluster, stores, tmp_path,
                                                                                      monkeypatch):
    """One fetch over every shard, several batches each: the shards' batches are read in turn
    (each shard sends its next batch while another's is read); a damaged and a missing object
    cost only themselves; a connection that breaks mid-fetch, inside an object whose first
    piece came in an earlier batch, is retried once on a fresh one; every connection is left
    in step for the next fetch."""
    from lmcache_hma.store.redis.node_tier import RedisTier
    from lmcache_hma.store.redis.pipelined_reads import ShardFetch
    from lmcache_hma.store.lmcache_storage import flat, release

    monkeypatch.setattr(RedisTier, "RANGE_BYTES", OBJECT_BYTES // 2 + 8)  # 2 pieces per object
    monkeypatch.setattr(RedisTier, "READ_BATCH_BYTES", 3 * (OBJECT_BYTES // 2 + 8))  # 3 pieces per batch
    a = stores(write_redis_yaml(tmp_path / "a.yaml", cluster.url, **STORE_KEYS))
    hashes = list(range(301, 331))
    for h in hashes:
        put(a, h, float(h - 300))  # exact in bf16
    r = cluster.client()
    assert wait_until(lambda: all(r.exists(*object_keys(a, h)) == 2 for h in hashes))
    data = object_keys(a, 305)[1]
    value = bytearray(r.get(data))
    value[9] ^= 0x10
    r.set(data, bytes(value))  # fails its checksum
    r.delete(*object_keys(a, 311))  # a miss
    b = stores(write_redis_yaml(tmp_path / "b.yaml", cluster.url, **STORE_KEYS, local_cpu=False))

    turns, breaks = [], []
    step, read = ShardFetch.step, ShardFetch._read

    def recorded_step(self, *args):
        turns.append(self.client)
        return step(self, *args)

    def breaking_read(self, piece, *args):
        i, _, lo, *_ = piece
        if not breaks and lo > 0 and i in self.filling and self.batches[self.done][0] is piece:
            breaks.append(i)  # this object's first piece came in the last batch: now its connection breaks
            raise ConnectionError("connection reset (injected)")
        return read(self, piece, *args)

    monkeypatch.setattr(ShardFetch, "step", recorded_step)
    monkeypatch.setattr(ShardFetch, "_read", breaking_read)
    wanted = [(ObjectKind.FULL, digest(h), PAYLOAD) for h in hashes]
    allocated = spy_allocations(b, monkeypatch)
    got = b.get_many(wanted)
    values = [None if obj is None else float(flat(obj)[0]) for obj, _ in got]
    for obj, _ in got:
        if obj is not None:
            release(obj)
    assert values == [None if h in (305, 311) else float(h - 300) for h in hashes]
    assert len(allocated) > len(hashes) and {o.get_ref_count() for o in allocated} == {0}  # all back (and the
    # broken object's, allocated again for the retry)
    assert b.integrity_failures == 1 and r.exists(*object_keys(a, 305)) == 0
    assert breaks, "the break happened (and its objects came on the retry)"
    assert len(set(map(id, turns[:3]))) == 3, "the first batches read must come from the 3 shards in turn"
    monkeypatch.setattr(ShardFetch, "step", step)
    got = b.get_many(wanted)  # every pooled connection is in step
    assert [None if obj is None else float(flat(obj)[0]) for obj, _ in got] == \
        [None if h in (305, 311) else float(h - 300) for h in hashes]
    for obj, _ in got:
        if obj is not None:
            release(obj)


def test_disk_tier_is_reindexed_with_hash_tagged_names(cluster, stores, tmp_path):
    def open_(name):
        return stores(write_redis_yaml(tmp_path / f"{name}.yaml", cluster.url, "cpu_disk_redis.yaml",
                                       **STORE_KEYS, local_disk=f"file://{tmp_path / 'disk'}/",
                                       max_local_disk_size=0.01))
    a = open_("a")
    put(a, 201, 1.0)
    assert wait_until(lambda: any(p.name.endswith("}.pt") for p in (tmp_path / "disk").iterdir()))
    a.close()
    b = open_("b")  # a restart: the disk tier is found again
    assert b.reindexed == 1 and b.foreign_files == 0


def test_cluster_faults_cost_bounded_time(tmp_path, stores):
    """Unreachable at start, then up; a master paused: only its objects miss; all killed; close."""
    c = LocalRedisCluster(tmp_path / "faults", masters=3)  # not started yet
    try:
        store = stores(write_redis_yaml(tmp_path / "a.yaml", c.url, **STORE_KEYS,
                                        extra_config={"hma_remote_timeout_s": TIMEOUT}))
        assert not store.tier("redis").up
        (hit, seconds) = timed(lambda: store.count_full_prefix([digest(1), digest(2)]))
        assert hit == 0 and seconds < 0.2 and put(store, 1, 1.0) and get(store, 1) is None
        c.start()
        assert wait_until(lambda: store.tier("redis").up, timeout=10)  # the health check noticed
        hashes = list(range(1, 31))
        for h in hashes:
            put(store, h, float(h))
        assert wait_until(lambda: c.dbsize() >= 2 * len(hashes))
        by_node = {h: where(c, object_keys(store, h)[0]) for h in hashes}
        paused = next(n for n in c.nodes if n.port == by_node[1])
        on_paused = [h for h in hashes if by_node[h] == paused.port]
        elsewhere = [h for h in hashes if by_node[h] != paused.port]
        assert on_paused and elsewhere
        paused.pause()
        try:
            # before the health check notices: one call waits about two socket timeouts
            assert timed(lambda: get(store, on_paused[0]))[1] < 4 * TIMEOUT + 1
            assert wait_until(lambda: paused.port in {int(n.rsplit(":", 1)[1]) for n in store.tier("redis")._down},
                              timeout=10)
            (values, seconds) = timed(lambda: [get(store, h) for h in hashes])
            assert seconds < 1.0, seconds  # misses for the paused shard cost no round trip
            assert [values[hashes.index(h)] for h in elsewhere] == [float(h) for h in elsewhere]
            assert all(values[hashes.index(h)] is None for h in on_paused)
            assert store.tier("redis").up  # the other shards keep serving: no bypass
            assert timed(lambda: store.count_full_prefix([digest(on_paused[0])]))[1] < TIMEOUT / 2
            new = list(range(1001, 1013))
            for h in new:
                put(store, h, float(h))  # writes to the paused shard are skipped, the others land
            owner = {h: c.node_for_slot(c.keyslot(object_keys(store, h)[0])) for h in new}
            skipped = [h for h in new if owner[h] in (None, paused)]
            landed = [h for h in new if h not in skipped]
            assert skipped and landed
            assert wait_until(lambda: all(owner[h].client().exists(*object_keys(store, h)) == 2 for h in landed))
        finally:
            paused.resume()
        assert wait_until(lambda: not store.tier("redis")._down, timeout=10)
        assert get(store, on_paused[0]) == float(on_paused[0])
        assert all(paused.client().exists(*object_keys(store, h)) == 0 for h in skipped)
        # every node killed: the tier is bypassed, calls cost nothing
        for node in c.nodes:
            node.kill()
        assert wait_until(lambda: not store.tier("redis").up, timeout=10)
        assert timed(lambda: [get(store, h) for h in hashes])[1] < 0.2
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < 5.0 and not store._manager.thread.is_alive()
    finally:
        c.stop()


def test_a_cluster_that_refuses_every_command_is_bypassed(tmp_path, stores):
    """Servers with cluster-require-full-coverage yes answer CLUSTERDOWN to all while a shard is lost."""
    c = LocalRedisCluster(tmp_path / "strict", masters=3, node_timeout_ms=1000, full_coverage=True).start()
    try:
        store = stores(write_redis_yaml(tmp_path / "a.yaml", c.url, **STORE_KEYS,
                                        extra_config={"hma_remote_timeout_s": TIMEOUT}))
        assert store.tier("redis").up
        c.nodes[0].kill()
        assert wait_until(lambda: not store.tier("redis").up, timeout=15)
        assert timed(lambda: (get(store, 1), store.count_full_prefix([digest(1)]), put(store, 2, 2.0)))[1] < 0.2
    finally:
        c.stop()


# ======================================================================================
# Part 2: two `lmcache-hma serve` processes sharing a cluster with replicas
# ======================================================================================

@pytest.fixture(scope="module")
def fleet(cluster, tmp_path_factory):
    """Servers A (password from ${ENV} in the YAML) and B (password in the URL) on ``cluster``."""
    from lmcache_hma.testing.tiny_model import build_tiny_model

    work = tmp_path_factory.mktemp("cluster_e2e")
    model = build_tiny_model("tiny-gemma3")
    seeds = cluster.plain_url[len("redis-cluster://"):]
    yaml_a = write_redis_yaml(work / "a.yaml", f"redis-cluster://:${{{PW_ENV}}}@{seeds}")
    yaml_b = write_redis_yaml(work / "b.yaml", cluster.url)
    servers = {}
    try:
        servers["a"] = Server("a", model, yaml_a, work, {PW_ENV: cluster.password})
        servers["b"] = Server("b", model, yaml_b, work)
        deadline = time.monotonic() + 300
        for s in servers.values():
            s.wait_ready(deadline)
        yield {"a": servers["a"], "b": servers["b"], "cluster": cluster, "work": work}
    finally:
        for s in servers.values():
            s.stop()


def logged_since(server, text, mark: int, timeout=15.0) -> bool:
    """Whether ``text`` appears in ``server``'s log past ``mark`` (a length of it) within ``timeout``."""
    return wait_until(lambda: text in server.text()[mark:], timeout=timeout, step=0.2)


def stored_by(cluster, fn, count=KEYS_PER_PROMPT):
    """Run ``fn``; wait until ``count`` new keys are in the cluster; (fn's result, the new keys by port)."""
    before = {port: set(keys) for port, keys in cluster.keys_by_node().items()}
    result = fn()

    def new():
        now = cluster.keys_by_node()
        return {port: set(keys) - before.get(port, set()) for port, keys in now.items()}
    assert wait_until(lambda: sum(len(k) for k in new().values()) >= count, timeout=30)
    return result, new()


def test_e2e_second_server_hits_what_the_first_stored(fleet):
    a, b, cluster = fleet["a"], fleet["b"], fleet["cluster"]
    (text_a, ids_a, hit_a, _), new = stored_by(cluster, lambda: a.complete(PROMPT))
    ref = (text_a, ids_a, a.last_margins)
    assert hit_a == 0
    assert sum(1 for keys in new.values() if keys) >= 2  # the prompt's objects are spread over shards
    for port, keys in new.items():  # each object's metadata sits with its bytes
        for key in keys:
            twin = key[:-len(b"metadata")] + b"kv_bytes" if key.endswith(b"metadata") else \
                key[:-len(b"kv_bytes")] + b"metadata"
            assert twin in keys, (port, key)
    text_b, ids_b, hit_b, _ = b.complete(PROMPT)  # fresh process, nothing local
    assert hit_b == EXPECTED_HIT, b.text()[-3000:]
    # B computes only the prompt's tail: another split than A's cold run (tests.engines.same_greedy)
    assert same_answer(ref, (text_b, ids_b)), (ref, ids_b)
    stats = json.loads(b.stats.read_text())
    assert stats.get("loads_ok", 0) >= 1 and stats.get("loads_failed", 0) == 0
    assert stats.get("integrity_failures", 0) == 0


def test_e2e_paused_master_costs_bounded_time(fleet):
    a, b, cluster = fleet["a"], fleet["b"], fleet["cluster"]
    prompt = other_prompt("Paused")
    (text_a, ids_a, hit_a, _), new = stored_by(cluster, lambda: a.complete(prompt))
    ref = (text_a, ids_a, a.last_margins)
    victim = next(n for n in cluster.masters() if new.get(n.port))
    marks = {s.name: len(s.text()) for s in (a, b)}
    victim.pause()
    try:
        text_b, ids_b, _, seconds = b.complete(prompt)  # a hit from the shards that answer
        assert same_answer(ref, (text_b, ids_b)), (ref, ids_b)
        assert seconds < 20, seconds
        text_b2, ids_b2, _, seconds = b.complete(other_prompt("While paused"))
        ref2 = (text_b2, ids_b2, b.last_margins)
        assert seconds < 20, seconds
    finally:
        victim.resume()
    # the node was paused longer than cluster-node-timeout: its replica may have taken over, also
    # seconds after the resume (node timeout, election delay): wait until the roles stop changing,
    # or the next test's first writes go to a node about to be demoted (and are lost)
    assert cluster.wait_healthy(60), cluster.describe()
    assert cluster.wait_settled(quiet_s=5.0, timeout=60), cluster.describe()
    if victim not in cluster.masters():
        # Until a server's health check reads the new slot map (once a second), it may still
        # write to the resumed node, which accepts them until it learns it was demoted and
        # then drops them (Redis Cluster's consistency: such writes are lost, future misses).
        for s in (a, b):
            assert logged_since(s, "slot map changed", marks[s.name]), s.name
    assert same_answer(ref2, a.complete(other_prompt("While paused"))[:2])


# `pytest -m failover` runs these two alone (about a minute).
@pytest.mark.failover
def test_e2e_master_killed_mid_run(fleet):
    a, b, cluster = fleet["a"], fleet["b"], fleet["cluster"]
    prompts = [other_prompt(f"Killed {i}") for i in range(4)]
    reference, stored = {}, {}
    for p in prompts:  # A stores each (cold: its tokens are the reference)
        (text, ids, hit, _), new = stored_by(cluster, lambda: a.complete(p))
        assert hit == 0
        reference[p], stored[p] = (text, ids, a.last_margins), new
    victim = max(cluster.masters(), key=lambda n: sum(bool(new.get(n.port)) for new in stored.values()))
    results, errors = [], []

    def serve_b():
        try:
            for p in prompts:
                results.append((p, b.complete(p)))
        except Exception as exc:  # any error reaching the user fails the test
            errors.append(exc)

    marks = {s.name: len(s.text()) for s in (a, b)}
    worker = threading.Thread(target=serve_b)
    worker.start()
    assert wait_until(lambda: results, timeout=60)  # B has served one request from the cluster
    victim.kill()
    worker.join(240)
    assert not worker.is_alive() and not errors, errors
    assert len(results) == len(prompts)
    for p, (text, ids, hit, seconds) in results:
        # A hit that backed off (a shard was failing over) changes the compute split: a
        # reference near-tie may then flip, as in every comparison with a cold run.
        assert same_answer(reference[p], (text, ids)), (p[:20], reference[p], text)
        assert seconds < 30, seconds
    # a new prompt during the election on both servers: no error, same tokens
    fresh = other_prompt("During the election")
    text_a, ids_a, _, _ = a.complete(fresh)
    assert same_answer((text_a, ids_a, a.last_margins), b.complete(fresh)[:2])
    assert a.healthy() and b.healthy()
    for s in (a, b):
        assert logged_since(s, "does not answer", marks[s.name]), f"{s.name}: no warning about the lost master"
    fleet["killed"], fleet["marks"] = victim, marks


@pytest.mark.failover
def test_e2e_sharing_resumes_after_the_replica_takes_over(fleet):
    a, b, cluster = fleet["a"], fleet["b"], fleet["cluster"]
    assert cluster.wait_failover(fleet["killed"], timeout=60), cluster.describe()
    for s in (a, b):  # each server's health check saw the new slot map
        assert logged_since(s, "slot map changed", fleet["marks"][s.name]), f"{s.name} did not see the failover"
    prompt = other_prompt("After the failover")
    (text_a, ids_a, hit_a, _), _ = stored_by(cluster, lambda: a.complete(prompt))
    ref = (text_a, ids_a, a.last_margins)
    assert hit_a == 0
    text_b, ids_b, hit_b, _ = b.complete(prompt)
    assert hit_b == EXPECTED_HIT and same_answer(ref, (text_b, ids_b)), (ref, ids_b)


def test_e2e_password_never_in_logs_and_prompt_shutdown(fleet):
    password = fleet["cluster"].password
    for s in (fleet["a"], fleet["b"]):
        log = s.text()
        assert "LMCache hit tokens" in log and "redis-cluster://" in log
        assert password not in log, f"{s.name}'s log shows the cluster password"
    seconds = {name: fleet[name].stop(timeout=30) for name in ("a", "b")}
    assert all(s < 30 for s in seconds.values()), seconds
