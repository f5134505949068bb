"""A turn-end marker rewritten more than once in one write batch (``ChunkStore.commit_many``):
turn ends after one prefix that finish together (conversations batched on one shared system
prompt) each rewrite the marker after it, every rewrite listing the offsets before it; the
writer commits them in one batch. The last one is stored, in every tier (a local tier keeps the
first put of a key it holds: the others' turn ends were then named by no marker, a miss)."""

import hashlib

import pytest

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.metadata import ObjectRef
from lmcache_hma.core.objects import payload_of
from lmcache_hma.core.turn_ends import MARK_BYTES, decode_marks, encode_marks
from lmcache_hma.store.lmcache_storage import flat, release
from tests.test_store import namespace, open_store


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_the_last_rewrite_of_a_marker_in_one_batch_is_the_one_stored(tmp_path, tier):
    keys = {} if tier == "cpu" else dict(local_cpu=False, local_disk=f"file://{tmp_path}/disk/",
                                         max_local_disk_size=0.01)
    store = open_store(tmp_path, namespace(), "value", **keys)
    try:
        prefix = hashlib.sha256(b"system prompt").digest()
        rewrites = [[244], [250, 244], [236, 250, 244]]  # TurnMarks.add: newest first
        items, refs = [], []
        for offsets in rewrites:
            obj = store.allocate(MARK_BYTES)
            encode_marks(offsets, payload_of(flat(obj)))
            items.append((ObjectKind.TURNMARK, prefix, obj))
            refs.append(ObjectRef(ObjectKind.TURNMARK, 2, prefix, 512 + offsets[0]))
        assert store.commit_many(items, refs=refs) == [True] * 3
        if tier == "disk":
            from tests.waiting import wait_for
            wait_for(lambda: not store.writes_pending(), what="the disk write")
        got = store.get(ObjectKind.TURNMARK, prefix, MARK_BYTES)
        assert got is not None
        try:
            assert decode_marks(payload_of(flat(got)), chunk_size=256) == [250, 244, 236]
        finally:
            release(got)
    finally:
        store.close()


def test_a_rewrite_keeps_the_offsets_a_lookup_read_in_the_marker():
    """A worker that read the marker after a prefix (a next turn on a fresh instance) rewrites it
    with its own turn end first, then the ones it read: the turn end that conversation went on
    from stays listed (an edit of the next message hits it); the last writer still wins."""
    from lmcache_hma.core.turn_ends import MARK_SLOTS, TurnMarks

    marks = TurnMarks()
    marks.learn(b"p" * 32, [-5, 40])
    assert marks.add(b"p" * 32, 60) == [60, -5, 40]
    marks.learn(b"p" * 32, [40, 7])
    assert marks.add(b"p" * 32, 61) == [61, 60, -5, 40, 7]
    marks.learn(b"q" * 32, list(range(1, 3 * MARK_SLOTS)))
    assert len(marks.add(b"q" * 32, 100)) == MARK_SLOTS
