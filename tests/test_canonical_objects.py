"""Objects in the parallelism-free format (``hma_share_parallel_shapes``), below the engine:
keys, token ranges, parts per KV head, and copies between ranks of TP sizes 1 and 2 and block
sizes 16 and 32 through ``CanonicalObjects`` over pages vLLM's own CPU kernel filled."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmcache_hma.core.keys import Namespace, head_part_digest
from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout
from lmcache_hma.kv_copy.canonical_kv import kv_heads_of_rank
from lmcache_hma.kv_copy.canonical_objects import CanonicalObjects

ops = pytest.importorskip("vllm._custom_ops")

HEADS, DIM, TOKENS, CHUNK, WINDOW = 2, 32, 192, 64, 40
FULL, SLIDING = ("f0", "f1"), ("s0", "s1")


def layout(block: int, heads: int = HEADS) -> HybridLayout:
    page = heads * block * 2 * DIM * 4
    return HybridLayout((GroupLayout(0, GroupKind.SLIDING, SLIDING, block, page, WINDOW),
                         GroupLayout(1, GroupKind.FULL, FULL, block, page)), CHUNK)


def namespace(block: int, world_size: int, rank: int, shared: bool) -> Namespace:
    return Namespace("m", torch.float32, layout(block, HEADS // world_size if shared else HEADS), "LBHNC/x",
                     world_size, rank, secret=b"s" * 16, shared_heads=(HEADS, DIM) if shared else None)


def test_shared_keys_name_no_tp_size_rank_or_block_size():
    shapes = [namespace(16, 1, 0, True), namespace(32, 2, 1, True), namespace(16, 2, 0, True)]
    assert len({ns.seed for ns in shapes}) == 1 and len({ns.fingerprint for ns in shapes}) == 1
    assert {(ns.key_world_size, ns.key_rank) for ns in shapes} == {(1, 0)}
    per_rank = [namespace(16, 1, 0, False), namespace(16, 2, 0, False), namespace(32, 1, 0, False)]
    assert len({ns.seed for ns in per_rank}) == 3  # the option off: nothing changes
    assert shapes[0].seed not in {ns.seed for ns in per_rank}
    # a part's key differs per head and from the object's name, and depends on the secret
    parts = {head_part_digest(b"s" * 16, b"c" * 32, h) for h in range(3)} | {b"c" * 32}
    assert len(parts) == 4 and head_part_digest(None, b"c" * 32, 0) not in parts


def test_token_ranges_hold_what_the_next_token_reads_from_whole_blocks_whatever_the_block_size():
    """A sliding range starts on a multiple of the largest divisor of the chunk size not above the
    window (64 and 40: 32), where every block of 16 and of 32 starts: the window before 128 starts
    at 89, the one before 150 at 111."""
    for block in (16, 32):
        lay = layout(block)
        assert lay.range_alignment(lay.groups[0]) == 32
        assert lay.token_ranges(ObjectKind.FULL, 1) == [(1, 64, 128)]
        assert lay.token_ranges(ObjectKind.TAIL, 1) == [(0, 64, 128)]
        assert lay.token_ranges(ObjectKind.TURN, 2, 150) == [(0, 96, 150), (1, 128, 150)]
        # the same tokens as the block-rounded segments, or more
        tail = lay.segments(ObjectKind.TAIL, 1)[0]
        assert tail.first_block * block >= 64 and (tail.first_block + tail.num_blocks) * block == 128
    big = HybridLayout((GroupLayout(0, GroupKind.SLIDING, SLIDING, 16, 1, 1024),), 256)
    assert big.range_alignment(big.groups[0]) == 256
    assert big.token_ranges(ObjectKind.TAIL, 7) == [(0, 2048 - 1024, 2048)]  # the window and one token


class Rank:
    """One rank's KV caches as vLLM's CPU backend allocates them, filled by its own kernel with
    the rank's heads of ``kv`` (per layer name: keys and values ``[T, H, D]``)."""

    def __init__(self, kv: dict, tp: int, rank: int, block: int, seed: int, num_blocks: int = 32):
        self.heads = kv_heads_of_rank(HEADS, tp, rank)
        h0, h1 = self.heads.heads.start, self.heads.heads.stop
        g = torch.Generator().manual_seed(seed)
        self.table = (torch.randperm(num_blocks - 1, generator=g)[:-(-TOKENS // block)] + 1).tolist()
        self.alloc = torch.zeros(len(kv), num_blocks, h1 - h0, block, 2 * DIM)
        slots = torch.tensor([self.table[t // block] * block + t % block for t in range(TOKENS)])
        self.caches = {}
        for i, (name, (keys, values)) in enumerate(kv.items()):
            cache = self.alloc[i].view(num_blocks, h1 - h0, 2 * block, DIM)
            key_cache, value_cache = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(keys[:, h0:h1].contiguous(), values[:, h0:h1].contiguous(),
                                           key_cache, value_cache, slots, "vec" if block % 32 == 0 else "vec16",
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
            self.caches[name] = self.alloc[i]
        self.objects = CanonicalObjects(layout(block, h1 - h0), self.caches, num_blocks, self.heads, b"s" * 16)
        self.block_table = [self.table, self.table]  # sliding group, full group

    def empty(self, seed: int) -> "Rank":
        other = Rank.__new__(Rank)
        other.__dict__.update(self.__dict__)
        other.alloc = torch.zeros_like(self.alloc)
        other.caches = {name: other.alloc[i] for i, name in enumerate(self.caches)}
        block, n = self.objects.groups[0].block_size, self.alloc.shape[1]
        other.objects = CanonicalObjects(layout(block, len(self.heads.heads)), other.caches, n, self.heads, b"s" * 16)
        return other


@pytest.fixture(scope="module")
def kv():
    g = torch.Generator().manual_seed(1)
    return {name: (torch.randn(TOKENS, HEADS, DIM, generator=g), torch.randn(TOKENS, HEADS, DIM, generator=g))
            for name in (*SLIDING, *FULL)}


def reference_part(kv, kind, chunk, end, head, lay) -> torch.Tensor:
    """A part by plain slicing: per group, ``[layer][K|V][token][dim]`` of ``head``."""
    out = []
    for pos, t0, t1 in lay.token_ranges(kind, chunk, end):
        names = lay.groups[pos].layer_names
        out += [torch.stack([kv[n][0][t0:t1, head], kv[n][1][t0:t1, head]]).reshape(-1) for n in names]
    return torch.cat(out)


def gather(rank: Rank, kind, chunk, end, head) -> torch.Tensor:
    copy = rank.objects.plan(kind, chunk, end, head, rank.block_table)
    payload = torch.full((rank.objects.payload_bytes(kind, chunk, end) // 4,), float("nan"))
    rank.objects.gather(copy, payload)
    return payload


OBJECTS = [(ObjectKind.FULL, 1, 0), (ObjectKind.TAIL, 1, 0), (ObjectKind.TURN, 2, 150)]


@pytest.mark.parametrize("kind, chunk, end", OBJECTS)
def test_parts_are_the_same_bytes_at_every_tp_size_and_block_size(kv, kind, chunk, end):
    tp1 = Rank(kv, 1, 0, 16, seed=2)
    halves = [Rank(kv, 2, r, 32, seed=3 + r) for r in range(2)]
    for head in range(HEADS):
        ref = reference_part(kv, kind, chunk, end, head, layout(16))
        assert torch.equal(gather(tp1, kind, chunk, end, head), ref)
        assert torch.equal(gather(halves[head], kind, chunk, end, head), ref)
    assert [h for h, _ in tp1.objects.parts(ObjectKind.FULL, b"c" * 32)] == [0, 1]
    assert [h for h, _ in halves[1].objects.parts(ObjectKind.FULL, b"c" * 32)] == [1]


@pytest.mark.parametrize("kind, chunk, end", OBJECTS)
def test_a_part_written_at_tp1_block16_loads_at_tp2_block32_as_vllm_wrote_it(kv, kind, chunk, end):
    """Scattered into an empty TP=2 rank of block 32, a TP=1 block-16 rank's part gives exactly
    the bytes vLLM's kernel wrote for those tokens there; no other byte is touched."""
    writer = Rank(kv, 1, 0, 16, seed=2)
    for r in range(2):
        filled = Rank(kv, 2, r, 32, seed=5 + r)
        empty = filled.empty(seed=0)
        head = filled.heads.heads.start
        copy = empty.objects.plan_load(kind, chunk, end, head, empty.block_table)
        empty.objects.scatter(copy, gather(writer, kind, chunk, end, head))
        assert torch.equal(gather(empty, kind, chunk, end, head), reference_part(kv, kind, chunk, end, head,
                                                                                 layout(32)))
        changed = empty.alloc != 0
        assert torch.equal(empty.alloc[changed], filled.alloc[changed])
        # every byte of the tokens the part holds was written: per group, the blocks they are in
        written = changed.any(-1).any(-1).any(-1)  # [layer, block]
        assert written.any()


def test_null_blocks_and_a_local_hit(kv):
    rank = Rank(kv, 1, 0, 16, seed=2)
    table = list(rank.table)
    table[4] = 0  # a block of chunk 1 (tokens 64..79) is the null block
    assert rank.objects.plan(ObjectKind.FULL, 1, 0, 0, [table, table]) is None
    assert rank.objects.plan(ObjectKind.FULL, 0, 0, 0, [table, table]) is not None
    # a local prefix-cache hit of 96 tokens: only tokens 96..127 of chunk 1 are copied
    copy = rank.objects.plan_load(ObjectKind.FULL, 1, 0, 0, rank.block_table, min_token=96)
    assert [seg.tokens for seg in copy.segments] == [(96, 128)]
    assert copy.block_ids == frozenset(rank.table[6:8])
    assert rank.objects.plan(ObjectKind.FULL, 1, 0, 0, [rank.table[:5]] * 2) is None  # past the table


def test_a_replica_rank_writes_no_shared_copy(kv):
    """TP larger than the KV heads: each head is on two ranks; only the first writes the shared tier."""
    writes = [kv_heads_of_rank(HEADS, 4, r) for r in range(4)]
    assert [(w.heads.start, w.writes) for w in writes] == [(0, True), (0, False), (1, True), (1, False)]


# -- recurrent states ----------------------------------------------------------------------

def state_setup(tp: int, rank: int, layout_name: str = "SD", num_blocks: int = 6):
    """A gated-delta-net rank: 2 k heads, 4 v heads, conv kernel 4, two layers, bf16 conv and
    float32 recurrent states registered as one tensor per part, filled from one canonical state
    per (layer, block) through ``gdn_state_runs`` (the reference mapping)."""
    import numpy as np

    from lmcache_hma.kv_copy.canonical_state import GdnDims, copy_runs, gdn_state_runs
    from lmcache_hma.kv_copy.state_kv import StateKV

    dims = GdnDims(2, 4, 8, 4, 4)
    conv, ssm = dims.rank_shapes(tp, layout_name)
    names = ("g0", "g1")
    page = (np.prod(conv) * 2 + np.prod(ssm) * 4).item()
    lay = HybridLayout((GroupLayout(0, GroupKind.FULL, ("f0",), 16, 64),
                        GroupLayout(1, GroupKind.STATE, names, 16, page, state_shapes=(conv, ssm),
                                    state_dtypes=("torch.bfloat16", "torch.float32"), conv_state_layout=layout_name)),
                       64)
    caches = {n: [torch.zeros(num_blocks, *conv, dtype=torch.bfloat16), torch.zeros(num_blocks, *ssm)] for n in names}
    state = StateKV(caches, lay, num_blocks)
    canon_bytes = dims.canonical_bytes(2, 4)
    g = torch.Generator().manual_seed(7)
    canonical = {(n, b): torch.randint(0, 127, (canon_bytes,), generator=g, dtype=torch.uint8).numpy()
                 for n in names for b in range(num_blocks)}
    runs = gdn_state_runs(dims, tp, rank, layout_name, 2, 4)
    for (n, b), c in canonical.items():
        pg = np.concatenate([p[b].contiguous().view(torch.uint8).reshape(-1).numpy() for p in caches[n]])
        copy_runs(pg, c, runs, to_canonical=False)
        sizes = np.cumsum([0] + [p[b].numel() * p.element_size() for p in caches[n]])
        for k, p in enumerate(caches[n]):
            p[b].view(torch.uint8).reshape(-1).copy_(torch.from_numpy(pg[sizes[k]:sizes[k + 1]].copy()))
    return lay, state, caches


@pytest.mark.parametrize("layout_name", ["SD", "DS"])
def test_state_shards_are_the_same_bytes_at_tp1_and_tp2_and_load_back(layout_name):
    from lmcache_hma.kv_copy.canonical_objects import CanonicalStates

    lay1, state1, _ = state_setup(1, 0, layout_name)
    one = CanonicalStates(lay1, state1, 1, 0, None)
    assert one.shards == 2 and list(one.owned) == [0, 1]
    for rank in range(2):
        lay2, state2, caches2 = state_setup(2, rank, layout_name)
        two = CanonicalStates(lay2, state2, 2, rank, None)
        assert list(two.owned) == [rank] and two.payload_bytes == one.payload_bytes
        a, b = (torch.zeros(one.payload_bytes, dtype=torch.uint8) for _ in range(2))
        one.gather([3], rank, a)
        two.gather([3], rank, b)
        assert torch.equal(a, b) and a.any()
        # TP=1's shard loaded into an empty TP=2 rank: the pages vLLM's TP=2 rank holds
        _, empty_state, empty = state_setup(2, rank, layout_name)
        for n in empty:
            for p in empty[n]:
                p.zero_()
        CanonicalStates(lay2, empty_state, 2, rank, None).scatter([3], rank, a)
        for n in empty:
            for p, q in zip(empty[n], caches2[n]):
                assert torch.equal(p[3], q[3]) and not p[2].any()


def test_a_corrupted_part_load_overwrites_only_the_groups_named(kv):
    """TEST ONLY fault injection (``hma_test_corrupt_loads``) on a part: "full_attention" puts
    noise into the full group's tokens of the load and nowhere else; "all" into every group's."""
    from lmcache_hma.worker.faults import corrupt_part

    writer = Rank(kv, 1, 0, 16, seed=2)
    payload = gather(writer, ObjectKind.TURN, 2, 150, 0)
    for kind, changed_groups in (("full_attention", {1}), ("all", {0, 1})):
        reader = writer.empty(seed=0)
        copy = reader.objects.plan_load(ObjectKind.TURN, 2, 150, 0, reader.block_table)
        reader.objects.scatter(copy, payload)
        before = reader.alloc.clone()
        corrupt_part(reader.objects, copy, layout(16), kind, payload)
        # allocation rows s0 s1 (group 0, sliding) f0 f1 (group 1, full)
        changed = {i // 2 for i in range(4) if not torch.equal(before[i], reader.alloc[i])}
        assert changed == changed_groups


# -- loads write whole blocks of the reader (issue 47, item 4) ---------------------------------

def reader_table(rank: Rank, boundary: int) -> list:
    """The reader's block table as vLLM allocates it for a hit of ``boundary`` tokens: the sliding
    group's blocks wholly before the window of the token at ``boundary`` are the null block."""
    block = rank.objects.groups[0].block_size
    first = layout(block).groups[0].first_token_needed(boundary) // block
    return [[0] * first + rank.table[first:], rank.table]


def load_plan(objects, kind, chunk, end, head, table, min_token=0):
    return objects.plan_load(kind, chunk, end, head, table, min_token)


@pytest.mark.parametrize("writer_block, reader_block", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("kind, chunk, end", [(ObjectKind.TAIL, 1, 0), (ObjectKind.TURN, 2, 150)])
def test_a_load_writes_every_sliding_block_it_touches_whole(kv, kind, chunk, end, writer_block, reader_block):
    """vLLM caches every full block of a loaded hit, so a later request may read a sliding block's
    tokens before the window of this hit: the load must write each non-null block it touches as
    vLLM's writer fills it, not only from the window's first token on (tail at 128, turn end at
    150, window 40: the window starts at 89 and 111, inside a block of 16 and of 32)."""
    boundary = end or (chunk + 1) * CHUNK
    writer = Rank(kv, 1, 0, writer_block, seed=2)
    filled = Rank(kv, 1, 0, reader_block, seed=5)  # the pages vLLM writes at the reader
    reader = filled.empty(seed=0)
    table = reader_table(reader, boundary)
    for head in range(HEADS):
        copy = load_plan(reader.objects, kind, chunk, end, head, table)
        reader.objects.scatter(copy, gather(writer, kind, chunk, end, head))
    n = reader_block
    real = [j for j, b in enumerate(table[0][:-(-boundary // n)]) if b != 0]
    assert real and real[0] == layout(n).groups[0].first_token_needed(boundary) // n
    for layer, name in enumerate(SLIDING):  # allocation rows 0, 1: the sliding layers
        lay = reader.objects.groups[0].layers[layer]
        want = filled.objects.groups[0].layers[layer]
        for j in real:
            b, m = table[0][j], min(n, boundary - j * n)  # the block's tokens before the boundary
            for got, ref in ((lay.key, want.key), (lay.value, want.value)):
                assert torch.equal(got[b, :, :m], ref[b, :, :m]), f"{name} block {j}: tokens {j * n}..{j * n + m}"
    assert not reader.alloc[:, 0].any()  # the null block is never written


def test_a_load_skips_the_null_blocks_before_the_window_and_never_starts_inside_a_block(kv):
    """The turn end at 150 holds tokens 96..149 of the sliding group; a reader of block 16 has null
    blocks before block 6 (the window starts at 111): the load writes blocks 6..9 from token 96.
    A null block inside the window, or a range starting inside a real block, is no load."""
    reader = Rank(kv, 1, 0, 16, seed=5).empty(seed=0)
    table = reader_table(reader, 150)
    assert table[0][:6] == [0] * 6
    copy = reader.objects.plan_load(ObjectKind.TURN, 2, 150, 0, table)
    assert [seg.tokens for seg in copy.segments] == [(96, 150), (128, 150)]
    # the tail at 128 holds 64..127 (window from 89): null blocks 0..4 skipped; a real block 4 written whole
    def tail_tokens(tail_table):
        return [seg.tokens for seg in reader.objects.plan_load(ObjectKind.TAIL, 1, 0, 0, tail_table).segments]

    assert tail_tokens(reader_table(reader, 128)) == [(80, 128)]
    assert tail_tokens([[0] * 4 + reader.table[4:], reader.table]) == [(64, 128)]
    holed = [list(table[0]), table[1]]
    holed[0][7] = 0  # tokens 112..127, in the window
    assert reader.objects.plan_load(ObjectKind.TURN, 2, 150, 0, holed) is None
    shape = reader.objects.shapes(ObjectKind.TURN, 2, 150)[0][1]
    inside = replace(shape, first_token=100, num_tokens=50)  # a range that would cut block 6
    assert reader.objects._tokens(0, inside, table[0], 0, load=True) is None


def test_a_writer_stores_only_the_parts_whose_every_block_it_still_holds(kv):
    """At a turn end after decoding, vLLM has freed the writer's sliding blocks before the window
    of its last step. A range that starts on one of them is not stored (a miss later), never
    stored with tokens nobody wrote: at 160 (window from 121, range from 96) a writer of block 16
    kept blocks 7.. only; one of block 32 kept block 3 (96..127) and stores it."""
    for block, stored in ((16, False), (32, True)):
        writer = Rank(kv, 1, 0, block, seed=2)
        freed = (160 - WINDOW) // block  # vLLM's skipped blocks once token 159 is computed
        table = [[0] * freed + writer.table[freed:], writer.table]
        assert (writer.objects.plan(ObjectKind.TURN, 2, 160, 0, table) is not None) is stored
        assert writer.objects.plan(ObjectKind.TURN, 2, 160, 0, writer.block_table) is not None


def test_a_block_size_that_does_not_divide_the_range_alignment_is_refused():
    """Window 40 and chunks of 64: sliding ranges start on multiples of 32; pages of block 64 could
    not be loaded whole, so the option refuses them at start, naming the group."""
    from lmcache_hma.core.layout import LayoutError

    caches = {name: torch.zeros(4, HEADS, 64, 2 * DIM) for name in (*SLIDING, *FULL)}
    with pytest.raises(LayoutError, match="group 0: block size 64 does not divide 32"):
        CanonicalObjects(layout(64), caches, 4, kv_heads_of_rank(HEADS, 1, 0), b"s" * 16)
