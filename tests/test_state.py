"""Recurrent-state groups (gated delta net) without an engine: layout, keys, copies, planning.

vLLM 0.32 on CPU registers a GDN layer as a raw int8 tensor ``(num_blocks, 1, 1, state_bytes)``
whose block stride is the padded page, over the same buffer as the attention layers
(``layouts`` below builds exactly that); a state after ``h`` tokens sits in block
``(h - 1) // block_size`` of each state group, and vLLM names the block it hands off
(``boundary_state_offloads``).
"""

import re
import uuid
from types import SimpleNamespace

import pytest
import torch

from lmcache_hma.config.settings import load_config
from lmcache_hma.core.keys import ChunkHasher, Namespace
from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout, LayoutError, Segment
from lmcache_hma.core.vllm_layout import layout_from_kv_cache_config
from lmcache_hma.core.metadata import HMAConnectorMetadata, LoadSpec, ObjectRef, SaveSpec, hit_objects
from lmcache_hma.scheduler.vllm_fields import arrange_state_retention
from lmcache_hma.kv_copy.state_kv import StateKV
from lmcache_hma.worker.worker_half import WorkerHalf
from tests.engines import write_yaml

SHAPES = ((3, 8), (2, 4, 4))  # conv (bf16), recurrent (fp32): 48 + 128 bytes
DTYPES = ("torch.bfloat16", "torch.float32")
STATE_BYTES = 176
PAGE = 256  # attention page: (1 head, 4 tokens, 32) bf16; the state page is padded to it
NUM_BLOCKS = 32
BLOCK, CHUNK = 4, 8


def gdn(index, name, block=BLOCK):
    return GroupLayout(index, GroupKind.STATE, (name,), block, STATE_BYTES, state_shapes=SHAPES,
                       state_dtypes=DTYPES, conv_state_layout="SD")


def state_layout() -> HybridLayout:
    """Qwen3-Next's shape: three GDN groups of one layer, then the full-attention group."""
    groups = (gdn(0, "G0"), gdn(1, "G1"), gdn(2, "G2"),
              GroupLayout(3, GroupKind.FULL, ("A3",), BLOCK, PAGE))
    return HybridLayout(groups, CHUNK)


def kv_caches(seed=0, as_parts=False) -> dict:
    """Like vLLM CPU: one byte buffer of pages; attention as bf16 pages, GDN layers as raw
    int8 rows of the unpadded state with the padded page as block stride."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 128, (NUM_BLOCKS * PAGE,), generator=g, dtype=torch.int8)
    out = {"A3": buf.view(torch.bfloat16).view(NUM_BLOCKS, 1, 4, 32)}
    for name in ("G0", "G1", "G2"):
        if as_parts:  # the other registration vLLM uses: one tensor per state part
            conv = torch.empty(0, dtype=torch.bfloat16).set_(buf.untyped_storage(), 0, (NUM_BLOCKS, 3, 8),
                                                            (PAGE // 2, 8, 1))
            ssm = torch.empty(0, dtype=torch.float32).set_(buf.untyped_storage(), 48 // 4, (NUM_BLOCKS, 2, 4, 4),
                                                          (PAGE // 4, 16, 4, 1))
            out[name] = [conv, ssm]
        else:
            out[name] = buf.as_strided((NUM_BLOCKS, 1, 1, STATE_BYTES), (PAGE, STATE_BYTES, STATE_BYTES, 1))
    return out


def block_bytes(caches, block) -> bytes:
    raw = caches["A3"].view(-1).view(torch.int8)
    return bytes(raw[block * PAGE:block * PAGE + STATE_BYTES].view(torch.uint8).tolist())


# -- layout, keys ----------------------------------------------------------------------

def test_state_groups_are_not_paged_and_sit_at_the_last_token_of_the_boundary():
    lay = state_layout()
    assert [g.kind for g in lay.state_groups] == [GroupKind.STATE] * 3 and lay.has_state
    assert lay.layer_names == ("A3",) and lay.state_layer_names == ("G0", "G1", "G2")
    assert lay.state_bytes == 3 * STATE_BYTES
    # the state after 16 tokens lives in block 3 of each GDN group; one row per layer
    assert lay.segments(ObjectKind.STATE, 1) == [Segment(0, 3, 1), Segment(1, 3, 1), Segment(2, 3, 1)]
    assert lay.full_segments(1) == [Segment(3, 2, 2)]
    assert lay.payload_bytes(ObjectKind.STATE, 5, PAGE) == 528  # 3 x 176, whole 16-byte units
    assert lay.checkpoint_interval() == CHUNK
    refs = hit_objects(0, [b"a", b"b"], lay.has_sliding, lay.has_state)
    assert [(r.kind, r.chunk) for r in refs] == [(ObjectKind.FULL, 0), (ObjectKind.FULL, 1), (ObjectKind.STATE, 1)]


def kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.x"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def mamba(kind="GDN_ATTN", mode="align", block=256, **kw):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block, shapes=((3, 768), (2, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                     page_size_padded=262144, mamba_type=getattr(MambaAttentionBackendEnum, kind),
                     mamba_cache_mode=mode, **kw)


def full(block=256):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)


def test_layout_from_vllm_reads_gdn_groups_unpadded():
    lay = layout_from_kv_cache_config(kv_cache_config(mamba(), mamba(), full()), 256)
    assert [g.kind for g in lay.groups] == [GroupKind.STATE, GroupKind.STATE, GroupKind.FULL]
    g = lay.groups[0]
    assert g.page_bytes == 3 * 768 * 2 + 2 * 128 * 128 * 4  # the padding (262144) is not stored
    assert g.state_shapes == ((3, 768), (2, 128, 128)) and g.state_dtypes == ("torch.bfloat16", "torch.float32")
    assert g.conv_state_layout in ("SD", "DS")


@pytest.mark.parametrize("spec, message", [
    (dict(kind="MAMBA2"), "Mamba2 hybrids .* crash with prefix caching"),
    (dict(kind="MAMBA1"), "Mamba1 layers do not run"),
    (dict(kind="LINEAR"), "linear-attention"),
    (dict(kind="SHORT_CONV"), "short-convolution"),
    (dict(mode="none"), "mamba_cache_mode is 'none'.*Enable prefix caching"),
    (dict(num_speculative_blocks=1), "speculative state blocks.*without speculative decoding"),
    (dict(num_prefill_checkpoint_blocks=1), "FlashInfer GDN prefill.*"
                                            + re.escape("""--additional-config '{"gdn_prefill_backend":"triton"}'""")),
])
def test_unverified_recurrent_groups_are_refused_with_the_reason(spec, message):
    with pytest.raises(LayoutError, match=r"group 0 \(MambaSpec, layers model.layers.0.x\).*" + message):
        layout_from_kv_cache_config(kv_cache_config(mamba(**spec), full()), 256)


def test_chunk_size_must_hold_whole_state_blocks_and_a_pure_recurrent_model_is_refused():
    with pytest.raises(LayoutError, match=r"not a multiple of the block size 384 of KV cache group\(s\) 0, 1 "
                                          r"\(full_attention, recurrent_state.*e\.g\. 384.*Setting attention block size"):
        layout_from_kv_cache_config(kv_cache_config(mamba(block=384), full(block=384)), 256)
    with pytest.raises(LayoutError, match="no attention layers"):
        layout_from_kv_cache_config(kv_cache_config(mamba()), 256)


def test_namespace_names_state_shapes_dtypes_and_conv_layout():
    def seed(**change):
        lay = state_layout()
        g = lay.groups[0]
        groups = (GroupLayout(**{**g.__dict__, **change}),) + lay.groups[1:]
        return Namespace("m", torch.bfloat16, HybridLayout(groups, CHUNK), "x", 1, 0).seed

    base = seed()
    assert seed(state_dtypes=("torch.bfloat16", "torch.bfloat16")) != base  # ssm cache dtype
    assert seed(conv_state_layout="DS") != base
    assert seed(state_shapes=((8, 3), (2, 4, 4))) != base
    assert seed() == base


# -- copies ---------------------------------------------------------------------------

@pytest.mark.parametrize("as_parts", [False, True])
def test_state_rows_copy_unpadded_bytes_both_ways(as_parts):
    lay = state_layout()
    caches = kv_caches(as_parts=as_parts)
    state = StateKV(caches, lay, NUM_BLOCKS)
    before = caches["A3"].view(torch.int8).clone().view(NUM_BLOCKS, -1)  # bytes: random bf16 has NaNs
    payload = torch.zeros(lay.payload_bytes(ObjectKind.STATE, 0, PAGE), dtype=torch.uint8)
    state.gather([5, 9, 17], payload)
    assert bytes(payload[:STATE_BYTES].tolist()) == block_bytes(caches, 5)
    assert bytes(payload[2 * STATE_BYTES:3 * STATE_BYTES].tolist()) == block_bytes(caches, 17)
    state.scatter([20, 21, 22], payload)
    for src, dst in ((5, 20), (9, 21), (17, 22)):
        assert block_bytes(caches, dst) == block_bytes(caches, src)
    after = caches["A3"].view(torch.int8).view(NUM_BLOCKS, -1)
    changed = [b for b in range(NUM_BLOCKS) if not torch.equal(after[b], before[b])]
    assert changed == [20, 21, 22]
    assert torch.equal(after[20][STATE_BYTES:], before[20][STATE_BYTES:])  # the padding is left alone
    with pytest.raises(LayoutError, match="not a real block"):
        state.scatter([0, 21, 22], payload)  # never the null block


def test_registered_state_of_another_size_is_refused():
    lay = state_layout()
    caches = kv_caches()
    caches["G1"] = caches["G1"][..., :100]
    with pytest.raises(LayoutError, match="layer G1: the registered state holds 100 bytes"):
        StateKV(caches, lay, NUM_BLOCKS)


# -- the worker: store, lookup rule, load; never held -------------------------------------

def make_worker(tmp_path):
    cfg = load_config({"lmcache_config_file": str(write_yaml(
        tmp_path / "w.yaml", chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.01))})
    lay = state_layout()
    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=lay, kv_layout="LBHNC/test",
                   world_size=1, rank=0)
    worker = WorkerHalf(cfg, lay, ns, f"unit-{uuid.uuid4().hex}", NUM_BLOCKS, serves_lookups=True)
    caches = kv_caches()
    worker.register_kv_caches(caches)
    return worker, lay, ns, caches


def test_worker_stores_handed_off_states_and_the_lookup_needs_them(tmp_path):
    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        assert worker.held is None  # recurrent states always load asynchronously
        hashes = ChunkHasher(ns).chunk_hashes(list(range(24)), 3)
        table = ([0, 0, 0, 0, 0, 5], [0, 0, 0, 0, 0, 6], [0, 0, 0, 0, 0, 7], [1, 2, 3, 4, 8, 9])
        full = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in range(3)]
        # vLLM handed off the state at 8 (blocks 10, 11, 12: not where the table says) and at 24
        states = [ObjectRef(ObjectKind.STATE, 0, hashes[0]), ObjectRef(ObjectKind.STATE, 2, hashes[2])]
        save = SaveSpec("w", table, full + states, {0: (10, 11, 12), 2: (5, 6, 7)})
        worker.wait_for_save(HMAConnectorMetadata(saves=[save]))
        worker.drain()
        c = worker.counters()
        assert c["objects_stored"] == 5 and c["stored_bytes_recurrent_state"] == 2 * 3 * STATE_BYTES
        assert worker._answer_lookup("r", 1, 0, hashes)[:2] == (3, False)
        worker.store.remove(ObjectKind.STATE, hashes[2])
        assert worker._answer_lookup("r", 2, 0, hashes)[:2] == (1, False)  # back off to the state at 8
        worker.store.remove(ObjectKind.STATE, hashes[0])
        assert worker._answer_lookup("r", 3, 0, hashes)[:2] == (0, False)

        # load the state at 8 into the blocks vLLM allocated at index (8 - 1) // 4 = 1
        target = ([0, 20], [0, 21], [0, 22], [23, 24])
        worker.wait_for_save(HMAConnectorMetadata(saves=[SaveSpec("w", table, states[:1], {0: (10, 11, 12)})]))
        worker.drain()
        load = LoadSpec("r", target, 0, 8, hit_objects(0, hashes[:1], False, True))
        worker.start_load_kv(HMAConnectorMetadata(loads=[load]))
        assert worker.take_transfer_results() == ({"r"}, set())
        for src, dst in ((10, 20), (11, 21), (12, 22)):
            assert block_bytes(caches, dst) == block_bytes(caches, src)
        assert worker.counters()["loaded_bytes_recurrent_state"] == 3 * STATE_BYTES
        # a table with the null block where the state goes: a failed load (vLLM recomputes)
        bad = LoadSpec("r2", ([0, 0], [0, 21], [0, 22], [23, 24]), 0, 8, load.objects)
        worker.start_load_kv(HMAConnectorMetadata(loads=[bad]))
        assert worker.take_transfer_results() == ({"r2"}, {"r2"})
    finally:
        worker.shutdown()


# -- the scheduler: which hand-offs become state objects --------------------------------

def test_scheduler_stores_chunk_aligned_handoffs_of_every_state_group_once(tmp_path):
    from lmcache_hma.scheduler.scheduler_half import RequestState, SchedulerHalf

    cfg = load_config({"lmcache_config_file": str(write_yaml(tmp_path / "s.yaml", chunk_size=CHUNK))})
    lay = state_layout()
    ns = Namespace(model="tiny", kv_dtype=torch.bfloat16, layout=lay, kv_layout="x", world_size=1, rank=0)
    sched = SchedulerHalf(cfg, lay, ns, f"unit-{uuid.uuid4().hex}")
    try:
        hashes = [bytes([i]) * 32 for i in range(4)]  # a 33-token prompt: 4 full chunks
        for req in ("a", "b", "gone"):
            keys = SimpleNamespace(digests=hashes, ensure=lambda n: min(n, len(hashes)))  # RequestKeys' API
            sched.requests[req] = RequestState(SimpleNamespace(num_computed_tokens=0), keys)
        sched.requests["b"].state_floor = 16  # loaded from the store up to 16

        def output(handoffs, preempted=()):
            return SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set(preempted),
                                   finished_req_ids=set(),
                                   kv_connector_block_state=SimpleNamespace(boundary_state_offloads=handoffs))

        every = lambda b, blocks: [(g, blk, b) for g, blk in zip((0, 1, 2), blocks)]
        meta = sched.build_connector_meta(output({
            "a": every(8, (1, 2, 3)) + every(12, (4, 5, 6)) + every(16, (7, 8, 9))[:2] + every(40, (1, 2, 3)),
            "b": every(16, (1, 2, 3)) + every(24, (4, 5, 6)),
            "gone": every(8, (1, 2, 3)),
            "unknown": every(8, (1, 2, 3)),
        }, preempted={"gone"}))
        saves = {s.req_id: s for s in meta.saves}
        assert set(saves) == {"a", "b"}
        # 12: not a chunk boundary; 16: one group missing; 40: past the prompt's chunks
        assert [(r.kind, r.chunk, r.chunk_hash) for r in saves["a"].objects] == [(ObjectKind.STATE, 0, hashes[0])]
        assert saves["a"].state_blocks == {0: (1, 2, 3)}
        assert [r.chunk for r in saves["b"].objects] == [2] and saves["b"].state_blocks == {2: (4, 5, 6)}
        again = sched.build_connector_meta(output({"a": every(8, (1, 2, 3))}))
        assert again.saves == []  # stored once per request
        sched.on_failed_loads(["b"])  # recomputed: its states are handed off again and stored
        meta = sched.build_connector_meta(output({"b": every(16, (1, 2, 3))}))
        assert [r.chunk for s in meta.saves for r in s.objects] == [1]
    finally:
        sched.shutdown()


def test_retention_interval_is_set_only_over_vllms_default():
    cfg, cache = SimpleNamespace(prefix_cache_retention_interval=0), SimpleNamespace(prefix_cache_retention_interval=0)
    assert arrange_state_retention(cfg, cache, 512) == 512
    assert cfg.prefix_cache_retention_interval == cache.prefix_cache_retention_interval == 512
    for user in (None, 1024):  # dense, or the user's own interval: left alone
        cfg = SimpleNamespace(prefix_cache_retention_interval=user)
        assert arrange_state_retention(cfg, SimpleNamespace(), 512) is None
        assert cfg.prefix_cache_retention_interval == user


# -- turn ends: the states at a finished request's last computed token --------------------

def finished(end, in_flight=0, turn=None):
    """A finished request's ``RequestState`` as ``turn_end_save`` reads it (``turn``: the turn end
    its hit read)."""
    keys = SimpleNamespace(answers=True, turn_digest=lambda n, on_tail=False: b"turn%d" % n)
    request = SimpleNamespace(request_id="r", num_computed_tokens=end + in_flight, num_in_flight_tokens=in_flight,
                              all_token_ids=list(range(end + in_flight + 1)))
    return SimpleNamespace(request=request, keys=keys, hashes=[bytes([i]) * 32 for i in range(4)],
                           skip_save=False, hit=turn.end if turn else 0, last_boundary=0, state_floor=0, tails=set(),
                           turn=turn)


def test_a_turn_end_keeps_the_states_vllm_holds_at_its_last_token():
    """vLLM ("align") keeps a running request's state in the block at ``(L - 1) // block_size``:
    a request that finished at 21 tokens leaves its states there (index 5), beside the turn
    object, under the turn end's key. Not when a step is in flight (it advances the state in
    place past 21), nor when that block is not there."""
    from lmcache_hma.scheduler.turn_ends import turn_end_save

    lay = state_layout()
    table = ([0, 0, 0, 0, 0, 5], [0, 0, 0, 0, 0, 6], [0, 0, 0, 0, 0, 7], [1, 2, 3, 4, 8, 9])
    save = turn_end_save(finished(21), table, lay, True, False)
    turn = ObjectRef(ObjectKind.TURN, 2, b"turn21", 21)
    assert save.objects == [turn, ObjectRef(ObjectKind.STATE, 2, b"turn21", 21),
                            ObjectRef(ObjectKind.TURNMARK, 2, bytes([1]) * 32, 21)]
    assert save.state_blocks == {2: (5, 6, 7)} and save.finished
    # a next turn that hit an earlier turn end names it and its states as superseded (value_policy)
    read = ObjectRef(ObjectKind.TURN, 1, b"turn12", 12)
    save = turn_end_save(finished(21, turn=read), table, lay, True, False)
    assert save.objects[0].supersedes == (read, ObjectRef(ObjectKind.STATE, 1, b"turn12", 12))
    assert lay.segments(ObjectKind.STATE, 2, 21) == lay.state_segments(21)  # block 5 of each GDN group
    assert turn_end_save(finished(21, in_flight=1), table, lay, True, False) is None
    assert turn_end_save(finished(21), ([0] * 6, [0] * 6, [0] * 6, table[3]), lay, True, False) is None


def test_a_turn_end_hit_needs_its_states_and_loads_them_where_the_next_token_reads(tmp_path):
    from lmcache_hma.core.metadata import turn_hit_objects

    worker, lay, ns, caches = make_worker(tmp_path)
    try:
        tokens = list(range(100, 130))
        hashes = ChunkHasher(ns).chunk_hashes(tokens, 3)
        key = ChunkHasher(ns).turn_digest(hashes[1], tokens, 16, 21, None)
        turn = ObjectRef(ObjectKind.TURN, 2, key, 21)
        table = ([0, 0, 0, 0, 0, 5], [0, 0, 0, 0, 0, 6], [0, 0, 0, 0, 0, 7], [1, 2, 3, 4, 8, 9])
        refs = [ObjectRef(ObjectKind.FULL, c, hashes[c]) for c in (0, 1)]
        saves = [SaveSpec("w", table, refs),
                 SaveSpec("w", table, [turn, ObjectRef(ObjectKind.STATE, 2, key, 21),
                                       ObjectRef(ObjectKind.TURNMARK, 2, hashes[1], 21)], {2: (5, 6, 7)},
                          finished=True)]
        worker.wait_for_save(HMAConnectorMetadata(saves=saves))
        worker.drain()
        assert worker.counters()["stored_bytes_turn_end"] >= 3 * STATE_BYTES
        assert not worker.counters().get("stored_bytes_recurrent_state")  # boundary states only
        first = worker._answer_lookup("r", 1, 0, hashes[:2], turn_limit=22)
        assert (first.marks, first.mark_chunk) == ((5,), 2)
        found = worker._answer_lookup("r", 2, 0, hashes[:2], turns=(2, [(21, key, False)]))
        assert found.turn_end == 21 and found.chunks == 2

        target = ([0, 0, 0, 0, 0, 20], [0, 0, 0, 0, 0, 21], [0, 0, 0, 0, 0, 22], [23, 24, 25, 26, 27, 28])
        load = LoadSpec("r", target, 0, 21, turn_hit_objects(0, hashes[:2], turn, lay.has_state))
        worker.start_load_kv(HMAConnectorMetadata(loads=[load]))
        assert worker.take_transfer_results() == ({"r"}, set())
        for src, dst in ((5, 20), (6, 21), (7, 22)):
            assert block_bytes(caches, dst) == block_bytes(caches, src)

        worker.store.remove(ObjectKind.STATE, key)  # the turn object alone cannot resume the model
        found = worker._answer_lookup("r", 3, 0, hashes[:2], turns=(2, [(21, key, False)]))
        assert found.turn_end == 0 and found.chunks == 0  # and no boundary state before it either
    finally:
        worker.shutdown()
