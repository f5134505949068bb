"""The worker half on real LMCache tiers and paged KV tensors like vLLM's (no engine).

A lookup that finds a hit in CPU memory fetches, verifies and holds its objects; the
synchronous load in the same step scatters from those references. LMCache never evicts
an object someone holds, and bytes removed from the tier meanwhile stay alive, so the
promised load cannot fail (vLLM could not recompute it).
"""

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from lmcache_hma.kv_copy import copy_ops
from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.metadata import HMAConnectorMetadata, LoadSpec, ObjectRef, SaveSpec, hit_objects
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.worker.worker_half import WorkerHalf
from tests.engines import write_yaml
from tests.fakes import digest, kv_caches, layout

NUM_BLOCKS = 64
CHUNKS = 3  # 24 tokens: 6 blocks of 4 per group


def make_worker(tmp_path, defer_gathers=False, kinds="SSF", events=False, **yaml_keys):
    """A worker on a fresh CPU tier; ``hma_*`` keys go to the adapter, the rest to LMCache.
    ``events``: with KV cache events on (a ``TierEventCollector``, as the connector sets it)."""
    keys = dict(chunk_size=8, local_cpu=True, max_local_cpu_size=0.002)
    keys.update({k: v for k, v in yaml_keys.items() if not k.startswith("hma_")})
    adapter = {k: v for k, v in yaml_keys.items() if k.startswith("hma_")}
    path = write_yaml(tmp_path / f"w-{uuid.uuid4().hex}.yaml", **keys)
    cfg = load_config({"lmcache_config_file": str(path), **adapter})
    lay = layout(kinds)
    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=lay, kv_layout="LBHNC/test",
                   world_size=1, rank=0)
    worker = WorkerHalf(cfg, lay, ns, f"unit-{uuid.uuid4().hex}", NUM_BLOCKS, serves_lookups=True,
                        defer_gathers=defer_gathers)
    if events:
        from lmcache_hma.worker.tier_events import TierEventCollector

        worker.tier_events = TierEventCollector(ns)
    caches = kv_caches(lay, num_blocks=NUM_BLOCKS)
    worker.register_kv_caches(caches)
    return worker, lay, ns, caches


def block(caches, layer, block_id):
    return caches[f"L{layer}"][block_id].clone()


def test_held_objects_survive_eviction_pressure_and_removal(tmp_path):
    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(24)), CHUNKS)
        stored = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18])
        objects = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in range(CHUNKS)]
        objects.append(ObjectRef(ObjectKind.TAIL, CHUNKS - 1, hashes[-1]))
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("writer", stored, objects)]))
        worker.drain()
        assert worker.counters()["objects_stored"] == CHUNKS + 1

        assert worker._answer_lookup("reader", 1, 0, hashes)[:2] == (CHUNKS, True)  # held for "reader"
        for i in range(40):  # other prompts fill the 2 MB tier: what is held is not evicted
            worker.store.put(ObjectKind.FULL, digest(1000 + i), 64 << 10, lambda p: p.fill_(0))
        assert all(worker.store.in_memory(r.kind, r.chunk_hash) for r in objects)
        for r in objects:  # removed meanwhile (e.g. by a clear): the held bytes stay alive
            worker.store.remove(r.kind, r.chunk_hash)
        assert worker.store.get(ObjectKind.FULL, hashes[0], 256) is None

        target = ([0, 0, 0, 0, 19, 20], [0, 0, 0, 0, 21, 22], [23, 24, 25, 26, 27, 28])  # null: out of window
        load = LoadSpec("reader", target, 0, CHUNKS * 8, hit_objects(0, hashes, True), sync=True, lookup=1)
        worker.start_load_kv(HMAConnectorMetadata(loads=[load]))
        assert worker.counters()["loads_sync"] == 1 and worker.take_transfer_results() == (set(), set())
        for layer, src, dst in [(4, 13, 23), (5, 18, 28), (0, 5, 19), (1, 6, 20), (2, 11, 21), (3, 12, 22)]:
            assert torch.equal(block(caches, layer, dst), block(caches, layer, src)), (layer, src, dst)
        assert worker.held.held_bytes == 0
    finally:
        worker.shutdown()


def test_lookup_holds_hits_from_disk_and_nothing_too_late_or_released(tmp_path):
    """A hit on disk is read, verified and held at lookup (a synchronous load, counted for the
    disk tier); an answer that comes too close to the scheduler's deadline holds nothing; a
    request the scheduler released gives its objects back."""
    worker, lay, ns, caches = make_worker(tmp_path, local_cpu=False, local_disk=f"file://{tmp_path}/disk/",
                                          max_local_disk_size=0.01)
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        objects = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]), objects)]))
        worker.drain()
        t0 = time.monotonic()  # LMCache writes disk files on its own thread
        while worker.store.count_full_prefix(hashes) == 0 or not worker.store.present(ObjectKind.TAIL, hashes)[0]:
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        assert not worker.store.in_memory(ObjectKind.FULL, hashes[0])
        late = time.monotonic() + worker.LATE_S / 2
        assert worker._answer_lookup("r", 1, 0, hashes, late)[:2] == (1, False) and worker.held.held_bytes == 0
        assert worker._answer_lookup("r", 2, 0, hashes, time.monotonic() + 5)[:2] == (1, True)
        target = ([7, 8], [9, 10], [11, 12])
        worker.start_load_kv(HMAConnectorMetadata(loads=[LoadSpec("r", target, 0, 8, objects, sync=True, lookup=2)]))
        c = worker.counters()
        assert c["loads_sync"] == 1 and c["loaded_tokens_disk"] == 8 and worker.held.held_bytes == 0
        for layer, src, dst in [(4, 5, 11), (5, 6, 12), (0, 1, 7), (1, 2, 8), (2, 3, 9), (3, 4, 10)]:
            assert torch.equal(block(caches, layer, dst), block(caches, layer, src)), (layer, src, dst)
        assert worker._answer_lookup("r2", 1, 0, hashes)[:2] == (1, True) and worker.held.held_bytes > 0
        worker.start_load_kv(HMAConnectorMetadata(released=[("r2", 1)]))  # e.g. the request was aborted
        assert worker.held.held_bytes == 0
    finally:
        worker.shutdown()


def test_deferred_gathers_end_before_the_next_step_writes_kv(tmp_path, monkeypatch):
    """wait_for_save returns before its blocks are gathered. The next step's first call
    (``before_step``, from vLLM's handle_preemptions, before it writes any KV) waits for the
    objects that read a block that step allocated (vLLM writes only blocks it allocated in
    the step; a freed block reused), gathering them itself when the gather thread has not
    started them, or for all when the step does not say which blocks it writes; the other
    gathers go on beside the step. Blocks vLLM reuses are read intact."""
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    gate, in_full, release_full = threading.Event(), threading.Event(), threading.Event()
    gather_many = copy_ops.gather_many

    def gather_held_for_full(paged, items, after=None):  # the gather thread's gather of the FULL object waits
        if (threading.current_thread().name.startswith("lmcache-hma-gather")
                and any(5 in rows.block_ids for rows, _ in items)):
            in_full.set()
            release_full.wait(10)
        return gather_many(paged, items, after)

    monkeypatch.setattr(copy_ops, "gather_many", gather_held_for_full)
    try:
        assert worker.defer_gathers
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        objects = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
        blocks = ([1, 2], [3, 4], [5, 6])  # groups S, S, F: the TAIL reads blocks 1..4, the FULL 5, 6
        before = {(layer, b): block(caches, layer, b) for layer in range(6) for b in range(1, 7)}
        worker._gatherer.submit(gate.wait)  # the gather thread is busy: the step's gathers queue
        worker.before_step(HMAConnectorMetadata(new_blocks=frozenset()))  # vLLM's first call of the step
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", blocks, objects)]))
        full_job, tail_job = sorted(worker._gather_round, key=lambda job: job.ref.kind is ObjectKind.TAIL)

        def next_step(new_blocks, blocks=False):
            """vLLM's next step begins; ``blocks``: the test expects it to wait (given 0.5 s to show
            it does), else it must return (given up to 10 s)."""
            t = threading.Thread(target=worker.before_step, args=(HMAConnectorMetadata(new_blocks=new_blocks),))
            t.start()
            t.join(0.5 if blocks else 10)
            return t

        assert not next_step(frozenset({7, 8, 40})).is_alive()  # writes none of blocks 1..6
        assert not full_job.done.is_set() and not tail_job.done.is_set()  # still queued
        assert not next_step(frozenset({9, 4})).is_alive()  # block 4 reused: the step gathers the TAIL itself
        assert tail_job.done.is_set() and not full_job.done.is_set()  # the FULL one goes on beside it
        assert worker._gathering is not None
        gate.set()
        assert in_full.wait(10)  # the gather thread is in the FULL object's gather
        t = next_step(frozenset({5}), blocks=True)  # block 5 reused: waits for the gather thread's FULL gather
        alive = t.is_alive()
        release_full.set()
        t.join(10)
        assert alive and not t.is_alive() and full_job.done.is_set()
        worker.finish_gathers()
        assert worker._gathering is None
        gate2 = threading.Event()  # a step that does not say which blocks it writes waits for all
        worker._gatherer.submit(gate2.wait)
        worker.before_step(HMAConnectorMetadata(new_blocks=frozenset()))
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w2", blocks, objects[:1])]))
        t = next_step(None, blocks=True)
        alive = t.is_alive()
        gate2.set()
        t.join(10)
        assert alive and not t.is_alive() and worker._gathering is None
        for kv in caches.values():  # the next step's forward reuses the blocks
            kv.fill_(7)
        worker.drain()
        assert worker.counters()["objects_stored"] >= 2
        target = ([9, 10], [11, 12], [13, 14])
        worker.start_load_kv(HMAConnectorMetadata(loads=[LoadSpec("r", target, 0, 8, hit_objects(0, hashes, True),
                                                                  sync=False)]))
        assert worker.take_transfer_results() == ({"r"}, set())
        for layer, src, dst in [(4, 5, 13), (5, 6, 14), (0, 1, 9), (1, 2, 10), (2, 3, 11), (3, 4, 12)]:
            assert torch.equal(block(caches, layer, dst), before[layer, src]), (layer, src, dst)
    finally:
        gate.set()
        release_full.set()
        worker.shutdown()



def test_without_vllms_first_call_of_a_step_gathers_end_in_the_step(tmp_path):
    """Deferred gathers rely on handle_preemptions (``before_step``) as the barrier before the
    next step writes KV; a step that did not start with it gathers in ``wait_for_save`` and
    stops deferring."""
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        objects = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]), objects)]))
        assert not worker.defer_gathers and worker._gathering is None  # gathered in the call
        worker.drain()
        assert worker.counters()["objects_stored"] == 2
    finally:
        worker.shutdown()


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 CPUs")
def test_background_threads_run_off_the_cpus_vllm_bound_the_worker_to(tmp_path):
    """Built on a thread bound to CPU 0 (as vLLM binds its CPU worker), the worker's store
    threads (LMCache's, the writer, the gather thread) run on the other CPUs, the lookup
    server's on CPU 0, and the building thread keeps its binding."""
    others = frozenset(os.sched_getaffinity(os.getppid())) - {0}  # what this process may use
    if not others:
        pytest.skip("this process may use CPU 0 only")
    built: dict = {}

    def build():
        os.sched_setaffinity(0, {0})
        built["before"] = set(threading.enumerate())
        built["worker"] = make_worker(tmp_path, defer_gathers=True)[0]
        built["after_build"] = os.sched_getaffinity(0)
        hashes = ChunkHasher(built["worker"].namespace).chunk_hashes(list(range(8)), 1)
        objects = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
        built["worker"].before_step(HMAConnectorMetadata())
        built["worker"].wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]),
                                                                            objects)]))
        built["worker"].finish_gathers()  # the gather thread exists now

    t = threading.Thread(target=build)
    t.start()
    t.join(60)
    worker = built["worker"]
    try:
        assert built["after_build"] == {0}
        started = {th for th in threading.enumerate() if th not in built["before"] and th is not t}
        where = {th.name: frozenset(os.sched_getaffinity(th.native_id)) for th in started}
        lookup = [n for n in where if n.startswith("lmcache-hma-lookup")]
        background = [n for n in where if not n.startswith("lmcache-hma-lookup")]
        assert lookup and all(where[n] == {0} for n in lookup), where
        assert any(n.startswith("lmcache-hma-writer") for n in background), where
        assert any(n.startswith("lmcache-hma-gather") for n in background), where
        assert all(where[n] == others for n in background), where
        worker.drain()
        assert worker.counters()["objects_stored"] == 2
    finally:
        worker.shutdown()


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs 2 CPUs")
def test_a_large_load_is_scattered_by_two_threads_into_the_right_blocks(tmp_path, monkeypatch):
    """With CPUs the worker is not bound to, a load's objects are split between the step's thread
    and the gather thread (every load, here: the size threshold is 0); each block lands where
    a one-thread scatter puts it."""
    from lmcache_hma.kv_copy import copy_ops

    if not frozenset(os.sched_getaffinity(os.getppid())) - {0}:
        pytest.skip("this process may use CPU 0 only")
    monkeypatch.setattr(WorkerHalf, "SPLIT_SCATTER_BYTES", 0)
    scattered_by = []
    scatter = copy_ops.scatter
    monkeypatch.setattr(copy_ops, "scatter", lambda *a: (scattered_by.append(threading.current_thread().name),
                                                         scatter(*a)))
    done: dict = {}

    def run():  # as vLLM's CPU worker: a thread bound to one CPU
        os.sched_setaffinity(0, {0})
        worker, lay, ns, caches = make_worker(tmp_path)
        done["caches"] = caches
        try:
            hashes = ChunkHasher(ns).chunk_hashes(list(range(24)), CHUNKS)
            stored = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18])
            objects = hit_objects(0, hashes, True)
            worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("writer", stored, objects)]))
            worker.drain()
            assert worker._answer_lookup("reader", 1, 0, hashes)[:2] == (CHUNKS, True)
            target = ([0, 0, 0, 0, 19, 20], [0, 0, 0, 0, 21, 22], [23, 24, 25, 26, 27, 28])
            worker.start_load_kv(HMAConnectorMetadata(
                loads=[LoadSpec("reader", target, 0, CHUNKS * 8, objects, sync=True, lookup=1)]))
            done["counters"] = worker.counters()
        finally:
            worker.shutdown()

    t = threading.Thread(target=run, name="step")
    t.start()
    t.join(60)
    assert done["counters"]["loads_sync"] == 1
    assert {"step"} < set(scattered_by) and any(n.startswith("lmcache-hma-gather") for n in scattered_by), scattered_by
    caches = done["caches"]
    for layer, src, dst in [(4, 13, 23), (5, 18, 28), (0, 5, 19), (1, 6, 20), (2, 11, 21), (3, 12, 22),
                            (4, 14, 24), (5, 17, 27)]:
        assert torch.equal(block(caches, layer, dst), block(caches, layer, src)), (layer, src, dst)


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or shutil.which("taskset") is None, reason="needs 2 CPUs, taskset")
def test_background_threads_never_take_cpus_the_process_was_kept_off():
    """Started under ``taskset -c 0`` (an operator keeping the engine on CPU 0), a worker thread
    bound to CPU 0 has no other CPUs for its background threads: they stay on CPU 0."""
    code = ("import os; from lmcache_hma.worker import cpu_placement as cpus; os.sched_setaffinity(0, {0}); "
            "print(sorted(cpus.unbound_cpus()), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run(["taskset", "-c", "0", "sh", "-c", f'"{sys.executable}" -c "{code}"'],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split("\n")[0] == "[] [0]", out


# vLLM's V2 model runner ------------------------------------------------------------------------

def test_v2_runner_order_never_seals_bytes_a_block_copy_overwrote(tmp_path):
    """Under vLLM's V2 model runner a step applies ``kv_cache_block_copies`` and zeroes new blocks
    in ``update_requests`` (``v1/worker/gpu/model_runner.py`` ~1259-1271) before ``pre_forward``
    calls ``handle_preemptions`` (``v1/worker/gpu/kv_connector.py`` ~81): the barrier comes after
    the write. That order is played here with the last step's gathers held back (the gather
    thread busy): a deferred gather would then read the overwritten block and seal it. Gathers
    must end in the step there; under the V1 runner (barrier first) they may be deferred."""
    from types import SimpleNamespace

    from lmcache_hma.vllm_compat import gathers_may_defer

    no_zeroing = SimpleNamespace(needs_kv_cache_zeroing=False)
    assert gathers_may_defer(SimpleNamespace(use_v2_model_runner=False), no_zeroing)[0]
    defer, why = gathers_may_defer(SimpleNamespace(use_v2_model_runner=True), no_zeroing)
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=defer)
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        objects = hit_objects(0, hashes, True)
        stored = ([1, 2], [3, 4], [5, 6])
        before = {name: kv.clone() for name, kv in caches.items()}
        gate = threading.Event()
        worker._gatherer.submit(gate.wait)  # a deferred gather could not have started yet
        worker.before_step(HMAConnectorMetadata(new_blocks=frozenset()))
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, objects)]))
        # the next step, V2's order: update_requests copies block 40 into block 5 (freed, reused) ...
        for kv in caches.values():
            kv[5] = kv[40]
        worker.before_step(HMAConnectorMetadata(new_blocks=frozenset({5})))  # ... then pre_forward
        gate.set()
        worker.drain()
        assert worker._answer_lookup("r", 1, 0, hashes)[:2] == (1, True)
        target = ([7, 8], [9, 10], [11, 12])
        worker.start_load_kv(HMAConnectorMetadata(loads=[LoadSpec("r", target, 0, 8, objects, sync=True, lookup=1)]))
        for layer, src, dst in [(4, 5, 11), (5, 6, 12), (0, 1, 7), (1, 2, 8), (2, 3, 9), (3, 4, 10)]:
            assert torch.equal(caches[f"L{layer}"][dst], before[f"L{layer}"][src]), (layer, src, dst, why)
    finally:
        worker.shutdown()


# failed synchronous loads and the copy-path probe ---------------------------------------------

def stored_hit(worker, ns, tokens=8, req="r", epoch=0):
    """Store one chunk (FULL + TAIL) from blocks 1..6 and hold its hit for ``req`` (lookup 1);
    ``epoch``: the scheduler's resets when it built the step (a step built before a reset the
    worker applied stores nothing)."""
    hashes = ChunkHasher(ns).chunk_hashes(list(range(tokens)), 1)
    objects = hit_objects(0, hashes, worker.layout.has_sliding)
    stored = tuple([2 * g + 1, 2 * g + 2] for g in range(len(worker.layout.groups)))
    worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, objects)], epoch=epoch))
    worker.drain()
    assert worker._answer_lookup(req, 1, 0, hashes)[:2] == (1, True)
    return objects


def test_a_failed_synchronous_load_is_tried_again(tmp_path):
    from lmcache_hma.worker.faults import FaultPlan

    worker, lay, ns, caches = make_worker(tmp_path, hma_test_fail_sync_loads=1)
    try:
        assert worker.faults.plan == FaultPlan(fail_sync_loads=1)
        objects = stored_hit(worker, ns)
        target = ([7, 8], [9, 10], [11, 12])
        worker.start_load_kv(HMAConnectorMetadata(loads=[LoadSpec("r", target, 0, 8, objects, sync=True, lookup=1)]))
        c = worker.counters()  # the retry scattered the objects the lookup held
        assert c["sync_load_retries"] == 1 and c["loads_sync"] == 1 and "sync_loads_failed" not in c
        for layer, src, dst in [(4, 5, 11), (5, 6, 12), (0, 1, 7), (1, 2, 8), (2, 3, 9), (3, 4, 10)]:
            assert torch.equal(block(caches, layer, dst), block(caches, layer, src)), (layer, src, dst)
        assert worker.held.held_bytes == 0
    finally:
        worker.shutdown()


def test_a_synchronous_load_that_fails_twice_never_leaves_a_hit_over_unwritten_blocks(tmp_path):
    """Several KV cache groups: vLLM 0.32 cannot recompute the blocks (its scheduler raises on
    ``invalid_block_ids``) nor a running request's failed receive: the step stops with a clear
    error. One group: the blocks are reported and vLLM recomputes them."""
    from lmcache_hma.worker.loads import SyncLoadError

    worker, lay, ns, caches = make_worker(tmp_path, hma_test_fail_sync_loads=2)
    try:
        objects = stored_hit(worker, ns)
        load = LoadSpec("r", ([7, 8], [9, 10], [11, 12]), 0, 8, objects, sync=True, lookup=1)
        with pytest.raises(SyncLoadError, match="cannot recompute"):
            worker.start_load_kv(HMAConnectorMetadata(loads=[load]))
        assert worker.counters()["sync_loads_failed"] == 1 and worker.take_failed_blocks() == set()
    finally:
        worker.shutdown()
    worker, lay, ns, caches = make_worker(tmp_path, kinds="F", hma_test_fail_sync_loads=2)
    try:
        objects = stored_hit(worker, ns)
        load = LoadSpec("r", ([7, 8, 9],), 0, 8, objects, sync=True, lookup=1)
        worker.start_load_kv(HMAConnectorMetadata(loads=[load]))
        assert worker.take_failed_blocks() == {7, 8} and worker.take_failed_blocks() == set()
        assert worker.counters()["sync_loads_failed"] == 1
    finally:
        worker.shutdown()


def test_a_copy_path_that_cannot_run_serves_no_hits_and_stores_nothing(tmp_path, monkeypatch):
    """E.g. a GPU host without CuPy: found at ``register_kv_caches``, said once, never a hit
    whose load would fail."""
    def broken(*args):
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(copy_ops, "gather", broken)
    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        assert "cupy" in worker.disabled
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]),
                                                                  hit_objects(0, hashes, True))]))
        worker.drain()
        assert worker.counters().get("objects_stored", 0) == 0 and worker.held is None
        assert worker._answer_lookup("r", 1, 0, hashes)[:2] == (0, False)
    finally:
        worker.shutdown()


# background threads ---------------------------------------------------------------------------

def test_the_store_writer_outlives_a_failing_batch(tmp_path, monkeypatch):
    from lmcache_hma.worker.store_writer import StoreWriter

    worker, lay, ns, caches = make_worker(tmp_path)
    commit = StoreWriter._commit
    failed = threading.Event()

    def fail_once(self, items):
        if not failed.is_set():
            failed.set()
            raise RuntimeError("injected")
        return commit(self, items)

    monkeypatch.setattr(StoreWriter, "_commit", fail_once)
    try:
        for n in range(2):
            hashes = ChunkHasher(ns).chunk_hashes(list(range(n, n + 8)), 1)
            worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]),
                                                                      hit_objects(0, hashes, True))]))
            worker.finish_gathers()
            assert failed.wait(10)
            worker.writer.drain()  # returns: the thread took the next batch
        c = worker.counters()
        assert c["writer_errors"] == 1 and c["objects_stored"] >= 2  # the second save's FULL and TAIL
        assert c["objects_stored"] + c["saves_failed"] == 4
    finally:
        worker.shutdown()


# cache reset ----------------------------------------------------------------------------------

def test_a_reset_empties_this_namespaces_objects_from_cpu_and_disk_and_nothing_else(tmp_path):
    from tests.waiting import wait_for

    disk = tmp_path / "disk"
    worker, lay, ns, caches = make_worker(tmp_path, local_disk=f"file://{disk}/", max_local_disk_size=0.01)
    try:
        objects = stored_hit(worker, ns)  # held for "r"
        hashes = [objects[0].chunk_hash]
        wait_for(lambda: len(list(disk.iterdir())) == 2, what="both objects on disk")
        (disk / "another-deployment.pt").write_bytes(b"x" * 64)
        assert worker.held.held_bytes > 0 and worker.store.count_full_prefix(hashes) == 1
        assert worker.server is not None and worker.reset()
        assert worker.held.held_bytes > 0  # a step may have promised its load (test_holds)
        assert worker.store.count_full_prefix(hashes) == 0 and not worker.store.present(ObjectKind.TAIL, hashes)[0]
        assert worker._answer_lookup("r", 2, 0, hashes)[:2] == (0, False)
        assert worker.held.held_bytes == 0  # the new lookup gave the old hold back
        wait_for(lambda: [p.name for p in disk.iterdir()] == ["another-deployment.pt"], what="our files removed")
        # a worker of another tensor-parallel rank learns of the reset with the next step's metadata
        worker.serves_lookups = False
        stored_hit(worker, ns, req="r2", epoch=1)  # a step built after the reset
        assert worker.store.count_full_prefix(hashes) == 1
        worker.before_step(HMAConnectorMetadata(new_blocks=frozenset(), reset=True, epoch=2))
        assert worker.store.count_full_prefix(hashes) == 0
    finally:
        worker.shutdown()


def save_one_chunk_slowly(worker, ns, monkeypatch, put_s: float) -> list[bytes]:
    """Save one chunk (FULL + TAIL) whose put takes ``put_s`` more; returns its digests once the
    writer is busy with it."""
    commit_many, started = worker.store.commit_many, threading.Event()

    def slow_commit(items, shared=True, **kw):
        started.set()
        time.sleep(put_s)
        return commit_many(items, shared, **kw)

    monkeypatch.setattr(worker.store, "commit_many", slow_commit)
    hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
    objects = hit_objects(0, hashes, worker.layout.has_sliding)
    stored = tuple([2 * g + 1, 2 * g + 2] for g in range(len(worker.layout.groups)))
    worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, objects)]))
    assert started.wait(5)
    return hashes


def test_a_store_under_way_at_a_reset_lands_before_it_and_is_removed(tmp_path, monkeypatch):
    """A store queued before the reset but still in the writer: the reset lets it land, then
    clears it, so no hit appears after the reset (one landing later would be)."""
    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        hashes = save_one_chunk_slowly(worker, ns, monkeypatch, 0.3)  # the writer is busy when the reset comes
        assert worker.writer.pending() > 0
        assert worker.reset()
        worker.drain()
        assert worker.store.count_full_prefix(hashes) == 0 and not worker.store.present(ObjectKind.TAIL, hashes)[0]
        assert worker._answer_lookup("r", 1, 0, hashes)[:2] == (0, False)
    finally:
        worker.shutdown()


def test_a_reset_slower_than_a_lookup_timeout_is_confirmed(tmp_path, monkeypatch):
    """The worker lets stores under way land for up to half the lookup timeout, then removes
    the objects; the scheduler's client waits for all of it (it waited exactly one timeout,
    reported a reset that happened as failed, and vLLM's pause/sleep raised)."""
    from lmcache_hma.scheduler.lookup_client import LookupClient
    from lmcache_hma.core.lookup_wire import socket_address

    worker, lay, ns, caches = make_worker(tmp_path, hma_lookup_timeout_s=1.0)
    client = LookupClient(socket_address(worker.engine_id), 1.0)
    try:
        under_way = time.monotonic() + 0.8  # a slow writer: longer than the reset waits for it
        monkeypatch.setattr(worker.writer, "pending", lambda: int(time.monotonic() < under_way))
        clear_local = worker.store.clear_local
        monkeypatch.setattr(worker.store, "clear_local", lambda: (time.sleep(0.7), clear_local())[1])
        t0 = time.monotonic()
        assert client.reset()
        assert 1.0 < time.monotonic() - t0 < 3.0
    finally:
        client.close()
        worker.shutdown()


def test_a_hit_that_cannot_be_fetched_within_the_lookup_is_loaded_asynchronously(tmp_path, monkeypatch):
    """The fetch gets the lookup's remaining time (less the margin an answer needs): a slow
    tier makes the hit asynchronous (fetched by the load, a step later), never a miss, and
    the answer comes before the scheduler's deadline."""
    disk = tmp_path / "disk"
    worker, lay, ns, caches = make_worker(tmp_path, local_cpu=False, local_disk=f"file://{disk}/",
                                          max_local_disk_size=0.01, hma_lookup_timeout_s=2.0)
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        objects = hit_objects(0, hashes, worker.layout.has_sliding)
        stored = tuple([2 * g + 1, 2 * g + 2] for g in range(len(worker.layout.groups)))
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, objects)]))
        worker.drain()
        from tests.waiting import wait_for

        wait_for(lambda: not worker.store.writes_pending(), what="the disk writes")
        (tier,) = [t for t in worker.store.tiers if t.label == "disk"]
        get_blocking = tier.backend.get_blocking
        monkeypatch.setattr(tier.backend, "get_blocking", lambda key: (time.sleep(1.0), get_blocking(key))[1])
        t0 = time.monotonic()
        deadline = t0 + 2.0
        assert worker._answer_lookup("r", 1, 0, hashes, deadline)[:3] == (1, False, ("disk",))
        assert time.monotonic() < deadline - 0.25  # answered before the scheduler gave up (0.5 s margin, less jitter)
        assert worker.counters()["lookups_not_held_in_time"] == 1 and worker.held.held_bytes == 0
        monkeypatch.setattr(tier.backend, "get_blocking", get_blocking)
        target = ([7, 8], [9, 10], [11, 12])
        worker.start_load_kv(HMAConnectorMetadata(loads=[LoadSpec("r", target, 0, 8, objects, sync=False, lookup=1)]))
        assert worker.take_transfer_results() == ({"r"}, set())
        for layer, src, dst in [(4, 5, 11), (5, 6, 12), (0, 1, 7), (1, 2, 8), (2, 3, 9), (3, 4, 10)]:
            assert torch.equal(block(caches, layer, dst), block(caches, layer, src)), (layer, src, dst)
    finally:
        worker.shutdown()


def test_kv_events_stop_calling_the_worker_busy_once_its_gathers_are_done(tmp_path):
    """A finished deferred gather round stays referenced until the next step's barrier; it is
    no work under way (it kept vLLM's idle engine stepping, and pause/sleep waiting, for 10 s)."""
    from tests.waiting import wait_for

    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True, events=True)
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        stored = tuple([2 * g + 1, 2 * g + 2] for g in range(len(worker.layout.groups)))
        worker.before_step(HMAConnectorMetadata(new_blocks=frozenset()))
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, hit_objects(0, hashes, True))]))
        assert worker._gathering is not None
        wait_for(lambda: worker._gathering.done() and not worker.writer.pending()
                 and not worker.store.writes_pending(), what="the gathers and their stores")
        assert worker._gathering is not None and not worker.tier_events.busy()
    finally:
        worker.shutdown()



def test_a_stats_file_that_cannot_be_written_costs_the_store_writer_nothing(tmp_path):
    """The writer rewrites ``hma_stats_file`` after each batch (an idle engine runs no step that
    would): a file that cannot be written is logged once; the batch stays stored and counted,
    no writer error, and neither a step nor the shutdown raises."""
    worker, lay, ns, caches = make_worker(tmp_path, hma_stats_file=str(tmp_path / "missing-dir" / "stats.json"))
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        stored = tuple([2 * g + 1, 2 * g + 2] for g in range(len(worker.layout.groups)))
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, hit_objects(0, hashes, True))]))
        worker.drain()
        c = worker.counters()
        assert c["objects_stored"] == 2 and "writer_errors" not in c
        assert worker.take_transfer_results() == (set(), set())  # the step's own write
    finally:
        worker.shutdown()
