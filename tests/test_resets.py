"""Cache resets around turn ends, in the orders vLLM calls them (no engine).

A reset (``reset_prefix_cache(reset_connector=True)``; a pause or ``LLM.sleep()`` that clears
caches; a weight update) must be followed by nothing computed before it: no turn end queued
before it stored after it, no save of a step planned before it, no object a read under way puts
back into CPU memory. And vLLM 0.34's scheduler empties its own prefix cache *before* it asks the
connector, which fails while blocks are kept for a turn end (``scheduler_half.bind_kv_cache_manager``).

vLLM's real ``KVCacheManager`` (0.32's, the installed one; 0.34's ``reset_prefix_cache`` and
``free`` are the same code: ``tests/vllm_surface.py``) plays the block pool."""

import time

import pytest
import torch

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef, SaveSpec
from tests.fakes import digest
from tests.test_scheduler import ANSWER, BLOCK, TOKENS, engine, request  # noqa: F401 - the fixture
from tests.test_turn_ends import WRITTEN, turn_at_21
from tests.test_worker import make_worker, save_one_chunk_slowly


def finished_inside_a_chunk(e, req_id="r"):
    """A request that computed 44 tokens (chunk 8: a turn end at 44) and finished: its
    ``request_finished`` answer and the request."""
    r = request(req_id, TOKENS[:20])
    e.admit(r)
    e.prefill(r)
    e.decode(r, ANSWER[:25])
    return e.sched.request_finished(r, e.kvm.get_block_ids(req_id)), r


def real_kv_cache_manager(lay, num_blocks=128):
    """vLLM's own ``KVCacheManager`` over the test layout's groups (block 4, window 8)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            SlidingWindowSpec)

    def spec(g):
        if g.sliding_window:
            return SlidingWindowSpec(block_size=g.block_size, num_kv_heads=1, head_size=4, dtype=torch.bfloat16,
                                     sliding_window=g.sliding_window)
        return FullAttentionSpec(block_size=g.block_size, num_kv_heads=1, head_size=4, dtype=torch.bfloat16)

    groups = [KVCacheGroupSpec(list(g.layer_names), spec(g)) for g in lay.groups]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK)


def keep_blocks(manager, r) -> None:
    """Allocate in ``manager`` the blocks of a request with ``r``'s id and computed tokens (the
    blocks vLLM keeps for its turn end: ``manager.free`` finds them by id)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    twin = Request(r.request_id, list(r.all_token_ids), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))
    assert manager.allocate_slots(twin, r.num_computed_tokens) is not None
    assert not manager.reset_prefix_cache()  # vLLM's own reset fails while they are in use


def reset_prefix_cache_as_vllm_034(scheduler_half, manager, running=()):
    """vLLM's ``Scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)``
    (what ``EngineCore._reset_caches`` runs for a pause or an in-process ``LLM.sleep()``, without
    a step first), vLLM's own code (``test_kept_blocks``): running requests preempted, the KV cache
    manager's reset, then the connector's."""
    from tests.test_kept_blocks import vllm_reset_prefix_cache

    return vllm_reset_prefix_cache(scheduler_half, manager, reset_running_requests=True, reset_connector=True,
                                   running=running)


def test_a_reset_right_after_a_request_kept_its_blocks_gives_them_back_first(engine, tmp_path):
    """vLLM 0.34 (V2 runner): a request that ends inside a chunk keeps its blocks for its turn end
    until the next step reports it in ``finished_sending``. A reset before that step (``LLM.sleep()``
    right after ``generate()``) found them in use and raised; now the blocks go back before vLLM's
    own reset, the turn end is not stored, and the next step still reports the request, whose
    second free (vLLM's ``_free_blocks``) finds nothing to free."""
    e = engine(interval=16)
    e.sched.keep_blocks_for_turn_ends = True
    manager = real_kv_cache_manager(e.lay)
    (kept, _), r = finished_inside_a_chunk(e)
    assert kept and e.sched.turn_saves_pending == {"r"}
    keep_blocks(manager, r)
    e.sched.bind_kv_cache_manager(manager)

    reset_prefix_cache_as_vllm_034(e.sched, manager)  # raised on 8c79212

    [save] = e.step().saves  # the engine steps once more (turn_saves_due) ...
    assert (save.req_id, save.objects, save.finished, save.blocks_kept) == ("r", [], True, True)
    worker, *_ = make_worker(tmp_path)
    try:
        worker.before_step(HMAConnectorMetadata(saves=[save], epoch=1))
        assert worker.take_finished_sending() == {"r"}  # ... whose workers report it free
        assert worker.counters().get("objects_stored", 0) == 0
    finally:
        worker.shutdown()
    e.sched.on_finished_sending({"r"})
    manager.free(r)  # vLLM's _free_blocks on finished_sending: nothing left to free
    assert not e.sched.turn_saves_pending and manager.reset_prefix_cache()


def test_kept_blocks_of_a_turn_end_already_sent_are_given_back_too(engine):
    """The turn end went out with a step that has not reported yet (asynchronous scheduling): the
    reset still finds the blocks free; that step's workers drop the save (it predates the reset)."""
    e = engine(interval=16)
    e.sched.keep_blocks_for_turn_ends = True
    manager = real_kv_cache_manager(e.lay)
    (kept, _), r = finished_inside_a_chunk(e)
    keep_blocks(manager, r)
    e.sched.bind_kv_cache_manager(manager)
    [save] = e.step().saves
    assert save.objects and save.blocks_kept
    reset_prefix_cache_as_vllm_034(e.sched, manager)
    assert not e.sched.turn_saves_due  # nothing more to send: the step in flight reports it


@pytest.mark.parametrize("kept", [False, True], ids=["blocks-freed", "blocks-kept"])
def test_a_turn_end_queued_before_a_reset_is_never_sent(engine, kept):
    """On 8c79212 the next metadata carried the old turn end with the reset, and the worker stored
    it (after a weight update: old weights' KV served to the next turn; after an in-process sleep,
    vLLM 0.33's pause resets without a step: blocks the sleep discarded)."""
    e = engine(interval=16)
    e.sched.keep_blocks_for_turn_ends = kept
    (answer, _), r = finished_inside_a_chunk(e)
    assert answer == kept and e.sched.turn_saves_due
    e.sched.reset()
    meta = e.step()
    assert [(s.req_id, s.objects, s.blocks_kept) for s in meta.saves] == ([("r", [], True)] if kept else [])
    assert meta.reset and meta.epoch == 1
    # a next turn does not wait for a turn end that will never land
    assert e.sched.get_num_new_matched_tokens(request("next", TOKENS[:20] + ANSWER[:30]), 0)[0] is not None


def test_saves_planned_before_a_reset_are_not_stored_after_it(tmp_path):
    """Rank 0 empties its tiers when the scheduler resets (the lookup server's thread), while a
    step built before the reset may still be on its way: its turn end and chunks must not land
    after the reset (the issue's reproduction: the TURN object and its marker were in the CPU tier
    and a lookup answered the marker's offset). A step built after it stores as usual."""
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    try:
        tokens, hashes, turn = turn_at_21(ns)
        chunks = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in (0, 1)]
        turn_end = [turn, ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)]

        def step(epoch):
            meta = HMAConnectorMetadata(saves=[SaveSpec("w", WRITTEN, chunks),
                                               SaveSpec("t", WRITTEN, turn_end, finished=True, blocks_kept=True)])
            meta.epoch = epoch  # the scheduler's resets when it was built
            return meta

        assert worker.reset()  # the scheduler's reset reached rank 0 first
        old = step(epoch=0)
        worker.before_step(old)
        worker.wait_for_save(old)
        worker.drain()
        assert worker.take_finished_sending() == {"t"}  # kept blocks are still given back
        assert worker.counters().get("objects_stored", 0) == 0
        assert worker.counters()["saves_after_reset_dropped"] == 2
        assert worker._answer_lookup("r", 1, 0, hashes[:2], turn_limit=21).marks == ()
        assert not worker.store.in_memory(ObjectKind.TURN, turn.chunk_hash)

        new = step(epoch=1)
        worker.before_step(new)
        worker.wait_for_save(new)
        worker.drain()
        assert worker.counters()["objects_stored"] == 4
        assert worker._answer_lookup("r", 2, 0, hashes[:2], turn_limit=21).marks == (5,)
    finally:
        worker.shutdown()


def test_a_read_under_way_puts_nothing_back_after_a_reset(tmp_path):
    """A lookup's fetch past its deadline, or an asynchronous load, reads an object from disk while
    the reset clears the local tiers: it may still serve what it read (promised before the reset),
    but it must not keep it in CPU memory (on 8c79212 it did: a hit nobody expects after a reset)."""
    worker, lay, ns, caches = make_worker(tmp_path, local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.01)
    try:
        store, key, size = worker.store, digest(1), 4096
        assert store.put(ObjectKind.FULL, key, size, lambda p: p.fill_(1))
        deadline = time.monotonic() + 10
        while store.writes_pending() and time.monotonic() < deadline:  # the disk write is asynchronous
            time.sleep(0.01)
        store.tier("cpu").clear(lambda k: True)  # only on disk now
        assert not store.in_memory(ObjectKind.FULL, key)

        disk = store.tier("disk")
        fetch_many = disk.fetch_many

        def read_then_reset(*args, **kwargs):  # the reset lands while the disk read is under way
            got = fetch_many(*args, **kwargs)
            worker.reset()
            return got

        disk.fetch_many = read_then_reset
        [(obj, tier)] = store.get_many([(ObjectKind.FULL, key, size)])
        assert tier == "disk" and obj is not None  # the read itself is served
        from lmcache_hma.store.lmcache_storage import release

        release(obj)
        assert not store.in_memory(ObjectKind.FULL, key) and not store.has(ObjectKind.FULL, key)
    finally:
        worker.shutdown()


def test_a_store_still_queued_when_the_reset_stops_waiting_lands_in_no_local_tier(tmp_path, monkeypatch):
    """The reset lets the stores under way land for half a lookup timeout, then clears: one the
    writer puts after that (a slow disk, a busy Redis) must not appear in CPU memory or on disk,
    whenever it lands (on 8c79212 it did: a hit of KV computed before the reset)."""
    worker, lay, ns, caches = make_worker(tmp_path, hma_lookup_timeout_s=0.2)
    try:
        hashes = save_one_chunk_slowly(worker, ns, monkeypatch, 0.5)  # past the reset's wait (0.1 s)
        assert worker.reset()  # gives up waiting for the slow store
        worker.drain()  # ... which lands now
        assert worker.store.count_full_prefix(hashes) == 0 and not worker.store.present(ObjectKind.TAIL, hashes)[0]
    finally:
        worker.shutdown()
