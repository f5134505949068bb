"""Sleep mode (vLLM 0.33+ ``unregister_kv_caches`` / ``restore_kv_caches``) on the worker half.

vLLM unmaps KV memory right after ``unregister_kv_caches`` returns: a deferred gather still
reading it then would fault (GPU) or seal garbage. ``before_sleep`` ends them; ``after_wake``
probes the copy path again. On vLLM 0.32 the hooks are never called and gathers are not
deferred under sleep mode (``vllm_compat.gathers_may_defer``).
"""

import threading

from lmcache_hma.connector import LMCacheHMAConnector
from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import HMAConnectorMetadata, LoadSpec, ObjectRef, SaveSpec, hit_objects
from lmcache_hma.kv_copy import copy_ops
from tests.test_worker import block, make_worker


def test_sleep_ends_deferred_gathers_before_kv_memory_is_unmapped(tmp_path):
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    gate = threading.Event()
    try:
        assert worker.defer_gathers
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        objects = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
        blocks = ([1, 2], [3, 4], [5, 6])
        before = {(layer, b): block(caches, layer, b) for layer in range(6) for b in range(1, 7)}
        worker._gatherer.submit(gate.wait)  # the gather thread is busy: the step's gathers wait
        worker.before_step(HMAConnectorMetadata(new_blocks=frozenset()))
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", blocks, objects)]))
        assert worker._gathering is not None  # deferred: nothing gathered yet
        sleeper = threading.Thread(target=worker.before_sleep)
        sleeper.start()
        sleeper.join(0.5)  # gathers what the gather thread has not started, then waits for it
        waited = sleeper.is_alive()
        gate.set()
        sleeper.join(10)
        assert waited and not sleeper.is_alive() and worker._gathering is None and worker.asleep
        for kv in caches.values():  # vLLM unmaps the KV memory: its bytes are gone
            kv.fill_(7)
        worker.after_wake()
        assert not worker.asleep and worker.disabled is None
        worker.drain()
        assert worker.counters()["objects_stored"] == 2
        target = ([9, 10], [11, 12], [13, 14])
        worker.start_load_kv(HMAConnectorMetadata(loads=[LoadSpec("r", target, 0, 8, hit_objects(0, hashes, True),
                                                                  sync=False)]))
        assert worker.take_transfer_results() == ({"r"}, set())
        for layer, src, dst in [(4, 5, 13), (5, 6, 14), (0, 1, 9), (1, 2, 10), (2, 3, 11), (3, 4, 12)]:
            assert block(caches, layer, dst).equal(before[layer, src]), (layer, src, dst)
    finally:
        gate.set()
        worker.shutdown()


def test_wake_probes_the_copy_path_again(tmp_path, monkeypatch):
    worker, *_ = make_worker(tmp_path)
    try:
        worker.after_wake()  # not asleep: nothing to do
        assert worker.disabled is None
        worker.before_sleep()
        worker.before_sleep()  # idempotent, as vLLM asks
        monkeypatch.setattr(copy_ops, "probe", lambda paged: "the KV memory is not mapped")
        worker.after_wake()
        assert worker.disabled == "the KV memory is not mapped"
    finally:
        worker.shutdown()


def test_the_connector_answers_vllms_sleep_hooks():
    for hook in ("unregister_kv_caches", "restore_kv_caches"):
        assert hook in LMCacheHMAConnector.__dict__
