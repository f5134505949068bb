"""Held hits end to end between the real scheduler half and the real worker half (no engine).

A lookup that holds a hit's objects pins bytes of LMCache's CPU tier until the load of
that lookup takes them. Every other path must give them back: an answer that arrives
after the scheduler gave up, a lookup superseded by another, a request that finishes.
vLLM asks again about a request it could not allocate blocks for (KV pressure): the
hold then serves the new lookup without another fetch.
"""

import threading
from types import SimpleNamespace

from lmcache_hma.config.settings import load_config
from lmcache_hma.core.metadata import HMAConnectorMetadata, SaveSpec, hit_objects
from lmcache_hma.scheduler.scheduler_half import SchedulerHalf
from tests.engines import write_yaml
from tests.test_scheduler import Blocks, request
from tests.test_worker import make_worker

TOKENS = list(range(1000, 1025))  # 3 chunks of 8 and one token to compute


def pair(tmp_path, timeout_s, **worker_keys):
    """A worker (serving lookups) and a scheduler half asking it, over the real socket."""
    worker, lay, ns, caches = make_worker(tmp_path, **worker_keys)
    path = write_yaml(tmp_path / "s.yaml", chunk_size=8, local_cpu=True, max_local_cpu_size=0.002)
    config = load_config({"lmcache_config_file": str(path), "hma_lookup_timeout_s": timeout_s})
    sched = SchedulerHalf(config, lay, ns, worker.engine_id)
    probe = sched._state(request("probe", TOKENS))
    probe.keys.ensure(3)
    hashes = list(probe.hashes)  # what the scheduler asks about a request with these tokens
    stored = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18])
    worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, hit_objects(0, hashes, True))]))
    worker.drain()
    return worker, sched


def step(sched):
    return sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))


def watch_answers(worker):
    """An event set once a (delayed) lookup answer is on its way."""
    done = threading.Event()
    delay = worker.faults.delay_answer
    worker.faults.delay_answer = lambda: (delay(), done.set())
    return done


def test_an_answer_after_the_scheduler_gave_up_holds_nothing(tmp_path):
    worker, sched = pair(tmp_path, 0.3, hma_test_lookup_delay_s=1.0)
    try:
        answered = watch_answers(worker)
        req = request("late", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # gave up after 0.3 s
        meta = step(sched)
        assert meta.released == [("late", 1)]
        worker.start_load_kv(meta)
        assert answered.wait(10)  # the worker held the hit, then answered too late
        assert worker.held.held_bytes == 0
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_request_asked_about_again_reuses_its_hold_and_every_hold_goes_back(tmp_path):
    worker, sched = pair(tmp_path, 2.0)
    fetches = []
    get_many = worker.store.get_many
    worker.store.get_many = lambda wanted, *rest: (fetches.append(len(wanted)), get_many(wanted, *rest))[1]
    try:
        req = request("r", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (24, False)  # held: a synchronous load
        held = worker.held.held_bytes
        assert held > 0 and len(fetches) == 1
        # vLLM could not allocate blocks for it this step; it asks again in a later one
        assert sched.get_num_new_matched_tokens(req, 0) == (24, False)
        assert worker.held.held_bytes == held and len(fetches) == 1  # the hold serves, no new fetch
        table = ([0, 0, 0, 0, 19, 20], [0, 0, 0, 0, 21, 22], [23, 24, 25, 26, 27, 28, 29])
        sched.update_state_after_alloc(req, Blocks(table), 24)
        meta = step(sched)
        (load,) = meta.loads
        assert load.sync and load.lookup == 2
        worker.start_load_kv(meta)
        assert worker.counters()["loads_sync"] == 1 and worker.held.held_bytes == 0
        assert len(fetches) == 1  # loaded from what was held

        # a hold superseded by another lookup, and one whose request finishes unloaded
        other = request("other", TOKENS)
        assert sched.get_num_new_matched_tokens(other, 0) == (24, False)
        assert sched.get_num_new_matched_tokens(other, 8) == (16, False)  # another first chunk
        assert 0 < worker.held.held_bytes < held  # the later lookup's hold replaced the earlier one
        sched.request_finished(other)
        worker.start_load_kv(step(sched))
        assert worker.held.held_bytes == 0
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_hold_shorter_than_what_is_stored_now_does_not_answer_the_request_asked_again(tmp_path):
    """vLLM asks again about a request it could not allocate for; meanwhile more of its chunks
    were stored (its own saves before a preemption landed): the answer is the longer hit, not
    the shorter one held (a lost hit; simulator seed 10049)."""
    worker, lay, ns, caches = make_worker(tmp_path)
    path = write_yaml(tmp_path / "s.yaml", chunk_size=8, local_cpu=True, max_local_cpu_size=0.002)
    config = load_config({"lmcache_config_file": str(path), "hma_lookup_timeout_s": 2.0})
    sched = SchedulerHalf(config, lay, ns, worker.engine_id)
    try:
        probe = sched._state(request("probe", TOKENS))
        probe.keys.ensure(3)
        hashes = list(probe.hashes)
        stored = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18])
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, hit_objects(0, hashes[:1], True))]))
        worker.drain()
        req = request("r", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (8, False)  # chunk 0 held
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, hit_objects(0, hashes, True))]))
        worker.drain()
        assert sched.get_num_new_matched_tokens(req, 0) == (24, False)  # asked again: all three
        sched.request_finished(req)
        worker.start_load_kv(step(sched))
        assert worker.held.held_bytes == 0
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_hit_with_no_cpu_memory_to_fetch_it_into_is_loaded_asynchronously(tmp_path):
    """The objects are stored, but the fetch cannot bring them all in (a small CPU tier full of
    what other requests hold and read): the hit is answered as an asynchronous load, as past the
    held budget, not as no hit (simulator seed 10172)."""
    from lmcache_hma.store.lmcache_storage import release

    worker, sched = pair(tmp_path, 2.0)
    get_many = worker.store.get_many

    def no_room_for_the_last(wanted, *rest):  # what LMCache's allocator answers when full
        got = get_many(wanted, *rest)
        if got and got[-1][0] is not None:
            release(got[-1][0])
            got[-1] = (None, None)
        return got
    worker.store.get_many = no_room_for_the_last
    try:
        req = request("r", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (24, True)
        assert worker.held.held_bytes == 0
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_release_that_overtakes_its_answer_voids_the_hold_to_come(tmp_path):
    """The scheduler's release can reach the worker before the answer it gave up on is held."""
    from lmcache_hma.worker.held import Hold, HeldObjects

    held = HeldObjects(1 << 20, void_keep_s=5.0)
    held.release("r", 3)  # lookups up to 3 will not be used
    released = []
    objects = {("k", b"h"): (SimpleNamespace(), "cpu")}
    import lmcache_hma.worker.held as held_module

    real, held_module.release = held_module.release, released.append
    try:
        assert not held.hold("r", Hold(3, 0, (b"h",), objects, 100)) and held.held_bytes == 0
        assert len(released) == 1  # given back at once
        assert held.hold("r", Hold(4, 0, (b"h",), dict(objects), 100)) and held.held_bytes == 100
        assert held.take("r", 3) is None and held.take("r", 4) is not None and held.held_bytes == 0
    finally:
        held_module.release = real


def test_a_reset_between_a_built_step_and_its_load_keeps_the_promised_load(tmp_path):
    """vLLM's async scheduling (its GPU default): the engine runs ``reset_prefix_cache`` after
    scheduling step N (a synchronous load promised) and before the worker's ``start_load_kv``
    of step N. The load must still find its objects (several KV cache groups: a failed
    synchronous load would stop the engine), and the reset must still empty the cache."""
    worker, sched = pair(tmp_path, 2.0)
    try:
        req = request("r", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (24, False)  # held: a synchronous load
        table = ([0, 0, 0, 0, 19, 20], [0, 0, 0, 0, 21, 22], [23, 24, 25, 26, 27, 28, 29])
        sched.update_state_after_alloc(req, Blocks(table), 24)
        meta = step(sched)  # step N is built
        assert [load.sync for load in meta.loads] == [True]
        assert sched.reset()  # the engine's utility call, before the worker runs step N
        worker.start_load_kv(meta)  # step N's load
        c = worker.counters()
        assert c["loads_sync"] == 1 and "sync_loads_failed" not in c and "sync_load_retries" not in c
        assert worker.held.held_bytes == 0
        # the reset emptied the cache: the same prompt misses now
        again = request("again", TOKENS)
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_failed_synchronous_load_after_a_reset_is_retried_with_its_held_objects(tmp_path):
    """As above, and the load's first attempt fails (a transient fault): the retry scatters the
    objects the lookup held, which the reset kept for it. Fetched from the store again they would
    be gone (the reset emptied the CPU tier and renamed every object), and a synchronous load
    that fails twice stops the step (simulator seed 79)."""
    worker, sched = pair(tmp_path, 2.0, hma_test_fail_sync_loads=1)
    try:
        req = request("r", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (24, False)
        table = ([0, 0, 0, 0, 19, 20], [0, 0, 0, 0, 21, 22], [23, 24, 25, 26, 27, 28, 29])
        sched.update_state_after_alloc(req, Blocks(table), 24)
        meta = step(sched)
        assert sched.reset()
        worker.start_load_kv(meta)
        c = worker.counters()
        assert c["sync_load_retries"] == 1 and c["loads_sync"] == 1 and "sync_loads_failed" not in c
        assert worker.held.held_bytes == 0
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_hold_made_before_a_reset_serves_no_later_lookup(tmp_path):
    """A lookup vLLM asks again (it could not allocate) after a reset misses: the reset emptied
    the cache, and what was held for the earlier lookup is given back."""
    worker, sched = pair(tmp_path, 2.0)
    try:
        req = request("r", TOKENS)
        assert sched.get_num_new_matched_tokens(req, 0) == (24, False)
        assert sched.reset() and worker.held.held_bytes > 0  # a step may still take it
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        worker.start_load_kv(step(sched))
        assert worker.held.held_bytes == 0
    finally:
        sched.shutdown()
        worker.shutdown()


def test_a_void_is_kept_for_the_lookup_timeout_however_many_releases_follow(monkeypatch):
    """A late answer whose lookup was voided never holds, even after many other requests'
    releases (a count-bounded memory of voids forgot it); a hold is refused past its
    deadline, so a void older than the lookup timeout can be forgotten safely."""
    import time as time_module

    import lmcache_hma.worker.held as held_module
    from lmcache_hma.worker.held import Hold, HeldObjects

    released = []
    monkeypatch.setattr(held_module, "release", released.append)
    now = [1000.0]
    monkeypatch.setattr(time_module, "monotonic", lambda: now[0])
    held = HeldObjects(1 << 20, void_keep_s=5.0)
    objects = {("k", b"h"): (SimpleNamespace(), "cpu")}
    held.release("late", 7)  # the scheduler gave up on lookup 7 of "late"
    for n in range(10_000):  # other requests' releases, within the timeout
        held.release(f"other-{n}", n)
    now[0] += 1.0
    assert not held.hold("late", Hold(7, 0, (b"h",), dict(objects), 100, deadline=now[0] + 3.0))
    assert held.held_bytes == 0 and len(released) == 1
    # past the lookup's deadline nothing is held, voided or not
    assert not held.hold("new", Hold(1, 0, (b"h",), dict(objects), 100, deadline=now[0] - 0.1))
    # voids older than void_keep_s are forgotten once the next release comes
    now[0] += 10.0
    held.release("other-x", 1)
    assert set(held._voided) == {"other-x"}


def test_a_hold_without_the_turn_end_does_not_answer_the_request_asked_again(tmp_path):
    """The first lookup of a next turn held its chunks without the turn end after them (the
    marker's read came too late); vLLM could not allocate and asks again: the turn end is
    answered now, not the hold of the shorter hit (a lost hit; simulator seed 11 once its hit
    floor read markers' offsets right)."""
    import time

    from lmcache_hma.core.kinds import ObjectKind
    from lmcache_hma.core.metadata import ObjectRef
    from tests.test_turn_ends import turn_at_21

    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        tokens, hashes, turn = turn_at_21(ns)
        stored = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18])
        mark = ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", stored, hit_objects(0, hashes[:2], True)),
                                                         SaveSpec("w", stored, [turn, mark], finished=True)]))
        worker.drain()
        read_marks = worker._read_marks
        worker._read_marks = lambda prefix, by: []  # the marker's read came too late
        first = worker._answer_lookup("r", 1, 0, hashes[:2], time.monotonic() + 30, turn_limit=21)
        assert (first.chunks, first.held, first.marks) == (2, True, ())
        worker._read_marks = read_marks
        again = worker._answer_lookup("r", 2, 0, hashes[:2], time.monotonic() + 30, turn_limit=21)
        assert (again.marks, again.mark_chunk) == ((5,), 2), again
    finally:
        worker.shutdown()
