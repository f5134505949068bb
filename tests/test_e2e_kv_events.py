"""KV cache events end to end (issue 29 item 2): what a router learns from them is what the
engines then serve.

Two ``lmcache-hma serve`` processes of the tiny Gemma-3 share one real Redis and publish
vLLM's KV cache events (``--kv-events-config``, ZMQ) to this process, which subscribes with
plain ``zmq`` SUB sockets and decodes the msgspec batches as an external router would
(vLLM's ``KVEventBatch``). A: CPU memory (small: it evicts), disk, Redis; B: CPU memory,
Redis. Both hash with ``sha256_cbor`` and have small vLLM KV caches, so vLLM's own prefix
cache forgets old prompts.

``Router`` keeps, from the events alone, each instance's vLLM cache (medium GPU), its local
tiers (LOCAL: CPU, disk) and the shared Redis (REMOTE), and predicts a prompt's hit on an
instance the way vLLM decides hybrid hits: the longest block boundary ``b`` before the
prompt's last token such that every full-attention group holds blocks ``[0, b)`` and every
sliding-window group the blocks of the window before ``b``, with the prompt's block hashes
computed here with vLLM's ``hash_block_tokens``. Each test compares that prediction with
the ``num_cached_tokens`` the engine reports (``prompt_tokens_details.cached_tokens``) and
the tier the worker says it loaded from (``hma_stats_file``). Two engine starts in all.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.engines import write_yaml
from tests.servers import ServeProcess
from tests.kv_router import Router, vllm_block_hashes
from tests.redis_server import MISSING, RedisServer, free_port, redis_server_binary
from tests.waiting import wait_for

CHUNK = 256
HELLO = "Hello, how are you?"


class Server(ServeProcess):
    """One ``lmcache-hma serve`` process publishing KV cache events to ``events_port``."""

    def __init__(self, name: str, model, yaml_path: Path, work: Path, events_port: int, gpu_blocks: int):
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": f"kv@{name}",
                  "endpoint": f"tcp://127.0.0.1:{events_port}"}  # not a wildcard: it connects to us
        super().__init__(name, model, yaml_path, work, [
            "--served-model-name", "tiny", "--kv-events-config", json.dumps(events),
            "--prefix-caching-hash-algo", "sha256_cbor", "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override", str(gpu_blocks), "--max-model-len", "2048"],
            {"VLLM_SERVER_DEV_MODE": "1"})

    def tokenize(self, text: str) -> list[int]:
        import requests

        r = requests.post(f"{self.base}/tokenize", json={"model": "tiny", "prompt": text}, timeout=30)
        r.raise_for_status()
        return r.json()["tokens"]

    def complete(self, tokens: list[int]) -> int:
        """Generate one token for the prompt ``tokens``; the engine's ``num_cached_tokens``."""
        import requests

        r = requests.post(f"{self.base}/v1/completions", timeout=180,
                          json={"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(tokens)
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def reset(self) -> None:
        import requests

        r = requests.post(f"{self.base}/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
        assert r.status_code == 200 and r.json().get("success"), r.text


# ======================================================================================
# The fleet: Redis, A (CPU memory 4 MB + disk + Redis), B (CPU memory + Redis), the router
# ======================================================================================

PROMPT_TOKENS = 1100  # 4 full chunks: 4 full-attention objects and 4 tails (one per boundary)
# per tier: a chunk's full object covers group 2, its tail groups 0 and 1; the request's turn end
# (tokens 1024-1099, scheduler.turn_ends) the whole blocks it covers: sliding block 7, groups 0 and 1
EVENTS_PER_PROMPT = 4 * (1 + 2) + 2
OBJECTS_PER_PROMPT = 4 + 4 + 2  # chunks, tails, the turn end and its marker


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from lmcache_hma.testing.tiny_model import build_tiny_model

    if redis_server_binary() is None:
        pytest.fail(MISSING)
    work = tmp_path_factory.mktemp("kv_events")
    redis = RedisServer(workdir=work / "redis").start()
    ports = {"a": free_port(), "b": free_port()}
    router = Router(ports)
    model = build_tiny_model("tiny-gemma3")
    shared = dict(chunk_size=CHUNK, local_cpu=True, remote_url=redis.url, remote_serde="naive")
    # a tail at every boundary (hma_tail_admission: interval): the events of each kind of object
    # at each boundary (tests/test_admission.py has where tails go by default)
    yaml_a = write_yaml(work / "a.yaml", max_local_cpu_size=0.004, local_disk=f"file://{work}/a-disk/",
                        max_local_disk_size=0.2, extra_config={"hma_tail_admission": "interval"}, **shared)
    # B stores no answers nor turn ends: its events count exactly per object (the last test)
    yaml_b = write_yaml(work / "b.yaml", max_local_cpu_size=0.05,
                        extra_config={"hma_store_answers": False, "hma_tail_admission": "interval"}, **shared)
    servers = {}
    try:
        for name, path in (("a", yaml_a), ("b", yaml_b)):
            servers[name] = Server(name, model, path, work, ports[name], gpu_blocks=64)
        deadline = time.monotonic() + 600
        for s in servers.values():
            s.wait_ready(deadline)
        prompts = {}
        for i, tag in enumerate(("P1", "Q", "R", "S")):
            prompts[tag] = servers["a"].tokenize(f"{tag} {i}: " + HELLO * 200)[:PROMPT_TOKENS]
        yield {**servers, "router": router, "redis": redis, "prompts": prompts}
    finally:
        for s in servers.values():
            s.stop()
        router.close()
        redis.stop()


def spliced(prefix: list[int], n: int, rest: list[int]) -> list[int]:
    """``prefix[:n]`` then ``rest`` from position ``n``: shares exactly ``n`` tokens with ``prefix``."""
    return prefix[:n] + rest[n:]


def events_of(router, name, kind, *, medium=None, locality=None) -> list:
    with router.lock:
        return [e for e in router.log[name] if type(e).__name__ == kind
                and (medium is None or e.medium == medium) and (locality is None or e.locality == locality)]


def chunk_entries(tokens, chunks, group=2, size=128) -> set:
    """(group, hash) of the full-attention blocks of ``chunks``."""
    hashes = vllm_block_hashes(tokens, size)
    per = CHUNK // size
    return {(group, hashes[j]) for c in chunks for j in range(c * per, (c + 1) * per)}


def tier_has(router, name, tier, entries) -> bool:
    with router.lock:
        where = router.redis if tier == "redis" else router.local[name][tier]
        return entries <= where


def test_every_store_is_announced_with_vllms_block_hashes(fleet):
    a, router, p1 = fleet["a"], fleet["router"], fleet["prompts"]["P1"]
    assert a.complete(p1) == 0
    hashes = vllm_block_hashes(p1, 128)
    # full-attention chunks 0-3 (blocks 0-7); tails at 256, 512, 768, 1024: blocks 1, 3, 5, 7
    full = chunk_entries(p1, range(4))
    tails = {(g, hashes[j]) for g in (0, 1) for j in (1, 3, 5, 7)}
    for tier in ("cpu", "disk", "redis"):
        wait_for(lambda: tier_has(router, "a", tier, full | tails), timeout=30,
                 what=f"P1's objects announced in {tier}")
    wait_for(lambda: a.counters().get("objects_stored") == OBJECTS_PER_PROMPT, timeout=30,
             what=f"A's {OBJECTS_PER_PROMPT} stored objects")
    gpu = defaultdict(list)  # vLLM's own prefix-cache events for this prompt, by group
    for e in events_of(router, "a", "BlockStored", medium="GPU"):
        gpu[e.group_idx].append(e)
    for medium, locality in (("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")):
        # the turn end's events name the blocks of the last tail again: the sets above can be
        # complete before they arrive, so wait for the count (then settle, so an extra one shows)
        settled(lambda: len(events_of(router, "a", "BlockStored", medium=medium, locality=locality)),
                EVENTS_PER_PROMPT, timeout=30)
        wait_for(lambda: not router_busy(router, "a", quiet_s=0.5), timeout=30, what="A's events to settle")
        got = events_of(router, "a", "BlockStored", medium=medium, locality=locality)
        assert len(got) == EVENTS_PER_PROMPT, [(e.group_idx, len(e.block_hashes)) for e in got]
        covered = set()
        for e in got:
            first = hashes.index(e.block_hashes[0])
            assert e.block_hashes == hashes[first:first + len(e.block_hashes)]
            assert e.parent_block_hash == (hashes[first - 1] if first else None)
            assert e.token_ids == p1[first * 128:(first + len(e.block_hashes)) * 128] and e.block_size == 128
            assert e.ownership is None and e.extra_keys == [None] * len(e.block_hashes)
            # the group's kind and window as vLLM's own events give them; for full attention,
            # the very hashes vLLM announced for its own cache
            theirs = gpu[e.group_idx]
            assert {(t.kv_cache_spec_kind, t.kv_cache_spec_sliding_window) for t in theirs} == {
                (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)}
            if e.kv_cache_spec_kind == "full_attention":
                assert set(e.block_hashes) <= {h for t in theirs for h in t.block_hashes}
            covered |= {(e.group_idx, h) for h in e.block_hashes}
        assert covered == full | tails
    with router.lock:
        assert router.seqs["a"] == list(range(len(router.seqs["a"]))) and router.topics["a"] == {"kv@a"}


def test_the_router_predicts_a_redis_hit_on_the_other_instance(fleet):
    b, router, p1, q = fleet["b"], fleet["router"], fleet["prompts"]["P1"], fleet["prompts"]["Q"]
    p2 = spliced(p1, 700, q)  # chunks 0 and 1 of P1, then Q's tokens
    assert router.predict(p2, router.tier_sets("b")) == (512, "redis")
    assert router.predict(p2, [("gpu", router.gpu["b"])])[0] == 0  # B never saw P1
    assert b.complete(p2) == 512
    assert settled(lambda: b.counters().get("loaded_tokens_redis"), 512) == 512
    # B kept the fetched objects in CPU memory and says so: the next such prompt is a CPU hit there
    wait_for(lambda: tier_has(router, "b", "cpu", chunk_entries(p1, range(2))), timeout=30,
             what="B's CPU copies of P1's chunks 0 and 1 announced")
    assert router.predict(spliced(p1, 600, fleet["prompts"]["R"]), router.tier_sets("b")) == (512, "cpu")


def test_evictions_are_announced_and_the_router_follows_them(fleet):
    a, router, p1 = fleet["a"], fleet["router"], fleet["prompts"]["P1"]
    p3 = spliced(p1, 900, fleet["prompts"]["R"])
    first_chunk = chunk_entries(p1, [0])
    fillers = 0
    # 4 MB of CPU memory holds about 4 prompts' objects; vLLM's 64 blocks about 5 prompts
    while tier_has(router, "a", "cpu", first_chunk) or router.predict(p3, [("gpu", router.gpu["a"])])[0]:
        assert fillers < 10, "A's CPU tier or vLLM's cache never evicted P1"
        filler = a.tokenize(f"filler {fillers}: " + HELLO * 200)[:PROMPT_TOKENS]
        a.complete(filler)
        fillers += 1
        wait_for(lambda: not router_busy(router, "a"), timeout=30, what="A's events to settle")
    removed = events_of(router, "a", "BlockRemoved", medium="CPU", locality="LOCAL")
    assert removed and all(e.ownership is None for e in removed)
    # every removal names hashes announced before in that tier
    announced = {(e.group_idx, h) for e in events_of(router, "a", "BlockStored", medium="CPU")
                 for h in e.block_hashes}
    assert {(e.group_idx, h) for e in removed for h in e.block_hashes} <= announced
    # P1 is gone from CPU memory, still on disk: the router says a disk hit of 3 chunks
    before = a.counters().get("loaded_tokens_disk", 0)
    assert router.predict(p3, router.tier_sets("a")) == (768, "disk")
    assert a.complete(p3) == 768
    assert settled(lambda: a.counters().get("loaded_tokens_disk", 0) - before, 768) == 768


def settled(value, want, timeout=10.0):
    """``value()`` once it equals ``want`` (the worker writes its counters after the step), or
    its last value after ``timeout`` s, for the assertion to show."""
    deadline = time.monotonic() + timeout
    while (got := value()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def router_busy(router, name, quiet_s=1.0) -> bool:
    """Whether ``name`` published anything in the last ``quiet_s`` seconds."""
    with router.lock:
        n = len(router.log[name])
    time.sleep(quiet_s)
    with router.lock:
        return len(router.log[name]) != n


def test_a_reset_is_announced_and_redis_no_longer_serves_what_came_before_it(fleet):
    a, router, p1 = fleet["a"], fleet["router"], fleet["prompts"]["P1"]
    # The earlier tests' last events (their stores land before the reset) are all in first.
    wait_for(lambda: not router_busy(router, "a", quiet_s=2.0), timeout=60, what="A's stores to land")
    cleared_before = len(events_of(router, "a", "AllBlocksCleared"))
    removed_before = len(events_of(router, "a", "BlockRemoved", locality="LOCAL"))
    with router.lock:
        local_before = len(router.local["a"]["cpu"]) + len(router.local["a"]["disk"])
    assert local_before  # the reset has something to announce
    a.reset()
    # vLLM's own (its prefix cache); the connector announces each object that left CPU memory
    # and disk instead (never AllBlocksCleared, which a router applies to the whole instance)
    wait_for(lambda: len(events_of(router, "a", "AllBlocksCleared")) >= cleared_before + 1, timeout=30,
             what="AllBlocksCleared from vLLM")
    wait_for(lambda: not router.local["a"]["cpu"] and not router.local["a"]["disk"], timeout=30,
             what="BlockRemoved for every object of A's CPU memory and disk")
    wait_for(lambda: not router_busy(router, "a"), timeout=30, what="A's events to settle")
    assert len(events_of(router, "a", "AllBlocksCleared")) == cleared_before + 1
    assert len(events_of(router, "a", "BlockRemoved", locality="LOCAL")) > removed_before
    with router.lock:
        assert not router.gpu["a"]
    # A's reset moved it to the next weights generation (docs/redis.md): what Redis holds from
    # before it (B's objects, still announced: a hint, docs/fleet.md) is not served to A any more
    p4 = spliced(p1, 1000, fleet["prompts"]["S"])
    before = a.counters().get("loaded_tokens_redis", 0)
    assert router.predict(p4, router.tier_sets("a")) == (768, "redis")
    assert a.complete(p4) == 0
    assert a.counters().get("loaded_tokens_redis", 0) == before


def test_every_object_the_writers_stored_was_announced_in_each_tier(fleet):
    """Over the whole run: B's writer stored every object in Redis and each was announced there
    once per group it covers (a full object 1, a tail 2). B stores no turn ends, whose events
    vary with where a request ended (A's: test_every_store_is_announced_with_vllms_block_hashes,
    and test_kv_events)."""
    for name, tiers in (("b", (("STORAGE", "REMOTE"),)),):
        server = fleet[name]
        stored = wait_for(lambda: server.counters().get("objects_stored"), what=f"{name}'s counters")
        for medium, locality in tiers:  # the last disk writes may still be landing
            got = settled(lambda: len(events_of(fleet["router"], name, "BlockStored", medium=medium,
                                                 locality=locality)), 3 * stored // 2)
            assert got == 3 * stored // 2, (name, medium, locality, got, stored)
    with fleet["router"].lock:
        for name in ("a", "b"):
            seqs = fleet["router"].seqs[name]
            assert seqs == list(range(len(seqs))), f"{name}: a batch was lost"
