"""The Redis tier when what comes back is not to be trusted (issue 27).

A real ``redis-server`` behind ``tests.redis_proxy.RedisProxy``, a proxy that lies
about bulk lengths, trickles bytes, closes mid-reply or injects RESP3 push frames.
Whatever it does, each call of the tier (lookup, read, write, delete, health
probe) ends within a deadline of about ``hma_remote_timeout_s`` (asserted
generously: 3x), allocates nothing near a claimed length, and ends in a clean
miss or a counted write failure: no exception escapes, no wrong bytes come back,
and the connections left in the pool are in step (the proxy turned honest again,
every object reads back right).

What Redis itself holds is not trusted either (issue 36): a value longer than its
object, or metadata longer than ``META_BYTES``, is a damaged object (counted, deleted,
a miss) that costs nothing else: the batch's other objects are served, the connection
stays in step, and a worker's lookup serves the chunks before it. A length Redis does
not confirm deletes nothing.

Then one engine: a fresh vLLM engine whose ``remote_url`` is a trickling proxy
starts, serves at full speed and gives the same greedy tokens as without the
connector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.store.lmcache_storage import flat, release
from tests.fakes import digest
from tests.redis_proxy import LIE_BYTES, MODES, RedisProxy
from tests.engines import Reference
from tests.redis_server import MISSING, REPO, redis_server_binary, write_redis_yaml
from tests.test_redis import PAYLOAD, STORE_KEYS, get, put, redis_keys, stores, wait_until  # noqa: F401

TIMEOUT_S = 0.5  # hma_remote_timeout_s of the tier behind the proxy
BOUND_S = 3 * TIMEOUT_S  # what any one call may take, generously
# A call that drops its connection, asks STRLEN and reads again pushes 4 MiB through the
# Python proxy: on a loaded 2-core machine that alone can take most of 0.5 s.
LONG_TIMEOUT_S = 3.0
HASHES = (1, 2, 3)
BAD_MODES = ["trickle", "lie", "close", "push"]  # every mode but "pass"
assert set(BAD_MODES) == set(MODES) - {"pass"}


@pytest.fixture(autouse=True, scope="module")
def _need_redis_server():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


@pytest.fixture
def behind_proxy(request, redis_server, redis_yaml, stores):
    """(a store on Redis directly, which wrote objects 1-3; a store reaching the same Redis
    through a proxy, honest for now; the proxy). The second store's health thread is
    stopped, so that its calls always go to Redis (a failed check would bypass it). Its
    ``hma_remote_timeout_s`` is ``TIMEOUT_S`` unless the test passes another (indirect)."""
    timeout_s = getattr(request, "param", TIMEOUT_S)
    a = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS))
    for h in HASHES:
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 2 * len(HASHES))
    proxy = RedisProxy(redis_server.port)
    b = stores(redis_yaml(proxy.url, local_cpu=False, **STORE_KEYS, extra_config={"hma_remote_timeout_s": timeout_s}))
    tier = b.tier("redis")
    assert tier is not None and tier.up
    tier._stop.set()
    tier._thread.join(5)
    yield a, b, proxy
    proxy.close()


def bounded(fn, limit: float = BOUND_S):
    """(``fn()``, seconds it took); fails if it runs past ``limit`` (the call is left to end when
    the proxy closes) or raises."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    seconds = time.monotonic() - t0
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {limit} s"
    if "error" in box:
        raise AssertionError(f"an exception escaped: {box['error']!r}") from box["error"]
    return box["value"], seconds


def read_all(store) -> list:
    """The values of objects 1-3 read in one fetch (None: a miss)."""
    got = store.get_many([(ObjectKind.FULL, digest(h), PAYLOAD) for h in HASHES])
    values = [None if obj is None else float(flat(obj)[0]) for obj, _ in got]
    for obj, _ in got:
        if obj is not None:
            release(obj)
    return values


def in_step_again(a, b, proxy) -> None:
    """The proxy honest again: every object reads back right through the same pool, nothing was
    removed or counted as damaged."""
    proxy.mode = "pass"
    assert read_all(b) == [1.0, 2.0, 3.0]
    assert b.present(ObjectKind.FULL, [digest(h) for h in HASHES]) == [True] * 3
    assert b.integrity_failures == 0 and [get(a, h) for h in HASHES] == [1.0, 2.0, 3.0]


def test_lookups_end_within_the_deadline_whatever_comes_back(behind_proxy):
    a, b, proxy = behind_proxy
    for mode in BAD_MODES:
        proxy.mode = mode
        flags, seconds = bounded(lambda: b.present(ObjectKind.FULL, [digest(h) for h in (*HASHES, 9)]))
        # lengths are not in EXISTS replies: a lie there changes nothing; anything else is a miss
        assert flags == ([True, True, True, False] if mode == "lie" else [False] * 4), (mode, flags)
        assert seconds < BOUND_S
        in_step_again(a, b, proxy)
    assert b.tier("redis").protocol_errors >= 1  # the push frames


def test_reads_are_clean_misses_within_the_deadline(behind_proxy):
    a, b, proxy = behind_proxy
    for mode in BAD_MODES:
        errors = b.tier("redis").protocol_errors
        proxy.mode = mode
        values, seconds = bounded(lambda: read_all(b))
        assert values == [None] * 3 and seconds < BOUND_S, (mode, values, seconds)
        if mode in ("lie", "push"):
            assert b.tier("redis").protocol_errors > errors, mode
        in_step_again(a, b, proxy)


def test_lying_lengths_allocate_nothing_near_them(behind_proxy):
    """A metadata reply claiming 256 MiB: refused before anything of that size exists."""
    a, b, proxy = behind_proxy
    proxy.mode = "lie"
    tracemalloc.start()
    try:
        values, _ = bounded(lambda: read_all(b))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"peak Python allocation while reading behind the lying proxy: {peak / 2**20:.2f} MiB "
          f"(claimed: {LIE_BYTES >> 20} MiB per value)")
    assert values == [None] * 3 and peak < LIE_BYTES // 16
    in_step_again(a, b, proxy)


def test_writes_fail_cleanly_within_the_deadline(behind_proxy):
    a, b, proxy = behind_proxy
    for n, mode in enumerate(BAD_MODES):
        proxy.mode = mode
        before = b.tier("redis").not_written
        _, seconds = bounded(lambda: put(b, 20 + n, 1.0))
        assert seconds < BOUND_S, (mode, seconds)
        if mode != "lie":  # +OK replies have no length to lie about: that write succeeds
            assert b.tier("redis").not_written == before + 1, mode
        in_step_again(a, b, proxy)


def test_probe_and_delete_end_within_the_deadline(behind_proxy):
    a, b, proxy = behind_proxy
    key = b.key(ObjectKind.FULL, digest(1))
    for mode in BAD_MODES:
        proxy.mode = mode
        (ok, why), seconds = bounded(b.tier("redis")._probe)
        assert ok == (mode == "lie") and seconds < BOUND_S, (mode, why, seconds)
        if mode != "lie":
            _, seconds = bounded(lambda: b.tier("redis").remove(key))  # whatever it did, it ended in time
            assert seconds < BOUND_S, (mode, seconds)
        proxy.mode = "pass"
        if not b.has(ObjectKind.FULL, digest(1)):  # the delete reached Redis before the reply broke
            put(a, 1, 1.0)
        in_step_again(a, b, proxy)


def test_health_thread_survives_an_exception_in_one_check(behind_proxy, monkeypatch):
    from lmcache_hma.store.redis.node_tier import RedisTier

    _, b, _ = behind_proxy
    tier = b.tier("redis")
    calls = []
    probe = tier._probe

    def flaky():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("injected into one health check")
        return probe()

    monkeypatch.setattr(RedisTier, "PERIOD_S", 0.05)
    monkeypatch.setattr(tier, "_probe", flaky)
    tier._stop.clear()
    tier._thread = threading.Thread(target=tier._watch, daemon=True)
    tier._thread.start()
    assert wait_until(lambda: len(calls) >= 4, timeout=5)
    assert tier._thread.is_alive() and tier.health_errors == 1 and tier.up


def test_health_thread_that_dies_anyway_bypasses_the_tier(behind_proxy, monkeypatch, caplog):
    from lmcache_hma.store.redis.node_tier import RedisTier

    class Fatal(BaseException):
        pass

    def fatal():
        raise Fatal("not an Exception: nothing inside the loop catches it")

    _, b, _ = behind_proxy
    tier = b.tier("redis")
    monkeypatch.setattr(RedisTier, "PERIOD_S", 0.05)
    monkeypatch.setattr(tier, "_probe", fatal)
    tier._stop.clear()
    tier._thread = threading.Thread(target=lambda: pytest.raises(Fatal, tier._watch), daemon=True)
    tier._thread.start()
    tier._thread.join(5)
    assert not tier.up and "RemoteBackend" in _bypassed(b)
    assert b.present(ObjectKind.FULL, [digest(1)]) == [False]  # a miss, at once
    assert sum("health thread stopped" in r.getMessage() for r in caplog.records) == 1
    tier._stop.set()


def _bypassed(store) -> set:
    from lmcache_hma.store import lmcache_compat

    return set(lmcache_compat.bypassed(store._manager))


# ======================================================================================
# Over-long objects in Redis: damaged objects, not protocol errors (issue 36)
# ======================================================================================

def object_keys(store, h, kind=ObjectKind.FULL) -> tuple[bytes, bytes]:
    """(metadata key, bytes key) of object ``h`` of ``store``'s namespace in Redis."""
    k = store.key(kind, digest(h)).to_string()
    return (k + "metadata").encode(), (k + "kv_bytes").encode()


def make_over_long(client, store, value_of=None, metadata_of=None, extra: int = 1) -> None:
    """Object ``value_of``'s value ``extra`` bytes longer than its object, object ``metadata_of``'s
    metadata ``extra`` bytes longer than ``META_BYTES`` (what anyone who can write Redis can do)."""
    from lmcache_hma.store.redis.wire import META_BYTES

    if value_of is not None:
        client.append(object_keys(store, value_of)[1], b"x" * extra)
    if metadata_of is not None:
        meta = object_keys(store, metadata_of)[0]
        client.append(meta, b"\0" * (META_BYTES + extra - client.strlen(meta)))


@pytest.mark.parametrize("behind_proxy", [LONG_TIMEOUT_S], indirect=True, ids=["timeout"])
@pytest.mark.parametrize("extra", [1, 4 << 20], ids=["drained", "too-long-to-drain"])  # SKIP_BYTES: 4 MiB
def test_over_long_value_and_metadata_cost_only_their_objects(redis_server, behind_proxy, extra):
    """Objects 2 (its value) and 4 (its metadata) are longer in Redis than any object of their
    keys: each is a damaged object (counted, both keys deleted, a miss) while the batch's other
    objects are served; no protocol error. A reply of at most ``SKIP_BYTES`` is drained (the one
    connection stays in step: the proxy saw no new one); a longer one costs its connection, and
    Redis confirms its length before anything is deleted. The next calls are served as usual."""
    a, b, proxy = behind_proxy
    for h in (4, 5):
        put(a, h, float(h))
    assert wait_until(lambda: len(redis_keys(redis_server)) == 10)
    make_over_long(redis_server.client(), a, value_of=2, metadata_of=4, extra=extra)
    tier, connections = b.tier("redis"), proxy.connections
    bound_s = 3 * LONG_TIMEOUT_S
    got, seconds = bounded(lambda: b.get_many([(ObjectKind.FULL, digest(h), PAYLOAD) for h in range(1, 6)]), bound_s)
    values = [None if obj is None else float(flat(obj)[0]) for obj, _ in got]
    for obj, _ in got:
        if obj is not None:
            release(obj)
    assert values == [1.0, None, 3.0, None, 5.0] and seconds < bound_s
    assert b.integrity_failures == 2 and tier.protocol_errors == 0
    assert redis_server.client().exists(*object_keys(a, 2), *object_keys(a, 4)) == 0  # deleted, both keys
    assert b.present(ObjectKind.FULL, [digest(h) for h in range(1, 6)]) == [True, False, True, False, True]
    assert [get(b, h) for h in (5, 1, 3)] == [5.0, 1.0, 3.0]
    if extra == 1:
        assert proxy.connections == connections  # drained: the pooled connection served every call
    else:
        assert proxy.connections > connections


def test_a_reply_longer_than_redis_holds_deletes_nothing(redis_server, behind_proxy):
    """A proxy claiming 256 MiB for every value: Redis says the values are not that long, so
    nothing is damaged or deleted; protocol errors, misses (``in_step_again`` checks the rest)."""
    a, b, proxy = behind_proxy
    proxy.mode = "lie"
    values, _ = bounded(lambda: read_all(b))
    assert values == [None] * 3 and b.tier("redis").protocol_errors >= 1
    assert len(redis_keys(redis_server)) == 2 * len(HASHES)
    in_step_again(a, b, proxy)


def test_with_a_shared_secret_only_this_deployments_over_long_object_is_deleted(redis_server, redis_yaml, stores):
    """With ``hma_shared_secret`` an over-long object's MAC is never checked: it is deleted all
    the same, under the key this deployment computes (its own namespace), and another
    deployment's over-long object of the same chunk stays."""
    from tests.test_redis import namespace

    ours = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS), namespace(secret=b"fleet-secret-0123456789"))
    theirs = stores(redis_yaml(redis_server.plain_url, **STORE_KEYS), namespace(secret=b"other-secret-0123456789"))
    for store in (ours, theirs):
        put(store, 1, 1.0)
        put(store, 2, 2.0)
    assert wait_until(lambda: len(redis_keys(redis_server)) == 8)
    r = redis_server.client()
    make_over_long(r, ours, value_of=2)
    make_over_long(r, theirs, value_of=2)
    assert [get(ours, h) for h in (2, 1)] == [None, 1.0] and ours.integrity_failures == 1
    assert r.exists(*object_keys(ours, 2)) == 0 and r.exists(*object_keys(theirs, 2)) == 2


@pytest.mark.parametrize("poisoned", ["value", "metadata"])
def test_a_lookup_serves_the_chunks_before_a_poisoned_one(redis_server, redis_yaml, tmp_path, poisoned):
    """End to end through the worker's lookup (no engine): a 5-chunk prefix in Redis whose chunk
    3 is over-long. The lookup finds 5 chunks, its fetch drops chunk 3 (deleted), and it serves
    and holds the 3 chunks before it, as after any damaged object."""
    import uuid

    import torch

    from lmcache_hma.config.settings import load_config
    from lmcache_hma.core.keys import ChunkHasher, Namespace
    from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef, SaveSpec
    from lmcache_hma.worker.worker_half import WorkerHalf
    from tests.fakes import kv_caches, layout

    lay = layout("F")
    cfg = load_config({"lmcache_config_file": str(redis_yaml(redis_server.plain_url, **STORE_KEYS))})
    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=lay, kv_layout="LBHNC/test", world_size=1, rank=0)
    worker = WorkerHalf(cfg, lay, ns, f"unit-{uuid.uuid4().hex}", 32, serves_lookups=True)
    worker.register_kv_caches(kv_caches(lay, num_blocks=32))
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(40)), 5)
        objects = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in range(5)]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("writer", (list(range(1, 11)),), objects)]))
        worker.drain()
        assert wait_until(lambda: len(redis_keys(redis_server)) == 10)
        key = worker.store.key(ObjectKind.FULL, hashes[3]).to_string()
        r = redis_server.client()
        if poisoned == "value":
            r.append(key + "kv_bytes", b"x")
        else:
            r.append(key + "metadata", b"\0" * (8 << 10))
        assert worker.store.count_full_prefix(hashes) == 5  # every lookup finds it
        chunks, held, tiers = worker._answer_lookup("reader", 1, 0, hashes)[:3]
        assert (chunks, held, tiers) == (3, True, ("redis",) * 3)
        assert worker.store.integrity_failures == 1 and r.exists(key + "metadata", key + "kv_bytes") == 0
        assert worker.store.count_full_prefix(hashes) == 3
    finally:
        worker.shutdown()


# ======================================================================================
# One engine behind a trickling proxy
# ======================================================================================

PROMPT = "Hello, how are you?" * 500 + "Tell me a very long story"  # 3007 tokens

_ENGINE_SCRIPT = r"""
import json, sys, time
from lmcache_hma.testing.tiny_model import build_tiny_model
from tests.engines import generate, make_llm, shutdown
yaml_path, prompt = sys.argv[1], sys.argv[2]
if __name__ == "__main__":
    model = build_tiny_model("tiny-gemma3")
    t0 = time.monotonic()
    llm = make_llm(model, yaml_path)
    start_s = time.monotonic() - t0
    t0 = time.monotonic()
    outs = [generate(llm, prompt)[0], generate(llm, "Another: " + prompt)[0]]
    serve_s = time.monotonic() - t0
    shutdown(llm)
    print("RESULT " + json.dumps({"start_s": start_s, "serve_s": serve_s, "outs": [o.__dict__ for o in outs]}),
          flush=True)
"""
# The reference without the connector: the session's tiny-gemma3 reference engine (in this process).
REFERENCE = Reference("tiny-gemma3", PROMPT)


def test_engine_behind_a_trickling_proxy_starts_and_serves_exactly(redis_server, tmp_path):
    """The tier does not answer in time, so it is bypassed at start: the engine starts, serves
    both prompts at full speed (lookups would otherwise wait for their trickled answers:
    ``hma_lookup_timeout_s`` is long here) and gives the tokens of an engine without the
    connector."""
    from tests.engines import Gen, same_greedy

    ref = REFERENCE.get()  # before the child's engine starts: one engine at a time
    with RedisProxy(redis_server.port, mode="trickle") as proxy:
        yaml_path = write_redis_yaml(tmp_path / "trickle.yaml", proxy.url, extra_config={
            "hma_remote_timeout_s": 1.0, "hma_lookup_timeout_s": 60.0})
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            out = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(yaml_path), PROMPT], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=400)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"no answer in 400 s:\n{(exc.stdout or b'')[-3000:]!r}") from None
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    result = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    print(f"behind the trickling proxy: engine start {result['start_s']:.1f} s, two prompts served in "
          f"{result['serve_s']:.1f} s")
    assert "is unreachable at start" in log
    first = Gen(**result["outs"][0])
    assert same_greedy(ref, first), (ref, first)
    assert result["start_s"] < 240 and result["serve_s"] < 20, result  # a start here: 20-70 s
