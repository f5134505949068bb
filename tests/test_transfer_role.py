"""Disaggregated prefill without an engine: what ``kv_role`` makes the scheduler half do
(``config.transfer_role``) and what a producer's promise makes a decode instance do
(``scheduler.promises``). End to end with two servers, a proxy and Redis: ``test_e2e_pd``.

Layout of ``tests.test_scheduler`` (chunk 8, block 4, window 8)."""

import time

import pytest

from lmcache_hma.config.transfer_role import TransferRole
from lmcache_hma.scheduler.promises import PromiseWaits, loadable_params, promise_of, read_promise
from lmcache_hma.core.keys import ChunkHasher
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef
from tests.test_scheduler import ANSWER, TOKENS, engine, names, request  # noqa: F401 - the fixture

PRODUCER, CONSUMER = TransferRole.of("kv_producer"), TransferRole.of("kv_consumer")


def test_roles_of_vllms_kv_role():
    assert TransferRole.of(None) == TransferRole.of("kv_both")
    both = TransferRole.of("kv_both")
    assert both.loads and both.stores_prompts and both.stores_answers and not both.prompt_turn_ends
    assert not PRODUCER.loads and PRODUCER.stores_prompts and PRODUCER.prompt_turn_ends
    assert CONSUMER.loads and not CONSUMER.stores and TransferRole.of("kv_consumer", True).stores_answers
    with pytest.raises(ValueError, match="kv_role 'kv_prefill'"):
        TransferRole.of("kv_prefill")


def test_kv_transfer_params_carry_the_loadable_tokens_and_nothing_else_is_read():
    req = request("r", TOKENS[:20])
    req.kv_transfer_params = loadable_params(19)
    assert read_promise(req).tokens == 19 and loadable_params(0) is None
    for params in (None, {}, {"lmcache_hma": 5}, {"lmcache_hma": {"loadable_tokens": "19"}},
                   {"lmcache_hma": {"loadable_tokens": True}}, {"do_remote_prefill": True}):
        req.kv_transfer_params = params
        assert read_promise(req).tokens == 0


@pytest.mark.parametrize("step_tokens", [None, 7], ids=["one-step", "chunked-prefill"])
def test_a_producer_never_looks_up_and_stores_its_prompt_to_l_minus_1(engine, step_tokens):
    """A prompt of 21 tokens: chunks 0 and 1 (with the tail where a repeat would hit, at 16), and a
    turn end at 20 (its last partial chunk, [16, 20), with the window before 20), gathered in the
    step that computes token 19; the answer's params promise 20 tokens to a decode instance."""
    e = engine(interval=16, role=PRODUCER)
    first = request("first", TOKENS[:21])
    e.admit(first)
    e.prefill(first)  # stored: the fake store now holds chunks 0 and 1
    r = request("r", TOKENS[:21])
    assert e.admit(r) == (0, False) and not e.store.asked  # never asked, whatever is stored
    metas = e.prefill(r, step_tokens)
    saves = [ref for m in metas for s in m.saves for ref in s.objects]
    hashes = e.hashes(TOKENS[:21])
    turn = ChunkHasher(e.ns).turn_digest(hashes[1], TOKENS[:21], 16, 20, None)
    assert ObjectRef(ObjectKind.TURN, 2, turn, 20) in saves
    assert ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 20) in saves
    last = metas[-1].saves[-1].objects  # with the step that reaches token 19
    assert last[-2:] == [ObjectRef(ObjectKind.TURN, 2, turn, 20), ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 20)]
    r.append_output_token_ids(ANSWER[0])
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r")) == (False, {"lmcache_hma": {"loadable_tokens": 20}})
    assert not e.sched.turn_saves_due  # no turn end at 21: nobody extends a prefill's one token


def test_a_producer_promises_the_chunk_boundary_where_l_minus_1_is_one(engine):
    e = engine(interval=16, role=PRODUCER)
    r = request("r", TOKENS[:17])  # L - 1 = 16: chunk 1's end, whose tail is stored
    e.admit(r)
    metas = e.prefill(r)
    assert not any(ref.kind is ObjectKind.TURN for m in metas for s in m.saves for ref in s.objects)
    assert "T1" in names([ref for m in metas for s in m.saves for ref in s.objects])
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r"))[1] == {"lmcache_hma": {"loadable_tokens": 16}}


def test_a_consumer_stores_nothing_unless_told_to_store_its_answers(engine):
    e = engine(interval=16, role=CONSUMER)
    r = request("r", TOKENS[:20])
    e.admit(r)
    metas = e.prefill(r) + e.decode(r, ANSWER[:25])
    assert not any(m.saves for m in metas)
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r")) == (False, None) and not e.sched.turn_saves_due

    e = engine(interval=16, role=TransferRole.of("kv_consumer", consumer_stores_answers=True))
    r = request("r2", TOKENS[:20])
    e.admit(r)
    metas = e.prefill(r) + e.decode(r, ANSWER[:25])
    stored = [ref for m in metas for s in m.saves for ref in s.objects]
    assert {ref.chunk for ref in stored} == {2, 3, 4}  # the chunks past the prompt's (16..20 is its)
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r2"))[0] is False and e.sched.turn_saves_due


def test_a_consumer_waits_for_what_its_producer_promised_at_most_a_lookup_timeout(engine, monkeypatch):
    """The producer's answer leaves as its step ends, maybe before its writer put the KV: the decode
    instance asks again next step while the store has less than promised, for a lookup timeout
    (2 s here) after arrival; it takes the hit as soon as the store has it."""
    e = engine(interval=8, role=CONSUMER)
    writer = engine(interval=8)
    w = request("w", TOKENS[:17])
    writer.admit(w)
    for m in writer.prefill(w):
        e.store.put(m)  # what the producer stored so far: chunks 0 and 1 with their tails

    def ask(req_id, promised, ago=0.0):
        r = request(req_id, TOKENS[:25])
        r.kv_transfer_params = loadable_params(promised)
        r.arrival_time = time.time() - ago
        return e.sched.get_num_new_matched_tokens(r, 0)

    assert ask("r", 24) == (None, False)  # 24 promised, 16 stored: asked again next step
    assert ask("r2", 16)[0] == 16  # what was promised is there: taken at once
    assert ask("late", 24, ago=3)[0] == 16  # past the lookup timeout: it computes the rest
    assert ask("plain", 0)[0] == 16  # no promise (a kv_both client, a plain proxy): never waits
    monkeypatch.setattr(PromiseWaits, "PROMISE_WAIT_S", 1.0)  # a cap shorter than this lookup timeout
    assert ask("gone", 24, ago=1.5)[0] == 16  # within the lookup timeout, past PROMISE_WAIT_S: not waited for
    assert e.sched.promises.take_not_kept() == 2  # "late" and "gone"
    local = request("local", TOKENS[:25])  # vLLM's own cache holds what was promised: nothing to wait for
    local.kv_transfer_params = loadable_params(24)
    assert e.sched.get_num_new_matched_tokens(local, 24) == (0, False)


def consumer_with_chunks_0_and_1_stored(engine, role=CONSUMER):
    e = engine(interval=8, role=role)
    writer = engine(interval=8)
    w = request("w", TOKENS[:17])
    writer.admit(w)
    for m in writer.prefill(w):
        e.store.put(m)
    return e


def ask(e, req_id, params, tokens=25):
    r = request(req_id, TOKENS[:tokens])
    r.kv_transfer_params = params
    return e.sched.get_num_new_matched_tokens(r, 0)


def test_only_a_decode_instance_honours_a_promise(engine):
    """``kv_transfer_params`` are whatever the client sent: on a kv_both server a promise of
    tokens nobody stored made every such request wait a second and look up again every step."""
    e = consumer_with_chunks_0_and_1_stored(engine, role=TransferRole.of("kv_both"))
    assert ask(e, "r", loadable_params(24))[0] == 16  # waited (None) before
    assert e.sched.promises.take_not_kept() == 0  # no promise to keep
    r = request("cap", TOKENS[:25])
    r.kv_transfer_params = loadable_params(10**9, 16)
    assert promise_of(r, TransferRole.of("kv_both")).tokens == 0
    assert (promise_of(r, CONSUMER).tokens, promise_of(r, CONSUMER).stored_from) == (24, 16)  # the prompt less one


def test_a_promise_whose_prefix_the_producer_did_not_store_is_not_waited_for(engine):
    """The producer took tokens [0, 16) from vLLM's own prefix cache and stored [16, 24) itself
    (``stored_from``). Where the store lacks that prefix (evicted), no wait brings it: the decode
    instance computes at once, and the promise is counted as not kept. Where the prefix is
    there, the rest is on its way: it waits."""
    e = engine(interval=8, role=CONSUMER)  # an empty store: the prefix was evicted
    assert ask(e, "gap", loadable_params(24, 16)) == (0, False)  # waited PROMISE_WAIT_S before
    assert e.sched.promises.take_not_kept() == 1
    e = consumer_with_chunks_0_and_1_stored(engine)
    assert ask(e, "on-its-way", loadable_params(24, 16)) == (None, False)
    assert e.sched.promises.take_not_kept() == 0


def test_a_producer_says_which_tokens_it_stored_itself(engine):
    """A prompt whose first two chunks vLLM's own prefix cache held on the producer: its promise
    names where its own stores begin."""
    e = engine(interval=8, role=PRODUCER)
    r = request("r", TOKENS[:25])
    e.admit(r, local=16)
    e.prefill(r)
    assert e.sched.request_finished(r, e.kvm.get_block_ids("r"))[1] == {
        "lmcache_hma": {"loadable_tokens": 24, "stored_from": 16}}


def test_a_promise_not_kept_is_a_metric():
    from lmcache_hma.metrics import METRICS, SchedulerStats

    stats = SchedulerStats()
    stats.on_promises_not_kept(0)
    assert stats.collect() is None
    stats.on_promises_not_kept(2)
    assert stats.collect().counters == {"promises_not_kept": 2} and METRICS["promises_not_kept"][0] == "counter"
    assert PromiseWaits(8, 2.0).take_not_kept() == 0


@pytest.mark.parametrize("value, skips", [(True, True), (False, False), ("true", True), ("false", False),
                                          (" False ", False), ("yes", False), (0, False), (1, False), (None, False)])
def test_skip_save_is_a_boolean_never_a_truthy_string(value, skips):
    """``"lmcache.skip_save": "false"`` (a JSON client's string) must store; anything but true or
    false stores, with a warning (it read as true before)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from lmcache_hma.scheduler.vllm_fields import skips_save

    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"lmcache.skip_save": value}})
    assert skips_save(Request("r", [1, 2, 3], params, None)) is skips
