import pytest

from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.layout import GroupLayout, HybridLayout, LayoutError, Segment, plan_rows
from tests.fakes import layout


def test_sliding_window_first_block_matches_vllm_example():
    # vLLM's example: window 4, 7 computed tokens -> tokens 0..3 skipped.
    g = GroupLayout(0, GroupKind.SLIDING, ("a",), block_size=2, page_bytes=1, sliding_window=4)
    assert g.first_block_needed(7) == 2  # skipped = 7-4+1 = 4 tokens = 2 blocks
    assert g.first_block_needed(3) == 0
    full = GroupLayout(1, GroupKind.FULL, ("b",), block_size=2, page_bytes=1)
    assert full.first_block_needed(100) == 0


def test_segments_full_and_tail():
    lay = layout("SFS", block=4, window=8, chunk=8)
    assert lay.full_segments(3) == [Segment(1, 6, 2)]
    # boundary 16: the next token reads tokens 9..15 -> blocks 2..3
    assert lay.tail_segments(16) == [Segment(0, 2, 2), Segment(2, 2, 2)]
    assert lay.segments(ObjectKind.TAIL, 1) == lay.tail_segments(16)
    # window larger than the prefix: everything from block 0
    assert lay.tail_segments(8) == [Segment(0, 0, 2), Segment(2, 0, 2)]
    assert lay.num_rows(lay.tail_segments(16)) == 8  # 2 groups x 2 layers x 2 blocks


def test_group_order_is_not_assumed():
    lay = layout("FSS")
    assert [g.kind for g in lay.groups] == [GroupKind.FULL, GroupKind.SLIDING, GroupKind.SLIDING]
    assert lay.full_segments(0) == [Segment(0, 0, 2)]
    assert all(s.group in (1, 2) for s in lay.tail_segments(16))


def test_default_checkpoint_interval_follows_the_window():
    assert layout("SF", window=8, chunk=8).checkpoint_interval() == 8
    assert layout("SF", window=20, chunk=8).checkpoint_interval() == 24
    assert layout("SF", window=20, chunk=8).checkpoint_interval(16) == 16
    assert layout("FF", chunk=8).checkpoint_interval() == 8


def test_chunk_size_must_be_multiple_of_block_size():
    with pytest.raises(LayoutError, match="not a multiple of the block size 4.*set chunk_size"):
        layout(chunk=6)


def test_plan_rows_skips_null_blocks_and_local_hit():
    lay = layout("SF", block=4, window=8, chunk=8)
    # 16-token hit; sliding group holds only its window (blocks 2,3), others null
    table = ([0, 0, 21, 22], [11, 12, 13, 14])
    rows = plan_rows(lay, lay.full_segments(1), table)
    assert rows.block_ids == [13, 14, 13, 14]
    assert rows.layer_indices == [2, 2, 3, 3]
    assert rows.object_rows == [0, 1, 2, 3]
    tail = plan_rows(lay, lay.tail_segments(16), table)
    assert tail.block_ids == [21, 22, 21, 22]
    # local hit of 12 tokens: only block 3 is loaded, in both groups
    rows = plan_rows(lay, lay.full_segments(1), table, min_token=12)
    assert rows.block_ids == [14, 14] and rows.object_rows == [1, 3]
    tail = plan_rows(lay, lay.tail_segments(16), table, min_token=12)
    assert tail.block_ids == [22, 22] and tail.object_rows == [1, 3]
    # null blocks inside a segment are never written
    rows = plan_rows(lay, [Segment(0, 0, 4)], table)
    assert 0 not in rows.block_ids
