"""Property: the sliding-window blocks of a tail are the blocks vLLM's own manager keeps.

For random windows W (W < block, W not a multiple of the block, W = 1, ...), block sizes,
chunk sizes (multiples of every block size), ``extra_retained_tokens`` and chunk
boundaries h, the tail object at h (``HybridLayout.segments(ObjectKind.TAIL, c)``, read
from a real vLLM ``KVCacheConfig`` by ``layout_from_kv_cache_config``) holds exactly the
blocks vLLM 0.32's ``SlidingWindowManager`` keeps:

* save side: a request prefilled through h in steps, with vLLM's own
  ``remove_skipped_blocks`` / ``allocate_new_blocks`` calls, holds every tail block in the
  step that computes h (nothing the save reads is the null block yet), and once h tokens
  are computed exactly the tail's blocks are left;
* load side: a request admitted with an external hit of h tokens gets real blocks
  (``add_local_computed_blocks`` + ``allocate_external_computed_blocks``) exactly where
  the tail's blocks are: every kept block is loaded, none is written to the null block.

Everything vLLM is called directly (a real ``BlockPool`` and ``SlidingWindowManager`` per
group); no formula of vLLM's is copied here. Plain seeded loops, no hypothesis.
"""

import math
import random

import torch

from lmcache_hma.core.kinds import GroupKind, ObjectKind
from lmcache_hma.core.vllm_layout import layout_from_kv_cache_config

CASES = 300


def vllm_specs(rng):
    """A full-attention group and one or two sliding groups with random shapes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    specs = [FullAttentionSpec(block_size=rng.choice([1, 2, 4, 8, 16]), **common)]
    for _ in range(rng.randint(1, 2)):
        block = rng.choice([1, 2, 3, 4, 8, 16])
        window = rng.choice([
            1,
            rng.randint(1, max(1, block - 1)),  # W < block (or W = 1)
            block, block + 1, block * rng.randint(1, 4),
            rng.randint(1, 6 * block),  # mostly not a multiple of the block
            rng.randint(6 * block, 40 * block),  # many blocks
        ])
        extra = 0 if rng.random() < 0.5 else rng.randint(1, 3 * block)
        specs.append(SlidingWindowSpec(block_size=block, sliding_window=window,
                                       extra_retained_tokens=extra, **common))
    rng.shuffle(specs)  # vLLM's group order is not assumed
    return specs


def kv_cache_config(specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)


def manager(spec, num_blocks):
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    pool = BlockPool(num_blocks, enable_caching=False, hash_block_size=spec.block_size)
    return SlidingWindowManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                                scheduler_block_size=spec.block_size)


def real_blocks(mgr, req_id):
    """Indices of the request's blocks that are not the null block."""
    null = mgr.block_pool.null_block
    return [j for j, b in enumerate(mgr.req_to_blocks[req_id]) if b is not null]


def tail_blocks(lay, chunk_index, group_pos):
    """Block indices of group ``group_pos`` that the tail at the end of ``chunk_index`` holds."""
    segs = [s for s in lay.segments(ObjectKind.TAIL, chunk_index) if s.group == group_pos]
    assert len(segs) <= 1
    return list(range(segs[0].first_block, segs[0].first_block + segs[0].num_blocks)) if segs else []


def test_tail_blocks_are_the_blocks_vllm_keeps():
    checked = {"boundaries": 0, "w_lt_block": 0, "w_not_multiple": 0, "extra": 0, "h_lt_w": 0}
    for seed in range(CASES):
        rng = random.Random(seed)
        specs = vllm_specs(rng)
        lcm = math.lcm(*(s.block_size for s in specs))
        chunk = lcm * rng.randint(1, max(1, 32 // lcm))
        lay = layout_from_kv_cache_config(kv_cache_config(specs), chunk)
        max_window = max(g.sliding_window for g in lay.sliding_groups)
        num_chunks = -(-(2 * max_window) // chunk) + 3  # boundaries before and well after W
        for pos, (g, spec) in enumerate(zip(lay.groups, specs)):
            if g.kind is not GroupKind.SLIDING:
                continue
            assert (g.sliding_window, g.extra_retained_tokens) == (spec.sliding_window,
                                                                   spec.extra_retained_tokens)
            bs = spec.block_size
            total_blocks = num_chunks * chunk // bs + 2
            save = manager(spec, total_blocks + 2)
            kept = manager(spec, total_blocks + 2)
            load = manager(spec, 2 * total_blocks + 2)
            before = 0
            h_max = num_chunks * chunk
            step_rng = random.Random(seed * 1000 + pos)
            while before < h_max:  # a chunked prefill, the way vLLM's allocate_slots runs it
                n = min(step_rng.randint(1, 2 * chunk + 3), h_max - before)
                save.remove_skipped_blocks("r", before)  # processed = computed before the step
                save.allocate_new_blocks("r", before + n, before + n)
                held = set(real_blocks(save, "r"))
                for c in range(before // chunk, (before + n) // chunk):
                    h = (c + 1) * chunk  # a boundary this step computes: before < h <= before + n
                    want = tail_blocks(lay, c, pos)
                    ctx = (f"seed {seed}: block {bs}, window {spec.sliding_window}, extra "
                           f"{spec.extra_retained_tokens}, chunk {chunk}, h {h}, step [{before}, {before + n})")
                    # The step that computes h still holds every block its tail reads.
                    assert set(want) <= held, ctx
                    # What vLLM keeps once h tokens are computed is exactly the tail.
                    kept.allocate_new_blocks("k", h, h)
                    kept.remove_skipped_blocks("k", h)
                    assert real_blocks(kept, "k") == want, ctx
                    kept.free("k")
                    vllm_first = kept.get_num_skipped_tokens(h) // bs  # vLLM's method, not a copy
                    assert g.first_block_needed(h) == vllm_first, ctx
                    # An external hit of h tokens: vLLM's blocks to load are the tail's.
                    rid = f"x{h}"
                    load.add_local_computed_blocks(rid, [], 0, h)
                    load.allocate_external_computed_blocks(rid, 0, h)
                    assert len(load.req_to_blocks[rid]) == h // bs, ctx
                    assert real_blocks(load, rid) == want, ctx
                    load.free(rid)
                    # Exactness: the window of the token at h lies in the tail.
                    window_tokens = range(max(0, h - spec.sliding_window + 1), h)
                    assert {t // bs for t in window_tokens} <= set(want), ctx
                    if not spec.extra_retained_tokens and want:
                        assert want[0] == vllm_first == window_tokens[0] // bs, ctx  # nothing more
                    checked["boundaries"] += 1
                    checked["w_lt_block"] += spec.sliding_window < bs
                    checked["w_not_multiple"] += spec.sliding_window % bs != 0
                    checked["extra"] += spec.extra_retained_tokens > 0
                    checked["h_lt_w"] += h < spec.sliding_window
                before += n
    # The random cases reached every kind the property is about.
    assert all(v > 50 for v in checked.values()), checked
