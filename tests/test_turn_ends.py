"""Turn ends without an engine: which finished request keeps its last partial chunk, the
marker that names it, and a lookup that finds it and loads it to the token (real LMCache
tier, paged KV tensors like vLLM's). End to end on real engines: ``test_e2e_exact`` (CPU
tier), ``test_e2e_kv_events`` (announced blocks), ``test_redis`` (another instance)."""

import pytest
import torch

from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import HMAConnectorMetadata, LoadSpec, ObjectRef, SaveSpec, turn_hit_objects
from lmcache_hma.core.turn_ends import MARK_BYTES, MARK_SLOTS, TurnMarks, decode_marks, encode_marks
from tests.fakes import layout
from tests.test_scheduler import ANSWER, TOKENS, engine, request  # noqa: F401 - the fixture
from tests.test_worker import block, make_worker


def test_a_marker_lists_the_newest_offsets_and_ignores_what_no_chunk_holds():
    marks = TurnMarks()
    for offset in range(1, MARK_SLOTS + 3):
        offsets = marks.add(b"p", offset)
    assert offsets == list(range(MARK_SLOTS + 2, 2, -1))  # newest first, at most MARK_SLOTS
    assert marks.add(b"p", 10)[0] == 10 and marks.add(b"q", 3) == [3]
    payload = torch.zeros(MARK_BYTES // 2, dtype=torch.bfloat16)
    encode_marks([5, 300, 7, -1, 5, -300, -6], payload)
    # distinct, inside a chunk, longest first; negative: a turn object on_tail
    assert decode_marks(payload, chunk_size=256) == [7, -6, 5, -1]


def test_turn_segments_cover_the_partial_chunk_and_the_window_at_its_end():
    lay = layout("SSF", block=4, window=8, chunk=8)
    # end 21 in chunk 2: full blocks of tokens 16..20 (4, 5), sliding blocks token 21 reads (14..20)
    segs = {s.group: (s.first_block, s.num_blocks) for s in lay.segments(ObjectKind.TURN, 2, 21)}
    assert segs == {0: (3, 3), 1: (3, 3), 2: (4, 2)}
    assert lay.payload_bytes(ObjectKind.TURN, 2, 100, 21) == (2 * 3 + 2 * 3 + 2 * 2) * 100
    assert lay.payload_bytes(ObjectKind.TURNMARK, 2, 100) == MARK_BYTES


@pytest.mark.parametrize("kept", [False, True], ids=["blocks-freed", "blocks-kept"])
def test_a_request_finishing_inside_a_chunk_stores_its_turn_end_with_the_next_step(engine, kept):
    """Its last partial chunk goes with the next step (the engine steps once more for it). Where
    vLLM's runner writes KV before the connector's first call of a step, vLLM keeps the blocks
    until the workers report the request in ``finished_sending``."""
    e = engine(interval=16)
    e.sched.keep_blocks_for_turn_ends = kept
    r = request("r", TOKENS[:20])
    e.admit(r)
    e.prefill(r)
    e.decode(r, ANSWER[:25])  # computes positions 20..43: 44 tokens computed, the 45th sampled
    table = e.kvm.get_block_ids("r")
    assert e.sched.request_finished(r, table) == (kept, None)
    assert e.sched.turn_saves_due and e.sched.turn_saves_pending == ({"r"} if kept else set())
    [save] = e.step().saves
    assert not e.sched.turn_saves_due and save.blocks_kept == kept
    whole = TOKENS[:20] + ANSWER[:25]
    hashes = e.hashes(whole)
    turn_key = ChunkHasher(e.ns).turn_digest(hashes[4], whole, 40, 44, None)
    assert save.finished and save.req_id == "r" and save.block_table == table
    assert save.objects == [ObjectRef(ObjectKind.TURN, 5, turn_key, 44), ObjectRef(ObjectKind.TURNMARK, 5, hashes[4], 44)]
    assert turn_key not in hashes
    e.sched.on_finished_sending({"r"})
    assert not e.sched.turn_saves_pending

    # the next turn's candidate: its own tokens give the same key; a changed token another one
    from lmcache_hma.scheduler.turn_ends import turn_candidates

    turn2 = request("turn2", whole + [7, 7])
    state = e.sched._state(turn2)
    assert turn_candidates(state, 5, [4, 6], limit=46) == [(46, state.keys.turn_digest(46), False),
                                                           (44, turn_key, False)]
    # a turn object on_tail (a negative offset) is keyed apart
    [(end, key, on_tail)] = turn_candidates(state, 5, [-4], limit=46)
    assert (end, on_tail) == (44, True) and key == state.keys.turn_digest(44, True) != turn_key
    assert turn_candidates(state, 5, [4], limit=43) == []  # past what the prompt may hit
    other = e.sched._state(request("other", whole[:42] + [1, 1, 7]))
    assert turn_candidates(other, 5, [4], limit=44) != [(44, turn_key, False)]


def test_under_speculative_decoding_a_turn_end_key_covers_the_token_after_it(engine):
    """With a lookahead (EAGLE) the draft's KV at ``L - 1`` was computed from token ``L`` (the
    last one sampled): the turn end's key covers it, so a next turn hits it only where its
    prompt holds that token."""
    from lmcache_hma.scheduler.turn_ends import turn_candidates

    e = engine(interval=16)
    e.sched.lookahead = 1  # as the connector builds it for EAGLE
    r = request("r", TOKENS[:20])
    e.admit(r)
    e.prefill(r)
    e.decode(r, ANSWER[:25])  # 44 tokens computed, the 45th sampled
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r")) == (False, None)
    [save] = e.step().saves
    whole = TOKENS[:20] + ANSWER[:25]
    hashes = ChunkHasher(e.ns).chunk_hashes(whole, 5, lookahead=1)
    key = ChunkHasher(e.ns).turn_digest(hashes[4], whole, 40, 44, None, lookahead=1)
    assert save.objects[0] == ObjectRef(ObjectKind.TURN, 5, key, 44)
    assert key != ChunkHasher(e.ns).turn_digest(hashes[4], whole, 40, 44, None)
    same = e.sched._state(request("same", whole + [7]))
    assert turn_candidates(same, 5, [4], limit=45) == [(44, key, False)]
    other = e.sched._state(request("other", whole[:44] + [1, 7]))  # another token at 44
    assert turn_candidates(other, 5, [4], limit=45) != [(44, key, False)]


def test_a_next_turn_arriving_before_the_turn_end_is_stored_waits_for_it(engine):
    """A conversation's next turn can reach the scheduler right after the previous one finished,
    before the step that gathers its turn end: vLLM is asked to try it again at its next step
    (``get_num_new_matched_tokens`` returns None) until that step ran, and the lookup then has
    the worker let its stores under way land first. Other prompts are not held up."""
    e = engine(interval=16)
    r = request("r", TOKENS[:20])
    e.admit(r)
    e.prefill(r)
    e.decode(r, ANSWER[:25])
    e.sched.request_finished(r, e.kvm.get_block_ids("r"))
    turn2 = request("turn2", TOKENS[:20] + ANSWER[:25] + [7, 7])
    assert e.sched.get_num_new_matched_tokens(turn2, 0) == (None, False)  # its save is not sent yet
    e.step()  # carries the save: its step may still be running when the next metadata is built
    assert e.sched.get_num_new_matched_tokens(turn2, 0) == (None, False)
    other = request("other", TOKENS[:8] + [9] * 40)
    assert e.sched.get_num_new_matched_tokens(other, 0)[0] is not None
    e.step()
    hit, _ = e.sched.get_num_new_matched_tokens(turn2, 0)
    assert hit is not None and e.store.settled[-1]  # looked up, after the stores under way
    for _ in range(4):
        e.step()
    e.sched.get_num_new_matched_tokens(turn2, 0)
    assert not e.store.settled[-1]  # stored long ago: an ordinary lookup


@pytest.mark.parametrize("computed, answers", [(40, True), (44, False), (4, True)],
                         ids=["at-a-chunk-boundary", "answers-off", "inside-the-first-chunk"])
def test_no_turn_end_where_none_is_needed_or_wanted(engine, computed, answers):
    """(``interval``: the answer's chunks have their tails already; ``branch``: tests/test_admission.py)"""
    e = engine(interval=16, answers=answers)
    r = request("r", TOKENS[:computed] if computed < 20 else TOKENS[:20])
    e.admit(r)
    e.prefill(r)
    if computed > 20:
        e.decode(r, ANSWER[:computed - 20 + 1])
    assert r.num_computed_tokens == computed
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r")) == (False, None)
    assert not e.sched.turn_saves_due and not e.step().saves


# a finished request's blocks (layout "SSF", block 4, window 8, chunk 8); null: out of window
WRITTEN = ([0, 0, 0, 1, 2, 3], [0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12])


def turn_at_21(ns):
    """(tokens, chunk digests, the ``TURN`` ref) of a request that finished at 21 tokens."""
    tokens = list(range(100, 130))
    hashes = ChunkHasher(ns).chunk_hashes(tokens, 3)
    return tokens, hashes, ObjectRef(ObjectKind.TURN, 2, ChunkHasher(ns).turn_digest(hashes[1], tokens, 16, 21, None), 21)


def test_a_stored_turn_end_is_found_through_its_marker_and_loads_to_the_token(tmp_path):
    """Worker side: the turn object and its marker are stored from a finished request's blocks,
    which vLLM may free once the worker says so (``finished_sending``); a lookup reads the marker,
    then hits the turn end, holds its objects, and the load restores every block the next token
    reads, byte for byte."""
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    try:
        tokens, hashes, turn = turn_at_21(ns)
        turn_key, written = turn.chunk_hash, WRITTEN
        saves = [SaveSpec("w", written, [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in (0, 1)]),
                 SaveSpec("w", written, [turn, ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)], finished=True)]
        worker.wait_for_save(HMAConnectorMetadata(saves=saves))
        worker.drain()
        assert worker.take_finished_sending() == set()  # vLLM did not keep the blocks for it
        assert worker.counters()["objects_stored"] == 4  # 2 chunks, the turn object, its marker

        # a prompt that may hit up to token 20 only: the marker's turn end is past it
        assert worker._answer_lookup("r", 1, 0, hashes[:2], turn_limit=20).marks == ()
        first = worker._answer_lookup("r", 2, 0, hashes[:2], turn_limit=21)
        assert (first.marks, first.mark_chunk, first.held) == ((5,), 2, False)
        other = ChunkHasher(ns).turn_digest(hashes[1], tokens[:20] + [1], 16, 21, None)
        found = worker._answer_lookup("r", 3, 0, hashes[:2], turns=(2, [(22, other, False), (21, turn_key, False)]))
        assert found[:3] == (2, True, ("cpu",) * 3) and found.turn_end == 21

        target = ([0, 0, 0, 21, 22, 23], [0, 0, 0, 24, 25, 26], [27, 28, 29, 30, 31, 32])
        load = LoadSpec("r", target, 0, 21, turn_hit_objects(0, hashes[:2], turn), sync=True, lookup=3)
        worker.start_load_kv(HMAConnectorMetadata(loads=[load]))
        assert worker.counters()["loads_ok"] == 1
        for g, layers in ((0, (0, 1)), (1, (2, 3)), (2, (4, 5))):
            for j in range(3 if g < 2 else 0, 6):  # every block the token at 21 reads
                for layer in layers:
                    assert torch.equal(block(caches, layer, target[g][j]), block(caches, layer, written[g][j]))
    finally:
        worker.shutdown()


def test_a_turn_end_on_tail_loads_its_chunk_and_the_tail_before_it_to_the_token(tmp_path):
    """``on_tail``: the turn object at 21 holds tokens 16..20 only (sliding blocks 4, 5); the
    tail at 16, stored by the request at its prompt's end (blocks 2, 3, block 2 out of the window
    at 21 by the time it finished), holds the rest of the window. The marker's entry is negative;
    the lookup hits the turn end only while that tail is stored, and the load restores every block
    the token at 21 reads, byte for byte."""
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    try:
        tokens, hashes, _ = turn_at_21(ns)
        key = ChunkHasher(ns).turn_digest(hashes[1], tokens, 16, 21, None, on_tail=True)
        turn = ObjectRef(ObjectKind.TURN, 2, key, 21, on_tail=True, parent=hashes[1])
        assert lay.turn_needs_tail(2, 21) and {s.group: (s.first_block, s.num_blocks)
                                               for s in lay.segments(ObjectKind.TURN, 2, 21, on_tail=True)} == {
            0: (4, 2), 1: (4, 2), 2: (4, 2)}
        at_16 = ([0, 0, 14, 1, 2, 3], [0, 0, 15, 4, 5, 6], WRITTEN[2])  # its blocks when it was at 16
        saves = [SaveSpec("w", at_16, [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in (0, 1)]
                          + [ObjectRef(ObjectKind.TAIL, 1, hashes[1])]),
                 SaveSpec("w", WRITTEN, [turn, ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21, on_tail=True)],
                          finished=True)]
        worker.wait_for_save(HMAConnectorMetadata(saves=saves))
        worker.drain()
        assert worker.counters()["objects_stored"] == 5
        first = worker._answer_lookup("r", 1, 0, hashes[:2], turn_limit=21)
        assert (first.marks, first.mark_chunk) == ((-5,), 2)
        found = worker._answer_lookup("r", 2, 0, hashes[:2], turns=(2, [(21, key, True)]))
        assert found[:3] == (2, True, ("cpu",) * 3) and (found.turn_end, found.turn_on_tail) == (21, True)

        target = ([0, 0, 0, 21, 22, 23], [0, 0, 0, 24, 25, 26], [27, 28, 29, 30, 31, 32])
        objects = turn_hit_objects(0, hashes[:2], turn)
        assert [(o.kind, o.chunk) for o in objects] == [(ObjectKind.FULL, 0), (ObjectKind.FULL, 1),
                                                        (ObjectKind.TAIL, 1), (ObjectKind.TURN, 2)]
        worker.start_load_kv(HMAConnectorMetadata(loads=[LoadSpec("r", target, 0, 21, objects, sync=True, lookup=2)]))
        assert worker.counters()["loads_ok"] == 1
        for g, layers in ((0, (0, 1)), (1, (2, 3)), (2, (4, 5))):
            for j in range(3 if g < 2 else 0, 6):  # every block the token at 21 reads
                for layer in layers:
                    assert torch.equal(block(caches, layer, target[g][j]), block(caches, layer, WRITTEN[g][j]))

        worker.store.remove(ObjectKind.TAIL, hashes[1])  # without the tail the turn end cannot hit
        found = worker._answer_lookup("r", 3, 0, hashes[:2], turns=(2, [(21, key, True)]))
        assert found.turn_end == 0 and found.chunks < 2
    finally:
        worker.shutdown()


def test_a_turn_end_is_gathered_before_the_step_writes_the_blocks_it_gave_back(tmp_path):
    """The finished request's blocks were freed and this step loads another request's hit into
    them: the step's first call (here ``start_load_kv``, as in a step whose ``handle_preemptions``
    did not run) gathers the turn end first, so it holds the finished request's KV."""
    worker, lay, ns, caches = make_worker(tmp_path, defer_gathers=True)
    try:
        _, _, turn = turn_at_21(ns)
        turn_key, table = turn.chunk_hash, WRITTEN
        before = {(layer, b): block(caches, layer, b) for layer in range(6) for b in range(1, 13)}
        # another request's chunk, stored elsewhere, now loaded into blocks 10 and 11 of group 2
        other = ChunkHasher(ns).chunk_hashes(list(range(300, 308)), 1)
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("o", ([], [], [20, 21]), [
            ObjectRef(ObjectKind.FULL, 0, other[0])])]))
        worker.drain()
        load = LoadSpec("o2", ([], [], [10, 11]), 0, 8, [ObjectRef(ObjectKind.FULL, 0, other[0])])
        step = HMAConnectorMetadata(saves=[SaveSpec("w", table, [turn], finished=True)], loads=[load])
        worker.start_load_kv(step)
        worker.wait_for_save(step)  # gathers nothing twice
        worker.drain()
        assert torch.equal(block(caches, 4, 10), block(caches, 4, 20))  # the load overwrote block 10
        got = worker.store.get(ObjectKind.TURN, turn_key, lay.payload_bytes(ObjectKind.TURN, 2, worker.paged.page_bytes, 21))
        assert got is not None and worker.counters()["objects_stored"] == 2
        from lmcache_hma.core.objects import payload_of
        from lmcache_hma.store.lmcache_storage import flat, release

        rows = payload_of(flat(got)).view(torch.uint8).view(-1, worker.paged.page_bytes)
        # rows: group 0 (layers 0, 1) blocks 3..5, group 1 (layers 2, 3) blocks 3..5, group 2 (4, 5) blocks 4, 5
        want = [before[(layer, b)] for layer, blocks in ((0, (1, 2, 3)), (1, (1, 2, 3)), (2, (4, 5, 6)),
                                                         (3, (4, 5, 6)), (4, (11, 12)), (5, (11, 12))) for b in blocks]
        assert all(torch.equal(r, w.view(torch.uint8).view(-1)) for r, w in zip(rows, want))
        release(got)
    finally:
        worker.shutdown()


def test_kept_blocks_are_given_back_even_when_nothing_can_be_stored(tmp_path):
    """Where vLLM keeps a finished request's blocks for its turn end, it frees them only once
    every worker says so: a worker that cannot copy (or whose save fails) says so at once."""
    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        turn = ObjectRef(ObjectKind.TURN, 2, b"\1" * 32, 21)
        worker.disabled = "no copy path"
        kept = dict(finished=True, blocks_kept=True)
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("a", ([], [], []), [turn], **kept)]))
        assert worker.take_finished_sending() == {"a"}
        worker.disabled = None
        bad = SaveSpec("b", ([1], [2], [3]), [turn], **kept)  # a block table too short: the plan fails
        worker.wait_for_save(HMAConnectorMetadata(saves=[bad]))
        assert worker.take_finished_sending() == {"b"} and worker.counters()["saves_failed"] == 1
    finally:
        worker.shutdown()
