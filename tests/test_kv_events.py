"""KV cache events (issue 29 item 2), no engine: the mapping from stored objects to vLLM's
block hashes (``scheduler.kv_events``) and the worker's tier records (``worker.tier_events``)
over LMCache's real CPU and disk tiers and a real Redis.

Requests are real vLLM ``Request`` objects hashed by vLLM's own block hasher (``sha256_cbor``);
the expected hashes are recomputed here with ``hash_block_tokens``, independently of the
request. Layout: ``fakes.layout()``: sliding groups 0 and 1 (window 8), full group 2;
block 4, chunk 8.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef
from lmcache_hma.core.tier_events import BUSY, CLEARED, REMOVED, STORED, TierReports
from lmcache_hma.scheduler.kv_events import KVEventAnnouncer
from tests.fakes import digest, layout

BLOCK, CHUNK = 4, 8
TOKENS = list(range(500, 541))  # 41 tokens: 10 full blocks, 5 full chunks


@pytest.fixture(scope="module")
def hash_fn():
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256_cbor)
    return sha256_cbor


def make_request(hash_fn, req_id="r", tokens=TOKENS, **kwargs):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(req_id, list(tokens), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn), **kwargs)


def expected_hashes(hash_fn, tokens, extra=lambda j: None, external=True) -> list:
    """vLLM's block hashes of ``tokens``, chained here with its ``hash_block_tokens``; as its
    events carry them (``external``: by default the hash's last 8 bytes as an int,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), else raw."""
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    out, parent = [], None
    for j in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(hash_fn, parent, tokens[j * BLOCK:(j + 1) * BLOCK], extra(j))
        out.append(maybe_convert_block_hash(parent) if external else parent)
    return out


def announcer(world_size=1) -> KVEventAnnouncer:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kw = dict(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    specs = [SlidingWindowSpec(**kw, sliding_window=8), SlidingWindowSpec(**kw, sliding_window=8),
             FullAttentionSpec(**kw)]
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])
    return KVEventAnnouncer(layout(), config, world_size, BLOCK)


def report(*records) -> TierReports:
    return TierReports(list(records))


FULL1 = ObjectRef(ObjectKind.FULL, 1, digest(101))
TAIL1 = ObjectRef(ObjectKind.TAIL, 1, digest(101))


def stored(tier, ref, rank=0):
    return (rank, STORED, tier, int(ref.kind), ref.chunk_hash)


def removed(tier, ref, rank=0):
    return (rank, REMOVED, tier, int(ref.kind), ref.chunk_hash)


def test_a_stored_chunk_is_announced_with_vllms_block_hashes_per_group(hash_fn):
    ann = announcer()
    req = make_request(hash_fn)
    want = expected_hashes(hash_fn, TOKENS)
    assert list(req.block_hashes) == expected_hashes(hash_fn, TOKENS, external=False)  # vLLM's hashing
    ann.remember(req, [FULL1, TAIL1])
    ann.on_reports(report(stored("cpu", FULL1), stored("cpu", TAIL1), stored("redis", FULL1), stored("redis", TAIL1)))
    events = ann.take_events()
    full = [e for e in events if e.group_idx == 2]
    # no ownership: Dynamo's index drops every event that names one (docs/fleet.md)
    assert [(e.medium, e.locality, e.ownership) for e in full] == [("CPU", "LOCAL", None),
                                                                  ("STORAGE", "REMOTE", None)]
    for e in full:  # chunk 1 = tokens [8, 16) = full blocks 2 and 3
        assert e.block_hashes == want[2:4] and e.parent_block_hash == want[1]
        assert e.token_ids == TOKENS[8:16] and e.block_size == BLOCK
        assert e.kv_cache_spec_kind == "full_attention" and e.kv_cache_spec_sliding_window is None
        assert e.extra_keys == [None, None] and e.lora_name is None
    # the tail at boundary 16 with window 8 holds tokens [9, 16): blocks 2 and 3 of each sliding group
    tails = sorted((e for e in events if e.group_idx != 2 and e.medium == "CPU"), key=lambda e: e.group_idx)
    assert [e.group_idx for e in tails] == [0, 1]
    for e in tails:
        assert e.block_hashes == want[2:4] and e.medium == "CPU" and e.token_ids == TOKENS[8:16]
        assert e.kv_cache_spec_kind == "sliding_window" and e.kv_cache_spec_sliding_window == 8
    assert len(events) == 6 and ann.take_events() == []


def full_events(events) -> list:
    """The events of the full-attention group (2)."""
    return [e for e in events if e.group_idx == 2]


def test_extra_keys_lora_and_cache_salt_as_vllm_hashes_them(hash_fn):
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("adapter-a", 3, "/adapters/a")
    req = make_request(hash_fn, lora_request=lora, cache_salt="tenant-7")

    def extra(j):  # vLLM's tagged keys: LoRA on every block, the salt on the first
        return (("lora", "adapter-a", "/adapters/a"),) + ((("cache_salt", "tenant-7"),) if j == 0 else ())

    want = expected_hashes(hash_fn, TOKENS, extra)
    assert list(req.block_hashes) == expected_hashes(hash_fn, TOKENS, extra, external=False)
    assert want != expected_hashes(hash_fn, TOKENS)
    ann = announcer()
    first, tail = ObjectRef(ObjectKind.FULL, 0, digest(100)), ObjectRef(ObjectKind.TAIL, 0, digest(100))
    ann.remember(req, [first, tail])
    ann.on_reports(report(stored("disk", first), stored("disk", tail)))
    (e,) = full_events(ann.take_events())
    assert (e.medium, e.locality, e.ownership) == ("STORAGE", "LOCAL", None)
    assert e.block_hashes == want[0:2] and e.parent_block_hash is None
    # published untagged, one entry per block (vLLM's to_event_extra_keys)
    assert e.extra_keys == [("adapter-a", "tenant-7"), ("adapter-a",)]
    assert (e.lora_name, e.lora_id) == ("adapter-a", 3)


def test_removal_names_the_announced_hashes_once(hash_fn):
    ann = announcer()
    want = expected_hashes(hash_fn, TOKENS)
    ann.remember(make_request(hash_fn), [FULL1, TAIL1])
    ann.on_reports(report(stored("cpu", FULL1), stored("redis", FULL1), stored("cpu", TAIL1), stored("redis", TAIL1)))
    ann.take_events()
    ann.on_reports(report(removed("cpu", FULL1), removed("cpu", FULL1), removed("disk", FULL1),
                          removed("disk", TAIL1)))  # again, a tier it was never in
    (e,) = ann.take_events()
    assert (e.block_hashes, e.group_idx, e.medium, e.locality) == (want[2:4], 2, "CPU", "LOCAL")
    # stored again (a later request recomputed it): announced again; Redis still has it
    ann.on_reports(report(stored("cpu", FULL1), removed("redis", FULL1)))
    again, gone = ann.take_events()
    assert again.medium == "CPU" and (gone.medium, gone.locality) == ("STORAGE", "REMOTE")


def test_a_store_never_reported_or_never_planned_announces_nothing(hash_fn):
    ann = announcer()
    ann.remember(make_request(hash_fn), [FULL1, TAIL1])  # planned; the writer dropped TAIL1
    ann.on_reports(report(stored("cpu", FULL1)))
    assert ann.take_events() == []  # no boundary at or after it: a lookup serves nothing of it
    ann.on_reports(report(stored("cpu", TAIL1)))
    assert sorted(e.group_idx for e in ann.take_events()) == [0, 1, 2]
    unknown = ObjectRef(ObjectKind.FULL, 3, digest(999))  # a record nothing planned
    ann.on_reports(report(stored("cpu", unknown), removed("cpu", unknown)))
    assert ann.take_events() == [] and ann.counters["stores_unmapped"] == 1


def test_an_object_is_announced_once_every_rank_stored_its_share(hash_fn):
    ann = announcer(world_size=2)
    ann.remember(make_request(hash_fn), [FULL1, TAIL1])
    ann.on_reports(report(stored("cpu", TAIL1, rank=0), stored("cpu", TAIL1, rank=1)))
    assert len(ann.take_events()) == 2  # the tail's two sliding groups
    ann.on_reports(report(stored("cpu", FULL1, rank=0)))
    assert ann.take_events() == []
    ann.on_reports(report(stored("cpu", FULL1, rank=1)))
    assert len(ann.take_events()) == 1
    ann.on_reports(report(removed("cpu", FULL1, rank=1)))  # no longer whole: removed
    assert [type(e).__name__ for e in ann.take_events()] == ["BlockRemoved"]
    ann.on_reports(report(removed("cpu", FULL1, rank=0)))
    assert ann.take_events() == []


def test_a_reset_announces_exactly_what_left_and_keeps_redis(hash_fn):
    """Never ``AllBlocksCleared``: vLLM resets the connector even when its own reset failed
    (requests running), and Redis is not emptied; a router must keep those entries."""
    ann = announcer()
    FULL2, TAIL2 = ObjectRef(ObjectKind.FULL, 0, digest(100)), ObjectRef(ObjectKind.TAIL, 0, digest(100))
    ann.remember(make_request(hash_fn), [FULL1, FULL2, TAIL1, TAIL2])
    ann.on_reports(report(stored("cpu", TAIL1), stored("redis", TAIL1), stored("disk", TAIL2)))
    ann.take_events()
    ann.expect_clear()
    assert ann.pending_work()  # the engine steps until the worker's CLEARED record comes
    ann.on_reports(report(stored("cpu", FULL1), stored("redis", FULL1), stored("disk", FULL2),
                          removed("cpu", FULL1),  # clear_local's own removals come before the marker
                          (0, CLEARED, None, None, None)))  # FULL2's removal was not reported
    events = full_events(ann.take_events())
    assert [(type(e).__name__, getattr(e, "medium", None), e.locality) for e in events] == [
        ("BlockStored", "CPU", "LOCAL"), ("BlockStored", "STORAGE", "REMOTE"), ("BlockStored", "STORAGE", "LOCAL"),
        ("BlockRemoved", "CPU", "LOCAL"), ("BlockRemoved", "STORAGE", "LOCAL")]
    assert events[3].block_hashes == events[0].block_hashes and events[4].block_hashes == events[2].block_hashes
    assert not ann.pending_work()
    ann.on_reports(report(removed("redis", FULL1)))  # Redis entries outlive the reset
    (e,) = full_events(ann.take_events())
    assert (e.medium, e.locality) == ("STORAGE", "REMOTE")


def test_busy_workers_keep_the_engine_stepping_until_they_are_done(hash_fn):
    ann = announcer()
    assert not ann.pending_work()
    ann.on_reports(report((0, BUSY, None, None, None)))
    ann.take_events()
    assert ann.pending_work()
    ann.take_events()  # a step whose output said nothing: the worker is done
    assert not ann.pending_work()
    ann.on_reports(report((0, BUSY, None, None, None)))
    ann.take_events()
    ann._last_news -= ann.KEEPALIVE_S  # busy, but no record for KEEPALIVE_S: stop stepping
    assert not ann.pending_work()


def test_hits_remember_what_a_fetch_keeps_in_memory(hash_fn):
    ann = announcer()
    req = make_request(hash_fn)
    hashes = [digest(100 + i) for i in range(5)]
    ann.on_hit(SimpleNamespace(request=req, hit=24, hashes=hashes, turn=None), num_computed_tokens=8)
    ann.on_reports(report(*(stored("cpu", ObjectRef(ObjectKind.FULL, c, hashes[c])) for c in range(5)),
                          stored("cpu", ObjectRef(ObjectKind.TAIL, 2, hashes[2]))))
    events = ann.take_events()  # chunks 1 and 2 (after vLLM's local hit of 8), the tail at 24
    want = expected_hashes(hash_fn, TOKENS)
    assert sorted((e.group_idx, tuple(e.block_hashes)) for e in events) == sorted(
        [(2, tuple(want[2:4])), (2, tuple(want[4:6])), (0, tuple(want[4:6])), (1, tuple(want[4:6]))])
    assert ann.counters["stores_unmapped"] == 3  # chunks 0, 3, 4: not part of this hit


def test_a_recurrent_state_names_the_boundary_block_at_its_groups_block_size(hash_fn):
    """A gated-delta-net model: the state object at boundary 16 covers block (16 - 1) // 8 of the
    state group (block size 8: vLLM's hashes at 4 viewed at 8), named with vLLM's hash there."""
    from lmcache_hma.core.kinds import GroupKind
    from lmcache_hma.core.layout import GroupLayout, HybridLayout
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    lay = HybridLayout((GroupLayout(0, GroupKind.FULL, ("L0",), BLOCK, 64),
                        GroupLayout(1, GroupKind.STATE, ("L1",), 8, 64, state_shapes=((4,),),
                                    state_dtypes=("float32",))), CHUNK)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full),
                                              SimpleNamespace(kv_cache_spec=object())])
    ann = KVEventAnnouncer(lay, config, 1, BLOCK)
    state = ObjectRef(ObjectKind.STATE, 1, digest(101))
    ann.remember(make_request(hash_fn), [state])
    ann.on_reports(report(stored("redis", state)))
    (e,) = ann.take_events()
    want = expected_hashes(hash_fn, TOKENS)  # at block size 4: the hash at token 16 is the 4th
    assert (e.group_idx, e.block_size, e.block_hashes, e.parent_block_hash) == (1, 8, [want[3]], want[1])
    assert e.token_ids == TOKENS[8:16] and e.kv_cache_spec_kind == "unknown"


# ======================================================================================
# The worker's records over LMCache's real tiers
# ======================================================================================

PAYLOAD = 64 * 1024


def collector_store(tmp_path, rename=None, **yaml_keys):
    from lmcache_hma.config.settings import load_config
    from lmcache_hma.core.keys import Namespace
    from lmcache_hma.store.chunk_store import ChunkStore
    from lmcache_hma.worker.tier_events import TierEventCollector
    from tests.engines import write_yaml

    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=layout(), kv_layout="LBHNC/test",
                   world_size=1, rank=0)
    keys = dict(chunk_size=8, local_cpu=True, max_local_cpu_size=0.001, **yaml_keys)
    cfg = load_config({"lmcache_config_file": str(write_yaml(tmp_path / "c.yaml", **keys))})
    store = ChunkStore(cfg.lmcache, ns)
    events = TierEventCollector(ns, rename)
    writer = SimpleNamespace(pending=lambda: 0)
    events.watch(store, writer, lambda: False)
    return store, events


def records(events) -> list:
    taken = events.take()
    return [r[1:] for r in (taken.records if taken else []) if r[1] != BUSY]


def test_parts_of_kv_heads_are_recorded_as_their_object(tmp_path):
    """hma_share_parallel_shapes: a stored part is reported under its object's name when
    ``rename`` knows it (rank 0's first head), and not at all otherwise."""
    names = {digest(11): digest(1)}
    store, events = collector_store(tmp_path, rename=names.get)
    try:
        assert store.put(ObjectKind.FULL, digest(11), PAYLOAD, lambda p: p.fill_(1.0))
        assert store.put(ObjectKind.FULL, digest(12), PAYLOAD, lambda p: p.fill_(1.0))  # another head
        assert records(events) == [(STORED, "cpu", 1, digest(1))]
    finally:
        store.close()


def test_store_records_durable_puts_evictions_and_removals(tmp_path):
    from tests.waiting import wait_for

    store, events = collector_store(tmp_path, local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.01)
    try:
        assert store.put(ObjectKind.FULL, digest(1), PAYLOAD, lambda p: p.fill_(1.0))
        wait_for(lambda: not store.writes_pending(), what="the disk write")
        got = records(events)
        assert sorted(got) == [(STORED, "cpu", 1, digest(1)), (STORED, "disk", 1, digest(1))]
        # ~1 MB of CPU memory holds about 15 such objects: LMCache evicts the oldest (not one
        # the disk tier is still writing, hence the wait: a put finding no room stores nothing)
        for n in range(2, 40):
            assert store.put(ObjectKind.TAIL, digest(n), PAYLOAD, lambda p: p.fill_(1.0))
            wait_for(lambda: not store.writes_pending(), what="the disk write")
        got = records(events)
        evicted = [r for r in got if r[:2] == (REMOVED, "cpu")]
        assert (REMOVED, "cpu", 1, digest(1)) in evicted and len(evicted) >= 20
        assert len([r for r in got if r[:2] == (STORED, "disk")]) == 38  # the disk is large enough
        store.remove(ObjectKind.FULL, digest(1))
        assert records(events) == [(REMOVED, "disk", 1, digest(1))]  # no longer in memory
        n = store.clear_local()
        events.cleared()
        got = records(events)  # each removal, then the reset's end
        assert got[-1] == (CLEARED, None, None, None) and len(got) == 1 + n
        assert all(r[0] == REMOVED for r in got[:-1])
    finally:
        store.close()


def test_a_dropped_or_failed_store_records_nothing(tmp_path):
    from lmcache_hma.store.lmcache_storage import flat
    from lmcache_hma.worker.store_writer import StoreWriter

    store, events = collector_store(tmp_path)
    gate = threading.Event()
    commit = store.commit_many

    def slow_commit(items, shared=True, **kw):
        gate.wait(10)
        if any(h == digest(3) for _, h, _ in items):
            raise OSError("tier failed")
        return commit(items, shared, **kw)

    store.commit_many = slow_commit
    writer = StoreWriter(store, max_queued=1)
    try:
        submitted = []
        for n in (1, 2, 3):  # 1 is taken by the writer (it waits), 2 queues, 3 finds the queue full
            obj = store.allocate(PAYLOAD)
            flat(obj).fill_(0)
            submitted.append(writer.submit(ObjectKind.FULL, digest(n), obj, "full_attention", PAYLOAD))
            if n == 1:
                from tests.waiting import wait_for

                wait_for(lambda: writer._queue.empty(), what="the writer to take the first object")
        assert submitted == [True, True, False] and writer.counts()["objects_dropped"] == 1
        assert not writer.wait_stored(time.monotonic() + 0.05)  # a lookup's bounded wait for them
        gate.set()
        assert writer.wait_stored(time.monotonic() + 10) and writer.pending() == 0
        obj = store.allocate(PAYLOAD)
        writer.submit(ObjectKind.FULL, digest(3), obj, "full_attention", PAYLOAD)  # its put fails
        writer.drain()
        assert writer.counts()["saves_failed"] == 1
        assert sorted(records(events)) == [(STORED, "cpu", 1, digest(1)), (STORED, "cpu", 1, digest(2))]
    finally:
        writer.close(5)
        store.close()


def test_redis_records_only_what_redis_acknowledged(tmp_path, redis_server):
    """A Redis that is gone takes nothing: CPU memory is announced, Redis is not; a damaged
    object dropped from every tier is recorded as removed from each."""
    store, events = collector_store(tmp_path, remote_url=redis_server.url, remote_serde="naive")
    try:
        assert store.put(ObjectKind.FULL, digest(1), PAYLOAD, lambda p: p.fill_(1.0))
        assert sorted(records(events)) == [(STORED, "cpu", 1, digest(1)), (STORED, "redis", 1, digest(1))]
        store.remove(ObjectKind.FULL, digest(1))
        assert sorted(records(events)) == [(REMOVED, "cpu", 1, digest(1)), (REMOVED, "redis", 1, digest(1))]
        redis_server.kill()
        assert store.put(ObjectKind.FULL, digest(2), PAYLOAD, lambda p: p.fill_(1.0))
        assert records(events) == [(STORED, "cpu", 1, digest(2))]
    finally:
        store.close()


def test_everything_is_off_without_kv_events_config(tmp_path):
    """No ``--kv-events-config`` (or events disabled): the connector builds no announcer nor
    collector (``connector.py``), and a store nobody watches records nothing and wraps nothing."""
    from vllm.config import KVEventsConfig

    from lmcache_hma.config.settings import load_config
    from lmcache_hma.core.keys import Namespace
    from lmcache_hma.store.chunk_store import ChunkStore
    from lmcache_hma.vllm_compat import kv_events_enabled
    from tests.engines import write_yaml

    assert not kv_events_enabled(SimpleNamespace(kv_events_config=None))
    assert not kv_events_enabled(SimpleNamespace(kv_events_config=KVEventsConfig()))
    assert kv_events_enabled(SimpleNamespace(kv_events_config=KVEventsConfig(enable_kv_cache_events=True)))
    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=layout(), kv_layout="LBHNC/test",
                   world_size=1, rank=0)
    cfg = load_config({"lmcache_config_file": str(write_yaml(
        tmp_path / "c.yaml", chunk_size=8, local_cpu=True, max_local_cpu_size=0.01,
        local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.01))})
    store = ChunkStore(cfg.lmcache, ns)
    try:
        assert store.events is None and all(store._on_stored(t) is None for t in store.tiers)
        # (the disk tier's remove is wrapped all the same, to give room back: keep_disk_room)
        removes = [vars(b).get("remove") for b in store._manager.storage_backends.values()]
        assert not any("observe_removals" in getattr(r, "__qualname__", "") for r in removes)
        assert store.put(ObjectKind.FULL, digest(1), PAYLOAD, lambda p: p.fill_(1.0))
    finally:
        store.close()


def test_stores_of_a_step_whose_events_are_taken_before_wait_for_save_say_busy(tmp_path, monkeypatch):
    """vLLM 0.33+'s V2 runner with a speculator takes a step's events (post_forward) before its
    wait_for_save (finalize_step): the stores are not gathered yet, and only BUSY keeps an engine
    going idle stepping until their events are announced."""
    from lmcache_hma.core.keys import ChunkHasher
    from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef, SaveSpec
    from lmcache_hma.worker.tier_events import TierEventCollector
    from lmcache_hma.worker.worker_half import WorkerHalf
    from tests import test_worker

    built = {}

    def with_events(self, caches):  # the connector sets tier_events before vLLM registers KV
        self.tier_events = built["events"] = TierEventCollector(self.namespace)
        register(self, caches)

    register = WorkerHalf.register_kv_caches
    monkeypatch.setattr(WorkerHalf, "register_kv_caches", with_events)
    worker, lay, ns, caches = test_worker.make_worker(tmp_path)
    events = built["events"]
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        meta = HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]),
                                                    [ObjectRef(ObjectKind.FULL, 0, hashes[0])])])
        worker.before_step(meta)  # handle_preemptions, in pre_forward
        taken = events.take()  # post_forward, before wait_for_save
        assert taken is not None and any(r[1] == BUSY for r in taken.records)
        worker.wait_for_save(meta)  # finalize_step
        worker.drain()
        records = [r[1] for r in events.take().records]
        assert STORED in records and BUSY not in records
    finally:
        worker.shutdown()


def test_a_turn_end_announces_its_whole_blocks_and_a_shared_block_leaves_with_its_last_holder(hash_fn):
    """A turn end at 21 (chunk 2, ``scheduler.turn_ends``) covers whole full-attention block 4
    (tokens 16-19; block 5 is partial) and the sliding blocks token 21 reads, whole: 3 and 4.
    The tail at 16 covers sliding blocks 2 and 3: block 3 is held by both, so it is announced
    removed only once both are gone. The turn end's marker is never announced."""
    ann = announcer()
    want = expected_hashes(hash_fn, TOKENS)
    turn = ObjectRef(ObjectKind.TURN, 2, digest(200), 21)
    mark = ObjectRef(ObjectKind.TURNMARK, 2, digest(101), 21)
    ann.remember(make_request(hash_fn), [TAIL1, turn, mark])
    ann.on_reports(report(stored("cpu", TAIL1), stored("cpu", turn)))
    got = {(e.group_idx, tuple(e.block_hashes)) for e in ann.take_events() if type(e).__name__ == "BlockStored"}
    assert got == {(0, tuple(want[2:4])), (1, tuple(want[2:4])),  # the tail
                   (0, tuple(want[3:5])), (1, tuple(want[3:5])), (2, (want[4],))}  # the turn end
    ann.on_reports(report(removed("cpu", TAIL1)))
    assert sorted((e.group_idx, e.block_hashes) for e in ann.take_events()) == [(0, [want[2]]), (1, [want[2]])]
    ann.on_reports(report(removed("cpu", turn)))
    assert sorted((e.group_idx, e.block_hashes) for e in ann.take_events()) == [
        (0, want[3:5]), (1, want[3:5]), (2, [want[4]])]


# ======================================================================================
# Restorable gating: a full chunk is announced while a lookup serves through it
# ======================================================================================

def chain(n) -> tuple[list, list]:
    """Full objects and tails of chunks 0 .. n-1 of TOKENS."""
    fulls = [ObjectRef(ObjectKind.FULL, c, digest(100 + c), parent=digest(99 + c) if c else b"") for c in range(n)]
    tails = [ObjectRef(ObjectKind.TAIL, c, digest(100 + c)) for c in range(n)]
    return fulls, tails


def full_blocks(events, want, kind="BlockStored", medium=None) -> list:
    """The chunks (block pairs of the full group) ``events`` of ``kind`` name, in order."""
    return [want.index(e.block_hashes[0]) // 2 for e in events
            if e.group_idx == 2 and type(e).__name__ == kind and (medium is None or e.medium == medium)]


def test_a_chunk_is_announced_only_with_a_boundary_at_or_after_it(hash_fn):
    """Tails are sparse (admission): the lookup serves a prefix only up to a boundary that has
    its tail. Full chunks past the last such boundary are not announced: an index crediting them
    would credit up to a whole sparse interval that is not served."""
    ann = announcer()
    want = expected_hashes(hash_fn, TOKENS)
    fulls, tails = chain(4)
    ann.remember(make_request(hash_fn), fulls + tails)
    ann.on_reports(report(*(stored("cpu", f) for f in fulls), stored("cpu", tails[1])))
    assert full_blocks(ann.take_events(), want) == [0, 1]  # chunks 2, 3: no tail at or after them
    ann.on_reports(report(stored("cpu", tails[3])))
    assert full_blocks(ann.take_events(), want) == [2, 3]  # parents first
    ann.on_reports(report(removed("cpu", tails[3])))  # the last boundary leaves: so do chunks 2, 3
    assert sorted(full_blocks(ann.take_events(), want, "BlockRemoved")) == [2, 3]
    ann.on_reports(report(removed("cpu", fulls[1])))  # chunk 1 leaves: chunk 0 has no boundary left
    assert sorted(full_blocks(ann.take_events(), want, "BlockRemoved")) == [0, 1]
    ann.on_reports(report(stored("cpu", fulls[1])))  # back: restorable again through the tail at 1
    assert full_blocks(ann.take_events(), want) == [0, 1]


def test_local_tiers_serve_one_prefix_and_redis_its_own(hash_fn):
    """A lookup reads each object from whichever local tier holds it: chunk 0 on disk, chunk 1
    and its tail in CPU memory make both restorable, each announced in the tier holding it.
    Redis is read on its own: a chunk there needs a boundary there."""
    ann = announcer()
    want = expected_hashes(hash_fn, TOKENS)
    fulls, tails = chain(2)
    ann.remember(make_request(hash_fn), fulls + tails)
    ann.on_reports(report(stored("disk", fulls[0]), stored("cpu", fulls[1]), stored("redis", fulls[0]),
                          stored("redis", fulls[1])))
    assert full_blocks(ann.take_events(), want) == []
    ann.on_reports(report(stored("cpu", tails[1])))
    events = ann.take_events()
    assert full_blocks(events, want, medium="STORAGE") == [0] and full_blocks(events, want, medium="CPU") == [1]
    assert all(e.locality == "LOCAL" for e in events)
    ann.on_reports(report(stored("redis", tails[0])))
    assert [(c, e.locality) for e, c in zip(*(lambda ev: (ev, full_blocks(ev, want)))(
        [e for e in ann.take_events() if e.group_idx == 2]))] == [(0, "REMOTE")]


def test_a_turn_end_is_a_boundary_for_the_chunks_before_it(hash_fn):
    """A turn end at 21 (chunk 2) serves to the token: chunks 0 and 1 are restorable through it,
    announced before its own blocks."""
    ann = announcer()
    want = expected_hashes(hash_fn, TOKENS)
    fulls, _ = chain(2)
    turn = ObjectRef(ObjectKind.TURN, 2, digest(200), 21, parent=digest(101))
    ann.remember(make_request(hash_fn), fulls + [turn])
    ann.on_reports(report(*(stored("cpu", f) for f in fulls)))
    assert ann.take_events() == []
    ann.on_reports(report(stored("cpu", turn)))
    assert full_blocks(ann.take_events(), want) == [0, 1, 2]  # block 4: the turn end's whole block
    ann.SNAPSHOTS = 1  # its snapshot long gone by its removal: what it stood for is still known
    ann.remember(make_request(hash_fn, "other", [7] * 16), [ObjectRef(ObjectKind.FULL, 0, digest(300))])
    ann.on_reports(report(removed("cpu", turn)))
    assert sorted(full_blocks(ann.take_events(), want, "BlockRemoved")) == [0, 1, 2]


def test_a_recurrent_model_announces_full_chunks_only_up_to_its_last_state(hash_fn):
    """A gated-delta-net model: a hit needs the state at its boundary. Chunks past the last
    stored state are not announced (an index keeping no state events counted them: whole chunks
    credited that neither vLLM nor the connector could serve)."""
    from lmcache_hma.core.kinds import GroupKind
    from lmcache_hma.core.layout import GroupLayout, HybridLayout
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    lay = HybridLayout((GroupLayout(0, GroupKind.FULL, ("L0",), BLOCK, 64),
                        GroupLayout(1, GroupKind.STATE, ("L1",), 8, 64, state_shapes=((4,),),
                                    state_dtypes=("float32",))), CHUNK)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full),
                                              SimpleNamespace(kv_cache_spec=object())])
    ann = KVEventAnnouncer(lay, config, 1, BLOCK)
    want = expected_hashes(hash_fn, TOKENS)
    fulls = [ObjectRef(ObjectKind.FULL, c, digest(100 + c)) for c in range(3)]
    states = [ObjectRef(ObjectKind.STATE, c, digest(100 + c)) for c in range(3)]
    ann.remember(make_request(hash_fn), fulls + states)
    ann.on_reports(report(*(stored("cpu", f) for f in fulls), stored("cpu", states[0])))
    got = [want.index(e.block_hashes[0]) // 2 for e in ann.take_events() if e.group_idx == 0]
    assert got == [0]  # chunks 1 and 2: no state at or after them
    ann.on_reports(report(stored("cpu", states[2])))
    got = [want.index(e.block_hashes[0]) // 2 for e in ann.take_events() if e.group_idx == 0]
    assert got == [1, 2]
