"""``SchedulerHalf`` planning: real vLLM ``Request`` objects, a real lookup server, no engine.

The worker's side of each lookup is ``Store``: the sets of full and tail digests the saves
planned so far put there, answered with ``core.hit_rule.longest_hit`` (the rule the worker
applies), ``held`` chosen by the test. ``Engine`` plays what vLLM 0.32's scheduler does
around the connector (``vllm/v1/core/sched/scheduler.py``): for a request without computed
tokens, the local hit, then ``get_num_new_matched_tokens``, allocation,
``update_state_after_alloc``; ``num_computed_tokens`` set to local + external when the
request is scheduled (at once for a synchronous load, once its asynchronous load is done);
``build_connector_meta`` at the end of ``schedule()``, then ``num_computed_tokens`` advanced
by the step's tokens; 0 after a preemption or a failed load.

Layout: ``fakes.layout()`` (two sliding groups, one full group; block 4, window 8,
chunk 8). Objects are written ``F<chunk>`` (full) and ``T<chunk>`` (tail at the chunk's end).
"""

import uuid
from types import SimpleNamespace

import pytest
import torch

from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.hit_rule import longest_hit
from lmcache_hma.core.lookup_wire import Found
from lmcache_hma.core.lookup_wire import socket_address
from lmcache_hma.worker.lookup_server import LookupServer
from lmcache_hma.core.metadata import HMAConnectorMetadata, hit_objects
from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.scheduler.scheduler_half import SchedulerHalf
from tests.engines import write_yaml
from tests.fakes import layout

CHUNK, BLOCK = 8, 4
TOKENS = list(range(1000, 1060))  # a shared prefix source
OTHER = list(range(2000, 2060))  # tokens that make a different continuation


def request(req_id, tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, list(tokens), SamplingParams(max_tokens=1), None)


class Store:
    """The worker's answer: longest hit over what was stored; held when the test says so."""

    def __init__(self):
        self.full: set[bytes] = set()
        self.tail: set[bytes] = set()
        self.held = False
        self.tier_of: dict[bytes, str] = {}  # the tier a chunk's objects are said to be in (else "cpu")
        self.asked: list[tuple[str, int, list[bytes]]] = []  # (req_id, first, hashes)
        self.settled: list[bool] = []  # per lookup: asked to let the stores under way land first

    def answer(self, req_id, lookup, first, hashes, deadline=None, **turns):
        self.asked.append((req_id, first, list(hashes)))
        self.settled.append(bool(turns.get("settle")))
        n = longest_hit([h in self.full for h in hashes], [h in self.tail for h in hashes])
        run = longest_hit([h in self.full for h in hashes], None)
        return Found(n, self.held and n > 0, tuple(self.tier_of.get(h, "cpu") for h in hashes[:n]), run=run)

    def put(self, meta: HMAConnectorMetadata) -> None:
        for save in meta.saves:
            for ref in save.objects:
                if ref.kind in (ObjectKind.FULL, ObjectKind.TAIL):  # turn ends: test_turn_ends
                    {ObjectKind.FULL: self.full, ObjectKind.TAIL: self.tail}[ref.kind].add(ref.chunk_hash)


class Blocks:
    """vLLM's ``KVCacheBlocks`` as ``update_state_after_alloc`` reads it."""

    def __init__(self, table):
        self._table = table

    def get_block_ids(self):
        return self._table


class KVCacheManager:
    """vLLM's ``KVCacheManager`` as the connector reads it: ``get_block_ids(req_id)``.

    Every request gets its own (nonzero, never reused) block ids, one list per group."""

    def __init__(self, lay):
        self.lay = lay
        self.tables: dict[str, tuple[list[int], ...]] = {}
        self._next = 1

    def allocate(self, req_id, num_tokens):
        table = self.tables.setdefault(req_id, tuple([] for _ in self.lay.groups))
        for g, blocks in zip(self.lay.groups, table):
            while len(blocks) * g.block_size < num_tokens:
                blocks.append(self._next)
                self._next += 1
        return table

    def free(self, req_id):
        self.tables.pop(req_id, None)

    def get_block_ids(self, req_id):
        return self.tables[req_id]


class Engine:
    def __init__(self, tmp_path, interval=None, answers=None, role=None, admission="interval"):
        """``role``: a ``config.transfer_role.TransferRole`` (kv_both when None). ``admission``:
        hma_tail_admission; these tests plan with ``interval`` (a tail at every interval and answer
        chunk: the bookkeeping they check is the same under either rule), tests/test_admission.py
        with ``branch``."""
        extra = {"hma_lookup_timeout_s": 2.0, "hma_tail_admission": admission}
        if interval:
            extra["hma_checkpoint_interval"] = interval
        if answers is not None:
            extra["hma_store_answers"] = answers
        path = write_yaml(tmp_path / f"s-{uuid.uuid4().hex}.yaml", chunk_size=CHUNK, local_cpu=True,
                          max_local_cpu_size=0.01, extra_config=extra)
        self.config = load_config({"lmcache_config_file": str(path)})
        self.lay = layout()
        assert self.lay.chunk_size == CHUNK and self.lay.groups[0].block_size == BLOCK
        self.ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=self.lay,
                            kv_layout="LBHNC/test", world_size=1, rank=0)
        engine_id = f"test-{uuid.uuid4().hex}"
        self.store = Store()
        self.server = LookupServer(socket_address(engine_id), self.store.answer)
        self.sched = SchedulerHalf(self.config, self.lay, self.ns, engine_id, **({"role": role} if role else {}))
        self.kvm = KVCacheManager(self.lay)
        self.sched.bind_kv_cache_manager(self.kvm)
        self.hit_of: dict[str, int] = {}  # local + external of the last admission

    def close(self):
        self.sched.shutdown()
        self.server.close()

    def hashes(self, tokens):
        return ChunkHasher(self.ns).chunk_hashes(tokens, len(tokens) // CHUNK)

    def admit(self, req, local=0, take=True):
        """A waiting request with no computed tokens is scheduled (vLLM's order of calls).

        ``local``: vLLM's own (block-aligned) prefix hit. ``take=False``: vLLM allocates
        without the connector's tokens (e.g. a longer local hit won). Returns what
        ``get_num_new_matched_tokens`` returned."""
        assert req.num_computed_tokens == 0
        ext, load_async = self.sched.get_num_new_matched_tokens(req, local)
        num_ext = ext if take else 0
        table = self.kvm.allocate(req.request_id, req.num_tokens if not load_async else local + num_ext)
        self.sched.update_state_after_alloc(req, Blocks(table), num_ext)
        self.hit_of[req.request_id] = local + num_ext
        if not (load_async and num_ext):
            req.num_computed_tokens = local + num_ext  # scheduled in this very step
        return ext, load_async

    def loaded(self, req):
        """The asynchronous load finished: vLLM schedules the request from its hit."""
        req.num_computed_tokens = self.hit_of[req.request_id]

    def step(self, scheduled=None, store=True):
        """One engine step: ``scheduled`` maps request to its number of new tokens."""
        scheduled = scheduled or {}
        for req, n in scheduled.items():
            self.kvm.allocate(req.request_id, req.num_computed_tokens + n)
        meta = self.sched.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens={r.request_id: n for r, n in scheduled.items()}))
        for req, n in scheduled.items():
            req.num_computed_tokens += n  # vLLM's _update_after_schedule
        if store:
            self.store.put(meta)
        return meta

    def prefill(self, req, step_tokens=None, store=True):
        """Compute the rest of the prompt in steps; returns the metadata of each step."""
        metas = []
        while req.num_computed_tokens < req.num_prompt_tokens:
            n = min(step_tokens or req.num_prompt_tokens, req.num_prompt_tokens - req.num_computed_tokens)
            metas.append(self.step({req: n}, store=store))
        return metas

    def decode(self, req, outputs):
        """Decode steps: each computes the last sampled token, then the next one is sampled
        (``outputs`` in turn; the first was sampled by the prefill). Returns each step's metadata."""
        metas = []
        req.append_output_token_ids(outputs[0])
        for token in outputs[1:]:
            metas.append(self.step({req: 1}))
            req.append_output_token_ids(token)
        return metas

    def preempt(self, req):
        self.kvm.free(req.request_id)
        req.num_computed_tokens = 0


@pytest.fixture
def engine(tmp_path):
    engines = []

    def make(interval=None, answers=None, role=None, admission="interval"):
        engines.append(Engine(tmp_path, interval, answers, role, admission))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def names(objects):
    letter = {ObjectKind.FULL: "F", ObjectKind.TAIL: "T"}
    return [f"{letter[r.kind]}{r.chunk}" for r in objects]


def saved(meta, req_id):
    """Names of what ``meta`` saves for ``req_id``; checks digests and the block table."""
    specs = [s for s in meta.saves if s.req_id == req_id]
    assert len(specs) <= 1
    return names(specs[0].objects) if specs else []


def check_refs(objects, hashes):
    for ref in objects:
        assert ref.chunk_hash == hashes[ref.chunk], f"{names([ref])} has the wrong digest"


def check_saves(e, meta):
    for spec in meta.saves:
        assert spec.block_table is e.kvm.tables[spec.req_id]  # the manager's table of that request
        check_refs(spec.objects, e.sched.requests[spec.req_id].hashes)


# chunked prefill ------------------------------------------------------------------------

# 45 tokens, interval 16: tails at 16 and 32 (interval), 40 (the repeat's hit, (45-1)//8*8,
# and the last full chunk); chunk 5 (tokens 40..44) is not full: never stored.
P45_ALL = ["F0", "F1", "T1", "F2", "F3", "T3", "F4", "T4"]


@pytest.mark.parametrize("step_tokens", [1, 5, 8, 12, 16, 45])
def test_chunked_prefill_saves_each_object_once_in_the_step_that_completes_it(engine, step_tokens):
    e = engine(interval=16)
    req = request("r", TOKENS[:45])
    assert e.admit(req) == (0, False)
    assert e.store.asked == [("r", 0, e.hashes(TOKENS[:40]))]  # chunks 0..4: a hit leaves a token
    assert e.sched.requests["r"].hashes == e.hashes(TOKENS[:45])
    everything = []
    while req.num_computed_tokens < 45:
        before = req.num_computed_tokens
        n = min(step_tokens, 45 - before)
        meta = e.step({req: n})
        check_saves(e, meta)
        want = [o for o in P45_ALL if before < (int(o[1:]) + 1) * CHUNK <= before + n]
        assert saved(meta, "r") == want, (before, n)
        assert meta.loads == [] and meta.released == []
        everything += saved(meta, "r")
    assert everything == P45_ALL  # each once
    for _ in range(3):  # decode steps store nothing
        assert e.step({req: 1}).saves == []


# a local hit that is not chunk-aligned -------------------------------------------------

def test_local_hit_inside_a_chunk(engine):
    e = engine()  # interval 8 (the window rounded up to a chunk): a tail at every chunk
    assert e.sched.checkpoint_interval == 8
    # vLLM has tokens 0..11 locally (3 blocks: chunk 0 and half of chunk 1); the store is empty.
    a = request("a", TOKENS[:41])
    assert e.admit(a, local=12) == (0, False)
    assert e.store.asked == [("a", 1, e.hashes(TOKENS[:40])[1:5])]  # from the chunk holding 12
    (meta,) = e.prefill(a)
    check_saves(e, meta)
    # Chunk 0 came from vLLM's cache (someone else computed and stored it); chunk 1 ends
    # after the local hit: its blocks 2 (local) and 3 (computed now) are all present.
    assert saved(meta, "a") == ["F1", "T1", "F2", "T2", "F3", "T3", "F4", "T4"]

    # The same 40 tokens then another 10, with the same local hit: the store has chunks 1..4.
    tokens = TOKENS[:40] + OTHER[:10]
    b = request("b", tokens)
    hs = e.hashes(tokens)
    ext, load_async = e.admit(b, local=12)
    assert e.store.asked[-1] == ("b", 1, hs[1:6])
    assert (ext, load_async) == (40 - 12, True)  # hit at 40 (chunk 5 differs)
    meta = e.step()  # b waits for its load this step
    (load,) = meta.loads
    assert (load.req_id, load.start, load.end, load.sync) == ("b", 12, 40, False)
    assert load.objects == hit_objects(1, hs[1:5], True)
    assert names(load.objects) == ["F1", "F2", "F3", "F4", "T4"]
    assert load.block_table is e.kvm.tables["b"]
    assert meta.saves == []
    e.loaded(b)
    (meta,) = e.prefill(b)
    check_saves(e, meta)
    assert saved(meta, "b") == ["F5", "T5"]  # nothing before the hit is saved again


# a prompt that fills its last chunk -----------------------------------------------------

def test_prompt_of_whole_chunks_stores_the_tails_its_repeat_and_extensions_hit(engine):
    e = engine(interval=16)
    assert e.sched.checkpoint_interval == 16
    a = request("a", TOKENS[:32])
    e.admit(a)
    assert e.store.asked[-1] == ("a", 0, e.hashes(TOKENS[:24]))  # 24: a hit leaves a token
    (meta,) = e.prefill(a)
    # Tails: 16 (interval), 24 (where a repeat hits: one chunk short of the end), 32
    # (interval, and the last full chunk, where a longer prompt extending it hits).
    assert saved(meta, "a") == ["F0", "F1", "T1", "F2", "T2", "F3", "T3"]
    assert [e.sched.saves.wants_tail(c, b"", 32) for c in range(4)] == [False, True, True, True]
    assert [e.sched.saves.wants_tail(c, b"", 33) for c in range(4)] == [False, True, False, True]

    repeat = request("repeat", TOKENS[:32])
    assert e.admit(repeat) == (24, True)  # T2 makes it 24 instead of 16
    (load,) = e.step().loads
    assert names(load.objects) == ["F0", "F1", "F2", "T2"] and (load.start, load.end) == (0, 24)

    longer = request("longer", TOKENS[:41])
    assert e.admit(longer) == (32, True)  # T3 at the last full chunk
    (load,) = e.step().loads
    assert names(load.objects) == ["F0", "F1", "F2", "F3", "T3"] and load.end == 32
    e.loaded(longer)
    (meta,) = e.prefill(longer)
    assert saved(meta, "longer") == ["F4", "T4"]


# held answers -----------------------------------------------------------------------------

def test_held_hits_load_synchronously_and_unused_holds_are_released(engine):
    e = engine()
    e.admit(first := request("first", TOKENS[:41]))
    e.prefill(first)  # the store now has F0..F4, T0..T4

    e.store.held = True
    a = request("a", TOKENS[:41])
    assert e.admit(a) == (40, False)  # held: vLLM computes the request in this very step
    assert a.num_computed_tokens == 40
    meta = e.step({a: 1})
    (load,) = meta.loads
    assert (load.req_id, load.start, load.end, load.sync) == ("a", 0, 40, True)
    assert meta.saves == [] and meta.released == []  # a taken hold is released by its load

    e.store.held = False
    b = request("b", TOKENS[:41])
    assert e.admit(b) == (40, True)  # not held: the request waits a step for its fetch
    assert b.num_computed_tokens == 0
    (load,) = e.step().loads
    assert (load.req_id, load.sync) == ("b", False)

    e.store.held = True
    c = request("c", TOKENS[:41])
    assert e.admit(c, take=False) == (40, False)  # vLLM does not take the hit
    meta = e.step()
    assert meta.loads == [] and [r for r, _ in meta.released] == ["c"]

    d = request("d", TOKENS[:41])
    assert e.sched.get_num_new_matched_tokens(d, 0) == (40, False)
    assert e.sched.request_finished(d) == (False, None)  # e.g. aborted before allocation
    assert "d" not in e.sched.requests
    meta = e.step()
    assert meta.loads == [] and [r for r, _ in meta.released] == ["d"]
    assert e.step().released == []  # once


# a failed load ------------------------------------------------------------------------------

def test_failed_load_is_recomputed_without_a_second_hit_and_stored_again(engine):
    e = engine()
    e.admit(first := request("first", TOKENS[:41]))
    e.prefill(first)
    stored = len(e.store.full) + len(e.store.tail)

    r = request("r", TOKENS[:41])
    assert e.admit(r) == (40, True)
    assert [ld.req_id for ld in e.step().loads] == ["r"]
    e.sched.on_failed_loads({"r"})  # the worker reported failed_recving
    e.preempt(r)  # vLLM: num_computed_tokens = 0, blocks freed, the request waits again
    asked = len(e.store.asked)
    assert e.admit(r) == (0, False)
    assert len(e.store.asked) == asked  # not even asked
    metas = e.prefill(r, step_tokens=16)
    assert all(m.loads == [] for m in metas)
    for m in metas:
        check_saves(e, m)
    assert [saved(m, "r") for m in metas] == [
        ["F0", "T0", "F1", "T1"], ["F2", "T2", "F3", "T3"], ["F4", "T4"]]
    assert len(e.store.full) + len(e.store.tail) == stored  # the same objects, stored again


# preemption -------------------------------------------------------------------------------

def test_preempted_request_is_looked_up_again_consistently_without_duplicate_saves(engine):
    e = engine()
    r = request("r", TOKENS[:41])
    e.admit(r)
    first_ask = e.store.asked[-1]
    assert saved(e.step({r: 12}), "r") == ["F0", "T0"]
    assert saved(e.step({r: 8}), "r") == ["F1", "T1"]
    e.preempt(r)

    assert e.admit(r) == (16, True)  # what the first two steps stored
    assert e.store.asked[-1] == first_ask  # the same question
    (load,) = e.step().loads
    assert names(load.objects) == ["F0", "F1", "T1"] and (load.start, load.end) == (0, 16)
    e.loaded(r)
    metas = e.prefill(r, step_tokens=10)
    assert [saved(m, "r") for m in metas] == [["F2", "T2"], ["F3", "T3"], ["F4", "T4"]]


def test_preempted_before_its_saves_landed_does_not_save_them_twice(engine):
    """The writer stores off the step: a lookup right after a preemption may miss what the
    request's earlier steps saved; the recompute must not plan those saves again."""
    e = engine()
    r = request("r", TOKENS[:41])
    e.admit(r)
    assert saved(e.step({r: 20}, store=False), "r") == ["F0", "T0", "F1", "T1"]
    e.preempt(r)
    assert e.admit(r) == (0, False)
    metas = e.prefill(r, step_tokens=12)
    assert [saved(m, "r") for m in metas] == [[], ["F2", "T2"], ["F3", "T3"], ["F4", "T4"]]


def test_preempted_after_decoding_hits_its_whole_prompt(engine):
    e = engine(interval=16)
    r = request("r", TOKENS[:32])
    e.admit(r)
    e.prefill(r)
    r.append_output_token_ids(7)  # the first generated token; the request decodes it next
    assert e.step({r: 1}).saves == []
    e.preempt(r)
    # 33 tokens now: the whole prompt (32, tail T3 at the last full chunk) is a hit.
    assert e.admit(r) == (32, True)
    assert e.store.asked[-1] == ("r", 0, e.hashes(TOKENS[:32]))
    (load,) = e.step().loads
    assert names(load.objects) == ["F0", "F1", "F2", "F3", "T3"]
    e.loaded(r)
    assert e.step({r: 1}).saves == []  # only the generated token is computed


# two requests with one prefix in one step ------------------------------------------------

def test_two_requests_with_one_prefix_in_one_step(engine):
    e = engine(interval=16)
    a = request("a", TOKENS[:30])
    b = request("b", TOKENS[:24] + OTHER[:17])
    assert e.admit(a) == (0, False) and e.admit(b) == (0, False)
    meta = e.step({a: 30, b: 41})
    check_saves(e, meta)
    assert saved(meta, "a") == ["F0", "F1", "T1", "F2", "T2"]  # 30 tokens: 24 is repeat and last full
    assert saved(meta, "b") == ["F0", "F1", "T1", "F2", "F3", "T3", "F4", "T4"]  # 41: 32, then 40
    ha, hb = e.sched.requests["a"].hashes, e.sched.requests["b"].hashes
    assert ha == hb[:3] and ha == e.hashes(TOKENS[:24])  # one prefix, one digest chain
    tables = {s.req_id: s.block_table for s in meta.saves}
    assert set(tables["a"][0]).isdisjoint(tables["b"][0])  # each from its own blocks

    # Two more with that prefix, one step: one held (computes now), one fetched.
    c = request("c", TOKENS[:24] + OTHER[30:41])
    d = request("d", TOKENS[:24] + OTHER[40:46])
    e.store.held = True
    assert e.admit(c) == (24, False)
    e.store.held = False
    assert e.admit(d) == (24, True)
    meta = e.step({c: 11})
    assert [(ld.req_id, ld.start, ld.end, ld.sync) for ld in meta.loads] == [
        ("c", 0, 24, True), ("d", 0, 24, False)]
    for ld in meta.loads:
        assert names(ld.objects) == ["F0", "F1", "F2", "T2"]
        check_refs(ld.objects, ha)
        assert ld.block_table is e.kvm.tables[ld.req_id]
    assert saved(meta, "c") == ["F3", "T3"] and saved(meta, "d") == []
    e.loaded(d)
    assert e.step({d: 6}).saves == []  # 30 tokens: nothing after its hit is a full chunk


def test_logged_bytes_to_load_count_the_rows_the_worker_copies(engine):
    """``_bytes_by_kind`` counts blocks without building rows; it must agree with
    ``plan_rows`` (what the worker copies) for any table with null blocks and any start."""
    import random

    from lmcache_hma.core.layout import plan_rows

    e = engine()
    rng = random.Random(0)
    hs = e.hashes(TOKENS[:48])
    for _ in range(200):
        first, end = sorted(rng.sample(range(0, 7), 2))
        start = first * CHUNK + rng.choice([0, BLOCK])
        table = tuple([0 if rng.random() < 0.3 else rng.randrange(1, 99) for _ in range(14)]
                      for _ in e.lay.groups)
        objects = hit_objects(first, hs[first:end], True)
        want = {"full_attention": 0, "sliding_window": 0, "recurrent_state": 0}
        for ref in objects:
            rows = plan_rows(e.lay, e.lay.segments(ref.kind, ref.chunk), table, start)
            for layer in rows.layer_indices:
                g = e.lay.group_of_layer[layer]
                want[g.kind.value] += g.page_bytes
        assert e.sched._bytes_by_kind(objects, table, start) == want


def test_new_blocks_of_a_step_are_every_block_vllm_allocated_in_it():
    """What the worker's gathers must not still be reading when the step writes KV."""
    from dataclasses import replace

    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from lmcache_hma.scheduler.vllm_fields import new_blocks

    cached = replace(CachedRequestData.make_empty(), req_ids=["b", "c"], new_block_ids=[([7], [8, 9]), None])
    out = SchedulerOutput(
        scheduled_new_reqs=[SimpleNamespace(block_ids=([1, 2], [0, 3]))], scheduled_cached_reqs=cached,
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
        new_block_ids_to_zero=[11], kv_cache_block_copies=[KVCacheBlockCopy(src_block_id=4, dst_block_id=12)])
    assert new_blocks(out) == {0, 1, 2, 3, 7, 8, 9, 11, 12}
    assert new_blocks(SimpleNamespace(num_scheduled_tokens={})) is None  # not said: the worker assumes any


# hits by tier ------------------------------------------------------------------------------

def test_a_hit_is_split_by_the_tier_of_each_chunk_for_vllms_metrics(engine):
    """``get_external_cache_hit_sources``: vLLM's ``prompt_tokens_cached_by_source`` gets every
    connector hit token under the tier its chunk came from, and the counts sum to the hit."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from lmcache_hma.vllm_compat import hit_sources

    e = engine()
    e.admit(first := request("first", TOKENS[:41]))
    e.prefill(first)  # chunks 0..4 stored
    hashes = e.hashes(TOKENS[:40])
    e.store.tier_of = {hashes[2]: "disk", hashes[3]: "disk", hashes[4]: "redis"}
    req = request("r", TOKENS[:41])
    assert e.admit(req, local=8) == (32, True)  # chunk 0 is vLLM's own local hit
    by_tier = e.sched.hit_tokens_by_tier(req, 32)
    assert by_tier == {"cpu": 8, "disk": 16, "redis": 8}
    assert hit_sources(by_tier) == {CacheHitSource.HOST: 8, CacheHitSource.DISK: 16, CacheHitSource.P2P: 8}
    assert e.sched.hit_tokens_by_tier(req, 0) == {}


# answers: chunks completed by decode steps -------------------------------------------------

ANSWER = list(range(3000, 3040))  # the tokens a request generates


def test_decode_steps_store_each_answer_chunk_with_a_tail_and_the_next_turn_hits_it(engine):
    e = engine(interval=16)
    r = request("r", TOKENS[:20])
    e.admit(r)
    assert saved(e.prefill(r)[0], "r") == ["F0", "F1", "T1"]  # 16: interval, repeat hit, last full
    metas = e.decode(r, ANSWER[:21])  # computes positions 20..39
    stored = {20 + i: saved(m, "r") for i, m in enumerate(metas) if m.saves}
    # Each answer chunk in the decode step that completes it (its last position), with a tail:
    # 24 and 40 are off the checkpoint interval, but the next turn hits at the answer's end.
    assert stored == {23: ["F2", "T2"], 31: ["F3", "T3"], 39: ["F4", "T4"]}
    whole = TOKENS[:20] + ANSWER[:20]
    for m in metas:
        check_saves(e, m)
        for spec in m.saves:  # the keys of prompt and answer hashed as one prompt
            check_refs(spec.objects, e.hashes(whole))
    assert e.sched.requests["r"].hashes == e.hashes(whole)

    turn2 = request("turn2", whole + OTHER[:5])  # the conversation so far and a new message
    assert e.admit(turn2) == (40, True)  # through the answer, not only the prompt's 16
    (load,) = e.step().loads
    assert names(load.objects) == ["F0", "F1", "F2", "F3", "F4", "T4"]
    check_refs(load.objects, e.hashes(whole))


def test_answers_are_not_stored_with_the_key_off(engine):
    e = engine(interval=16, answers=False)
    r = request("r", TOKENS[:20])
    e.admit(r)
    assert saved(e.prefill(r)[0], "r") == ["F0", "F1", "T1"]
    assert all(m.saves == [] for m in e.decode(r, ANSWER[:21]))
    assert e.sched.requests["r"].hashes == e.hashes(TOKENS[:16])  # the prompt's chunks only
    turn2 = request("turn2", TOKENS[:20] + ANSWER[:20] + OTHER[:5])
    assert e.admit(turn2) == (16, True)  # the prompt's stored chunks: no answer hit


@pytest.mark.parametrize("answers", [True, False])
def test_a_streaming_session_growing_its_prompt_extends_the_keys(engine, answers):
    """vLLM's streaming input (``Scheduler._update_request_as_session``): the session keeps its
    computed output, drops the last sampled token, and its prompt grows by the new input after
    the connector hashed it; steps then complete chunks past the keys hashed so far."""
    e = engine(interval=16, answers=answers)
    r = request("r", TOKENS[:12])
    r.resumable = True
    e.admit(r)
    assert e.sched.requests["r"].hashes == e.hashes(TOKENS[:8])
    e.prefill(r)
    e.decode(r, ANSWER[:3])  # computes positions 12, 13; ANSWER[2] is sampled, never computed
    # the session update, as vLLM makes it
    kept = list(r.all_token_ids[12:14])
    del r._all_token_ids[14:]
    r._output_token_ids.clear()
    r.prompt_token_ids.extend(kept)
    r._all_token_ids.extend(OTHER[:20])
    r.prompt_token_ids.extend(OTHER[:20])
    r.num_prompt_tokens = len(r.prompt_token_ids)
    assert r.num_prompt_tokens == 34
    metas = e.prefill(r, step_tokens=7)  # the new input
    everything = [o for m in metas for o in saved(m, "r")]
    assert everything == ["F1", "T1", "F2", "F3", "T3"]  # 16: interval; 32: also last full, repeat hit
    for m in metas:
        check_refs([ref for spec in m.saves for ref in spec.objects], e.hashes(list(r.all_token_ids)))


def test_under_speculative_decoding_an_answer_chunk_is_stored_once_the_token_after_it_is(engine):
    """With a lookahead (EAGLE) a chunk's key covers the token after it (the draft's KV of its
    last position was computed from it): an answer's chunk is stored in the step after the one
    that computed its last position, when that token was accepted and the chunk's KV, the
    draft's included, is final."""
    e = engine(interval=16)
    e.sched.lookahead = 1  # as the connector builds it for EAGLE
    r = request("r", TOKENS[:20])
    e.admit(r)
    assert saved(e.prefill(r)[0], "r") == ["F0", "F1", "T1"]  # each followed by a prompt token
    metas = e.decode(r, ANSWER[:21])  # steps computing positions 20..39
    stored = {20 + i: saved(m, "r") for i, m in enumerate(metas) if m.saves}
    assert stored == {24: ["F2", "T2"], 32: ["F3", "T3"]}  # chunk 2 ends at 23, its next token is 24
    whole = list(r.all_token_ids)
    assert e.sched.requests["r"].hashes == ChunkHasher(e.ns).chunk_hashes(whole, 4, lookahead=1)
    for m in metas:
        check_refs([ref for spec in m.saves for ref in spec.objects], e.sched.requests["r"].hashes)


def test_a_chain_continued_from_its_last_digest_equals_one_hashed_at_once(engine):
    e = engine()
    h = ChunkHasher(e.ns)
    extra = [None, ("lora", "a", "d"), (("cache_salt", "x"),), None, None, None, None]
    for lookahead in (0, 1):
        n = (len(TOKENS) - lookahead) // CHUNK
        once = h.chunk_hashes(TOKENS, n, extra[:n], lookahead)
        grown = h.continue_hashes(None, TOKENS, 0, 2, extra[:2], lookahead)
        grown += h.continue_hashes(grown[-1], TOKENS, 2, n, extra[2:n], lookahead)
        assert grown == once
    with pytest.raises(ValueError):
        h.continue_hashes(None, TOKENS, 2, 3)  # chunk 2 needs chunk 1's digest
