"""vLLM's device events on a hybrid, gated by where its prefix cache's hit can end
(``scheduler.device_restorable``), on vLLM's real ``KVCacheManager``: a full-attention group
beside two "align"-mode Mamba groups, or two sliding-window groups, or one of each, or a Mamba
group and a second full-attention group (vLLM's hit needs both). An index fed them (a
set of hashes, as Dynamo's and llm-d's keep) holds exactly the blocks vLLM's own
``find_longest_cache_hit`` serves through, checked after every step of seeded schedules of
prompts sharing prefixes, states kept at some block ends, evictions and resets."""

from __future__ import annotations

import random

import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request

from lmcache_hma.scheduler.device_events import DeviceEventDedup
from lmcache_hma.scheduler.device_restorable import DeviceRestorable

BLOCK = 4
WINDOW = 3 * BLOCK + 1  # a hit needs the 3 blocks before its end (vLLM: cdiv(window - 1, block))
FULL = 0
# the groups after the first full-attention one (group 0)
SHAPES = {"states": ("state", "state"), "windows": ("window", "window"), "both": ("state", "window"),
          "two full": ("state", "full")}


@pytest.fixture(autouse=True, scope="module")
def _none_hash():
    init_none_hash(sha256)


def manager(num_blocks: int = 40, shape: str = "states") -> KVCacheManager:
    def spec(kind):
        if kind == "full":
            return FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.float32)
        if kind == "state":
            return MambaSpec(block_size=BLOCK, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode="align")
        return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.float32,
                                 sliding_window=WINDOW)

    groups = [KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4,
                                                           dtype=torch.float32))]
    groups += [KVCacheGroupSpec([f"other{i}"], spec(kind)) for i, kind in enumerate(SHAPES[shape])]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True, enable_kv_cache_events=True)


def kinds(shape: str) -> dict:
    return {i + 1: kind for i, kind in enumerate(SHAPES[shape])}


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


class Index:
    """The full-attention group's blocks, as a set (what Dynamo's index keeps per tier); it
    refuses a store whose parent it does not hold, as Dynamo's does."""

    def __init__(self) -> None:
        self.held: set = set()
        self.stores = 0
        self.refused = 0

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored) and e.group_idx == FULL:
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                if e.parent_block_hash is not None and e.parent_block_hash not in self.held:
                    self.refused += 1  # Dynamo's ParentBlockNotFound: the store is dropped
                    continue
                self.stores += len(e.block_hashes)
                self.held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved) and e.group_idx == FULL:
                self.held.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.held.clear()


def gated(kvm: KVCacheManager, gate: bool = True, shape: str = "states") -> DeviceEventDedup:
    other = kinds(shape)
    states = [g for g, k in other.items() if k == "state"]
    windows = [([g for g, k in other.items() if k == "window"], 3)] if "window" in other.values() else []
    full = [FULL] + [g for g, k in other.items() if k == "full"]
    dedup = DeviceEventDedup(full, DeviceRestorable(full, states, windows) if gate else None)
    assert dedup.bind(kvm.block_pool)
    return dedup


def compute(kvm: KVCacheManager, req: Request, states: set[int], shape: str = "states") -> list:
    """A prefill of ``req`` computed from its start: its full-attention and sliding-window blocks
    all cached, a state kept at the end of each block of ``states`` (vLLM keeps one where a
    prefill step ends)."""
    pool, n = kvm.block_pool, len(req.block_hashes)
    full = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, full, 0, n, BLOCK, FULL)
    held = list(full)
    for g, kind in kinds(shape).items():
        if kind == "state":
            blocks = [pool.get_new_blocks(1)[0] if i in states else pool.null_block for i in range(n)]
        else:  # a sliding window's blocks, or a second full-attention group's
            blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(req, blocks, 0, n, BLOCK, g)
        held += [b for b in blocks if not b.is_null]
    return held


def serves(kvm: KVCacheManager, req: Request) -> int:
    """The blocks of ``req``'s prompt vLLM's prefix cache serves (its own lookup)."""
    return kvm.coordinator.find_longest_cache_hit(req.block_hashes, len(req.block_hashes) * BLOCK)[1] // BLOCK


def restorable(kvm: KVCacheManager, requests) -> set:
    """Every block some prompt is served through, by vLLM's own lookup."""
    out = set()
    for req in requests:
        out.update(maybe_convert_block_hash(h) for h in req.block_hashes[:serves(kvm, req)])
    return out


def test_blocks_past_the_last_state_are_announced_when_a_state_comes_and_withdrawn_when_it_goes():
    kvm = manager()
    gated(kvm)
    index = Index()
    tokens = list(range(100, 116))  # four blocks
    first = request("a", tokens)
    hashes = [maybe_convert_block_hash(h) for h in first.block_hashes]
    kvm.block_pool.free_blocks(compute(kvm, first, {1}))  # a state after block 1 only
    index.apply(kvm.block_pool.take_events())
    assert serves(kvm, first) == 2 and index.held == set(hashes[:2])

    again = compute(kvm, request("b", tokens), {3})  # a later prefill step ends after block 3
    events = kvm.block_pool.take_events()
    index.apply(events)
    assert serves(kvm, first) == 4 and index.held == set(hashes)
    [late] = [e for e in events if isinstance(e, BlockStored) and e.group_idx == FULL]
    assert (late.block_hashes, late.parent_block_hash, late.token_ids) == (hashes[2:], hashes[1], tokens[8:])

    kvm.block_pool.free_blocks(again)
    kvm.block_pool.evict_blocks({b.block_id for b in again[4:]})  # the states after block 3 leave
    events = kvm.block_pool.take_events()
    index.apply(events)
    assert serves(kvm, first) == 2 and index.held == set(hashes[:2])
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved) and e.group_idx == FULL] == [
        [hashes[3], hashes[2]]]  # the blocks after a block first


def test_without_the_gate_an_index_credits_blocks_vllm_recomputes():
    """vLLM's events (one per hash) alone: the index holds all four blocks, vLLM serves two."""
    kvm = manager()
    gated(kvm, gate=False)
    index = Index()
    req = request("a", list(range(100, 116)))
    kvm.block_pool.free_blocks(compute(kvm, req, {1}))
    index.apply(kvm.block_pool.take_events())
    assert serves(kvm, req) == 2 and len(index.held) == 4


def schedule(seed: int, shape: str = "states", steps: int = 60, gate: bool = True) -> list[str]:
    """A seeded schedule; the steps after which the index is not what vLLM serves through."""
    rng = random.Random(seed)
    kvm = manager(rng.choice([24, 40, 64]), shape)
    gated(kvm, gate, shape)
    per_block = 1 + len(SHAPES[shape])
    pool, index = kvm.block_pool, Index()
    prompts: list[list[int]] = []
    seen: list[Request] = []
    running: list[list] = []  # blocks of requests still running (not evictable)
    wrong = []
    for step in range(steps):
        op = rng.random()
        if op < 0.7 or not prompts:  # a prompt: a prefix of an earlier one, then new tokens
            base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
            keep = rng.randrange(len(base) // BLOCK + 1) * BLOCK
            tokens = base[:keep] + [rng.randrange(1000) for _ in range(BLOCK * rng.randint(1, 4))]
            tokens = tokens[:BLOCK * 8]
            req = request(f"r{step}", tokens)
            n = len(req.block_hashes)
            states = {i for i in range(n) if rng.random() < 0.3} | ({n - 1} if rng.random() < 0.5 else set())
            if pool.get_num_free_blocks() < n * per_block + 2:
                for held in running:
                    pool.free_blocks(reversed(held))
                running = []
            if pool.get_num_free_blocks() < n * per_block:
                continue
            blocks = compute(kvm, req, states, shape)
            prompts.append(tokens)
            seen.append(req)
            if rng.random() < 0.3:
                running.append(blocks)
            else:
                pool.free_blocks(reversed(blocks))
        elif op < 0.85:  # vLLM evicts some free cached blocks (a state, a block of a chain)
            free = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null]
            pool.evict_blocks(set(rng.sample(free, min(len(free), rng.randint(1, 3)))))
        elif op < 0.95:
            for held in running:
                pool.free_blocks(reversed(held))
            running = []
        else:
            for held in running:
                pool.free_blocks(reversed(held))
            running = []
            assert pool.reset_prefix_cache()
        if rng.random() < 0.3:
            continue  # the next operation comes in the same step: one batch of events for both
        index.apply(pool.take_events())
        if index.refused:
            wrong.append(f"step {step}: {index.refused} stores refused for want of their parent")
            index.refused = 0
        if index.held != restorable(kvm, seen):
            wrong.append(f"step {step}: the index holds {len(index.held - restorable(kvm, seen))} blocks vLLM "
                         f"does not serve through and lacks {len(restorable(kvm, seen) - index.held)}")
    return wrong


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", range(20))
def test_the_index_holds_what_vllm_serves_through(seed, shape):
    assert schedule(seed, shape) == []


def test_blocks_with_many_blocks_after_them(monkeypatch):
    """A block that many chains go on from (a shared system prompt's) keeps them in a set: the
    same schedules with a set from the second one on."""
    monkeypatch.setattr(DeviceRestorable, "KIDS_LIST", 1)
    assert [seed for seed in range(10) if schedule(seed, "both")] == []


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_schedules_find_vllms_own_events_wrong(shape):
    """The same schedules without the gate: the index credits blocks vLLM recomputes."""
    assert any(schedule(seed, shape, gate=False) for seed in range(5))


def test_the_connector_gates_hybrids_of_one_block_size_without_eagle():
    """``device_events(layout)``, as the connector binds it: gated where the other groups share
    the full-attention block size (vLLM's hashes name the same blocks); not where the sizes
    differ, nor under EAGLE (then vLLM's events, one per hash)."""
    from lmcache_hma.core.kinds import GroupKind
    from lmcache_hma.core.layout import GroupLayout, HybridLayout
    from lmcache_hma.scheduler.device_events import device_events

    def layout(kind, size):
        other = GroupLayout(1, kind, ("L1",), size, 64, sliding_window=8 if kind is GroupKind.SLIDING else 0,
                            **({"state_shapes": ((4,),), "state_dtypes": ("float32",)}
                               if kind is GroupKind.STATE else {}))
        return HybridLayout((GroupLayout(0, GroupKind.FULL, ("L0",), BLOCK, 64), other), 4 * BLOCK)

    gate = device_events(layout(GroupKind.STATE, BLOCK)).gate
    assert (gate.full, gate.states, gate.windows) == ((0,), (1,), ())
    gate = device_events(layout(GroupKind.SLIDING, BLOCK)).gate
    assert (gate.full, gate.states, gate.windows) == ((0,), (), (((1,), 2),))  # cdiv(8 - 1, 4) blocks
    assert device_events(layout(GroupKind.STATE, 2 * BLOCK)).gate is None
    assert device_events(layout(GroupKind.SLIDING, BLOCK), use_eagle=True).gate is None


def test_a_failure_to_rewrite_leaves_vllms_events_and_its_step(monkeypatch):
    """A defect in the rewriting never fails vLLM's scheduler step: that step's events and all
    later ones are vLLM's own, the pool's methods its own again."""
    kvm = manager()
    dedup = gated(kvm)
    pool = kvm.block_pool

    def broken(self, events):
        raise RuntimeError("a defect")

    monkeypatch.setattr(DeviceRestorable, "rewrite", broken)
    req = request("a", list(range(100, 116)))
    pool.free_blocks(compute(kvm, req, {1}))
    [full] = [e for e in pool.take_events() if isinstance(e, BlockStored) and e.group_idx == FULL]
    assert len(full.block_hashes) == 4 and dedup.gate is None
    assert pool.take_events.__func__ is type(pool).take_events
    assert pool._insert_block_hash.__func__ is type(pool)._insert_block_hash
