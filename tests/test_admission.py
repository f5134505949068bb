"""``hma_tail_admission: branch`` (scheduler.admission): tails at prompt ends, at branch points
lookups find, and at an answer's end; planned by the real ``SchedulerHalf`` against
tests/test_scheduler.py's lookup server (layout "SSF", chunk 8, window 8; objects ``F<chunk>``
and ``T<chunk>``, the tail at the chunk's end)."""

import pytest

from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef
from lmcache_hma.scheduler.admission import Admission
from tests.test_scheduler import ANSWER, OTHER, TOKENS, engine, names, request, saved  # noqa: F401 - the fixture


def test_a_prompt_stores_its_chunks_and_the_tails_at_its_end_and_every_sparse_interval(engine):
    """41 tokens: ``interval`` (16) stores tails at 16, 32 and 40; ``branch`` at 40 (the repeat's
    hit and the last full chunk) and every sparse interval: with one of 1000 none; by default the
    layout's ``tail_interval`` (16 here: a tail weighs as much as 16 tokens' full-attention KV),
    and then the checkpoint interval's other boundaries (8 here) on speculation (``spare``:
    ``hma_spare_tail_fill``, tests/test_spare_tails.py)."""
    cases = (("interval", 16, ["T1", "T3", "T4"], []), ("branch", 1000, ["T4"], []),
             ("branch", None, ["T0", "T1", "T2", "T3", "T4"], ["T0", "T2"]))
    for admission, interval, tails, spare in cases:
        e = engine(interval=interval, admission=admission)
        assert e.sched.admission.sparse_interval == (interval or e.lay.tail_interval() == 16 and 16)
        a = request("a", TOKENS[:41])
        e.admit(a)
        (meta,) = e.prefill(a)
        assert [n for n in saved(meta, "a") if n[0] == "T"] == tails, admission
        assert [f"T{r.chunk}" for s in meta.saves for r in s.objects if r.spare] == spare
        assert [n for n in saved(meta, "a") if n[0] == "F"] == ["F0", "F1", "F2", "F3", "F4"]


def test_a_branch_point_a_lookup_finds_is_stored_by_its_request_and_serves_the_next(engine):
    """B shares A's first two chunks: its lookup finds them stored but no tail at their end (a
    miss). B stores that tail (and not the two chunks again); C, sharing them too, hits there."""
    e = engine(interval=1000, admission="branch")
    a = request("a", TOKENS[:41])
    e.admit(a)
    e.prefill(a)
    b = request("b", TOKENS[:16] + OTHER[:25])
    assert e.admit(b) == (0, False)
    (meta,) = e.prefill(b)
    assert saved(meta, "b") == ["T1", "F2", "F3", "F4", "T4"]
    assert e.sched.admission.is_branch(e.hashes(TOKENS[:16])[1])
    c = request("c", TOKENS[:16] + list(range(7000, 7030)))
    assert e.admit(c) == (16, True)
    (load,) = e.step().loads
    assert names(load.objects) == ["F0", "F1", "T1"]


def test_any_request_computing_a_known_branch_point_stores_its_tail(engine):
    """Once found, a branch point is stored by whichever request computes it next (its tail may
    have been evicted, or the request that found it preempted)."""
    e = engine(interval=1000, admission="branch")
    branch = e.hashes(TOKENS[:16])[1]
    e.sched.admission.found_branch(e.hashes(TOKENS[:16]), 0, 2)
    assert e.sched.admission.is_branch(branch)
    d = request("d", TOKENS[:33])
    e.admit(d)
    (meta,) = e.prefill(d)
    assert saved(meta, "d") == ["F0", "F1", "T1", "F2", "F3", "T3"]


def test_an_answer_stores_no_tails_but_at_its_end(engine):
    """Decoding: no tail at the answer's chunks (its turn end serves the next turn); an answer
    ending on a chunk boundary stores the tail there as its turn end, and the next turn hits it."""
    e = engine(interval=1000, answers=True, admission="branch")
    r = request("r", TOKENS[:20])
    e.admit(r)
    e.prefill(r)
    metas = e.decode(r, ANSWER[:21])  # computes 40 tokens
    assert r.num_computed_tokens == 40
    decoded = [n for m in metas for n in saved(m, "r")]
    assert decoded == ["F2", "F3", "F4"]  # chunks 2..4 complete while decoding, no tails
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r")) == (False, None)
    (turn,) = [s for s in e.step().saves if s.finished]
    assert [(o.kind, o.chunk) for o in turn.objects] == [(ObjectKind.TAIL, 4)]
    e.store.put(type("M", (), {"saves": [turn]})())
    e.step()  # sent with the last metadata, it may still be landing: the lookup waits a step (turn_end_landing)
    nxt = request("next", TOKENS[:20] + ANSWER[:20] + list(range(8000, 8010)))
    assert e.admit(nxt) == (40, True)


@pytest.mark.parametrize("answer, on_tail", [(3, True), (8, False)], ids=["after-its-tail", "past-a-boundary"])
def test_a_turn_end_after_a_stored_tail_holds_its_own_chunk_only(engine, answer, on_tail):
    """The window before a turn end at 22 (window 8) reaches into chunk 1: the request stored the
    tail at 16 (its prompt's end), so its turn object holds tokens 16..21 only (``on_tail``, keyed
    apart, its marker entry says so) and a hit loads that tail beside it. At 27 the answer crossed
    24, where no tail is stored: the turn object holds the whole window, as before."""
    e = engine(interval=1000, answers=True, admission="branch")
    r = request("r", TOKENS[:20])
    e.admit(r)
    (meta,) = e.prefill(r)
    assert [n for n in saved(meta, "r") if n[0] == "T"] == ["T1"]
    e.decode(r, ANSWER[:answer])
    end = r.num_computed_tokens
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r")) == (False, None)
    (save,) = [s for s in e.step().saves if s.finished]
    turn, mark = save.objects
    assert (turn.kind, turn.end, turn.on_tail, mark.kind, mark.on_tail) == (
        ObjectKind.TURN, end, on_tail, ObjectKind.TURNMARK, on_tail)
    assert e.lay.turn_needs_tail(turn.chunk, end)
    whole = TOKENS[:20] + ANSWER[:answer]
    prev, start = e.hashes(whole)[turn.chunk - 1], turn.chunk * e.lay.chunk_size
    assert turn.chunk_hash == ChunkHasher(e.ns).turn_digest(prev, whole, start, end, None, on_tail=on_tail) != \
        ChunkHasher(e.ns).turn_digest(prev, whole, start, end, None, on_tail=not on_tail)
    whole, part = e.lay.payload_bytes(ObjectKind.TURN, turn.chunk, 100, end), \
        e.lay.payload_bytes(ObjectKind.TURN, turn.chunk, 100, end, on_tail=True)
    assert part < whole


def test_a_branch_point_is_where_the_run_of_stored_chunks_ends():
    adm = Admission("branch", chunk_size=8, interval=32)
    hashes = [bytes([i]) * 32 for i in range(10)]
    assert adm.found_branch(hashes, 0, 7) == 7 and adm.is_branch(hashes[6])
    assert adm.found_branch(hashes, 4, 4) == 0  # the hit is at the run's end: nothing to learn
    assert not adm.is_branch(hashes[3])


def test_a_rule_that_is_not_known_is_refused():
    with pytest.raises(ValueError, match="tail admission 'sometimes'"):
        Admission("sometimes", 8, 16)


def test_turn_ends_under_a_first_chunk_whose_turn_ends_nobody_reads_are_sampled():
    """Single-turn traffic (RAG on one system prompt): after ``TURN_PROBE`` turn ends none of which
    was hit, one request in ``TURN_PROBE`` stores its turn end, then one in twice as many after
    each probe (up to ``TURN_PROBE_MAX``); one hit, and every request does again. Conversations on
    another system prompt are not affected."""
    adm = Admission("branch", 8, 16)
    adm.TURN_JUDGED_AFTER = 1  # each turn end judged at the next request (the test below: the wait)
    rag, chat = b"r" * 32, b"c" * 32
    probe, most = Admission.TURN_PROBE, Admission.TURN_PROBE_MAX
    assert all(adm.admits_turn_end(rag) for _ in range(probe))
    later = [adm.admits_turn_end(rag) for _ in range(probe + 2 * probe + 4 * probe + 3 * most)]
    at = [i + 1 for i, stored in enumerate(later) if stored]  # requests since the last probe, summed
    gaps = [b - a for a, b in zip([0] + at, at)]
    assert gaps == [probe, 2 * probe, 4 * probe] + [min(8 * probe * 2 ** i, most) for i in range(len(gaps) - 3)]
    assert gaps[-1] == most
    for _ in range(3 * probe):  # a chat: each next turn hits the turn end before it
        assert adm.admits_turn_end(chat)
        adm.turn_end_hit(chat)
    for _ in range(-(-(probe + sum(later)) // probe)):  # conversations begin on the RAG prompt: one in
        adm.turn_end_hit(rag)  # TURN_PROBE of the turn ends stored is read
    for _ in range(3 * probe):
        assert adm.admits_turn_end(rag)
        adm.turn_end_hit(rag)
    assert all(Admission("interval", 8, 16).admits_turn_end(rag) for _ in range(3 * probe))


def test_turn_ends_of_conversations_started_together_are_stored_until_their_next_turns_could_come():
    """Several conversations begin on one system prompt at once (a batch, users arriving together):
    none of their turn ends can be read before the others' turns finished, so each is stored; a
    turn end counts as unread only once ``TURN_JUDGED_AFTER`` requests finished after it. RAG on
    that prompt (nothing read) is sampled from then on."""
    adm = Admission("branch", 8, 16)
    system = b"s" * 32
    wait = Admission.TURN_JUDGED_AFTER
    assert wait > Admission.TURN_PROBE  # (else the rule below is the bare probe)
    assert all(adm.admits_turn_end(system) for _ in range(wait))  # e.g. 8 conversations' first turns
    for _ in range(wait):  # their next turns each hit the turn end before
        adm.turn_end_hit(system)
        assert adm.admits_turn_end(system)
    rag = b"r" * 32  # nothing read: the first TURN_PROBE judged decide, then probes
    first = [adm.admits_turn_end(rag) for _ in range(wait + Admission.TURN_PROBE + 8)]
    n = wait + Admission.TURN_PROBE - 1  # the TURN_PROBE-th judged one decides
    assert first[:n] == [True] * n and not first[n] and not all(first[n:])


def test_a_next_turn_that_would_have_hit_a_turn_end_not_stored_counts_as_a_hit(engine):
    """Turn ends under a first chunk are sampled once ``TURN_PROBE`` went unread; those not stored
    are remembered, and a next turn extending one (a miss) counts as a hit of turn ends there, so
    storing resumes as if it had hit. A prompt that extends none counts nothing."""
    assert Admission.TURN_PROBE == 2  # the counts below
    e = engine(interval=1000, answers=True, admission="branch")
    e.sched.admission.TURN_JUDGED_AFTER = 1  # each turn end judged at the next request

    def prompt(i):
        return TOKENS[:12] + list(range(5000 + 10 * i, 5006 + 10 * i))

    def finish(i):
        r = request(f"r{i}", prompt(i))
        e.admit(r)
        e.prefill(r)
        e.decode(r, ANSWER[:3])
        e.sched.request_finished(r, e.kvm.get_block_ids(f"r{i}"))
        return bool([o for s in e.step().saves if s.finished for o in s.objects])

    def next_turn(i):  # looked up only
        e.admit(request(f"next{i}", prompt(i) + ANSWER[:2] + list(range(7000 + 10 * i, 7006 + 10 * i))))

    # stored, hit, skipped since, gap: [2,0,0,2] [2,0,1,2] [3,0,0,4] [3,0,1,4]
    assert [finish(i) for i in range(5)] == [True, True, False, True, False]
    next_turn(2)  # would have hit r2's turn end: [3,1,1,4]
    e.admit(request("unrelated", prompt(9) + list(range(9000, 9006))))  # extends none: nothing counted
    assert not finish(5)  # 1 * 2 < 3, and no probe yet: [3,1,2,4]
    next_turn(4)  # [3,2,2,4]
    assert finish(6)  # 2 * 2 >= 3: stored
    next_turn(4)  # counted once: r4's is forgotten
    assert finish(7) and not finish(8)  # [5,2,0,2]: 4 < 5


@pytest.mark.parametrize("first, answer, new, tail_too", [(20, 3, 6, True), (16, 2, 2, False)],
                         ids=["in-a-later-chunk", "in-the-same-chunk"])
def test_a_turn_end_names_the_one_its_hit_read_as_superseded(engine, first, answer, new, tail_too):
    """Turn 2 hit turn 1's turn end (on_tail: with the tail at 16) and stored its own: its turn
    object names turn 1's as superseded (``ObjectRef.supersedes``: the store's eviction then ranks
    it as never used), with turn 1's tail where turn 2's turn end does not need that tail itself
    (same chunk: it is turn 2's tail too)."""
    e = engine(interval=1000, answers=True, admission="branch")
    r = request("r", TOKENS[:first])
    e.admit(r)
    e.prefill(r)
    e.decode(r, ANSWER[:answer])
    e.sched.request_finished(r, e.kvm.get_block_ids("r"))
    (save,) = [s for s in e.step().saves if s.finished]
    x = save.objects[0]
    assert x.kind is ObjectKind.TURN and x.on_tail and x.supersedes == ()  # turn 1 read no turn end
    e.step()  # the step after the one that carried it: a next turn's lookup no longer waits for it
    prompt = TOKENS[:first] + ANSWER[:answer] + [7] * new
    turn2 = request("t2", prompt)
    e.admit(turn2)
    e.sched.requests["t2"].turn = x  # what its lookup found (tests/test_turn_ends: found through the marker)
    e.prefill(turn2)
    e.decode(turn2, [5, 5, 5])
    e.sched.request_finished(turn2, e.kvm.get_block_ids("t2"))
    (save,) = [s for s in e.step().saves if s.finished]
    y = save.objects[0]
    assert y.kind is ObjectKind.TURN and y.end > x.end and (y.chunk > x.chunk) == tail_too
    tail = ObjectRef(ObjectKind.TAIL, x.chunk - 1, e.hashes(prompt)[x.chunk - 1])
    assert y.supersedes == ((tail, x) if tail_too else (x,))
    assert [(r.chunk_hash, r.end) for r in y.supersedes if r.kind is ObjectKind.TURN] == [(x.chunk_hash, x.end)]
