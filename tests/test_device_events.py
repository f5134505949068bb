"""vLLM's own device-cache events made one per block hash (``scheduler.device_events``), on
vLLM's real ``BlockPool``: copies of a hash cached beside a held one are announced neither
when cached nor when evicted, so an index that keeps a set of hashes (Dynamo's, llm-d's) and
one that counts copies both hold exactly what the pool caches."""

from __future__ import annotations

from collections import Counter

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (get_block_hash, get_group_id, get_request_block_hasher, init_none_hash,
                                         maybe_convert_block_hash)
from vllm.v1.request import Request

from lmcache_hma.scheduler.device_events import DeviceEventDedup

BLOCK = 4
FULL, SLIDING = 0, 1


@pytest.fixture(autouse=True, scope="module")
def _none_hash():
    """vLLM's root hash, as an engine sets it at start (here, not at import: no side effect on
    the other modules of a test process)."""
    init_none_hash(sha256)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


class Index:
    """An index fed the events: a set per group (Dynamo's, llm-d's) and a count of copies."""

    def __init__(self) -> None:
        self.held: set = set()
        self.copies: Counter = Counter()
        self.stores = 0

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                self.stores += len(e.block_hashes)
                for h in e.block_hashes:
                    self.held.add((e.group_idx, h))
                    self.copies[(e.group_idx, h)] += 1
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.held.discard((e.group_idx, h))
                    self.copies[(e.group_idx, h)] -= 1
                    if self.copies[(e.group_idx, h)] <= 0:
                        del self.copies[(e.group_idx, h)]
            elif isinstance(e, AllBlocksCleared):
                self.held.clear()
                self.copies.clear()


def cached(pool: BlockPool, group: int) -> set:
    return {(group, maybe_convert_block_hash(get_block_hash(k)))
            for k in pool.cached_block_hash_to_block._cache if get_group_id(k) == group}


def pool_and_index(dedup: bool):
    pool = BlockPool(32, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    if dedup:
        assert DeviceEventDedup([FULL]).bind(pool)
    return pool, Index()


def cache(pool: BlockPool, req: Request, n_blocks: int, group: int = FULL):
    blocks = pool.get_new_blocks(n_blocks)
    pool.cache_full_blocks(req, blocks, 0, n_blocks, BLOCK, group)
    return blocks


@pytest.mark.parametrize("dedup", [False, True])
def test_an_index_holds_what_the_pool_caches_when_a_copy_of_a_hash_is_evicted(dedup):
    """A prompt cached twice (two copies of each block), then the first copies evicted: vLLM
    announces their removal while the second copies stay cached; the index must keep them."""
    pool, index = pool_and_index(dedup)
    tokens = list(range(100, 112))  # three blocks
    first = cache(pool, request("a", tokens), 3)
    index.apply(pool.take_events())
    second = cache(pool, request("b", tokens), 3)  # recomputed: vLLM's own hit stopped short
    index.apply(pool.take_events())
    pool.evict_blocks({b.block_id for b in first})
    index.apply(pool.take_events())
    if not dedup:  # vLLM's own events: the index lost what the pool still serves
        assert index.held == set() and len(cached(pool, FULL)) == 3
        return
    assert index.held == cached(pool, FULL) and len(index.held) == 3
    assert set(index.copies) == index.held and set(index.copies.values()) == {1}  # one store per hash
    pool.evict_blocks({b.block_id for b in second})  # the last copies: now they are removed
    index.apply(pool.take_events())
    assert index.held == cached(pool, FULL) == set() and not index.copies


def test_a_store_is_cut_around_the_copies_it_holds():
    """A prompt sharing two blocks with a cached one, recomputed from its start: its event
    announces only its third block, with the second as its parent and the third's tokens."""
    pool, index = pool_and_index(True)
    a = list(range(100, 112))
    cache(pool, request("a", a), 3)
    index.apply(pool.take_events())
    b = a[:8] + [7, 8, 9, 10]
    cache(pool, request("b", b), 3)
    [event] = pool.take_events()
    hashes = [maybe_convert_block_hash(h) for h in request("b", b).block_hashes]
    assert event.block_hashes == hashes[2:] and event.parent_block_hash == hashes[1]
    assert event.token_ids == [7, 8, 9, 10]
    index.apply([event])
    assert index.held == cached(pool, FULL) and len(index.held) == 4


def test_copies_in_the_middle_of_a_store_split_it_into_runs():
    pool, index = pool_and_index(True)
    a = list(range(100, 116))  # four blocks
    held = cache(pool, request("a", a), 4)
    index.apply(pool.take_events())
    pool.evict_blocks({held[0].block_id, held[2].block_id})  # blocks 0 and 2 leave, 1 and 3 stay
    index.apply(pool.take_events())
    cache(pool, request("b", a), 4)  # 0 and 2 enter again; 1 and 3 are copies
    events = pool.take_events()
    hashes = [maybe_convert_block_hash(h) for h in request("a", a).block_hashes]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events] == [
        ([hashes[0]], None, a[0:4]), ([hashes[2]], hashes[1], a[8:12])]
    index.apply(events)
    assert index.held == cached(pool, FULL) and set(index.copies.values()) == {1}


def test_other_groups_keep_vllms_events():
    """Sliding-window and state groups' events skip null blocks: left as vLLM announces them."""
    pool, index = pool_and_index(True)
    tokens = list(range(100, 108))
    cache(pool, request("a", tokens), 2, SLIDING)
    cache(pool, request("b", tokens), 2, SLIDING)
    events = pool.take_events()
    assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)) == 4


def test_a_reset_clears_and_the_next_store_is_announced():
    pool, index = pool_and_index(True)
    tokens = list(range(100, 108))
    blocks = cache(pool, request("a", tokens), 2)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    index.apply(pool.take_events())
    assert index.held == set()
    cache(pool, request("b", tokens), 2)
    index.apply(pool.take_events())
    assert index.held == cached(pool, FULL) and len(index.held) == 2
