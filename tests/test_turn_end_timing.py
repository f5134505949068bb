"""When a next turn's lookup finds its turn end: a lookup on a busy server waits only for the
stores queued before it (never for the store queue to empty), a prompt whose hit limit is a
chunk boundary still asks for turn ends, no prompt waits on turn ends other requests keep
leaving, and no marker names a turn object that was dropped. No engine: the worker on a real
CPU tier (``test_worker.make_worker``), the scheduler with the fake engine of
``test_scheduler``."""

import threading
import time

from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.lookup_wire import socket_address
from lmcache_hma.core.metadata import HMAConnectorMetadata, ObjectRef, SaveSpec
from lmcache_hma.store.lmcache_storage import flat
from tests.fakes import digest
from tests.test_scheduler import ANSWER, TOKENS, engine, request  # noqa: F401 - the fixture
from tests.test_turn_ends import WRITTEN, turn_at_21
from tests.test_worker import make_worker
from tests.waiting import wait_for

PAYLOAD = 256  # bytes of a filler object


class BusyWriter:
    """Keeps a worker's store writer busy: each put takes ``put_s`` (a Redis round trip under
    load) and another thread queues a filler object every ``every_s``, so the queue is never
    empty for long."""

    def __init__(self, worker, put_s=0.01, every_s=0.002):
        self.worker, self.every_s = worker, every_s
        self.stop = threading.Event()
        commit_many = worker.store.commit_many
        worker.store.commit_many = lambda items, shared=True, **kw: (time.sleep(put_s), commit_many(items, shared, **kw))[1]
        self.thread = threading.Thread(target=self._feed, daemon=True)

    def _feed(self):
        n = 0
        while not self.stop.is_set():
            n += 1
            obj = self.worker.store.allocate(PAYLOAD)
            if obj is not None:
                flat(obj).fill_(0)
                self.worker.writer.submit(ObjectKind.FULL, digest(10_000 + n), obj, "full_attention", PAYLOAD)
            time.sleep(self.every_s)

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.worker.writer.pending() > 0, what="the writer to be busy")
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def test_a_settle_wait_ends_once_what_was_queued_before_it_landed(tmp_path):
    """The queue of a busy writer is rarely empty: the wait is for the objects queued before it
    (a turn end the scheduler sent), not for the queue to drain (that ran to the deadline)."""
    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        with BusyWriter(worker):
            obj = worker.store.allocate(PAYLOAD)
            flat(obj).fill_(1)
            assert worker.writer.submit(ObjectKind.FULL, digest(1), obj, "full_attention", PAYLOAD)
            t0 = time.monotonic()
            assert worker.writer.wait_stored(t0 + 3.0)
            waited = time.monotonic() - t0
            assert worker.store.present(ObjectKind.FULL, [digest(1)]) == [True]
            assert waited < 1.0, waited  # a few 10 ms puts, not the 3 s deadline
    finally:
        worker.shutdown()


def test_a_lookup_on_a_busy_server_answers_the_turn_ends_marks_in_time(tmp_path):
    """The next turn's lookup (``settle``) waits for the turn end queued before it, then reads
    its marker with time to spare: it answered no turn end after waiting out its deadline. One
    that comes before the turn end's step ran (pipeline parallelism keeps more batches in
    flight) misses it at once."""
    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        tokens, hashes, turn = turn_at_21(ns)
        chunks = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in (0, 1)]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", WRITTEN, chunks)]))
        worker.drain()
        with BusyWriter(worker):
            t0 = time.monotonic()
            early = worker._answer_lookup("r", 1, 0, hashes[:2], t0 + 3.0, turn_limit=21, settle=[hashes[1]])
            assert early.marks == () and time.monotonic() - t0 < 1.0
            mark = ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)
            worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", WRITTEN, [turn, mark], finished=True)]))
            t0 = time.monotonic()
            found = worker._answer_lookup("r", 2, 0, hashes[:2], t0 + 3.0, turn_limit=21, settle=[hashes[1]])
            waited = time.monotonic() - t0
        assert (found.marks, found.mark_chunk) == ((5,), 2)
        assert waited < 1.0, waited
    finally:
        worker.shutdown()


def test_a_prompt_whose_limit_is_a_chunk_boundary_hits_a_turn_end_inside_an_earlier_chunk(engine, tmp_path):
    """A 49-token prompt may hit up to token 48, a chunk boundary; its whole chunks stop at 40,
    where the previous turn ended inside chunk 5 (at 44): the lookup asks for turn ends up to
    48 and hits that one (it sent no turn limit and hit 40)."""
    from lmcache_hma.scheduler.lookup_client import LookupClient

    worker, lay, ns, caches = make_worker(tmp_path)
    e = engine(interval=16)
    try:
        e.sched.client.close()  # the scheduler asks the real worker
        e.sched.client = LookupClient(socket_address(worker.engine_id), e.config.lookup_timeout_s)
        r = request("r", TOKENS[:20])
        e.admit(r)
        metas = e.prefill(r) + e.decode(r, ANSWER[:25])  # 44 tokens computed
        e.sched.request_finished(r, e.kvm.get_block_ids("r"))
        metas += [e.step(), e.step()]  # the turn end's save, then a step after it
        for meta in metas:
            worker.wait_for_save(meta)
        worker.drain()
        whole = TOKENS[:20] + ANSWER[:25]
        turn2 = request("turn2", whole[:44] + [7] * 5)
        assert ChunkHasher(ns).chunk_hashes(whole, 5) == e.hashes(whole[:40])  # one key space
        assert e.sched.get_num_new_matched_tokens(turn2, 0) == (44, False)  # held: loaded in the step
        assert e.sched.requests["turn2"].turn.end == 44
    finally:
        worker.shutdown()


def finished_inside_chunk_2(e, req_id, answer):
    """A request on ``TOKENS[:20]`` computed to 22 tokens, ready to finish: its turn end's
    marker is keyed by chunk 1's digest, which every prompt on ``TOKENS[:16]`` has."""
    r = request(req_id, TOKENS[:20])
    e.admit(r)
    e.prefill(r)
    e.decode(r, answer)
    assert r.num_computed_tokens == 22
    return r


def test_requests_finishing_on_a_shared_prefix_never_keep_another_prompt_waiting(engine):
    """Conversations sharing a system prompt leave turn ends whose markers have one key. A
    prompt on that prefix that is no next turn of theirs is not held back for them: it waited
    as long as one finished in every step."""
    e = engine(interval=16)
    finishing = [finished_inside_chunk_2(e, f"f{i}", [5000 + i, 5100 + i, 5200 + i]) for i in range(4)]
    prompt = request("new", TOKENS[:20] + [9] * 20)
    for r in finishing:  # one finishes in every step
        e.sched.request_finished(r, e.kvm.get_block_ids(r.request_id))
        assert e.sched.get_num_new_matched_tokens(prompt, 0)[0] is not None
        assert e.store.settled[-1]  # the stores under way land first, within the lookup's time
        e.step()


def test_no_prompt_waits_for_landing_turn_ends_past_one_lookup_timeout(engine):
    """Its own previous turn ends before a prompt arrives: a prompt older than a lookup timeout
    waits for no turn end (copies of one conversation could leave one in every step)."""
    e = engine(interval=16)
    r = finished_inside_chunk_2(e, "r", ANSWER[:3])
    e.sched.request_finished(r, e.kvm.get_block_ids("r"))
    fresh = request("fresh", TOKENS[:20] + ANSWER[:3] + [7, 7, 7])
    old = request("old", TOKENS[:20] + ANSWER[:3] + [7, 7, 7])
    old.arrival_time -= e.config.lookup_timeout_s + 0.1
    assert e.sched.get_num_new_matched_tokens(fresh, 0) == (None, False)  # its turn end is not sent yet
    assert e.sched.get_num_new_matched_tokens(old, 0)[0] is not None and e.store.settled[-1]


def test_no_marker_names_a_turn_object_the_full_queue_dropped(tmp_path):
    """The writer's queue is full when a turn end is gathered: its object is dropped and its
    marker not written, nor its offset recorded for the next marker after that chunk."""
    worker, lay, ns, caches = make_worker(tmp_path, hma_store_queue_objects=2)
    gate = threading.Event()
    commit_many = worker.store.commit_many
    worker.store.commit_many = lambda items, shared=True, **kw: (gate.wait(10), commit_many(items, shared, **kw))[1]
    try:
        for n in (1, 2, 3):  # 1 is taken by the writer (it waits), 2 and 3 fill the queue
            obj = worker.store.allocate(PAYLOAD)
            assert worker.writer.submit(ObjectKind.FULL, digest(n), obj, "full_attention", PAYLOAD)
            if n == 1:
                wait_for(lambda: worker.writer._queue.empty(), what="the writer to take the first object")
        tokens, hashes, turn = turn_at_21(ns)
        mark = ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("a", WRITTEN, [turn, mark], finished=True)]))
        assert worker.counters()["objects_dropped"] == 1  # the turn object; no marker was queued
        gate.set()
        worker.drain()
        assert worker.store.present(ObjectKind.TURNMARK, [hashes[1]]) == [False]

        # another turn end after the same chunk, stored: its marker lists it alone
        key22 = ChunkHasher(ns).turn_digest(hashes[1], tokens, 16, 22, None)
        turn22 = [ObjectRef(ObjectKind.TURN, 2, key22, 22), ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 22)]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("b", WRITTEN, turn22, finished=True)]))
        worker.drain()
        assert worker._read_marks(hashes[1], None) == [6]
    finally:
        gate.set()
        worker.shutdown()


def test_a_settle_wait_waits_for_its_turn_end_not_the_backlog_queued_behind_it(tmp_path):
    """A next turn's lookup lets the turn end it would hit land first, and only that: a backlog of
    other objects queued after the turn end (other requests' chunks, whose puts are held back
    here until the lookup has answered) does not hold it up. It waited for the whole backlog
    (``wait_stored`` of everything queued before the lookup), half its time, inside vLLM's
    ``schedule()``."""
    worker, lay, ns, caches = make_worker(tmp_path)
    tokens, hashes, turn = turn_at_21(ns)
    backlog_free, turn_end_free, turn_end_put = threading.Event(), threading.Event(), threading.Event()
    commit_many = worker.store.commit_many

    def put(items, shared=True, **kw):
        if any(kind is ObjectKind.TURNMARK for kind, _, _ in items):
            turn_end_put.set()
            turn_end_free.wait(30)
        elif any(kind is ObjectKind.FULL and h not in hashes for kind, h, _ in items):
            backlog_free.wait(30)  # the backlog's puts: slow until the lookup answered
        return commit_many(items, shared, **kw)

    try:
        chunks = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in (0, 1)]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", WRITTEN, chunks)]))
        worker.drain()
        worker.store.commit_many = put
        mark = ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", WRITTEN, [turn, mark], finished=True)]))
        assert turn_end_put.wait(10)  # the writer is putting the turn end: the backlog queues behind it
        for n in range(8):
            obj = worker.store.allocate(PAYLOAD)
            flat(obj).fill_(0)
            assert worker.writer.submit(ObjectKind.FULL, digest(20_000 + n), obj, "full_attention", PAYLOAD)
        answers = []
        t0 = time.monotonic()
        lookup = threading.Thread(target=lambda: answers.append(worker._answer_lookup(
            "r", 1, 0, hashes[:2], t0 + 60.0, turn_limit=21, settle=[hashes[1]])))
        lookup.start()
        turn_end_free.set()  # the turn end's own put ends; the backlog's do not
        lookup.join(20)  # the backlog's wait was half the lookup's 60 s
        assert not lookup.is_alive(), "the lookup waited for the backlog queued behind its turn end"
        assert worker.writer.pending() >= 8  # the backlog is still queued or being put
        [found] = answers
        assert (found.marks, found.mark_chunk) == ((5,), 2)  # the turn end landed first
    finally:
        turn_end_free.set()
        backlog_free.set()
        worker.shutdown()


def test_a_turn_end_the_scheduler_no_longer_names_still_lands_before_the_lookup(tmp_path):
    """The scheduler takes a turn end as stored three metadata after the one that sent it and
    stops naming its marker (``settle``); a writer that slow still has it queued. The next turn's
    lookup lets the markers keyed by its own chunks land too, and hits the turn end; it answered
    the chunk boundary before it (found by the simulator's check of turn ends on their way)."""
    worker, lay, ns, caches = make_worker(tmp_path)
    tokens, hashes, turn = turn_at_21(ns)
    free = threading.Event()
    commit_many = worker.store.commit_many
    try:
        chunks = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in (0, 1)]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", WRITTEN, chunks)]))
        worker.drain()
        worker.store.commit_many = lambda items, shared=True, **kw: (free.wait(30), commit_many(items, shared, **kw))[1]
        mark = ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", WRITTEN, [turn, mark], finished=True)]))
        wait_for(lambda: worker.writer.pending() > 0, what="the turn end to be queued")
        found = answer_once_landed(worker, free, hashes[:2], turn_limit=21)  # no settle
        assert (found.marks, found.mark_chunk) == ((5,), 2)
    finally:
        free.set()
        worker.shutdown()


def test_a_settle_wait_for_a_turn_end_whose_put_hangs_ends_at_its_deadline(tmp_path):
    """The turn end's own put does not end (a Redis that stopped answering): the wait for it
    ends at the time it was given, and says it did not land."""
    worker, lay, ns, caches = make_worker(tmp_path)
    free = threading.Event()
    commit_many = worker.store.commit_many
    worker.store.commit_many = lambda items, shared=True, **kw: (free.wait(30), commit_many(items, shared, **kw))[1]
    try:
        obj = worker.store.allocate(PAYLOAD)
        flat(obj).fill_(1)
        assert worker.writer.submit(ObjectKind.TURNMARK, digest(1), obj, "turn_end", PAYLOAD)
        t0 = time.monotonic()
        assert not worker.writer.wait_stored(t0 + 0.3, [(ObjectKind.TURNMARK, digest(1))])
        assert time.monotonic() - t0 < 10
        assert worker.writer.wait_stored(t0 + 0.3, [(ObjectKind.TURNMARK, digest(2))])  # nothing queued under it
    finally:
        free.set()
        worker.shutdown()


def answer_once_landed(worker, free: threading.Event, hashes, **lookup):
    """A lookup of ``hashes`` made while the writer's puts wait for ``free``: it must still be
    waiting 0.3 s later (for its own objects to land); then the puts go on and it answers."""
    answers = []
    thread = threading.Thread(target=lambda: answers.append(
        worker._answer_lookup("r", 1, 0, hashes, time.monotonic() + 60.0, **lookup)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not answers, "the lookup answered before the objects it may hit landed"
    free.set()
    thread.join(20)
    [found] = answers
    return found


def test_a_prompt_repeated_while_its_chunks_are_still_being_gathered_hits_them(tmp_path):
    """A prompt repeated right after the step that computed it, whose saves are planned on the
    gather thread (gathered beside the next step) while that thread has not had the CPU yet:
    nothing is queued for the writer. The lookup gathers them itself
    (``Gathers.gather_for_lookup``); they are queued, land, and it hits. It answered no hit
    before (the eagle3 flake once more: 0 of 1,792 tokens cached, no store wait logged)."""
    from concurrent.futures import ThreadPoolExecutor

    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    busy, gatherer = threading.Event(), ThreadPoolExecutor(1)
    gatherer.submit(busy.wait, 30)  # the gather thread: not scheduled until the lookup answered
    worker._gatherer = gatherer
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        chunk = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
        meta = HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]), chunk)])
        worker.before_step(meta)
        worker.wait_for_save(meta)
        assert worker.gathers_under_way() and worker.writer.pending() == 0  # planned, not queued
        found = worker._answer_lookup("r", 1, 0, hashes, time.monotonic() + 60.0)
        assert found.chunks == 1, found
    finally:
        busy.set()
        worker.shutdown()
        gatherer.shutdown(wait=True)


def test_a_prompt_repeated_while_its_chunks_are_still_queued_hits_them_once_they_land(tmp_path):
    """A prompt repeated right after the request that computed it (vLLM's own cache emptied): its
    chunks' saves are still in the store writer's queue (a busy writer: their put is slow). The
    lookup lets those objects land first, within half its time, and hits them; it answered no hit
    before (the flake of ``test_e2e_eagle`` on a loaded machine: 0 tokens cached of 1792)."""
    worker, lay, ns, caches = make_worker(tmp_path)
    free = threading.Event()
    commit_many = worker.store.commit_many
    worker.store.commit_many = lambda items, shared=True, **kw: (free.wait(30), commit_many(items, shared, **kw))[1]
    try:
        hashes = ChunkHasher(ns).chunk_hashes(list(range(8)), 1)
        chunk = [ObjectRef(ObjectKind.FULL, 0, hashes[0]), ObjectRef(ObjectKind.TAIL, 0, hashes[0])]
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", ([1, 2], [3, 4], [5, 6]), chunk)]))
        wait_for(lambda: worker.writer.pending() > 0, what="the chunks to be queued")
        found = answer_once_landed(worker, free, hashes)
        assert found.chunks == 1, found
    finally:
        free.set()
        worker.shutdown()
